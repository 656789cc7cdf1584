"""The host agent's ends of the SSH session: its stdout (the kernel's channel) and its stdin, read by a thread of
its own (`KernelReader`) from the agent's first line on, before torch is imported.

Before any rank starts, the session's end (the kernel's stop, or the kernel gone) ends the agent at once, also
in the middle of its imports: an interrupt while the hosts start stops the launch in the time of a login, not
of the imports (~2 s). After, the relay loop (host_agent.py) learns of it through a wake-up pipe, and if that
loop is stuck (a rank that does not read what it is sent), the thread kills the ranks and this process after
SESSION_END_GRACE seconds. The ranks forked here do not keep these ends open (`_release_session_in_child`).

Nothing here imports torch: `python -m nbaccel.launch.agent` opens the session first (agent/__main__.py).
"""

from __future__ import annotations

import os
import pickle
import queue
import signal
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from ..host_protocol import STOP

SESSION_END_GRACE = 10.0  # seconds the relay loop has to stop the ranks once the SSH session ended
# what a batch system sends a job's steps to ask its programs for a checkpoint (`scancel --signal=USR1 JOB`,
# `sbatch/salloc --signal=USR1@90`): meant for the ranks, it reaches the agent (srun's task), which it killed,
# and the ranks with it (PR_SET_PDEATHSIG); the agent hands it to its ranks' process groups instead
FORWARDED_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)

_SESSION_FDS: list[int] = []  # this process's ends of the SSH session (and its wake-up pipe)
_AT_LEAVE: list[Callable[[], None]] = []
_RANKS: list[int] = []  # the pids of this host's ranks, each its process group's leader: FORWARDED_SIGNALS' aim
_TERMINATED = threading.Event()


def _in_slurm_step_cgroup() -> bool:
    """Whether this process runs in a SLURM job step's cgroup (proctrack/cgroup: .../job_N/step_M/...), where
    SLURM signals every process of the step, the ranks forked here too; else (proctrack/pgid) only this one's
    process group."""
    try:
        with open("/proc/self/cgroup") as cgroups:
            text = cgroups.read()
    except OSError:
        return False
    return "/job_" in text and "/step_" in text


_SLURM_SIGNALS_EVERY_PROCESS = _in_slurm_step_cgroup()


