"""The rank processes of a `RankPool`: start them with their pipes, wait until they are ready, stop them.

Kept apart from `RankPool` so that finalizers (garbage collection, interpreter exit) hold these objects and
never the pool itself.
"""

from __future__ import annotations

import atexit
import multiprocessing.util
import os
import select
import shutil
import threading
import time
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

from ...utils.constants import INIT_METHOD_ENV
from ..channel import close_quietly
from ..environment import RankSpec
from ..errors import oom_hint
from ..kernel.fork_thread import start_process
from ..kernel.processes import (
    free_port,
    get_context,
    main_module_hidden,
    preload_worker_modules,
    resource_tracker_scope,
    signal_name,
    stop_processes,
)
from ..output import read_available
from ..private_dirs import make_store_dir
from .results import RankStartError

START_TIMEOUT = 120.0  # seconds for every rank to build its process group


class RankProcess:
    """The kernel's ends of one rank: process, command pipe, status pipe, stdout/stderr pipes."""

    def __init__(self, rank: int, process: Any, commands: Connection, status: Connection, out_fd: int,
                 err_fd: int, telemetry: Connection | None = None) -> None:
        self.rank = rank
        self.telemetry = telemetry  # read end of the rank's telemetry pipe (used while an observer attaches)
        self.on_output: Callable[[str, bytes], None] | None = None  # (stream, data) of every read, if set
        self.process = process
        self.commands = commands
        self.status = status
        self.status_unanswered = 0  # status queries sent whose answers were not read (an interrupted call)
        self.out_fd = out_fd
        self.err_fd = err_fd
        self.out = bytearray()
        self.err = bytearray()
        self.device = "cpu"
        self.pid = process.pid
        self.closed_fds: set[int] = set()
        # one poll object for the output pipes, kept for the rank's life: take_output runs twice per rank in
        # every call, and a selector built per call cost more than the rest of a trivial call's kernel side
        self._output_poll = select.poll() if hasattr(select, "poll") else None
        if self._output_poll is not None:
            for fd in (out_fd, err_fd):
                self._output_poll.register(fd, select.POLLIN)

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

    def __init__(self, num_processes: int, start_method: str, env: dict[str, str], device: str) -> None:
        self.ranks: list[RankProcess] = []
        self.closed = False
        self.start_method = start_method
        self._tracker = resource_tracker_scope()
        self._tracker.__enter__()
        ctx = get_context(start_method)
        preload_worker_modules(start_method)  # forked ranks inherit PartialState's modules
        port = free_port()
        # the ranks' process group meets in a FileStore in an owner-only folder: no TCP store on the network
        self._store_dir = make_store_dir()  # mode 0700; a killed kernel's are removed by the next one
        env = dict(env, **{INIT_METHOD_ENV: "file://" + os.path.join(self._store_dir, "store")})
        kernel_fds: list[int] = []
        # PDEATHSIG follows the thread that started the rank: under fork, the kernel-long fork thread
        death_signal = start_method == "fork" or threading.current_thread() is threading.main_thread()
        try:
            for rank in range(num_processes):
                commands, worker_commands = ctx.Pipe(duplex=True)
                status, worker_status = ctx.Pipe(duplex=True)
                telemetry, worker_telemetry = ctx.Pipe(duplex=False)
                out_read, out_write = os.pipe()
                err_read, err_write = os.pipe()
                kernel_fds += [commands.fileno(), status.fileno(), telemetry.fileno(), out_read, err_read]
                rank_env = RankSpec(rank=rank, local_rank=rank, world_size=num_processes,
                                    local_world_size=num_processes, node_rank=0, master_addr="127.0.0.1",
                                    master_port=port, device=device.format(local_rank=rank)).environ(env)
                from .rank_worker import pool_worker

                process = ctx.Process(
                    target=pool_worker, name=f"nbaccel-rank-{rank}",
                    args=(worker_commands, worker_status, Connection(out_write, readable=False),
                          Connection(err_write, readable=False), rank_env,
                          list(kernel_fds) if start_method == "fork" else [], death_signal, worker_telemetry),
                )
                with main_module_hidden(start_method):
                    start_process(process, start_method)
                close_quietly(worker_commands, worker_status, worker_telemetry, out_write, err_write)
                self.ranks.append(RankProcess(rank, process, commands, status, out_read, err_read, telemetry))
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
                    if message.get("error"):
                        error = message["error"]
                        problem = f"rank {rank.rank} failed to start:\n{error['traceback'].rstrip()}"
                        break
                    rank.device = message.get("device", "cpu")
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
                    rank.commands.send(("stop",))
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
        stop_processes(processes)
        for rank in self.ranks:
            rank.close()
        shutil.rmtree(self._store_dir, ignore_errors=True)
        try:
            self._tracker.__exit__(None, None, None)
        except Exception:
            pass


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
