"""The rank processes of a `RankPool`: started and owned by the backend of the plan's placement (a launch's, with
the program `pool`) inside a launch session (kernel/launch_session.py, as every launch); here the pool waits
until they are ready and stops them (asking first, then as the backend stops a launch's ranks).

Kept apart from `RankPool` so that finalizers (garbage collection, interpreter exit) hold these objects and
never the pool itself.
"""

from __future__ import annotations

import atexit
import multiprocessing.util
import select
import time
import weakref
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import TYPE_CHECKING, Any

from ..channel import close_quietly
from ..errors import ended_how
from ..kernel.launch_session import LaunchSession
from ..messages import PoolCommand, Ready
from ..output import read_available
from .results import RankStartError

if TYPE_CHECKING:
    from ..kernel.placement_base import StartedRank
    from ..kernel.plan import LaunchPlan

START_TIMEOUT = 120.0  # seconds for every rank to build its process group


class RankOutput:
    """The pool's bookkeeping of one rank's output (kept by `RankProcesses.outputs`, by rank): its stdout and
    stderr pipes (the rank's `StartedRank` ends), read between and during calls, and what was read."""

    def __init__(self, started: StartedRank) -> None:
        self.on_output: Callable[[str, bytes], None] | None = None  # (stream, data) of every read, if set
        self.out_fd = out_fd = started.stdout_fd
        self.err_fd = err_fd = started.stderr_fd
        self.out = bytearray()
        self.err = bytearray()
        self.closed_fds: set[int] = set()
        # one poll object for the output pipes, kept for the rank's life: take runs twice per rank in every call,
        # and a selector built per call cost more than the rest of a trivial call's kernel side
        self._output_poll = select.poll() if hasattr(select, "poll") else None
        if self._output_poll is not None:
            for fd in (out_fd, err_fd):
                self._output_poll.register(fd, select.POLLIN)

    def open_fds(self) -> list[int]:
        return [fd for fd in (self.out_fd, self.err_fd) if fd not in self.closed_fds]

    def drain(self, fd: int) -> None:
        if fd in self.closed_fds:
            return
        data, at_end = read_available(fd)
        (self.out if fd == self.out_fd else self.err).extend(data)
        if self.on_output is not None and data:
            self.on_output("stdout" if fd == self.out_fd else "stderr", data)
        if at_end:
            self._closed(fd)

    def _closed(self, fd: int) -> None:
        self.closed_fds.add(fd)
        if self._output_poll is not None:
            self._output_poll.unregister(fd)

    def close(self) -> None:
        """Close the output pipes; the descriptors' numbers may be reused, so nothing here polls them again."""
        close_quietly(self.out_fd, self.err_fd)
        self.closed_fds.update((self.out_fd, self.err_fd))
        self._output_poll = None

    def take(self, poll: bool = True) -> tuple[str, str]:
        """What the rank wrote since the last take: (stdout, stderr). `poll=False`: only what was read already
        (the caller just read the pipes that were ready: pool/call.py's quick wait)."""
        if not poll:
            pass
        elif self._output_poll is not None:  # one poll instead of a read of each pipe (most calls print nothing)
            for fd, events in self._output_poll.poll(0):
                if events & select.POLLNVAL:  # closed on this side (the pool is stopping)
                    self._closed(fd)
                else:
                    self.drain(fd)
        else:
            open_fds = self.open_fds()
            for fd in wait(open_fds, 0) if open_fds else ():
                self.drain(fd)
        if not self.out and not self.err:
            return "", ""
        out, err = bytes(self.out).decode("utf-8", "replace"), bytes(self.err).decode("utf-8", "replace")
        self.out.clear()
        self.err.clear()
        return out, err


