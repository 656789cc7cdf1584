"""The local backend: worker processes started here with multiprocessing (fork, spawn or forkserver)."""

from __future__ import annotations

import select
import signal
from typing import TYPE_CHECKING, Any

from ..channel import close_quietly
from ..errors import WorkerFailure
from ..worker.entry import run_worker
from .fork_thread import start_process
from .pipes import Pipes
from .processes import get_context, main_module_hidden, signal_groups, stop_processes
from .supervisor import WorkerHandle

if TYPE_CHECKING:
    from ..serialize import Payload
    from .plan import LaunchPlan


class LocalBackend:
    """Starts one multiprocessing.Process per local rank of the plan and reports their exits."""

    fail_fast = True
    workers_may_not_start = False
    inherits_objects = True
    preloads_modules = True
    freezes_gc = True
    private_store = True
    result_folder = True
    rank_groups = True

    def __init__(self) -> None:
        self.processes: list[Any] = []
        self._reported: set[int] = set()

    def start(self, plan: LaunchPlan, payload: Payload) -> list[WorkerHandle]:
        """Start every rank, each with its own pipes (made right before it starts: no rank inherits another's)."""
        ctx = get_context(plan.start_method)
        pipes = Pipes(ctx, 0)
        try:
            for spec in plan.ranks():
                pipes.add(ctx)
                channel, out, err = pipes.worker_ends(spec.local_rank)
                proc = ctx.Process(target=run_worker,
                                   args=(payload, channel, out, err, plan.rank_environ(spec.local_rank)),
                                   name=f"nbaccel-rank-{spec.rank}")
                with main_module_hidden(plan.start_method):
                    start_process(proc, plan.start_method)
                self.processes.append(proc)
                close_quietly(channel, out, err)  # the worker holds them now; end of stream when it exits
        except BaseException:
            stop_processes(self.processes)
            pipes.close_all()
            raise
        return pipes.handles(plan.first_rank)

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

    def exit_failures(self) -> dict[int, WorkerFailure]:
        return {}

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

    def verdict(self) -> None:
        """Nothing but the supervisor watches these ranks."""
        return None

    def lost_reason(self) -> str | None:
        return None
