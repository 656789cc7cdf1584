"""Accelerate's `utils.operations` under its names: distributed collectives and nested-structure helpers.

The code lives in three small modules: `structures` (local helpers over nested data), `collectives`
(gather, reduce, broadcast, pad_across_processes, wait_for_everyone) and `object_collectives`
(gather_object, broadcast_object_list, copy_tensor_to_devices). Import from here or from `nbaccel.utils`.
"""

from __future__ import annotations

from .collectives import (
    CannotPadNestedTensorWarning,
    DistributedOperationException,
    GatheredParameters,
    broadcast,
    chained_operation,
    debug_mode_enabled,
    gather,
    is_torch_xpu_tensor,
    pad_across_processes,
    reduce,
    verify_operation,
    wait_for_everyone,
)
from .dataclasses import TensorInformation
from .object_collectives import broadcast_object_list, copy_tensor_to_devices, gather_object
from .structures import (
    ConvertOutputsToFp32,
    concatenate,
    convert_outputs_to_fp32,
    convert_to_fp32,
    find_batch_size,
    find_device,
    get_data_structure,
    get_shape,
    honor_type,
    ignorant_find_batch_size,
    initialize_tensors,
    is_namedtuple,
    is_tensor_information,
    is_torch_tensor,
    listify,
    pad_input_tensors,
    recursively_apply,
    send_to_device,
    slice_tensors,
)

__all__ = [
    "CannotPadNestedTensorWarning", "ConvertOutputsToFp32", "DistributedOperationException", "TensorInformation",
    "broadcast", "broadcast_object_list", "concatenate", "convert_outputs_to_fp32", "convert_to_fp32",
    "copy_tensor_to_devices", "debug_mode_enabled", "find_batch_size", "find_device", "gather", "gather_object",
    "get_data_structure", "get_shape", "honor_type", "ignorant_find_batch_size", "initialize_tensors",
    "is_namedtuple", "is_tensor_information", "is_torch_tensor", "listify", "pad_across_processes",
    "pad_input_tensors", "recursively_apply", "reduce", "send_to_device", "slice_tensors", "wait_for_everyone",
    "chained_operation", "verify_operation", "GatheredParameters", "is_torch_xpu_tensor",
]


def __getattr__(name: str):
    """`TENSOR_TYPE_TO_INT` / `TENSOR_INT_TO_DTYPE`: Accelerate's dtype codes (built on first use)."""
    if name not in ("TENSOR_TYPE_TO_INT", "TENSOR_INT_TO_DTYPE"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import torch

    codes = {torch.float: 1, torch.double: 2, torch.half: 3, torch.bfloat16: 4, torch.uint8: 5, torch.int8: 6,
             torch.int16: 7, torch.int32: 8, torch.int64: 9, torch.bool: 10}
    globals().update(TENSOR_TYPE_TO_INT=codes, TENSOR_INT_TO_DTYPE={v: k for k, v in codes.items()})
    return globals()[name]


def gather_tensor_shape(tensor):
    """The shape (an int tensor) and dtype code of `tensor`, which only one process holds (the others pass None),
    on every process: what a receiver needs to allocate before a broadcast."""
    import torch
    import torch.distributed as dist

    mine = None if tensor is None else (list(tensor.shape), __getattr__("TENSOR_TYPE_TO_INT")[tensor.dtype])
    if dist.is_available() and dist.is_initialized():
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        mine = next((item for item in everyone if item is not None), None)
    if mine is None:
        raise ValueError("gather_tensor_shape: no process passed a tensor")
    shape, dtype = mine
    return torch.tensor(shape, dtype=torch.int), dtype
