"""The entry of a rank under torch_xla's spawn: one replica per process, or several as threads of one process."""

from __future__ import annotations

import os
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from ...utils.constants import LAUNCH_DEVICE_ENV as DEVICE_ENV
from ..channel import close_quietly
from .entry import freeze_inherited_heap, run_worker
from .parent_death import die_with_parent
from .replica_threads import run_worker_thread

if TYPE_CHECKING:
    from ..serialize import Payload


def replica_layout() -> tuple[int, range]:
    """Worker side, inside `xmp.spawn`: (this replica's local ordinal, the local ordinals this process runs)."""
    import torch_xla.runtime as xr

    per_process = max(1, xr.addressable_device_count())
    first = int(os.environ.get("PJRT_LOCAL_PROCESS_RANK", "0")) * per_process
    return xr.local_ordinal(), range(first, first + per_process)


def xla_entry(index: int, payload: Payload, channels: list[Connection], stdouts: list[Connection],
              stderrs: list[Connection], env: dict[str, str]) -> None:
    """Entry point under torch_xla's spawn, called in every replica with its global ordinal (the rank).

    One replica per process: as any worker. Several (one thread per device): see `replica_threads`.
    """
    freeze_inherited_heap()
    die_with_parent()
    local, own = replica_layout()
    if own.stop > len(channels):
        raise RuntimeError(
            f"torch_xla started more replicas ({own.stop}+) than notebook_launcher prepared for ({len(channels)}): "
            "pass num_processes=None, or limit the devices (TPU_VISIBLE_CHIPS, CPU_NUM_DEVICES)"
        )
    local_env = dict(env, LOCAL_RANK=str(local), RANK=str(index))
    local_env[DEVICE_ENV] = f"xla:{local}"
    if len(own) > 1:
        run_worker_thread(payload, local, own, channels, stdouts, stderrs, local_env)
        return
    for i in range(len(channels)):
        if i != local:
            close_quietly(channels[i], stdouts[i], stderrs[i])
    run_worker(payload, channels[local], stdouts[local], stderrs[local], local_env)
