"""Hooks around a module's forward: move inputs and weights to the execution device just in time.

`add_hook_to_module` wraps `module.forward` so that a `ModelHook` sees (and may change) the arguments before
the call and the output after it, keyword arguments included (torch's own forward hooks do not pass kwargs
to pre-hooks in every version). `AlignDevicesHook` uses this to bring offloaded weights from the CPU or disk
onto the execution device for one forward and to drop them again afterwards. Names and behaviour follow
Accelerate's `hooks` module; a model dispatched by either library exposes the same `_hf_hook` attribute.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .utils.modeling import named_module_tensors, set_module_tensor_to_device
from .utils.offload import PrefixedDataset
from .utils.operations import find_device, send_to_device

# Modules whose forward reads their submodules' weights without calling those submodules (so a submodule hook
# would never fire): their whole subtree is loaded by one hook, as if named in `preload_module_classes`.
_PRELOAD_ALWAYS = (nn.MultiheadAttention,)

# Attributes dispatch_model adds on a model instance; remove_hook_from_module takes them away again.
_ADDED_ATTRIBUTES = ["to", "cuda", "npu", "xpu", "mlu", "musa", "sdaa", "neuron"]


def _send_to_device(data: Any, device: Any, skip_keys: str | list[str] | None = None) -> Any:
    """`send_to_device`, with no device meaning "leave it where it is"."""
    return data if device is None else send_to_device(data, device, skip_keys=skip_keys)


class ModelHook:
    """Callbacks run around a module's forward. Subclass and override what you need.

    `no_grad = True` runs the wrapped forward under `torch.no_grad()`.
    """

    no_grad = False

    def init_hook(self, module: nn.Module) -> nn.Module:
        """Called when the hook is attached; returns the module."""
        return module

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        """Called before forward; returns the (possibly changed) args and kwargs."""
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        """Called after forward; returns the (possibly changed) output."""
        return output

    def detach_hook(self, module: nn.Module) -> nn.Module:
        """Called when the hook is removed; returns the module."""
        return module


class SequentialHook(ModelHook):
    """Several hooks run one after the other (what `add_hook_to_module(..., append=True)` builds)."""

    def __init__(self, *hooks: ModelHook):
        self.hooks = hooks

    def init_hook(self, module: nn.Module) -> nn.Module:
        for hook in self.hooks:
            module = hook.init_hook(module)
        return module

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        for hook in self.hooks:
            args, kwargs = hook.pre_forward(module, *args, **kwargs)
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        for hook in self.hooks:
            output = hook.post_forward(module, output)
        return output

    def detach_hook(self, module: nn.Module) -> nn.Module:
        for hook in self.hooks:
            module = hook.detach_hook(module)
        return module


def _hooked_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    hook = module._hf_hook
    args, kwargs = hook.pre_forward(module, *args, **kwargs)
    if hook.no_grad:
        with torch.no_grad():
            output = module._old_forward(*args, **kwargs)
    else:
        output = module._old_forward(*args, **kwargs)
    return hook.post_forward(module, output)


def add_hook_to_module(module: nn.Module, hook: ModelHook, append: bool = False) -> nn.Module:
    """Attach `hook` to `module` (replacing its hook, or chained after it with `append=True`); returns it."""
    if append and getattr(module, "_hf_hook", None) is not None:
        previous = module._hf_hook
        remove_hook_from_module(module)
        hook = SequentialHook(previous, hook)
    if hasattr(module, "_hf_hook") and hasattr(module, "_old_forward"):
        original = module._old_forward
    else:
        original = module.forward
        module._old_forward = original
    module = hook.init_hook(module)
    module._hf_hook = hook
    wrapped = functools.update_wrapper(functools.partial(_hooked_forward, module), original)
    if "GraphModuleImpl" in str(type(module)):  # fx graph modules look forward up on the class
        module.__class__.forward = wrapped
    else:
        module.forward = wrapped
    return module


def remove_hook_from_module(module: nn.Module, recurse: bool = False) -> nn.Module:
    """Detach the hook of `module` (and of all its submodules with `recurse=True`), restoring its forward."""
    if hasattr(module, "_hf_hook"):
        module._hf_hook.detach_hook(module)
        delattr(module, "_hf_hook")
    if hasattr(module, "_old_forward"):
        if "GraphModuleImpl" in str(type(module)):
            module.__class__.forward = module._old_forward
        else:
            module.forward = module._old_forward
        delattr(module, "_old_forward")
    for name in _ADDED_ATTRIBUTES:
        module.__dict__.pop(name, None)
    if recurse:
        for child in module.children():
            remove_hook_from_module(child, recurse)
    return module


def remove_hook_from_submodules(module: nn.Module) -> None:
    """Detach the hooks of `module` and every submodule."""
    remove_hook_from_module(module, recurse=True)


class AlignDevicesHook(ModelHook):
    """Put inputs (and weights) on `execution_device` for the forward; with `offload=True`, weights live on
    the "meta" device between calls and are read from `weights_map` (a state dict or offload loader) for each
    forward, then dropped.

    `io_same_device`: return the output on the device the input came from. `place_submodules`: the hook
    covers the weights of the submodules too. `skip_keys`: keyword arguments not to move.
    """

    def __init__(
        self,
        execution_device: Any = None,
        offload: bool = False,
        io_same_device: bool = False,
        weights_map: Mapping | None = None,
        offload_buffers: bool = False,
        place_submodules: bool = False,
        skip_keys: str | list[str] | None = None,
        tied_params_map: dict[int, dict[Any, torch.Tensor]] | None = None,
    ):
        self.execution_device = execution_device
        self.offload = offload
        self.io_same_device = io_same_device
        self.weights_map = weights_map
        self.offload_buffers = offload_buffers
        self.place_submodules = place_submodules
        self.skip_keys = skip_keys
        self.tied_params_map = tied_params_map
        self.input_device = None
        self.original_devices: dict[str, torch.device] = {}
        self.param_original_devices: dict[str, torch.device] = {}  # Accelerate's attributes, kept for code that
        self.buffer_original_devices: dict[str, torch.device] = {}  # reads them (empty there too)
        # Offloaded tensors that are tied weights: their copy in the weights map (a safetensors read from disk
        # gives a new pointer each time) is entered in `tied_params_map` at each forward, so the modules that
        # share it load it once; `tied_pointers_to_remove` are those entries, dropped after the forward so the
        # execution device does not keep the weight.
        self.tied_params_names: set[str] = set()
        self.tied_pointers_to_remove: set[tuple[int, Any]] = set()

    def __repr__(self) -> str:
        return (
            f"AlignDevicesHook(execution_device={self.execution_device}, offload={self.offload}, "
            f"io_same_device={self.io_same_device}, offload_buffers={self.offload_buffers}, "
            f"place_submodules={self.place_submodules}, skip_keys={self.skip_keys!r})"
        )

    def _offloaded(self, module: nn.Module) -> list[str]:
        return [name for name, _ in named_module_tensors(
            module, include_buffers=self.offload_buffers, recurse=self.place_submodules, remove_non_persistent=True)]

    def init_hook(self, module: nn.Module) -> nn.Module:
        if str(self.execution_device) == "meta":
            self.tied_params_map = None
        if not self.offload:
            if self.execution_device is not None:
                for name, _ in named_module_tensors(module, recurse=self.place_submodules):
                    set_module_tensor_to_device(module, name, self.execution_device,
                                                tied_params_map=self.tied_params_map)
            return module
        self.original_devices = {
            name: tensor.device for name, tensor in named_module_tensors(module, recurse=self.place_submodules)
        }
        if self.weights_map is None:  # keep the current values on the CPU as the offloaded copy
            self.weights_map = {
                name: tensor.to("cpu") for name, tensor in named_module_tensors(
                    module, include_buffers=self.offload_buffers, recurse=self.place_submodules)
            }
        for name in self._offloaded(module):
            if self.tied_params_map is not None and _tensor(module, name).data_ptr() in self.tied_params_map:
                self.tied_params_names.add(name)
            set_module_tensor_to_device(module, name, "meta")
        if self.execution_device is not None:
            if self.offload_buffers:  # non-persistent buffers are not in any weights map: keep them on device
                kept = set(dict(module.named_buffers(recurse=self.place_submodules))) - set(self._offloaded(module))
            else:
                kept = [name for name, _ in module.named_buffers(recurse=self.place_submodules)]
            for name in kept:
                set_module_tensor_to_device(module, name, self.execution_device,
                                            tied_params_map=self.tied_params_map)
        return module

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        if self.io_same_device:
            self.input_device = find_device([args, kwargs])
        if self.offload:
            self.tied_pointers_to_remove = set()
            for name in self._offloaded(module):
                value = self.weights_map[name]
                self._track_tied(name, value)
                set_module_tensor_to_device(module, name, self.execution_device, value=value,
                                            fp16_statistics=self._fp16_statistics(name, value),
                                            tied_params_map=self.tied_params_map)
        return (
            _send_to_device(args, self.execution_device),
            _send_to_device(kwargs, self.execution_device, skip_keys=self.skip_keys),
        )

    def _track_tied(self, name: str, value: torch.Tensor | None) -> None:
        """Enter the loaded copy of a tied weight in `tied_params_map` for this forward."""
        if value is None or self.tied_params_map is None:
            return
        pointer = value.data_ptr()
        if name in self.tied_params_names and pointer not in self.tied_params_map:
            self.tied_params_map[pointer] = {}
        if pointer in self.tied_params_map and self.execution_device not in self.tied_params_map[pointer]:
            self.tied_pointers_to_remove.add((pointer, self.execution_device))

    def _fp16_statistics(self, name: str, value: torch.Tensor | None) -> torch.Tensor | None:
        """The `SCB` scales stored beside an int8 weight in the weights map (8-bit checkpoints), if any."""
        if value is None or value.dtype != torch.int8 or "weight" not in name:
            return None
        scales = name.replace("weight", "SCB")
        return self.weights_map[scales] if scales in self.weights_map else None

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        if self.offload:
            for name in self._offloaded(module):
                set_module_tensor_to_device(module, name, "meta")
            for pointer, device in self.tied_pointers_to_remove:  # free the tied copies this forward loaded
                self.tied_params_map[pointer].pop(device, None)
            self.tied_pointers_to_remove = set()
        if self.io_same_device and self.input_device is not None:
            output = _send_to_device(output, self.input_device, skip_keys=self.skip_keys)
        return output

    def detach_hook(self, module: nn.Module) -> nn.Module:
        if self.offload:
            for name, device in self.original_devices.items():
                if device.type != "meta" and name in self.weights_map:
                    value = self.weights_map[name]
                    set_module_tensor_to_device(module, name, device, value=value,
                                                fp16_statistics=self._fp16_statistics(name, value))
        return module


def _tensor(module: nn.Module, name: str) -> torch.Tensor:
    """The parameter or buffer at the dotted `name` under `module`."""
    owner_path, _, attribute = name.rpartition(".")
    return getattr(module.get_submodule(owner_path), attribute)


def _preloads(module: nn.Module, preload_module_classes: list[str] | None) -> bool:
    if isinstance(module, _PRELOAD_ALWAYS):
        return True
    return preload_module_classes is not None and module.__class__.__name__ in preload_module_classes


def attach_execution_device_hook(
    module: nn.Module,
    execution_device: Any,
    skip_keys: str | list[str] | None = None,
    preload_module_classes: list[str] | None = None,
    tied_params_map: dict | None = None,
) -> None:
    """Give every submodule with weights (and no hook yet) a hook that moves its inputs to `execution_device`."""
    if not hasattr(module, "_hf_hook") and len(module.state_dict()) > 0:
        add_hook_to_module(module, AlignDevicesHook(execution_device, skip_keys=skip_keys,
                                                    tied_params_map=tied_params_map))
    if _preloads(module, preload_module_classes):
        return
    for child in module.children():
        attach_execution_device_hook(child, execution_device, skip_keys=skip_keys,
                                     preload_module_classes=preload_module_classes, tied_params_map=tied_params_map)


def attach_align_device_hook(
    module: nn.Module,
    execution_device: Any = None,
    offload: bool = False,
    weights_map: Mapping | None = None,
    offload_buffers: bool = False,
    module_name: str = "",
    skip_keys: str | list[str] | None = None,
    preload_module_classes: list[str] | None = None,
    tied_params_map: dict | None = None,
) -> None:
    """Attach an `AlignDevicesHook` to every submodule that holds tensors directly (weights read from
    `weights_map` under the submodule's prefix); a module of a `preload_module_classes` class gets one hook
    covering all its submodules."""
    whole = offload and (_preloads(module, preload_module_classes))
    if whole or any(True for _ in named_module_tensors(module)):
        prefixed = None
        if weights_map is not None:
            prefixed = PrefixedDataset(weights_map, f"{module_name}." if module_name else "")
        add_hook_to_module(module, AlignDevicesHook(
            execution_device=execution_device, offload=offload, weights_map=prefixed,
            offload_buffers=offload_buffers, place_submodules=whole, skip_keys=skip_keys,
            tied_params_map=tied_params_map,
        ), append=True)
    if whole:
        return
    for child_name, child in module.named_children():
        attach_align_device_hook(
            child, execution_device=execution_device, offload=offload, weights_map=weights_map,
            offload_buffers=offload_buffers, module_name=f"{module_name}.{child_name}" if module_name else child_name,
            skip_keys=skip_keys, preload_module_classes=preload_module_classes, tied_params_map=tied_params_map,
        )


def attach_align_device_hook_on_blocks(
    module: nn.Module,
    execution_device: Any = None,
    offload: bool | dict[str, bool] = False,
    weights_map: Mapping | None = None,
    offload_buffers: bool = False,
    module_name: str = "",
    skip_keys: str | list[str] | None = None,
    preload_module_classes: list[str] | None = None,
    tied_params_map: dict | None = None,
) -> None:
    """Attach hooks block by block following a device map: `execution_device` and `offload` are either one
    value for the whole model or dicts {module name: value} (the device map's keys)."""
    if not isinstance(execution_device, Mapping) and not isinstance(offload, Mapping):
        if offload:
            attach_align_device_hook(module, execution_device=execution_device, offload=True,
                                     weights_map=weights_map, offload_buffers=offload_buffers,
                                     module_name=module_name, skip_keys=skip_keys, tied_params_map=tied_params_map)
        else:
            add_hook_to_module(module, AlignDevicesHook(execution_device=execution_device, io_same_device=True,
                                                        skip_keys=skip_keys, place_submodules=True,
                                                        tied_params_map=tied_params_map))
        return
    if not isinstance(execution_device, Mapping):
        execution_device = dict.fromkeys(offload, execution_device)
    if not isinstance(offload, Mapping):
        offload = dict.fromkeys(execution_device, offload)

    if module_name in execution_device and module_name in offload:
        device = execution_device[module_name]
        if not offload[module_name]:
            add_hook_to_module(module, AlignDevicesHook(
                execution_device=device, offload_buffers=offload_buffers, io_same_device=(module_name == ""),
                place_submodules=True, skip_keys=skip_keys, tied_params_map=tied_params_map))
            attach_execution_device_hook(module, device, skip_keys=skip_keys, tied_params_map=tied_params_map)
        else:
            attach_align_device_hook(
                module, execution_device=device, offload=True, weights_map=weights_map,
                offload_buffers=offload_buffers, module_name=module_name, skip_keys=skip_keys,
                preload_module_classes=preload_module_classes, tied_params_map=tied_params_map)
            if not hasattr(module, "_hf_hook"):
                add_hook_to_module(module, AlignDevicesHook(execution_device=device,
                                                            io_same_device=(module_name == ""),
                                                            skip_keys=skip_keys, tied_params_map=tied_params_map))
            attach_execution_device_hook(module, device, skip_keys=skip_keys,
                                         preload_module_classes=preload_module_classes,
                                         tied_params_map=tied_params_map)
    elif module_name == "":
        add_hook_to_module(module, AlignDevicesHook(execution_device=execution_device.get(""), io_same_device=True,
                                                    skip_keys=skip_keys, tied_params_map=tied_params_map))
    # deeper keys of the map ({"b": "cpu", "b.0": "disk"}) override this module's hooks for their submodules
    for child_name, child in module.named_children():
        attach_align_device_hook_on_blocks(
            child, execution_device=execution_device, offload=offload, weights_map=weights_map,
            offload_buffers=offload_buffers, module_name=f"{module_name}.{child_name}" if module_name else child_name,
            skip_keys=skip_keys, preload_module_classes=preload_module_classes, tied_params_map=tied_params_map,
        )


def _default_execution_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


class CpuOffload(ModelHook):
    """Keep a model on the CPU until its forward, then leave it on `execution_device` until `offload()` is
    called on its `UserCpuOffloadHook` (or the next model of a pipeline runs, via `prev_module_hook`)."""

    def __init__(self, execution_device: Any = None, prev_module_hook: UserCpuOffloadHook | None = None):
        self.prev_module_hook = prev_module_hook
        self.execution_device = torch.device(execution_device) if execution_device is not None \
            else _default_execution_device()

    def init_hook(self, module: nn.Module) -> nn.Module:
        return module.to("cpu")

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        if isinstance(self.prev_module_hook, UserCpuOffloadHook):
            previous = next(self.prev_module_hook.model.parameters(), None)
            if previous is not None and previous.device.type != "cpu":
                self.prev_module_hook.offload()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
        current = next(module.parameters(), None)
        if current is not None and current.device == self.execution_device:
            return args, kwargs
        module.to(self.execution_device)
        return _send_to_device(args, self.execution_device), _send_to_device(kwargs, self.execution_device)


class UserCpuOffloadHook:
    """Handle returned by `cpu_offload_with_hook`: `offload()` sends the model back to the CPU, `remove()`
    detaches the hook."""

    def __init__(self, model: nn.Module, hook: CpuOffload):
        self.model = model
        self.hook = hook

    def offload(self) -> None:
        self.hook.init_hook(self.model)

    def remove(self) -> None:
        remove_hook_from_module(self.model)


class LayerwiseCastingHook(ModelHook):
    """Keep a layer's weights in `storage_dtype` (e.g. float8) and cast them to `compute_dtype` only for its
    forward: memory of the small dtype, arithmetic of the large one."""

    def __init__(self, storage_dtype: torch.dtype, compute_dtype: torch.dtype, non_blocking: bool) -> None:
        self.storage_dtype = storage_dtype
        self.compute_dtype = compute_dtype
        self.non_blocking = non_blocking

    def init_hook(self, module: nn.Module) -> nn.Module:
        return module.to(dtype=self.storage_dtype, non_blocking=self.non_blocking)

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        module.to(dtype=self.compute_dtype, non_blocking=self.non_blocking)
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        module.to(dtype=self.storage_dtype, non_blocking=self.non_blocking)
        return output


# Layers whose weights layerwise casting stores in a small dtype (norms and embeddings keep theirs).
_CASTABLE_LAYERS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
                    nn.Linear)


def attach_layerwise_casting_hooks(
    module: nn.Module,
    storage_dtype: torch.dtype,
    compute_dtype: torch.dtype,
    skip_modules_pattern: str | tuple[str, ...] | None = None,
    skip_modules_classes: tuple[type[nn.Module], ...] | None = None,
    non_blocking: bool = False,
) -> None:
    """Give every linear/convolution layer of `module` (except those whose name matches a regex of
    `skip_modules_pattern` or whose class is in `skip_modules_classes`) a `LayerwiseCastingHook`."""
    import re

    if isinstance(skip_modules_pattern, str):
        skip_modules_pattern = (skip_modules_pattern,)

    def visit(current: nn.Module, prefix: str) -> None:
        if skip_modules_classes is not None and isinstance(current, tuple(skip_modules_classes)):
            return
        if skip_modules_pattern is not None and any(re.search(p, prefix) for p in skip_modules_pattern):
            return
        if isinstance(current, _CASTABLE_LAYERS):
            add_hook_to_module(current, LayerwiseCastingHook(storage_dtype, compute_dtype, non_blocking),
                               append=True)
            return
        for name, child in current.named_children():
            visit(child, f"{prefix}.{name}" if prefix else name)

    visit(module, "")
