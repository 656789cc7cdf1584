"""Putting one tensor of a module on a device (`set_module_tensor_to_device`), and telling tensors that share
storage apart (`id_tensor_storage`). Below `modeling`, `offload` and `other`, which all use them (one
direction, no cycle); Accelerate's home for both names is `utils.modeling`, which re-exports them.
"""

from __future__ import annotations

from typing import Any, Union

import torch
from torch import nn

Device = Union[int, str, torch.device]  # noqa: UP007 (a runtime alias, evaluated on 3.10)
_NOT_CAST_PREFIXES = ("torch.uint", "torch.int", "torch.bool")  # integer/bool tensors keep their dtype


class UnknownDtypeError(ValueError, AttributeError):
    """A `dtype` string that names no torch dtype: a ValueError, and an AttributeError as Accelerate's
    `getattr(torch, name)` raises."""


class NoSuchSubmoduleError(ValueError, AttributeError):
    """A dotted tensor name through a submodule the module lacks: a ValueError, and the AttributeError that
    Accelerate's `getattr` raises there."""


def _as_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """`"float16"`, `"torch.float16"` or `torch.float16` -> `torch.float16`."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        found = getattr(torch, dtype.replace("torch.", ""), None)
        if isinstance(found, torch.dtype):
            return found
    raise UnknownDtypeError(f"`dtype` {dtype!r} is not a torch dtype; use e.g. torch.float16 or 'bfloat16'.")


def id_tensor_storage(tensor: torch.Tensor) -> tuple[torch.device, int, int]:
    """(device, storage pointer, storage bytes): equal for tensors that share memory (meta tensors: pointer 0)."""
    try:
        storage = tensor.untyped_storage()
        return tensor.device, storage.data_ptr(), storage.nbytes()
    except (NotImplementedError, RuntimeError):
        return tensor.device, 0, tensor.nelement() * tensor.element_size()


def _normalize_device(device: Device) -> Device:
    """An accelerator index as a device of this machine's accelerator type; other devices as given."""
    if isinstance(device, int) and not isinstance(device, bool):
        for backend in ("cuda", "xpu", "npu"):
            runtime = getattr(torch, backend, None)
            if runtime is not None and runtime.is_available():
                return torch.device(backend, device)
        # No accelerator: torch's own RuntimeError when the index is used ("Cannot access accelerator device when
        # none is available"), as under Accelerate; naming a backend here said "not compiled with XPU" instead.
    return device


def set_module_tensor_to_device(
    module: nn.Module,
    tensor_name: str,
    device: Device,
    value: torch.Tensor | None = None,
    dtype: str | torch.dtype | None = None,
    fp16_statistics: torch.Tensor | None = None,
    tied_params_map: dict[int, dict[Any, torch.Tensor]] | None = None,
    non_blocking: bool = False,
    clear_cache: bool = True,
) -> None:
    """Put the parameter or buffer `tensor_name` (dotted, relative to `module`) on `device`, optionally with a
    new `value` (cast to the existing dtype, or to `dtype` when given; integer tensors are never cast). Without a
    value, `dtype` applies only to a move to "meta".

    `param.to(device)` would return a detached copy; this replaces the module's entry instead, keeping the
    Parameter class and `requires_grad`. With `tied_params_map` ({data_ptr: {device: tensor}}), a tied weight
    already materialized on `device` is reused instead of copied again.
    """
    owner, name = module, tensor_name
    if "." in tensor_name:
        path, name = tensor_name.rsplit(".", 1)
        for part in path.split("."):
            child = getattr(owner, part, None)
            if child is None:
                raise NoSuchSubmoduleError(f"{module.__class__.__name__} has no submodule {part!r} (in {tensor_name!r}).")
            owner = child
    if name not in owner._parameters and name not in owner._buffers:
        raise ValueError(f"{owner.__class__.__name__} has no parameter or buffer named {name!r} ({tensor_name!r}).")
    is_buffer = name in owner._buffers
    old = owner._buffers[name] if is_buffer else owner._parameters[name]
    if old is None:
        raise ValueError(f"{tensor_name!r} is None in the module; there is nothing to move.")
    device = _normalize_device(device)
    dtype = _as_dtype(dtype)

    if tied_params_map is not None:
        for candidate in (value, old):
            if candidate is None or candidate.device.type == "meta":
                continue
            shared = tied_params_map.get(candidate.data_ptr())
            if shared is not None and device in shared:
                if is_buffer:
                    owner._buffers[name] = shared[device]
                else:
                    owner._parameters[name] = shared[device]
                return

    to_meta = str(device) == "meta"
    if old.device.type == "meta" and not to_meta and value is None:
        raise ValueError(f"{tensor_name} is on the meta device, we need a `value` to put it on {device}.")

    with torch.no_grad():
        if value is not None:
            if not isinstance(value, torch.Tensor):
                value = torch.tensor(value)
            if tuple(old.shape) != tuple(value.shape):
                raise ValueError(
                    f"Trying to set a tensor of shape {tuple(value.shape)} in {tensor_name!r} (which has shape "
                    f"{tuple(old.shape)}): the checkpoint does not match the model."
                )
            if dtype is None:
                value = value.to(old.dtype, non_blocking=non_blocking)
            elif not str(value.dtype).startswith(_NOT_CAST_PREFIXES):
                value = value.to(dtype, non_blocking=non_blocking)
            new = value.to(device, non_blocking=non_blocking)
        else:
            if not to_meta and old.device == torch.device(device):
                return
            new = old.to(device, non_blocking=non_blocking)
            # without a value, `dtype` only shapes a meta placeholder (as in Accelerate): a real tensor keeps its dtype
            if to_meta and dtype is not None and not str(old.dtype).startswith(_NOT_CAST_PREFIXES):
                new = new.to(dtype)

        if is_buffer:
            owner._buffers[name] = new
        else:
            param_cls = type(old)
            extra = {k: v for k, v in old.__dict__.items() if not k.startswith("_")}
            try:
                wrapped = param_cls(new, requires_grad=old.requires_grad)
            except TypeError:
                wrapped = nn.Parameter(new, requires_grad=old.requires_grad)
            for key, attr in extra.items():  # keep user attributes (e.g. sharding hints) on the new Parameter
                setattr(wrapped, key, attr)
            if fp16_statistics is not None:
                wrapped.SCB = fp16_statistics.to(device)
            owner._parameters[name] = wrapped
            new = wrapped

    if clear_cache and not to_meta and torch.device(device).type == "cuda":
        torch.cuda.empty_cache()

    if tied_params_map is not None:
        for candidate in (old, value):
            if candidate is not None and candidate.device.type != "meta":
                slot = tied_params_map.get(candidate.data_ptr())
                if slot is not None and device not in slot:
                    slot[device] = new