def open_session() -> tuple[Connection, KernelReader]:
    """(the kernel's channel, the reader of its frames), both taken from stdout and stdin; anything else printed
    here (and by the ranks, which inherit fds) goes to stderr, and stdin is /dev/null."""
    kernel = Connection(os.dup(1), readable=False)
    commands = Connection(os.dup(0), writable=False)
    _SESSION_FDS.extend((kernel.fileno(), commands.fileno()))
    os.register_at_fork(after_in_child=_release_session_in_child)
    for signum in FORWARDED_SIGNALS:  # from the first line on: one that comes while torch imports is no rank's
        signal.signal(signum, _forward_to_ranks)
    signal.signal(signal.SIGTERM, _terminate)
    os.dup2(2, 1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    return kernel, KernelReader(commands)


def forward_signals_to(ranks: list[int]) -> None:
    """FORWARDED_SIGNALS go to these ranks (pids) from now on."""
    _RANKS[:] = ranks


def terminated() -> bool:
    """Whether the agent got SIGTERM once its ranks ran (SLURM's scancel or time limit, before SIGKILL)."""
    return _TERMINATED.is_set()


def _terminate(signum: int, frame: Any) -> None:
    """SIGTERM: before any rank runs, end at once (as by default). Then the ranks get it too (a checkpoint on
    SIGTERM is theirs to save in SLURM's KillWait) and the relay loop leaves once they have exited, without
    reporting their exits: the kernel takes them for lost with this agent, and names why from srun's lines."""
    if not _RANKS:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    _TERMINATED.set()
    _forward_to_ranks(signum, frame)


def _forward_to_ranks(signum: int, frame: Any) -> None:
    if _SLURM_SIGNALS_EVERY_PROCESS:
        return  # the ranks have it already
    for pid in _RANKS:
        try:
            os.killpg(pid, signum)  # the rank and what it started, as `nbaccel launch` signals a rank
        except ProcessLookupError:
            try:
                os.kill(pid, signum)  # a rank that has not made its group yet
            except ProcessLookupError:
                pass
        except PermissionError:
            pass


def hold_in_session(fd: int) -> None:
    """`fd` stays this process's own: a process forked here gets /dev/null in its place."""
    _SESSION_FDS.append(fd)


class KernelReader:
    """The one reader of the kernel's frames (stdin), in a thread: each frame goes into `frames` and wakes the
    relay loop through a pipe (`wake_fd`); the end of the session puts STOP there. The session's end is thus
    seen whatever the relay loop is doing, and if that loop has not finished within SESSION_END_GRACE
    seconds, `on_stuck` runs (it kills the ranks and this process). Frames are unpickled by their taker, not
    here: the start's plan imports nbaccel's launch modules, which the agent's main thread may be importing
    at that moment."""

    def __init__(self, commands: Connection) -> None:
        self.commands = commands
        self.frames: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()  # None: the session ended
        self.wake_fd, self._wake_w = os.pipe()
        os.set_blocking(self.wake_fd, False)
        os.set_blocking(self._wake_w, False)
        _SESSION_FDS.extend((self.wake_fd, self._wake_w))
        self.done = threading.Event()  # set by the relay loop once its ranks are stopped
        self._on_stuck: Any = None  # set (under _phase) once ranks may start: until then the session's end exits
        self._phase = threading.Lock()
        self._thread = threading.Thread(target=self._read, name="nbaccel-agent-kernel-reader", daemon=True)
        self._thread.start()

    def next_frame(self) -> Any:
        """The next frame, waiting for it (before the relay loop runs: the probe, then the start)."""
        return _frame(self.frames.get())

    def ranks_may_start(self, on_stuck: Any) -> None:
        """From now on the session's end goes to the relay loop, and `on_stuck` runs if that loop has not
        stopped the ranks SESSION_END_GRACE s later."""
        with self._phase:
            self._on_stuck = on_stuck

    def _read(self) -> None:
        while True:
            try:
                data = self.commands.recv_bytes()
            except (EOFError, OSError):
                break  # the SSH session closed: the kernel is gone or done (its STOP comes just before)
            self.frames.put(data)
            self._wake()
        with self._phase:
            if self._on_stuck is None:  # no rank started here (the store's process dies with this one)
                leave(0)
        self.frames.put(None)
        self._wake()
        if not self.done.wait(SESSION_END_GRACE):
            self._on_stuck()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:
            pass  # the loop has wake-ups enough to read
        except OSError:
            pass

    def take(self) -> list[Any]:
        """The frames that came, in order (the wake-up bytes read too)."""
        try:
            while os.read(self.wake_fd, 4096):
                pass
        except (BlockingIOError, OSError):
            pass
        frames = []
        while True:
            try:
                frames.append(_frame(self.frames.get_nowait()))
            except queue.Empty:
                return frames


def _frame(data: bytes | None) -> Any:
    return STOP if data is None else pickle.loads(data)


def _release_session_in_child() -> None:
    """In a process forked here (a rank): point the session's fds at /dev/null. A rank holding the session's
    stdout would keep the SSH session open after this agent ended; the numbers stay taken, so nothing else
    reuses them while the copied Connection objects still name them. The forwarded signals are the rank's own
    again (their default, or its function's handlers)."""
    for signum in (*FORWARDED_SIGNALS, signal.SIGTERM):
        try:
            signal.signal(signum, signal.SIG_DFL)
        except (ValueError, OSError):
            pass  # forked from another thread than the main one (it is the child's main thread in CPython)
    try:
        devnull = os.open(os.devnull, os.O_RDWR)
    except OSError:
        return
    for fd in _SESSION_FDS:
        try:
            os.dup2(devnull, fd, inheritable=False)
        except OSError:
            pass
    os.close(devnull)


def at_leave(end: Callable[[], None]) -> None:
    """`end` runs when the agent leaves, whichever way: what it started besides the ranks ends with it."""
    _AT_LEAVE.append(end)


def leave(code: int) -> None:
    """Exit without the interpreter's teardown: the ranks are stopped and reaped by now (Relay.serve, or none
    started), what `at_leave` registered ends here, and unwinding a process that imported torch costs ~0.3 s,
    which the kernel would wait for (it waits for every agent's exit before the launch returns)."""
    for end in _AT_LEAVE:
        try:
            end()
        except Exception:
            pass  # leaving all the same: what is left dies with this process (PR_SET_PDEATHSIG)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
