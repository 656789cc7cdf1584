"""Which devices this machine offers a launch: the XLA (TPU) devices, found without starting torch_xla's
runtime in the kernel, so the plan can check `num_processes` before anything starts. (GPUs: the
environment's `visible_gpus`.) Read by the plan (plan.py) and the XLA backend (xla_backend.py).
"""

from __future__ import annotations

import os
import threading
from typing import Any

TPU_CORES = 8  # what a TPU launch expects when the device count cannot be read (Colab/Kaggle v2-8, v3-8)
DETECT_TIMEOUT = 10.0  # seconds: reading the TPU version may ask the metadata server

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


def local_device_count() -> tuple[int | None, str]:
    """(number of XLA devices on this machine, how it was found); None when it cannot be read safely.

    PJRT_DEVICE=CPU: CPU_NUM_DEVICES (torch_xla's default 1; ValueError when it is not a positive whole
    number). TPU: the chips on the PCI bus times the cores per chip, read in a helper thread so a metadata
    server that does not answer cannot hang the kernel.
    """
    device = os.environ.get("PJRT_DEVICE", "").upper()
    if device == "CPU":
        value = os.environ.get("CPU_NUM_DEVICES", "1")
        if not value.strip().isdigit() or int(value) < 1:
            raise ValueError(f"CPU_NUM_DEVICES={value!r}: set it to the number of XLA CPU devices (ranks), e.g. 2")
        return int(value), f"CPU_NUM_DEVICES={value}"
    if device not in ("", "TPU"):
        return None, f"PJRT_DEVICE={device}"
    found: list[int] = []

    def detect() -> None:
        try:
            from torch_xla._internal import tpu

            found.append(int(tpu.num_available_devices()))
        except Exception:
            pass

    thread = threading.Thread(target=detect, name="nbaccel-tpu-count", daemon=True)
    thread.start()
    thread.join(DETECT_TIMEOUT)
    if found and found[0] > 0:
        return found[0], "TPU devices on this machine"
    return None, "the TPU device count could not be read"
