"""An interrupt always ends the launch: a KeyboardInterrupt that Python swallowed is raised again.

Python runs a SIGINT handler at whatever bytecode the main thread is executing when the signal arrives. When
that is a finalizer (a weakref callback such as WeakSet's, `__del__`, a `weakref.finalize` callback, run when
the garbage collector or a reference count frees an object), the KeyboardInterrupt the handler raises is
printed as "Exception ignored in ..." and dropped: the launch went on as if nothing happened (it ran to the end,
or failed much later when the other ranks ended). The more garbage with finalizers a kernel holds (earlier
launches, their failures and tracebacks), the more often the supervisor's thread is inside one.

`interrupts_kept` wraps the kernel's own SIGINT handler for the duration of a launch (in the main thread,
where Python runs handlers): the handler runs as before, and when it raised KeyboardInterrupt, that is noted.
`raise_if_swallowed` (the supervisor calls it every loop) and the end of the launch raise KeyboardInterrupt
when one was noted and none came through. `interrupts_held` holds a SIGINT until the end of a step that must
not be cut in half (starting the rank groups' keeper and keeping its handle). The handler is put back when the launch ends, unless something else
replaced it meanwhile. A handler that does not raise (e.g. one that ignores interrupts) is left to decide.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any


class InterruptNote:
    """The SIGINTs whose handler raised KeyboardInterrupt during one launch, and whether one came through."""

    def __init__(self, previous: Any) -> None:
        self.previous = previous
        self.pending = False  # a KeyboardInterrupt was raised that no one has seen end the launch yet
        self.holding = 0  # inside `interrupts_held`: a SIGINT waits for its end
        self.held = False

    def handle(self, signum: int, frame: FrameType | None) -> None:
        if self.holding:
            self.held = True
            return
        try:
            self.previous(signum, frame)
        except KeyboardInterrupt:
            self.pending = True
            raise


_active: list[InterruptNote] = []  # the launches under way in the main thread, innermost last


def raise_if_swallowed() -> None:
    """Raise KeyboardInterrupt when the current launch was interrupted but is still running: the interrupt's
    KeyboardInterrupt was dropped somewhere (a finalizer); the launch must end as if it had come through."""
    if _active and _active[-1].pending:
        _active[-1].pending = False
        raise KeyboardInterrupt


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """Hold a SIGINT that arrives inside this block until its end (during a launch, in the main thread): for a
    step that must not be cut in half, e.g. starting a helper process and keeping its handle."""
    note = _active[-1] if _active and threading.current_thread() is threading.main_thread() else None
    if note is None:
        yield
        return
    note.holding += 1
    try:
        yield
    finally:
        note.holding -= 1
        if not note.holding and note.held:
            note.held = False
            note.handle(signal.SIGINT, None)  # the kernel's handler decides now (KeyboardInterrupt, noted)


@contextlib.contextmanager
def interrupts_kept() -> Iterator[None]:
    """For the duration of a launch, note every KeyboardInterrupt the SIGINT handler raises; at the end,
    raise one that was swallowed (instead of returning, or chained to the error that ended the launch)."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread runs signal handlers: nothing to note here
        return
    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous):  # SIG_IGN, SIG_DFL, or set outside Python: nothing raises KeyboardInterrupt
        yield
        return
    note = InterruptNote(previous)
    signal.signal(signal.SIGINT, note.handle)
    _active.append(note)
    error: BaseException | None = None
    try:
        yield
    except BaseException as exc:  # noqa: BLE001 - raised again below, or an interrupt in its place
        error = exc
    finally:
        _active.remove(note)
        if signal.getsignal(signal.SIGINT) == note.handle:  # else someone replaced it: theirs stays
            signal.signal(signal.SIGINT, previous)
    if isinstance(error, KeyboardInterrupt):
        raise error
    if note.pending:  # swallowed: during the cleanup (the launch returned), or before the error that ended it
        raise KeyboardInterrupt from error
    if error is not None:
        raise error
