"""A RankPool rank's telemetry: a `WorkerSink` on the rank's own telemetry pipe, switched on by the `telemetry`
command when the kernel's first observer attaches and off when the last detaches (the kernel's reader is
pool/telemetry_reader.py)."""

from __future__ import annotations

from multiprocessing.connection import Connection
from typing import Any

from ..channel import WorkerSink
from .entry import start_memory_reports

_sink: Any = None


def set_worker_telemetry(conn: Connection | None, enabled: bool, rank: int) -> None:
    """In a rank: report telemetry into `conn` (enabled) or stop reporting (the pipe stays open)."""
    global _sink
    from ... import telemetry

    if not enabled:
        telemetry.detach()
        if _sink is not None:
            _sink.ticker = None
            _sink.stop_sender()  # sends what is queued; an idle rank keeps no thread waking up
        return
    if conn is None:
        raise RuntimeError("this rank has no telemetry pipe")
    if _sink is None:
        _sink = WorkerSink(conn, rank)
    start_memory_reports(telemetry, _sink)  # memory samples ride the sink's sender thread...
    _sink._start_sender()  # ...which runs from now on, so idle ranks report their memory too
    telemetry.attach(_sink, rank)
