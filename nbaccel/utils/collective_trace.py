"""Which collective this process is in right now.

Every nbaccel collective wraps its communication in `in_collective(...)`. The record it leaves (operation,
torch call, shapes, dtypes, call site, start time) is what the persistent ranks' hang report and the
dashboard show when ranks diverge. `seq` numbers the collectives this process entered (1, 2, ...): ranks
running the same program agree on it, so two ranks waiting in different `seq` can never meet. Listeners
(registered by `nbaccel.telemetry` when a launcher channel is attached) hear each enter and each exit
("exit", or "error" when an exception left the collective); with none registered the cost is a few
attribute writes.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

CollectiveListener = Callable[[str, "CollectiveRecord"], None]


@dataclass
class CollectiveRecord:
    """One collective in progress: `op` is the nbaccel name (e.g. "gather"), `call` the torch call."""

    op: str
    call: str = ""
    shapes: list[list[int]] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    site: str = ""
    started: float = 0.0
    seq: int = 0

    def describe(self) -> str:
        """One line for reports: `gather(all_gather_into_tensor, shape [2], float32) at cell line 4`."""
        parts = [self.call] if self.call else []
        if self.shapes:
            parts.append("shape " + ", ".join(str(list(s)) for s in self.shapes))
        if self.dtypes:
            parts.append(", ".join(sorted(set(self.dtypes))))
        text = f"{self.op}({', '.join(parts)})"
        return f"{text} at {self.site}" if self.site else text

    def to_dict(self) -> dict[str, Any]:
        """The fields as a dict (the lists are shared, not copied: a record is not changed once made)."""
        return {"op": self.op, "call": self.call, "shapes": self.shapes, "dtypes": self.dtypes, "site": self.site,
                "started": self.started, "seq": self.seq}


# Operations whose traced tensors differ in shape between ranks by design (the communication itself is
# even: pad_across_processes all-gathers the lengths of tensors that differ); hang reports compare
# their operation and sequence number, not their shapes.
UNEVEN_SHAPES = frozenset({"pad_across_processes"})

_current: in_collective | None = None
_count = 0  # collectives entered by this process: the next one's `seq` is _count + 1
_listeners: list[CollectiveListener] = []
_lock = threading.Lock()
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH_MARKER = os.sep + "torch" + os.sep


def current() -> CollectiveRecord | None:
    """The collective this process is inside, or None."""
    active = _current
    return active.record() if active is not None else None


def add_listener(listener: CollectiveListener) -> None:
    """Call `listener("enter" | "exit", record)` around every traced collective."""
    with _lock:
        if listener not in _listeners:
            _listeners.append(listener)


def remove_listener(listener: CollectiveListener) -> None:
    with _lock:
        if listener in _listeners:
            _listeners.remove(listener)


def internal_frame(filename: str) -> bool:
    """Whether a frame's file is nbaccel's or torch's own code (or contextlib's, which wraps them): not the
    user's. Hang reports hide these frames; the first frame that is not one is the user's call site."""
    return filename.startswith(_PACKAGE_DIR) or _TORCH_MARKER in filename or "contextlib" in filename


def _caller_site() -> str:
    """The first frame outside nbaccel and torch: the user's line that started the collective."""
    frame = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not internal_frame(filename):
            # a notebook cell: the kernel's, a RankPool cell (`<rank-cell-3>`) or a %%ranks cell (`Cell In[7]`)
            if filename.startswith(("<", "Cell In[")) or "ipykernel" in filename:
                return f"cell line {frame.f_lineno}"
            return f"{filename}:{frame.f_lineno}"
        frame = frame.f_back
    return ""


class in_collective:  # noqa: N801 - used as a function: `with in_collective("gather", ...):`
    """Mark the body as collective `op` (torch call `call`) over `tensors` (a tensor or a list of them).

    A class rather than a generator-based context manager: it runs around every collective, and entering
    and leaving a generator costs several times more. With no listener, the record (shapes, dtypes) is
    built only when someone asks for it (`current()`, from a hang report), not on every collective."""

    __slots__ = ("_op", "_call", "_tensors", "_started", "_seq", "_site", "_record", "_previous")

    def __init__(self, op: str, call: str = "", tensors: Any = ()) -> None:
        global _count
        _count += 1
        self._op, self._call, self._tensors = op, call, tensors
        self._started, self._seq = time.time(), _count
        self._site = _caller_site() if _listeners else ""
        self._record: CollectiveRecord | None = None
        self._previous: in_collective | None = None

    def record(self) -> CollectiveRecord:
        """The record of this collective (built at the first call)."""
        record = self._record
        if record is None:
            tensors = self._tensors
            items = tensors if isinstance(tensors, (list, tuple)) else [tensors]
            record = self._record = CollectiveRecord(
                op=self._op,
                call=self._call,
                shapes=[list(getattr(t, "shape", ())) for t in items],
                dtypes=[str(getattr(t, "dtype", "")).replace("torch.", "") for t in items if hasattr(t, "dtype")],
                site=self._site,
                started=self._started,
                seq=self._seq,
            )
        return record

    def __enter__(self) -> CollectiveRecord | None:
        global _current
        self._previous, _current = _current, self
        if _listeners:
            record = self.record()
            for listener in list(_listeners):
                listener("enter", record)
        return self._record

    def __exit__(self, kind: Any, value: Any, traceback: Any) -> None:
        global _current
        _current = self._previous
        if _listeners:
            record, event = self.record(), "exit" if kind is None else "error"
            for listener in list(_listeners):
                listener(event, record)
