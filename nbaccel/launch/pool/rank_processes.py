"""The rank processes of a `RankPool`: started and owned by the backend of the plan's placement (a launch's, with
the program `pool`) inside a launch session (kernel/launch_session.py, as every launch); here the pool waits
until they are ready and stops them (asking first, then as the backend stops a launch's ranks).

Kept apart from `RankPool` so that finalizers (garbage collection, interpreter exit) hold these objects and
never the pool itself.
"""

from __future__ import annotations

import atexit
import multiprocessing.util
import os
import select
import signal
import time
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING

from ..channel import close_quietly
from ..errors import oom_hint
from ..kernel.launch_session import LaunchSession
from ..kernel.process_trees import signal_name
from ..messages import PoolCommand, Ready
from ..output import read_available
from .results import RankStartError

if TYPE_CHECKING:
    from ..kernel.placement_base import StartedRank
    from ..kernel.plan import LaunchPlan

START_TIMEOUT = 120.0  # seconds for every rank to build its process group


class RankProcess:
    """What the pool does with one started rank (kernel/placements.py StartedRank): its command, status and
    telemetry pipes, and its output, read between and during calls."""

    def __init__(self, started: StartedRank) -> None:
        self.rank = started.rank
        self.telemetry = started.telemetry  # read end of the rank's telemetry pipe (used while an observer attaches)
        self.on_output: Callable[[str, bytes], None] | None = None  # (stream, data) of every read, if set
        self.process = started.process
        self.commands: Connection = started.channel
        self.status: Connection = started.status  # type: ignore[assignment]
        self.status_unanswered = 0  # status queries sent whose answers were not read (an interrupted call)
        self.out_fd = out_fd = started.stdout_fd
        self.err_fd = err_fd = started.stderr_fd
        self.out = bytearray()
        self.err = bytearray()
        self.device = "cpu"
        self.host = started.host  # RankPool(hosts=...): the host it runs on, as named there
        self.pid = started.pid
        self.closed_fds: set[int] = set()
        # one poll object for the output pipes, kept for the rank's life: take_output runs twice per rank in
        # every call, and a selector built per call cost more than the rest of a trivial call's kernel side
        self._output_poll = select.poll() if hasattr(select, "poll") else None
        if self._output_poll is not None:
            for fd in (out_fd, err_fd):
                self._output_poll.register(fd, select.POLLIN)

    def interrupt(self) -> None:
        """SIGINT to the rank (a rank on another host: through its agent)."""
        send = getattr(self.process, "send_signal", None)  # kernel/ssh_pool_backend.py's RemoteRank
        if send is not None:
            send(signal.SIGINT)
        else:
            os.kill(self.pid, signal.SIGINT)

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
        """Close the kernel's ends; the descriptors' numbers may be reused, so nothing here polls them again."""
        close_quietly(self.commands, self.telemetry, self.out_fd, self.err_fd)
        self.closed_fds.update((self.out_fd, self.err_fd))
        self._output_poll = None

    def take_output(self) -> tuple[str, str]:
        if self._output_poll is not None:  # one poll instead of a read of each pipe (most calls print nothing)
            for fd, events in self._output_poll.poll(0):
                if events & select.POLLNVAL:  # closed on this side (the pool is stopping)
                    self._closed(fd)
                else:
                    self.drain(fd)
        else:
            open_fds = [fd for fd in (self.out_fd, self.err_fd) if fd not in self.closed_fds]
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
        self.ranks: list[RankProcess] = []
        self.closed = False
        self.start_method = plan.start_method
        # what every launch owns (preload, private FileStore folder, rank groups and their keeper): the session's
        self.session = LaunchSession(plan)
        self._backend = self.session.backend
        try:
            self.session.open()
            self.ranks = [RankProcess(started) for started in self.session.start()]
        except BaseException:
            self.close(graceful=False)
            raise
        _LIVE.add(self)

    def wait_ready(self, timeout: float) -> None:
        """Wait until every rank built its process group; on failure stop them all and raise RankStartError."""
        pending = {rank.commands: rank for rank in self.ranks}
        sentinels = {rank.process.sentinel: rank for rank in self.ranks}
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
                        problem = f"rank {rank.rank} exited while starting"
                        break
                    ready = Ready.from_wire(message)
                    if ready.error:
                        problem = f"rank {rank.rank} failed to start:\n{ready.error['traceback'].rstrip()}"
                        break
                    rank.device = ready.device or "cpu"
                elif obj in sentinels and sentinels[obj].commands in pending:
                    rank = sentinels[obj]
                    if not rank.commands.poll(0):
                        problem = f"rank {rank.rank} exited while starting ({exit_text(rank.process.exitcode)})"
                        break
        if problem is not None:
            output = "\n".join(text for rank in self.ranks for text in rank.take_output() if text.strip())
            self.close(graceful=False)
            raise RankStartError(problem + (f"\n\nOutput of the ranks:\n{output.rstrip()}" if output else ""))

    def close(self, graceful: bool = True) -> None:
        """Stop every rank. Graceful: ask them to leave (they destroy the process group); after a short wait,
        or at once when not graceful, closing the status pipes makes them exit; SIGTERM/SIGKILL last."""
        if self.closed:
            return
        self.closed = True
        _LIVE.discard(self)
        processes = [rank.process for rank in self.ranks]
        if graceful:
            for rank in self.ranks:
                try:
                    rank.commands.send((PoolCommand.STOP.value,))
                except (OSError, ValueError):
                    pass
            deadline = time.monotonic() + 2.0
            for process in processes:
                process.join(max(0.0, deadline - time.monotonic()))
        for rank in self.ranks:
            close_quietly(rank.status)  # end of file: the rank's status thread exits the process
        deadline = time.monotonic() + 1.0
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
        try:
            self._backend.stop()
        finally:
            try:
                self.session.close()  # rank groups, the backend's pipes and sessions, folders, resource tracker
            except Exception:
                pass
        for rank in self.ranks:
            rank.close()


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


def exit_text(exitcode: int | None) -> str:
    name = signal_name(exitcode)
    if name == "SIGKILL":
        return f"killed by SIGKILL ({oom_hint(None)})"
    return f"killed by {name}" if name else f"exit code {exitcode}"
