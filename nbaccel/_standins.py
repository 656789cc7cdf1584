"""TEMPORARY private stand-ins, used only while `nbaccel.utils.operations` /
the configuration classes of `nbaccel.utils.dataclasses` have not landed in this branch.

`nbaccel.accelerator`, `nbaccel.data_loader`, `nbaccel.optimizer` and `nbaccel.scheduler` import the real
modules first and fall back to these names only on ImportError. They follow Accelerate's documented API
for the few members the training modules use. Delete this file once the real modules are merged.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

# ----------------------------------------------------------------------------------------------- operations


def recursively_apply(func, data, *args, test_type=lambda t: isinstance(t, torch.Tensor), **kwargs):
    if isinstance(data, (tuple, list)):
        values = [recursively_apply(func, o, *args, test_type=test_type, **kwargs) for o in data]
        return type(data)(*values) if hasattr(data, "_fields") else type(data)(values)
    if isinstance(data, dict):
        return type(data)({k: recursively_apply(func, v, *args, test_type=test_type, **kwargs)
                           for k, v in data.items()})
    if test_type(data):
        return func(data, *args, **kwargs)
    return data


def send_to_device(tensor, device, non_blocking: bool = False, skip_keys=None):
    return recursively_apply(lambda t: t.to(device, non_blocking=non_blocking), tensor)


def gather(tensor):
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return tensor

    def _one(t):
        t = t.contiguous() if t.dim() else t[None]
        out = torch.empty((t.shape[0] * dist.get_world_size(), *t.shape[1:]), dtype=t.dtype, device=t.device)
        dist.all_gather_into_tensor(out, t)
        return out

    return recursively_apply(_one, tensor)


def gather_object(obj):
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return [x for y in out for x in y]


def reduce(tensor, reduction: str = "mean", scale: float = 1.0):
    def _one(t):
        t = t.clone()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(t)
            if reduction == "mean":
                t /= dist.get_world_size()
        return t * scale if scale != 1.0 else t

    return recursively_apply(_one, tensor)


def pad_across_processes(tensor, dim: int = 0, pad_index: int = 0, pad_first: bool = False):
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return tensor

    def _one(t):
        size = torch.tensor(t.shape, device=t.device)[None]
        sizes = gather(size)
        longest = int(sizes[:, dim].max())
        if longest == t.shape[dim]:
            return t
        new = list(t.shape)
        new[dim] = longest
        out = t.new_full(new, pad_index)
        idx = [slice(None)] * t.dim()
        idx[dim] = slice(longest - t.shape[dim], longest) if pad_first else slice(0, t.shape[dim])
        out[tuple(idx)] = t
        return out

    return recursively_apply(_one, tensor)


def broadcast_object_list(object_list, from_process: int = 0):
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(object_list, src=from_process)
    return object_list


def broadcast(tensor, from_process: int = 0):
    if dist.is_initialized() and dist.get_world_size() > 1:
        recursively_apply(lambda t: dist.broadcast(t, src=from_process), tensor)
    return tensor


def convert_to_fp32(tensor):
    return recursively_apply(lambda t: t.float(),
                             tensor, test_type=lambda t: isinstance(t, torch.Tensor) and t.dtype in (
                                 torch.float16, torch.bfloat16))


class ConvertOutputsToFp32:
    def __init__(self, model_forward):
        self.model_forward = model_forward

    def __call__(self, *args, **kwargs):
        return convert_to_fp32(self.model_forward(*args, **kwargs))


convert_outputs_to_fp32 = ConvertOutputsToFp32

# ----------------------------------------------------------------------------------------------- configuration


class KwargsHandler:
    def to_kwargs(self) -> dict:
        default = self.__class__()
        return {k: v for k, v in self.__dict__.items() if getattr(default, k, None) != v}


@dataclasses.dataclass
class DataLoaderConfiguration:
    split_batches: bool = False
    dispatch_batches: bool | None = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: int | None = None
    non_blocking: bool = False
    use_stateful_dataloader: bool = False


@dataclasses.dataclass
class ProjectConfiguration:
    project_dir: str | None = None
    logging_dir: str | None = None
    automatic_checkpoint_naming: bool = False
    total_limit: int | None = None
    iteration: int = 0
    save_on_each_node: bool = False

    def set_directories(self, project_dir: str | None = None) -> None:
        self.project_dir = project_dir
        if self.logging_dir is None:
            self.logging_dir = project_dir

    def __post_init__(self) -> None:
        self.set_directories(self.project_dir)


@dataclasses.dataclass
class GradientAccumulationPlugin(KwargsHandler):
    num_steps: int | None = None
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False

    def to_kwargs(self) -> dict:  # the state reads every field
        return dataclasses.asdict(self)


@dataclasses.dataclass
class AutocastKwargs(KwargsHandler):
    enabled: bool = True
    cache_enabled: bool | None = None


@dataclasses.dataclass
class GradScalerKwargs(KwargsHandler):
    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True


@dataclasses.dataclass
class DistributedDataParallelKwargs(KwargsHandler):
    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False


@dataclasses.dataclass
class InitProcessGroupKwargs(KwargsHandler):
    backend: str | None = "nccl"
    init_method: str | None = None
    timeout: Any = None


@dataclasses.dataclass
class TorchDynamoPlugin(KwargsHandler):
    backend: Any = None
    mode: str | None = None
    fullgraph: bool = False
    dynamic: bool | None = None
    options: Any = None
    disable: bool = False
    use_regional_compilation: bool = False

    def to_kwargs(self) -> dict:
        kwargs = {"backend": str(self.backend or "no").lower(), "mode": self.mode or "default",
                  "fullgraph": self.fullgraph, "dynamic": self.dynamic, "options": self.options,
                  "disable": self.disable}
        return kwargs
