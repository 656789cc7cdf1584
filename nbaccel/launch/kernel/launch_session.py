"""What every launch owns, whatever its placement and program: `LaunchSession`.

notebook_launcher's launches (launcher.py `run_plan`), RankPool's ranks (pool/rank_processes.py) and `nbaccel
launch` (commands/launch.py, through `run_plan`) each open one session around the backend of their plan:

1. `open()`: imports the modules the ranks will need, when they fork from here (`preloads_modules`); makes the
   launch's private folders its backend asks for (FileStore, large results) and the folder where each rank
   registers the process group it leads (`rank_groups`, with its keeper: rank_groups.py); returns the plan
   with those folders in the ranks' environment. Nothing has started yet.
2. `start(payload)`: the backend starts the ranks (gc frozen around the forks when `freezes_gc`).
3. `close()`: stops what any rank left running (rank groups) and signals their keeper, closes the backend,
   removes the folders, leaves the resource tracker scope and reaps the keeper, in that order, whatever
   happened before. Idempotent.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from ..private_dirs import make_store_dir, remove_dir
from ..shared_tensors import make_result_dir, remove_result_dir
from .module_preload import preload_worker_modules
from .placements import select_backend
from .plan import Program
from .rank_groups import RankGroups
from .start_methods import gc_frozen, resource_tracker_scope

if TYPE_CHECKING:
    from ..serialize import Payload
    from .placements import Backend, StartedRank
    from .plan import LaunchPlan


class LaunchSession:
    """The backend of one plan and everything the launch owns around it, from `open` to `close`."""

    def __init__(self, plan: LaunchPlan, backend: Backend | None = None) -> None:
        self.plan = plan
        self.backend = backend if backend is not None else select_backend(plan)
        self.groups: RankGroups | None = None
        self.store_dir: str | None = None  # the FileStore's owner-only folder, when the backend asks for one
        self.result_dir: str | None = None
        self._tracker: contextlib.AbstractContextManager[None] | None = None
        self._closed = False

    def open(self) -> LaunchPlan:
        """Prepare what the backend asks for; return the plan with the launch's folders (nothing started)."""
        backend, plan = self.backend, self.plan
        self._tracker = resource_tracker_scope()
        self._tracker.__enter__()
        try:
            if backend.preloads_modules:  # forked ranks inherit the modules instead of importing them each
                preload_worker_modules(plan.start_method, launch=plan.program is Program.FUNCTION)
            # the ranks' process group meets in a FileStore in an owner-only folder: no TCP store on the network
            self.store_dir = make_store_dir() if backend.private_store else None
            functions = plan.program is Program.FUNCTION  # a pool's values come back in its replies
            self.result_dir = make_result_dir() if backend.result_folder and functions else None
            # each rank registers the process group it leads: every one is stopped with the launch (the keeper
            # runs before any rank starts)
            self.groups = RankGroups() if backend.rank_groups else None
            self.plan = plan.with_folders(self.store_dir, self.result_dir,
                                          self.groups.folder if self.groups else None)
        except BaseException:
            self.close()
            raise
        return self.plan

    def start(self, payload: Payload | None = None) -> list[StartedRank]:
        """Start the ranks through the backend (`open` first); on failure the backend stopped them."""
        with gc_frozen(self.plan.start_method if self.backend.freezes_gc else "none"):
            return self.backend.start(self.plan, payload)

    def close(self) -> None:
        """Release everything the launch owns; the ranks are stopped (or being stopped) by the caller."""
        if self._closed:
            return
        self._closed = True
        try:
            try:
                if self.groups is not None:  # what any rank, dead or alive, left running; the keeper signalled
                    self.groups.end()
            finally:
                # before a resource tracker this launch started stops: it would unlink the semaphores of the
                # queues the backend still holds (torch elastic's, under spawn)
                self.backend.close()
                remove_dir(self.store_dir)
                self._exit_tracker()
        finally:
            try:
                remove_result_dir(self.result_dir)
            finally:
                if self.groups is not None:  # the keeper exited meanwhile: reaped here, its folder removed
                    self.groups.close()

    def _exit_tracker(self) -> None:
        tracker, self._tracker = self._tracker, None
        if tracker is not None:
            tracker.__exit__(None, None, None)

    def __enter__(self) -> LaunchSession:
        self.open()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
