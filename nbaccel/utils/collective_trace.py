"""Which collective this process is in right now.

Every nbaccel collective wraps its communication in `in_collective(...)`. The record it leaves (operation,
torch call, shapes, dtypes, call site, start time) is what the persistent ranks' hang report and the
dashboard show when ranks diverge. `seq` numbers the collectives this process entered (1, 2, ...): ranks
running the same program agree on it, so two ranks waiting in different `seq` can never meet. Listeners
(registered by `nbaccel.telemetry` when a launcher channel is attached) hear each enter and each exit
("exit", or "error" when an exception left the collective); with none registered the cost is a few
attribute writes. A listener registered with `with_record=False` is handed the `in_collective` itself
(its `op`, `call`, `seq`, `started`, `site` and `layout()`), so no record is built for it: the launcher's
telemetry, which runs around every collective of a launch, takes that way.
"""

from __future__ import annotations

import operator
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .tracebacks import PACKAGE_DIR

CollectiveListener = Callable[[str, Any], None]  # (event, CollectiveRecord), or (event, in_collective)


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
# Replaced, never changed in place (under _lock), so a collective loops over them without copying.
_record_listeners: tuple[CollectiveListener, ...] = ()  # called with the CollectiveRecord
_trace_listeners: tuple[CollectiveListener, ...] = ()  # called with the in_collective (with_record=False)
_listeners: tuple[CollectiveListener, ...] = ()  # both: a collective looks up its call site when non-empty
_lock = threading.Lock()
_internal_files: dict[str, bool] = {}  # internal_frame() of the file names seen, for _caller_site
_shape_of, _dtype_of = operator.attrgetter("shape"), operator.attrgetter("dtype")
_TORCH_MARKER = os.sep + "torch" + os.sep


def current() -> CollectiveRecord | None:
    """The collective this process is inside, or None."""
    active = _current
    return active.record() if active is not None else None


def add_listener(listener: CollectiveListener, *, with_record: bool = True) -> None:
    """Call `listener("enter" | "exit" | "error", record)` around every traced collective.

    With `with_record=False` the listener gets the `in_collective` instead of a `CollectiveRecord`: its
    attributes `op`, `call`, `seq`, `started`, `site` and `layout()` (the traced tensors' sizes and
    dtypes, as torch gives them), read during the call; it must not keep the object (it holds the
    tensors)."""
    global _record_listeners, _trace_listeners
    with _lock:
        if listener in _listeners:
            return
        if with_record:
            _record_listeners += (listener,)
        else:
            _trace_listeners += (listener,)
        _update_listeners()


def remove_listener(listener: CollectiveListener) -> None:
    global _record_listeners, _trace_listeners
    with _lock:
        _record_listeners = tuple(known for known in _record_listeners if known != listener)
        _trace_listeners = tuple(known for known in _trace_listeners if known != listener)
        _update_listeners()


def _update_listeners() -> None:
    global _listeners
    _listeners = _record_listeners + _trace_listeners


def internal_frame(filename: str) -> bool:
    """Whether a frame's file is nbaccel's or torch's own code (or contextlib's, which wraps them): not the
    user's. Hang reports hide these frames; the first frame that is not one is the user's call site."""
    return filename.startswith(PACKAGE_DIR) or _TORCH_MARKER in filename or "contextlib" in filename


def _caller_site() -> str:
    """The first frame outside nbaccel and torch: the user's line that started the collective."""
    frame = sys._getframe(2)
    known = _internal_files
    while frame is not None:
        filename = frame.f_code.co_filename
        internal = known.get(filename)
        if internal is None:
            if len(known) > 4096:  # a long session's many cells: start over rather than grow
                known.clear()
            internal = known[filename] = internal_frame(filename)
        if not internal:
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
    built only when someone asks for it (`current()`, from a hang report), not on every collective; a
    listener registered with `with_record=False` reads the attributes below instead.

    `op`, `call`: as given; `seq`: this process's count of collectives entered; `started`: time.time() when
    made; `site`: the user's line that called (looked up only while some listener is registered).

    With `announce=False` the listeners hear the enter only at `announce()`, which an asynchronous
    collective calls once its communication has started: their work (the call site's look-up, the
    telemetry's queueing) then overlaps the data's travel instead of delaying this rank's send, which its
    peers wait for. A block left before `announce()` announces first, so listeners always hear an enter
    before its exit or error."""

    __slots__ = ("op", "call", "_tensors", "started", "seq", "site", "_record", "_previous", "_unheard")

    def __init__(self, op: str, call: str = "", tensors: Any = (), *, announce: bool = True) -> None:
        global _count
        _count += 1
        self.op, self.call, self._tensors = op, call, tensors
        self.started, self.seq = time.time(), _count
        self.site = _caller_site() if _listeners and announce else ""
        self._unheard = not announce and bool(_listeners)  # an enter the listeners are still to hear
        self._record: CollectiveRecord | None = None
        self._previous: in_collective | None = None

    def layout(self) -> tuple[list[Any], list[Any]]:
        """The traced tensors' sizes (torch.Size, or () for an item without a shape) and their dtypes
        (torch.dtype; items without one are left out): what the record's `shapes` and `dtypes` are made of,
        without the conversion."""
        tensors = self._tensors
        items = tensors if isinstance(tensors, (list, tuple)) else (tensors,)
        try:  # map: no Python frame per item (list comprehensions are functions in this Python)
            return list(map(_shape_of, items)), list(map(_dtype_of, items))
        except AttributeError:  # something other than tensors traced: the general way
            return ([getattr(t, "shape", ()) for t in items],
                    [t.dtype for t in items if hasattr(t, "dtype")])

    def record(self) -> CollectiveRecord:
        """The record of this collective (built at the first call)."""
        record = self._record
        if record is None:
            shapes, dtypes = self.layout()
            record = self._record = CollectiveRecord(
                op=self.op,
                call=self.call,
                shapes=list(map(list, shapes)),
                dtypes=list(map(dtype_name, dtypes)),
                site=self.site,
                started=self.started,
                seq=self.seq,
            )
        return record

    def __enter__(self) -> CollectiveRecord | None:
        global _current
        self._previous, _current = _current, self
        if _listeners and not self._unheard:
            self._tell_enter()
        return self._record

    def announce(self) -> None:
        """Let the listeners hear the enter of a collective made with `announce=False` (once only)."""
        if self._unheard:
            self._unheard = False
            self.site, self._record = _caller_site(), None  # a record made before had no site
            self._tell_enter()

    def _tell_enter(self) -> None:
        for listener in _trace_listeners:
            listener("enter", self)
        if _record_listeners:
            record = self.record()
            for listener in _record_listeners:
                listener("enter", record)

    def __exit__(self, kind: Any, value: Any, traceback: Any) -> None:
        global _current
        _current = self._previous
        if self._unheard:  # left before its communication started (e.g. it raised): the enter first
            self.announce()
        if _listeners:
            event = "exit" if kind is None else "error"
            for listener in _trace_listeners:
                listener(event, self)
            if _record_listeners:
                record = self.record()
                for listener in _record_listeners:
                    listener(event, record)


_dtype_names: dict[Any, str] = {}


def dtype_name(dtype: Any) -> str:
    """The name that records and messages carry for a dtype: `float32` for torch.float32."""
    name = _dtype_names.get(dtype)
    if name is None:
        name = str(dtype).replace("torch.", "")
        if len(_dtype_names) < 256:
            _dtype_names[dtype] = name
    return name
