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
