"""A backend for launchers that start the worker processes themselves (torch elastic, torch_xla).

Their blocking call runs in a helper thread while the supervisor, in the caller's thread, reads the
channels and output pipes. The workers are found as the new child processes of this process, so stopping
them does not depend on the other launcher's internals.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..channel import close_quietly
from ..errors import WorkerFailure
from .pipes import Pipes
from .placement_base import Backend, StartedRank
from .process_trees import STOP_GRACE, kill_pids
from .start_methods import get_context

if TYPE_CHECKING:
    from ..serialize import Payload
    from .plan import LaunchPlan

JOIN_TIMEOUT = 5.0


class ThreadedBackend(Backend):
    """Run the other launcher's blocking call in a thread; `finished()` once it returned; `stop()` kills the
    workers it started. Subclasses say what to run (`target`) for a plan."""

    fail_fast = False
    workers_may_not_start = False
    inherits_objects = False
    preloads_modules = False
    freezes_gc = False
    private_store = False
    result_folder = False
    rank_groups = True  # the other launcher's ranks run here (each registers its group)
    thread_name = "nbaccel-launcher"
    stop_grace = STOP_GRACE  # seconds a stopped worker gets between SIGTERM and SIGKILL
    stop_signal: int = signal.SIGTERM  # what a stopped worker gets first (`nbaccel launch`: the signal it got)

    def __init__(self) -> None:
        self._target: Callable[[], Any] = lambda: None
        self._worker_ends: list[Any] = []  # kept open while workers may still be (re)started
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
        self._before: set[int] = set()
        self._stopped = False
        self.value: Any = None
        self.error: BaseException | None = None

    def target(self, plan: LaunchPlan, entry_args: tuple) -> Callable[[], Any]:
        """The blocking call that starts and waits for the workers (in the helper thread)."""
        raise NotImplementedError

    def start(self, plan: LaunchPlan, payload: Payload) -> list[StartedRank]:
        """Prepare every local rank's pipes, then run `target` in the helper thread."""
        pipes = Pipes(get_context(plan.start_method), plan.num_processes)
        try:
            entry_args = (payload, pipes.worker_channels, pipes.worker_out, pipes.worker_err, dict(plan.environ))
            self._target = self.target(plan, entry_args)
            self._worker_ends = pipes.worker_ends()
            self._before = set(_children())
            self._thread.start()
        except BaseException:
            pipes.close_all()
            raise
        return pipes.handles(plan.first_rank)

    def lost_reason(self) -> str | None:
        return None

    def close(self) -> None:
        """Nothing to release: the other launcher owns its process objects."""

    def _run(self) -> None:
        try:
            self.value = self._target()
        except BaseException as exc:
            self.error = exc

    def wait_objects(self) -> list[Any]:
        return []

    def poll_exits(self) -> list[tuple[int, int]]:
        return []

    def finished(self) -> bool:
        if self._thread.is_alive():
            return False
        if self._worker_ends:  # no worker can start any more: let the pipes reach end of stream
            close_quietly(*self._worker_ends)
            self._worker_ends = []
        return True

    def before_stop(self) -> None:
        """Keep the other launcher from starting new workers (e.g. elastic restarts)."""

    def after_kill(self) -> None:
        """Undo what the killed workers left the other launcher's thread waiting for (called after each kill
        while that thread runs)."""

    def stop(self) -> None:
        if not self._stopped:
            self._stopped = True
            self.before_stop()
        # Stopped early (an interrupt right after the start), the other launcher may start its workers after a
        # kill: kill what is there until its call returns, rather than wait JOIN_TIMEOUT for it and kill once.
        # Stopped again (the supervisor stopped, then the launch; or a second Ctrl-C cut the first stop short),
        # the same, so that the caller never goes on, and this process never exits, while that thread is still
        # inside the other launcher: at exit Python ends such a thread in the middle of its C++ call (torch
        # elastic's exit barrier, a store's `add`), which aborts the process (SIGABRT instead of its status).
        deadline = time.monotonic() + JOIN_TIMEOUT
        while True:
            self._kill_started()
            self.after_kill()
            self._thread.join(0.1)
            if not self._thread.is_alive() or time.monotonic() >= deadline:
                break
        self._kill_started()
        self.finished()

    def _kill_started(self) -> None:
        """Stop the workers the other launcher started (this process's children since the start)."""
        kill_pids((pid for pid in _children() if pid not in self._before), self.stop_grace, self.stop_signal)

    def exit_failures(self) -> dict[int, WorkerFailure]:
        return {}

    def verdict(self) -> object | None:
        """Nothing but the supervisor watches these ranks (placement elastic's script: its collective watch too)."""
        return None


def _children() -> list[int]:
    try:
        import psutil

        return [child.pid for child in psutil.Process(os.getpid()).children(recursive=False)]
    except Exception:
        return []
