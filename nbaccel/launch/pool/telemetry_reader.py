"""A `RankPool`'s channel messages for observers (a `Dashboard`, a recorder): only while one is attached.

In the rank (worker/pool_telemetry.py), telemetry (metrics, steps, memory, collectives) goes through a `WorkerSink` on a pipe of its own,
switched on by the `telemetry` command when the first observer attaches and off when the last detaches; the
kernel reads those pipes in a `TelemetryReader` thread. Status (`running` when a call starts, `finished` /
`failed` when its reply arrives) and output lines (`OutputLines`, fed by the pool's own reads of the ranks'
stdout/stderr) are made in the kernel. With nothing attached none of this runs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

from .. import messages
from ..channel import Message
from ..messages import MessageKind, RankState
from ..output import LineForwarder

READ_WAKE = 0.1  # seconds: how soon the reader thread notices it was asked to stop


def observer_of(target: Any) -> Callable[[Message], None]:
    """The callable to notify for `target`: its `.observe` (a Dashboard) or the target itself."""
    observe = getattr(target, "observe", None)
    if callable(observe):
        return observe
    if callable(target):
        return target
    raise TypeError(f"{target!r} is not an observer: pass a Dashboard (an object with .observe(message)) or a "
                    "callable taking a message dict")


class OutputLines:
    """Turn one rank's stdout/stderr bytes into `output` messages, one per complete line."""

    def __init__(self, rank: int, deliver: Callable[[Message], None]) -> None:
        self._forwarders = {stream: LineForwarder(self._sender(rank, stream, deliver))
                            for stream in ("stdout", "stderr")}

    @staticmethod
    def _sender(rank: int, stream: str, deliver: Callable[[Message], None]) -> Callable[[str], None]:
        def send(line: str) -> None:
            deliver(messages.output(rank, rank, stream, line))
        return send

    def __call__(self, stream: str, data: bytes) -> None:
        self._forwarders[stream].feed(data)


class TelemetryReader:
    """A thread that reads the ranks' telemetry pipes and hands every message (batches unpacked) on."""

    def __init__(self, conns: list[Connection], deliver: Callable[[Message], None]) -> None:
        self._conns = list(conns)
        self._deliver = deliver
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="nbaccel-pool-telemetry", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        conns = list(self._conns)
        while conns and not self._stop.is_set():
            for conn in wait(conns, READ_WAKE):
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    conns.remove(conn)
                    continue
                for item in message.get("messages", ()) if message.get("kind") == MessageKind.BATCH else (message,):
                    self._deliver(item)

    def stop(self) -> None:
        """Stop reading (before the pipes are closed); what is still queued is dropped."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(2 * READ_WAKE + 1.0)


def status_message(rank: int, state: RankState, device: str, **fields: Any) -> Message:
    """A rank's `status` message, made in the kernel (a pool's rank number is also its local rank)."""
    return messages.status(rank, rank, RankState(state), device=device, **fields)
