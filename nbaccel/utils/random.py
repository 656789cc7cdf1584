"""Seeding and synchronizing random number generators across processes.

`utils` sits below the state classes, so this talks to `torch.distributed` directly: the process group
tells the rank and carries the broadcast (from rank 0) of the generator states.
"""

from __future__ import annotations

import os
import random
import sys
from collections.abc import Iterable

import numpy as np
import torch
import torch.distributed as dist

from .collective_trace import in_collective
from .collectives import _rank
from .dataclasses import RNGType
from .environment import get_cpu_distributed_information
from .imports import is_cuda_available, is_npu_available, is_torch_xla_available, is_xpu_available


def _process_index() -> int:
    """This process's global rank: from the process group, torch_xla's runtime, or the launcher's variables."""
    if dist.is_available() and dist.is_initialized():
        return _rank()
    if "torch_xla" in sys.modules:
        import torch_xla.runtime as xr

        return xr.global_ordinal()
    return get_cpu_distributed_information().rank


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed `random`, numpy, torch and every accelerator's generators with `seed`.

    `device_specific=True` adds the process index, so each rank draws different numbers (data augmentation);
    `deterministic=True` makes PyTorch use deterministic algorithms where it has them (slower; on CUDA this
    also sets CUBLAS_WORKSPACE_CONFIG if unset, which deterministic cuBLAS needs).
    """
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"set_seed(seed=...) needs an int, got {type(seed).__name__}")
    seed = int(seed)
    if device_specific:
        seed += _process_index()
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device, lazily
    if is_xpu_available():
        torch.xpu.manual_seed_all(seed)
    if is_npu_available():
        torch.npu.manual_seed_all(seed)
    if "torch_xla" in sys.modules:
        import torch_xla.core.xla_model as xm

        xm.set_rng_state(seed)
    if deterministic:
        if is_cuda_available():  # only cuBLAS reads it: a CPU process's environment stays as Accelerate leaves it
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)


def _as_rng_type(rng_type: str | RNGType | None) -> RNGType:
    if rng_type is None:
        return RNGType.TORCH
    try:
        return RNGType(rng_type)
    except ValueError:
        raise ValueError(f"unknown rng_type {rng_type!r}: use one of {RNGType.list()}") from None


def _get_state(rng_type: RNGType, generator: torch.Generator | None) -> torch.Tensor:
    if rng_type == RNGType.TORCH:
        return torch.get_rng_state()
    if rng_type == RNGType.GENERATOR:
        if generator is None:
            raise ValueError("synchronize_rng_state(rng_type='generator') needs the `generator` to synchronize")
        return generator.get_state()
    if rng_type == RNGType.CUDA:
        if not is_cuda_available():
            raise ValueError("cannot synchronize the 'cuda' generator: no CUDA device here")
        return torch.cuda.get_rng_state()
    if rng_type == RNGType.XLA:
        if not is_torch_xla_available():
            raise ValueError("cannot synchronize the 'xla' generator: torch_xla is not installed (pip install nbaccel[tpu])")
        import torch_xla.core.xla_model as xm

        return torch.tensor(xm.get_rng_state())
    module = getattr(torch, rng_type.value, None)
    if module is None or not hasattr(module, "get_rng_state") or not module.is_available():
        raise ValueError(f"cannot synchronize the {rng_type.value!r} generator: no such device here")
    return module.get_rng_state()


def _set_state(rng_type: RNGType, state: torch.Tensor, generator: torch.Generator | None) -> None:
    if rng_type == RNGType.TORCH:
        torch.set_rng_state(state)
    elif rng_type == RNGType.GENERATOR:
        generator.set_state(state)  # type: ignore[union-attr]
    elif rng_type == RNGType.XLA:
        import torch_xla.core.xla_model as xm

        xm.set_rng_state(int(state.item()))
    else:
        getattr(torch, rng_type.value).set_rng_state(state)


def _broadcast_from_rank0(state: torch.Tensor) -> torch.Tensor:
    """Rank 0's copy of `state` on every rank (unchanged when the run is a single process)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return state
    backend = str(dist.get_backend()).lower()
    if backend == "gloo" or backend == "mpi":
        device = torch.device("cpu")
    elif backend == "xla":
        import torch_xla

        device = torch_xla.device()
    elif "nccl" in backend:
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        accelerator = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
        device = accelerator if accelerator is not None else torch.device("cpu")
    moved = state.to(device)
    with in_collective("synchronize_rng_state", "broadcast", moved):
        dist.broadcast(moved, src=0)
    return moved.cpu()


def synchronize_rng_state(rng_type: str | RNGType | None = None, generator: torch.Generator | None = None) -> None:
    """Give every process rank 0's state of one generator: `rng_type` is an `RNGType` or its value ("torch",
    "cuda", "xla", "generator", ...; None means "torch"); "generator" synchronizes `generator`."""
    kind = _as_rng_type(rng_type)
    _set_state(kind, _broadcast_from_rank0(_get_state(kind, generator)), generator)


def synchronize_rng_states(
    rng_types: Iterable[str | RNGType], generator: torch.Generator | None = None
) -> None:
    """`synchronize_rng_state` for each of `rng_types`."""
    if isinstance(rng_types, (str, RNGType)):
        rng_types = [rng_types]
    kinds = [_as_rng_type(kind) for kind in rng_types]  # validate all before the first collective
    for kind in kinds:
        synchronize_rng_state(kind, generator=generator)
