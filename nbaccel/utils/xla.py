"""What training on several XLA replicas (TPU cores, torch_xla's CPU device) needs beyond DDP's work.

DDP is not used on XLA: gradients are averaged across replicas at each optimizer step (unless
`clip_grad_norm_` already did it this step), as torch_xla's `optimizer_step` does, and the lazily recorded
graph of a step runs when the data loader hands out the next batch, as torch_xla's MpDeviceLoader does.
As with Accelerate, the weights are not broadcast: replicas start equal when the model is built after
`set_seed` or built in the kernel and passed in. Each helper is called only for XLA devices, where
torch_xla is already imported.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def is_xla_device(device: Any) -> bool:
    import torch

    return device is not None and torch.device(device).type == "xla"


def runtime_started() -> bool:
    """Whether this process already runs torch_xla's runtime. Never imports torch_xla or starts it."""
    xla = sys.modules.get("torch_xla")
    if xla is None:
        return False
    try:
        return bool(xla._XLAC._xla_runtime_is_initialized())
    except Exception:
        return False


def inside_spawned_replica() -> bool:
    """True in a replica started by torch_xla's `xmp.spawn`: its runtime is up with replication set."""
    if not runtime_started():
        return False
    try:
        return sys.modules["torch_xla"]._XLAC._xla_get_replication_devices_count() > 0
    except Exception:
        return False


def run_pending_graph() -> None:
    """Execute what was recorded on the XLA device so far (one training step's graph)."""
    import torch_xla

    sync = getattr(torch_xla, "sync", None)
    if sync is not None:
        sync()
    else:  # torch_xla < 2.6
        import torch_xla.core.xla_model as xm

        xm.mark_step()


def average_gradients(optimizer: torch.optim.Optimizer) -> None:
    """Replace every gradient the optimizer holds by its mean over all replicas (no-op for one replica)."""
    import torch_xla.core.xla_model as xm

    xm.reduce_gradients(optimizer)