class RankProcesses:
    """Start and stop the rank processes. Separate from RankPool so finalizers never keep the pool alive."""

    def __init__(self, plan: LaunchPlan) -> None:
        """Start the ranks of `plan` (a persistent plan: its ranks, start method, device and environment)
        through its backend (kernel/persistent.py), which owns the processes."""
        self.ranks: list[StartedRank] = []  # the pool's ranks, as the backend started them
        self.outputs: list[RankOutput] = []  # by rank: what each wrote
        self.quick_polls: dict[tuple[int, ...], Any] = {}  # pool/call.py's poll objects, by selection of ranks
        self.closed = False
        self.start_method = plan.start_method
        # what every launch owns (preload, private FileStore folder, rank groups and their keeper): the session's
        self.session = LaunchSession(plan)
        self._backend = self.session.backend
        try:
            self.session.open()
            self.ranks = self.session.start()
            self.outputs = [RankOutput(started) for started in self.ranks]
        except BaseException:
            self.close(graceful=False)
            raise
        _LIVE.add(self)

    def wait_ready(self, timeout: float) -> None:
        """Wait until every rank built its process group; on failure stop them all and raise RankStartError."""
        pending = {rank.channel: rank for rank in self.ranks}
        sentinels = {rank.exit_sentinel: rank for rank in self.ranks}
        deadline = time.monotonic() + timeout
        problem = None
        while pending and problem is None:
            left = deadline - time.monotonic()
            if left <= 0:
                problem = f"ranks {sorted(r.rank for r in pending.values())} did not start within {timeout:g} s"
                break
            for obj in wait([*pending, *sentinels], left):
                if obj in pending:
                    rank = pending.pop(obj)
                    try:
                        message = obj.recv()
                    except (EOFError, OSError):
                        problem = f"rank {rank.rank} ended while starting"
                        break
                    ready = Ready.from_wire(message)
                    if ready.error:
                        problem = f"rank {rank.rank} failed to start:\n{ready.error['traceback'].rstrip()}"
                        break
                    rank.device = ready.device or "cpu"
                elif obj in sentinels and sentinels[obj].channel in pending:
                    rank = sentinels[obj]
                    if not rank.channel.poll(0):
                        problem = f"rank {rank.rank} ended while starting ({ended_how(rank.wait_exit(1.0))})"
                        break
        if problem is not None:
            output = "\n".join(text for out in self.outputs for text in out.take() if text.strip())
            self.close(graceful=False)
            raise RankStartError(problem + (f"\n\nOutput of the ranks:\n{output.rstrip()}" if output else ""))

    def close(self, graceful: bool = True) -> None:
        """Stop every rank. Graceful: ask them to leave (they destroy the process group); after a short wait,
        or at once when not graceful, closing the status pipes makes them exit; SIGTERM/SIGKILL last."""
        if self.closed:
            return
        self.closed = True
        _LIVE.discard(self)
        if graceful:
            for rank in self.ranks:
                try:
                    rank.channel.send((PoolCommand.STOP.value,))
                except (OSError, ValueError):
                    pass
            deadline = time.monotonic() + 2.0
            for rank in self.ranks:
                rank.wait_exit(max(0.0, deadline - time.monotonic()))
        for rank in self.ranks:
            close_quietly(rank.status)  # end of file: the rank's status thread exits the process
        deadline = time.monotonic() + 1.0
        for rank in self.ranks:
            rank.wait_exit(max(0.0, deadline - time.monotonic()))
        try:
            self._backend.stop()
        finally:
            try:
                self.session.close()  # rank groups, the backend's pipes and sessions, folders, resource tracker
            except Exception:
                pass
        for rank, output in zip(self.ranks, self.outputs):
            close_quietly(rank.channel, rank.telemetry)  # the kernel's ends (the output pipes: `output.close`)
            output.close()


_LIVE: weakref.WeakSet[RankProcesses] = weakref.WeakSet()


def _close_all() -> None:
    for workers in list(_LIVE):
        try:
            workers.close(graceful=False)
        except Exception:
            pass


atexit.register(_close_all)
# multiprocessing's own exit handler joins non-daemon children: close ours before it does
multiprocessing.util.Finalize(None, _close_all, exitpriority=100)
