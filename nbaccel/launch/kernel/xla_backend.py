"""TPU launches (Colab/Kaggle: PJRT_DEVICE=TPU or TPU_NAME set) through torch_xla's multiprocessing.

torch_xla (2.x, PJRT) decides the layout itself: one replica (rank) per XLA device, run as processes and,
where one process drives several devices (TPU v2/v3, the CPU device), as threads of that process. Its
`xmp.spawn` accepts only `nprocs=None` (every device) or 1; the plan checks `num_processes` against the
device count (kernel/devices.py) before anything starts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .devices import import_xmp
from .plan import Program
from .threaded import ThreadedBackend

if TYPE_CHECKING:
    from .plan import LaunchPlan

class XlaBackend(ThreadedBackend):
    """Runs `xmp.spawn(entry, ...)` over every XLA device in a helper thread."""

    programs = frozenset({Program.FUNCTION})
    fail_fast = True
    thread_name = "nbaccel-xla-spawn"

    def target(self, plan: LaunchPlan, entry_args: tuple) -> Any:
        from ..worker.xla_entry import xla_entry

        xmp = import_xmp()
        # without a device count the pipes were prepared for TPU_CORES or num_processes ranks
        self.workers_may_not_start = not plan.xla_count_known

        def target() -> Any:
            return xmp.spawn(xla_entry, args=entry_args, nprocs=None, start_method=plan.start_method)

        return target

    def exit_failures(self) -> dict:
        return {}

    def lost_reason(self) -> str | None:
        """Why ranks ended without a word: torch_xla's spawn raised (e.g. a process of its pool died)."""
        if self.error is None:
            return None
        return (f"ended without returning a result: torch_xla's spawn failed with {type(self.error).__name__}: "
                f"{self.error} (the rank's last output is above)")
