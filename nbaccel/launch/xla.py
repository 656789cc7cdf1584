"""TPU launches (Colab/Kaggle: PJRT_DEVICE=TPU or TPU_NAME set) through torch_xla's multiprocessing."""

from __future__ import annotations

import os
from typing import Any

from .threaded import ThreadedBackend

TPU_CORES = 8


FORCE_ENV = "NBACCEL_LAUNCH_XLA"  # "1": take the torch_xla path on any PJRT device (scripts/test-xla, CPU)


def tpu_requested() -> bool:
    """True on a TPU machine as Colab and Kaggle set it up (or when NBACCEL_LAUNCH_XLA=1)."""
    return (os.environ.get("PJRT_DEVICE", "").upper() == "TPU" or bool(os.environ.get("TPU_NAME"))
            or os.environ.get(FORCE_ENV) == "1")


def import_xmp() -> Any:
    try:
        import torch_xla.distributed.xla_multiprocessing as xmp
    except ImportError as exc:
        raise ImportError(
            "A TPU is configured (PJRT_DEVICE=TPU or TPU_NAME) but torch_xla is not installed: "
            "pip install nbaccel[tpu]  (torch_xla must match your torch version)."
        ) from exc
    return xmp


class XlaBackend(ThreadedBackend):
    """Runs `xmp.spawn(worker.xla_entry, ...)` in a helper thread."""

    def __init__(self, *, entry: Any, entry_args: tuple, worker_ends: list[Any], nprocs: int | None,
                 start_method: str) -> None:
        xmp = import_xmp()

        def target() -> Any:
            return xmp.spawn(entry, args=entry_args, nprocs=nprocs, start_method=start_method)

        super().__init__(target, worker_ends, name="nbaccel-xla-spawn")
        self.fail_fast = True
        # with nprocs=None torch_xla starts one process per local device: fewer than the pipes prepared
        self.workers_may_not_start = nprocs is None

    def exit_failures(self) -> dict:
        return {}
