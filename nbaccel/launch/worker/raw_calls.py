"""A launched rank's watch on raw `torch.distributed` collectives: which one its main thread is blocked in.

nbaccel's own collectives are traced exactly (`utils/collective_trace.py`); a script's own
`dist.all_reduce(...)` is not, and wrapping every torch.distributed function would make every call pay.
Instead a daemon thread looks at the main thread's stack (`sys._current_frames()`) every SAMPLE seconds: a
frame of one of torch.distributed's collectives, outside any traced collective, is reported as a
`collective` message with `event` "raw" (the torch function, the user's line that called it, when the rank
was first seen in it, when it was last seen, and the stack down to it), again at each sample while the rank
stays there, and once with `op` None when it left. A call shorter than a sample is seen now and then or
never: it costs nothing, and only a call that blocks matters. The kernel (kernel/collective_tracker.py) treats a
rank seen in a raw collective as waiting there, for hang_report's rules. RankPool's ranks answer the same
question from their status snapshots (worker/pool_rank.py `snapshot`).

A look holds the main thread's frames, and with them their locals: a collective's frame refers to the process
group (`torch.distributed.breakpoint` keeps it in a local too). `stop()` returns only once no look is under way,
so the rank's end destroys the group with nothing else holding it. A look still holding the frames then (the
watch's thread descheduled on a busy machine) kept the group alive past `destroy_process_group`; the thread
freed it later, and when that was as the interpreter finalized, gloo's destructor in that thread could not
take the GIL back: the rank aborted ("terminate called without an active exception", exit -6) after its result.
"""

from __future__ import annotations

import _thread
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from types import FrameType

SAMPLE = 0.5  # seconds between looks at the main thread's stack
STOP_WAIT = 5.0  # seconds `stop()` waits at most for a look under way (one takes milliseconds at most)
# torch.distributed's collectives (distributed_c10d): point-to-point calls (send/recv) are left out, since a
# matching pair has different names
COLLECTIVES = frozenset({
    "all_reduce", "all_reduce_coalesced", "broadcast", "broadcast_object_list", "all_gather", "all_gather_object",
    "all_gather_into_tensor", "all_gather_coalesced", "reduce", "reduce_scatter", "reduce_scatter_tensor",
    "all_to_all", "all_to_all_single", "gather", "gather_object", "scatter", "scatter_object_list", "barrier",
    "monitored_barrier",
})
_TORCH_DISTRIBUTED = f"{os.sep}torch{os.sep}distributed{os.sep}"
_HERE = os.path.dirname(os.path.abspath(__file__)) + os.sep  # the rank entries' folder (worker/)


def raw_collective(frame: FrameType | None) -> tuple[str, list[traceback.FrameSummary]] | None:
    """(the torch.distributed collective the stack of `frame` is in, the stack from the outermost frame down
    to it), or None. The outermost such frame counts: torch's collectives call each other inside."""
    return _outermost_collective(_callers(frame)[::-1])


def _callers(frame: FrameType | None) -> list[tuple[FrameType, int]]:
    """`frame` and its callers, innermost first, each with the line it is at."""
    frames = []
    while frame is not None:
        frames.append((frame, frame.f_lineno))
        frame = frame.f_back
    return frames


def _outermost_collective(frames: list[tuple[FrameType, int]]) -> tuple[str, list[traceback.FrameSummary]] | None:
    """`raw_collective` of a stack given outermost first, each frame with its line."""
    for index, (frame, _) in enumerate(frames):
        code = frame.f_code
        if code.co_name in COLLECTIVES and _TORCH_DISTRIBUTED in code.co_filename:
            stack = traceback.StackSummary.extract(iter(frames[:index + 1]), lookup_lines=True)
            return f"torch.distributed.{code.co_name}", list(stack)
    return None


