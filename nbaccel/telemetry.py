"""The worker-side reporter: status, logged metrics, steps, memory samples and collectives.

Training code (`Accelerator.log`, the optimizer step, the data loader) reports here unconditionally. Until
a launcher plugs in a sink with `attach`, every call is a cheap no-op, so scripts run without a kernel pay
nothing. The launcher's sink carries messages to the kernel, where the dashboard and persistent ranks read
them. Message shape and kinds are documented in docs/internals.md ("The channel").
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from .utils import collective_trace

Message = dict[str, Any]
Sink = Callable[[Message], None]

_sink: Sink | None = None
_rank: int = 0


def attach(sink: Sink, rank: int) -> None:
    """Send every report of this process, tagged with `rank`, to `sink` (called from any thread)."""
    global _sink, _rank
    _sink, _rank = sink, rank
    collective_trace.add_listener(_on_collective)


def detach() -> None:
    """Stop reporting; later calls are no-ops again."""
    global _sink
    _sink = None
    collective_trace.remove_listener(_on_collective)


def is_attached() -> bool:
    return _sink is not None


def emit(kind: str, **fields: Any) -> None:
    """Send one message of `kind` with `fields`; dropped silently when no sink is attached."""
    sink = _sink
    if sink is None:
        return
    fields.update(kind=kind, rank=_rank, time=time.time())
    sink(fields)


def log_metrics(values: dict[str, Any], step: int | None = None) -> None:
    """What `Accelerator.log` recorded: numbers only, as floats."""
    if _sink is None:
        return
    numbers = {key: float(value) for key, value in values.items() if _is_number(value)}
    if numbers:
        emit("metrics", values=numbers, step=step)


def report_step(step: int, total: int | None = None) -> None:
    """One optimizer step done (`step` counts from 1); `total` when the run length is known."""
    if _sink is not None:
        emit("step", step=step, total=total)


def report_total_steps(total: int) -> None:
    """The number of steps the run will take (e.g. the prepared data loader's length), for progress bars."""
    if _sink is not None:
        emit("total", total=total)


def _is_number(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, (int, float)):
        return True
    return getattr(value, "numel", lambda: 0)() == 1  # a one-element tensor or numpy scalar


def _on_collective(event: str, record: collective_trace.CollectiveRecord) -> None:
    emit("collective", event=event, **record.to_dict())
