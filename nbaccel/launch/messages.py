"""The messages between ranks and the kernel: their kinds, the rank states, and small constructors.

A message is a plain dict (it crosses a pipe and reaches observers as is) with `kind`, `rank` and `time`.
Kinds and states are `str` enums equal to their text, so observers written against strings ("status",
"failed") keep working. docs/internals.md lists every kind (tests/test_messages.py checks the table).
"""

from __future__ import annotations

import time
from enum import Enum
from typing import Any


class MessageKind(str, Enum):
    """What a message carries."""

    STATUS = "status"  # a rank's state changed (RankState)
    OUTPUT = "output"  # one line a rank wrote to stdout/stderr (made in the kernel)
    METRICS = "metrics"  # Accelerator.log values
    STEP = "step"  # optimizer step count
    TOTAL = "total"  # steps expected
    MEMORY = "memory"  # host and device memory
    COLLECTIVE = "collective"  # entering/leaving a collective
    RESULT = "result"  # the function's return value
    ERROR = "error"  # the function's exception
    LAUNCH = "launch"  # the launch as a whole (kernel side, rank None)
    BATCH = "batch"  # telemetry queued by a worker, sent together; unpacked before observers see it
    LIVE = "live"  # the rows a rank is redrawing in place (a progress bar), made in the kernel
    DISPLAY = "display"  # a rich display (display(), a figure) from a rank, as a MIME bundle
    CLEAR_OUTPUT = "clear_output"  # IPython.display.clear_output from a rank

    def __str__(self) -> str:
        return self.value


# Modules that cost seconds to import in every rank of every launch and that a forked rank inherits when the
# kernel holds them. A rank's `result` message names those it imported (`imported`); the kernel imports them
# before its next fork launch (kernel/processes.py preload_worker_modules).
PRELOADABLE_MODULES = ("torch._dynamo",)  # every torch optimizer imports it when the first one is built


class RankState(str, Enum):
    """The states of a rank in `status` messages."""

    STARTING = "starting"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    STOPPED = "stopped"  # stopped by the launcher after another rank failed, on interrupt or timeout

    def __str__(self) -> str:
        return self.value


class LaunchState(str, Enum):
    """The states of a `launch` message."""

    STARTED = "started"
    FINISHED = "finished"
    FAILED = "failed"
    TIMEOUT = "timeout"
    INTERRUPTED = "interrupted"

    def __str__(self) -> str:
        return self.value


Message = dict[str, Any]


def message(kind: MessageKind, rank: int | None, **fields: Any) -> Message:
    """A message of `kind` from `rank`, stamped now."""
    return {"kind": kind.value, "rank": rank, "time": time.time(), **fields}


def status(rank: int, local_rank: int, state: RankState, **fields: Any) -> Message:
    """A rank's `status` message (e.g. made in the kernel when a rank was stopped or killed)."""
    return message(MessageKind.STATUS, rank, local_rank=local_rank, state=state.value, **fields)


def output(rank: int, local_rank: int, stream: str, text: str) -> Message:
    """One line of a rank's stdout or stderr."""
    return message(MessageKind.OUTPUT, rank, local_rank=local_rank, stream=stream, text=text)


def live(rank: int, local_rank: int, stream: str, lines: list[str]) -> Message:
    """The rows of a rank's stream that it is still redrawing (tqdm's carriage returns, rich's cursor moves)."""
    return message(MessageKind.LIVE, rank, local_rank=local_rank, stream=stream, lines=lines)


def launch(state: LaunchState, **fields: Any) -> Message:
    """The launch's start (with its settings) or end."""
    return message(MessageKind.LAUNCH, None, state=state.value, **fields)


def memory(rank: int, local_rank: int, sample: dict[str, Any], **fields: Any) -> Message:
    """A `memory` message from a sample of `telemetry.memory_sample` / `telemetry.process_memory`."""
    return message(MessageKind.MEMORY, rank, local_rank=local_rank, **sample, **fields)