class RawCollectiveWatch:
    """The sampling thread (see the module docstring); `send(**fields)` gets each report; `stop()` ends it."""

    def __init__(self, send: Callable[..., None], main_ident: int | None = None,
                 interval: float = SAMPLE, first: Callable[[], None] | None = None) -> None:
        self._send = send
        self._first = first
        self._main = threading.main_thread().ident if main_ident is None else main_ident
        self._interval = interval
        self._stop = threading.Event()
        self._looking = threading.Lock()  # held by the thread while it holds the main thread's frames
        self._inside: tuple[str, str] | None = None  # (op, site) of the raw collective the rank is in
        self._started = 0.0
        # a bare daemon thread: threading.Thread.start waits until the new thread runs, which on a busy machine
        # held the rank 1-3 ms on its way to the user's function (the watch's first look is SAMPLE s away)
        _thread.start_new_thread(self._run, ())

    def stop(self, wait: float = STOP_WAIT) -> None:
        """End the watch. Returns once the thread holds no frame of the main thread: a look under way ends first
        (at most `wait` seconds), and none starts after (see the module docstring)."""
        self._stop.set()
        if self._looking.acquire(timeout=wait):
            self._looking.release()

    def _run(self) -> None:
        try:
            if self._first is not None:  # e.g. the rank's `running` status, sent off the rank's main thread
                self._first()
            while not self._stop.wait(self._interval):
                with self._looking:
                    if self._stop.is_set():
                        break
                    found = self._look()
                self._report(found)
        except Exception:  # the watch must never disturb the rank
            pass

    def _look(self) -> tuple[str, list[traceback.FrameSummary]] | None:
        """The raw collective the main thread is in now, if any. The frames it looks at (and an exception's
        traceback, which refers to them) are gone when it returns."""
        from ...utils import collective_trace

        try:
            frame = sys._current_frames().get(self._main)
            return None if frame is None or collective_trace.current() is not None else raw_collective(frame)
        except Exception:
            return None

    def _report(self, found: tuple[str, list[traceback.FrameSummary]] | None) -> None:
        now = time.time()
        if found is None:
            if self._inside is not None:
                self._inside = None
                self._send(event="raw", op=None, seen=now)
            return
        op, stack = found
        site, shown = _site_and_stack(stack)
        if self._inside != (op, site):
            self._inside, self._started = (op, site), now
        self._send(event="raw", op=op, site=site, started=self._started, seen=now, stack=shown)

    def report_failure(self, exc: BaseException) -> None:
        """Report that `exc` came out of a raw collective, when it did (gloo's "Connection closed by peer" in a
        rank whose peer returned): sent before the rank's failure, so the kernel names the collective the
        rank waited in rather than blaming it. The exception's own frames say where it was: a peer that
        returns ends the call at once, often before any sample."""
        tb = exc.__traceback__
        if tb is None:
            return
        frames = _callers(tb.tb_frame.f_back)[::-1]  # where it was caught, and its callers
        while tb is not None:  # the frames it came through, each at the line it was at then
            frames.append((tb.tb_frame, tb.tb_lineno))
            tb = tb.tb_next
        found = _outermost_collective(frames)
        if found is None:
            return
        op, stack = found
        site, shown = _site_and_stack(stack)
        now = time.time()
        started = self._started if self._inside == (op, site) else now  # seen there: since when
        self._send(event="raw", op=op, site=site, started=started, seen=now, stack=shown, failed=True)


def _site_and_stack(stack: list[traceback.FrameSummary]) -> tuple[str, str]:
    """The user's line that called into torch.distributed (the innermost frame outside it), and the stack to
    show: the user's part, below the last frame of the rank's entry (this folder), as in a traceback."""
    caller = next((entry for entry in reversed(stack) if _TORCH_DISTRIBUTED not in entry.filename), stack[-1])
    start = next((i + 1 for i in range(len(stack) - 1, -1, -1) if stack[i].filename.startswith(_HERE)), 0)
    return f"{caller.filename}:{caller.lineno}", "".join(traceback.format_list(stack[start:][-10:]))


def watch_raw_collectives(send: Callable[..., None], first: Callable[[], None] | None = None,
                          ) -> RawCollectiveWatch | None:
    """Start the watch for the calling thread (the one that runs the rank's function or script); None where
    the interpreter has no `sys._current_frames` (it is CPython's). `first`: called by the watch's thread
    before its first look."""
    if not hasattr(sys, "_current_frames"):
        return None
    return RawCollectiveWatch(send, threading.get_ident(), first=first)
