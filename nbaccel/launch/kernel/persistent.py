"""The persistent backend: RankPool's ranks, started from a local plan by the same process-owning code as a
launch's ranks (LocalBackend: start, exits, stop), each running worker/pool_rank.py's loop until the pool
stops it. A rank has three pipes besides its stdout/stderr: commands (duplex), status queries (duplex,
answered by a helper thread while the main thread is busy) and telemetry; `start` returns their kernel ends.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from ..channel import close_quietly
from ..worker.pool_rank import pool_worker
from .fork_thread import start_process
from .local import LocalBackend
from .processes import get_context, main_module_hidden

if TYPE_CHECKING:
    from .plan import LaunchPlan


@dataclass
class RankEnds:
    """The kernel's ends of one persistent rank."""

    rank: int
    process: Any
    commands: Connection
    status: Connection
    telemetry: Connection
    out_fd: int
    err_fd: int

    def close(self) -> None:
        close_quietly(self.commands, self.status, self.telemetry, self.out_fd, self.err_fd)


class PersistentBackend(LocalBackend):
    """Starts one process per rank of the plan running the rank loop; owns them as LocalBackend does."""

    inherits_objects = False  # no payload: functions and cells come down the command pipe
    preloads_modules = True
    freezes_gc = False
    private_store = True
    result_folder = False  # values come back in the replies

    def start(self, plan: LaunchPlan, payload: Any = None) -> list[RankEnds]:  # type: ignore[override]
        """Start every rank of `plan` with `plan.rank_environ(i)`; return the kernel's ends, by rank."""
        method = plan.start_method
        ctx = get_context(method)
        ends: list[RankEnds] = []
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
                ends.append(RankEnds(rank, process, commands, status, telemetry, out_read, err_read))
        except BaseException:
            self.stop()
            for end in ends:
                end.close()
            raise
        return ends
