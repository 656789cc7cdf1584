"""Placement local: rank processes started here with multiprocessing (fork, spawn or forkserver), running a
launch's function (worker/entry.py) or RankPool's rank loop (worker/pool_rank.py); `LocalBackend` owns them.

A pool rank has three pipes besides its stdout/stderr: commands (duplex, its `channel`), status queries (duplex,
answered by a helper thread while the main thread is busy) and telemetry."""

from __future__ import annotations

import os
import select
import signal
import threading
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from ..channel import close_quietly
from ..worker.entry import run_worker
from .fork_thread import run_forks, start_process
from .pipes import Pipes
from .placement_base import Backend, StartedRank
from .plan import Program
from .process_trees import signal_groups, stop_processes
from .start_methods import get_context, main_module_hidden

if TYPE_CHECKING:
    from ..serialize import Payload
    from .plan import LaunchPlan


class LocalBackend(Backend):
    """Starts one multiprocessing.Process per local rank of the plan and reports their exits."""

    programs = frozenset({Program.FUNCTION, Program.POOL})
    inherits_objects = True  # a function's payload; a pool's ranks get functions and cells down their commands
    preloads_modules = True
    freezes_gc = True
    private_store = True
    result_folder = True
    rank_groups = True

    def __init__(self) -> None:
        self.processes: list[Any] = []
        self._reported: set[int] = set()

    def start(self, plan: LaunchPlan, payload: Payload | None) -> list[StartedRank]:
        """Start every rank, each with its own pipes (made right before it starts: no rank inherits another's)."""
        if plan.program is Program.POOL:
            return self._start_pool(plan)
        assert payload is not None, "a launch's ranks run its function"
        ctx = get_context(plan.start_method)
        pipes = Pipes(ctx, 0)
        forked = plan.start_method == "fork"

        def start_ranks() -> None:
            for spec in plan.ranks():
                pipes.add(ctx)
                channel, out, err = pipes.worker_ends(spec.local_rank)
                proc = ctx.Process(target=run_worker,
                                   args=(payload, channel, out, err, plan.rank_environ(spec.local_rank)),
                                   name=f"nbaccel-rank-{spec.rank}")
                if forked:  # here in the fork thread already
                    proc.start()
                else:
                    with main_module_hidden(plan.start_method):
                        start_process(proc, plan.start_method)
                self.processes.append(proc)
                close_quietly(channel, out, err)  # the worker holds them now; end of stream when it exits

        try:
            if forked:  # every rank from the fork thread, in one hand-off
                run_forks(start_ranks)
            else:
                start_ranks()
        except BaseException:
            stop_processes(self.processes)
            pipes.close_all()
            raise
        return pipes.handles(plan.first_rank, self.processes)

    def _start_pool(self, plan: LaunchPlan) -> list[StartedRank]:
        """Start every rank of `plan` running RankPool's loop with `plan.rank_environ(i)`."""
        from ..worker.pool_rank import pool_worker  # only pools load the rank loop

        method = plan.start_method
        ctx = get_context(method)
        ranks: list[StartedRank] = []
        kernel_fds: list[int] = []
        # PDEATHSIG follows the thread that started the rank: under fork, the kernel-long fork thread
        death_signal = method == "fork" or threading.current_thread() is threading.main_thread()
        try:
            for rank in range(plan.num_processes):
                commands, worker_commands = ctx.Pipe(duplex=True)
                status, worker_status = ctx.Pipe(duplex=True)
                telemetry, worker_telemetry = ctx.Pipe(duplex=False)
                out_read, out_write = os.pipe()
                err_read, err_write = os.pipe()
                kernel_fds += [commands.fileno(), status.fileno(), telemetry.fileno(), out_read, err_read]
                process = ctx.Process(
                    target=pool_worker, name=f"nbaccel-rank-{rank}",
                    args=(worker_commands, worker_status, Connection(out_write, readable=False),
                          Connection(err_write, readable=False), plan.rank_environ(rank),
                          list(kernel_fds) if method == "fork" else [], death_signal, worker_telemetry),
                )
                with main_module_hidden(method):
                    start_process(process, method)
                self.processes.append(process)
                close_quietly(worker_commands, worker_status, worker_telemetry, out_write, err_write)
                ranks.append(StartedRank(rank, plan.first_rank + rank, commands, out_read, err_read,
                                         process=process, status=status, telemetry=telemetry))
        except BaseException:
            self.stop()
            for started in ranks:
                close_quietly(started.channel, started.status, started.telemetry, started.stdout_fd,
                              started.stderr_fd)
            raise
        return ranks

    def wait_objects(self) -> list[Any]:
        return [proc.sentinel for i, proc in enumerate(self.processes) if i not in self._reported]

    def poll_exits(self) -> list[tuple[int, int]]:
        exits = []
        for i, proc in enumerate(self.processes):
            if i in self._reported:
                continue
            code = proc.exitcode
            if code is None and select.select([proc.sentinel], [], [], 0)[0]:
                # its sentinel closed: it is exiting. Wait for it (join reaps it with a blocking waitpid)
                # instead of spinning until the OS makes it a zombie.
                proc.join(5)
                code = proc.exitcode
            if code is not None:
                self._reported.add(i)
                exits.append((i, code))
                # what it started and left running (re-parented to pid 1, holding its output pipes) ends too
                signal_groups([proc.pid], signal.SIGTERM)
        return exits

    def finished(self) -> bool:
        return len(self._reported) == len(self.processes)

    def stop(self) -> None:
        stop_processes(self.processes)

    def close(self) -> None:
        """Kill what the ranks started and left (their process groups), and release the process objects (each
        holds a sentinel pipe until garbage collection otherwise)."""
        signal_groups([proc.pid for proc in self.processes if proc.pid is not None], signal.SIGKILL)
        for proc in self.processes:
            try:
                if proc.exitcode is None:
                    proc.join(1.0)
                proc.close()  # ValueError while it still runs: left to the garbage collector
            except ValueError:
                pass

