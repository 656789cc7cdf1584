"""The one vocabulary of the launch machinery: message kinds, rank states, RankPool's commands, and typed
messages built and read the same way on both sides of a pipe.

On the wire a message is a plain dict (it crosses a pipe and reaches observers as is) with `kind`, `rank`
and `time`. Kinds and states are `str` enums equal to their text, so observers written against strings
("status", "failed") keep working. A sender builds a typed message (`Status`, `Result`, `Failure`, ...) and
sends `to_wire()`; a reader that needs the fields takes `from_wire(message)`. docs/internals.md lists every
kind (tests/test_messages.py checks the table).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar


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
    READY = "ready"  # a RankPool rank built its process group (or failed to): its first message
    REPLY = "reply"  # a RankPool rank's answer to one command
    # a rank's input(), breakpoint(), pdb (worker/rank_prompts.py, kernel/prompt_relay.py)
    PROMPT = "prompt"  # a rank waits for one line of input
    ANSWER = "answer"  # the kernel's answer to a prompt: the line typed, end of input, or why none can come

    def __str__(self) -> str:
        return self.value


# Modules that cost seconds to import in every rank of every launch and that a forked rank inherits when the
# kernel holds them. A rank's `result` message names those it imported (`imported`); the kernel imports them
# before its next fork launch (kernel/process_trees.py preload_worker_modules).
PRELOADABLE_MODULES = ("torch._dynamo",)  # every torch optimizer imports it when the first one is built


class RankState(str, Enum):
    """The states of a rank in `status` messages."""

    STARTING = "starting"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    STOPPED = "stopped"  # stopped by the launcher after another rank failed, on interrupt or timeout
    # the kernel's judgements, never in a `status` message: hang reports and RankPool's results
    IDLE = "idle"  # the rank does not run this call (a RankPool cell on other ranks)
    DEAD = "dead"  # the rank's process ended during the call
    WAITING = "waiting"  # hung in a collective when the call was given up
    NOT_RUN = "not run"  # a RankPool result of a rank the call never reached

    def __str__(self) -> str:
        return self.value

    @property
    def done(self) -> bool:
        """The rank's work is over (for better or worse)."""
        return self in (RankState.FINISHED, RankState.FAILED, RankState.STOPPED, RankState.DEAD)


REPORTED_STATES = (RankState.STARTING, RankState.RUNNING, RankState.FINISHED, RankState.FAILED, RankState.STOPPED)
"""The states a `status` message carries (the others are the kernel's judgements)."""


class PoolCommand(str, Enum):
    """What the kernel asks of a RankPool rank: the first item of the command tuple sent down its pipe."""

    EXEC = "exec"  # (EXEC, id, source, filename, ends_with_expression): run a cell's source
    RUN = "run"  # (RUN, id, payload): call a cloudpickled function
    PUSH = "push"  # (PUSH, id, name, data): set one variable of the rank's namespace
    PULL = "pull"  # (PULL, id, name): send one variable back
    TELEMETRY = "telemetry"  # (TELEMETRY, id, on): report to an attached dashboard, or stop
    DEBUG = "debug"  # (DEBUG, id): pdb's post-mortem at the exception of the rank's last failed command
    STOP = "stop"  # (STOP,): leave the loop; no reply

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


def _wire_value(value: Any) -> Any:
    return value.value if isinstance(value, Enum) else value


@dataclass(frozen=True)
class _Typed:
    """A message's fields with their types; `to_wire()` is the dict that crosses the pipe (fields left at None
    are left out, so the wire is what the string-keyed senders sent); `from_wire()` reads one back."""

    kind: ClassVar[MessageKind]

    def fields(self) -> dict[str, Any]:
        """The fields besides kind, rank and time, as they go on the wire."""
        out: dict[str, Any] = {}
        for item in dataclasses.fields(self):
            if item.name in ("rank", "time"):
                continue
            value = getattr(self, item.name)
            if item.name == "extra":
                out.update(value)
            elif value is not None:
                out[item.name] = _wire_value(value)
        return out

    def to_wire(self) -> Message:
        wire: Message = {"kind": self.kind.value, "rank": getattr(self, "rank", None)}
        if getattr(self, "time", None) is not None:
            wire["time"] = self.time  # type: ignore[attr-defined]
        wire.update(self.fields())
        return wire

    @classmethod
    def from_wire(cls, message: Mapping[str, Any]) -> Any:
        """The typed message of a wire dict of this kind; fields it does not name go to `extra` (when it has
        one), so nothing a newer sender adds is lost."""
        names = {item.name for item in dataclasses.fields(cls)}
        known = {key: value for key, value in message.items() if key in names and key != "extra"}
        if "extra" in names:
            known["extra"] = {key: value for key, value in message.items()
                              if key not in names and key != "kind"}
        return cls(**known)


