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

`withdrawable` is the other direction: the kernel's main thread waits where nothing but a signal can wake it
(the kernel's input(), asked for a rank's prompt), and a watch thread ends that wait with `Withdrawn` once it
became moot (the rank died at its prompt, another rank failed). The watch sends the main thread a SIGINT, and
the handler installed for the wait turns the watch's own SIGINTs into `Withdrawn`; the user's stay interrupts.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable, Iterator
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


# ---------------------------------------------------------------------------------------------------------
# Ending a wait of the main thread that became moot
# ---------------------------------------------------------------------------------------------------------

WATCH_EVERY = 0.2  # seconds between two checks of whether the wait became moot
LANDING = 1.0  # seconds the end of the wait gives a SIGINT the watch sent to land (it takes microseconds)


class Withdrawn(BaseException):
    """The main thread's wait (in `withdrawable`) became moot; the text says why. A BaseException, since
    ipykernel's input() logs any Exception raised while it waits as a bad message and waits on."""


class _MootWatch:
    """The thread that asks `moot()` while the main thread waits, and the SIGINT handler of that wait.

    The watch counts the SIGINTs it sends, the handler those it takes, so a late one (sent as the wait ended)
    is taken at the end of the wait instead of landing later as the user's interrupt. It sends again each
    round until the wait ends: a handler run inside a finalizer has its exception dropped."""

    def __init__(self, moot: Callable[[], str | None], previous: Callable[..., object], every: float) -> None:
        self._moot = moot
        self._previous = previous
        self._every = every
        self._main = threading.main_thread().ident
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._open = True  # the main thread still waits: the watch may signal it
        self.reason: str | None = None
        self._sent = 0
        self._taken = 0
        self._thread = threading.Thread(target=self._run, name="nbaccel-moot-watch", daemon=True)

    def handle(self, signum: int, frame: FrameType | None) -> None:
        if self.reason is None or self._taken >= self._sent:  # not the watch's: the user's interrupt
            self._previous(signum, frame)
            return
        self._taken += 1
        if self._open:
            raise Withdrawn(self.reason)

    def _run(self) -> None:
        while not self._done.wait(self._every):
            if self.reason is None:
                try:
                    reason = self._moot()
                except Exception:  # a check that fails must not end the wait
                    reason = None
                if reason is None:
                    continue
                self.reason = reason
            with self._lock:
                if not self._open:
                    return
                self._sent += 1
                signal.pthread_kill(self._main, signal.SIGINT)  # type: ignore[arg-type]

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """The wait ended (the main thread): no more signals; take those on their way."""
        with self._lock:
            self._open = False
        self._done.set()
        self._thread.join(LANDING)
        deadline = time.monotonic() + LANDING
        while self._taken < self._sent and time.monotonic() < deadline:
            time.sleep(0.001)  # a signal ends the sleep, and its handler runs here


@contextlib.contextmanager
def withdrawable(moot: Callable[[], str | None], every: float = WATCH_EVERY) -> Iterator[None]:
    """Run the block, a wait of the main thread that only a signal can cut short (the kernel's input()), while
    a thread calls `moot()` every `every` seconds; once it returns a reason, the block ends with
    `Withdrawn(reason)`. The user's interrupt stays a KeyboardInterrupt. Outside the main thread, or where
    SIGINT has no Python handler, the block runs unwatched."""
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or not callable(previous):
        yield
        return
    watch = _MootWatch(moot, previous, every)
    signal.signal(signal.SIGINT, watch.handle)
    try:
        watch.start()
        try:
            yield
        finally:
            watch.close()
    finally:
        if signal.getsignal(signal.SIGINT) == watch.handle:  # else someone replaced it: theirs stays
            signal.signal(signal.SIGINT, previous)
