"""TEMPORARY private stand-ins, used only while `nbaccel.utils.operations` /
the configuration classes of `nbaccel.utils.dataclasses` have not landed in this branch.

`nbaccel.accelerator`, `nbaccel.data_loader`, `nbaccel.optimizer` and `nbaccel.scheduler` import the real
modules first and fall back to these names only on ImportError. They follow Accelerate's documented API
for the few members the training modules use. Delete this file once the real modules are merged.
"""

from __future__ import annotations

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