@dataclass(frozen=True)
class Status(_Typed):
    """A rank's state changed (from the rank, or made in the kernel when it stopped or lost a rank)."""

    kind: ClassVar[MessageKind] = MessageKind.STATUS
    rank: int | None
    state: RankState
    device: str | None = None
    local_rank: int | None = None
    pid: int | None = None
    restart: int | None = None  # torch elastic's restart count
    error: str | None = None  # the first line, for FAILED
    host: str | None = None  # hosts=: the rank's host, as named there; stamped by the kernel, never sent by a rank
    time: float = field(default_factory=time.time)
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "state", RankState(self.state))


@dataclass(frozen=True)
class Result(_Typed):
    """The function's return value, pickled (shared_tensors.dumps_value); `imported`: the preloadable
    modules the rank imported (PRELOADABLE_MODULES)."""

    kind: ClassVar[MessageKind] = MessageKind.RESULT
    rank: int | None
    value: Any
    imported: list[str] | None = None
    local_rank: int | None = None
    time: float = field(default_factory=time.time)


@dataclass(frozen=True)
class Failure(_Typed):
    """The function's exception: its type's name, message and formatted traceback."""

    kind: ClassVar[MessageKind] = MessageKind.ERROR
    rank: int | None
    exc_type: str | None = None
    message: str = ""
    traceback: str = ""
    local_rank: int | None = None
    time: float = field(default_factory=time.time)

    @property
    def first_line(self) -> str:
        """`Type: first line of the message` (the type alone when there is no message)."""
        return f"{self.exc_type}: {self.message}".splitlines()[0] if self.message else self.exc_type


@dataclass(frozen=True)
class Ready(_Typed):
    """A RankPool rank's first message: its device and pid, or the error that stopped its set-up."""

    kind: ClassVar[MessageKind] = MessageKind.READY
    rank: int | None
    device: str | None = None
    pid: int | None = None
    error: Mapping[str, str] | None = None  # exc_type, message, traceback
    time: float | None = None  # not stamped: a rank's first message was never timed


@dataclass(frozen=True)
class Prompt(_Typed):
    """A rank asks for one line of input (`input(prompt)`, pdb's `(Pdb) `); it waits for the `Answer`."""

    kind: ClassVar[MessageKind] = MessageKind.PROMPT
    rank: int | None
    prompt: str = ""
    id: int = 0  # the rank's count of prompts, echoed by the answer
    time: float = field(default_factory=time.time)
    password: bool = False  # getpass(): asked without showing what the user types


@dataclass(frozen=True)
class Answer(_Typed):
    """The kernel's answer to a `Prompt`: `text` (the line, without its newline), or `eof` (the input ended:
    the rank's input() raises EOFError), or `unavailable` (why nobody can answer: the rank's input() raises
    RankInputUnavailable with it)."""

    kind: ClassVar[MessageKind] = MessageKind.ANSWER
    rank: int | None
    id: int = 0
    text: str | None = None
    eof: bool | None = None
    unavailable: str | None = None
    time: float = field(default_factory=time.time)


def message(kind: MessageKind, rank: int | None, **fields: Any) -> Message:
    """A message of `kind` from `rank`, stamped now."""
    return {"kind": kind.value, "rank": rank, "time": time.time(), **fields}


def status(rank: int, local_rank: int, state: RankState, device: str | None = None, *, pid: int | None = None,
           error: str | None = None, host: str | None = None) -> Message:
    """A rank's `status` message (e.g. made in the kernel when a rank was stopped or killed)."""
    return Status(rank, state, device=device, local_rank=local_rank, pid=pid, error=error, host=host).to_wire()


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


def rank_label(rank: int, host: str | None = None) -> str:
    """How errors and reports name a rank: `rank 3`, or on a host of a several-host launch `rank 3 on gpu-b`."""
    return f"rank {rank} on {host}" if host else f"rank {rank}"
