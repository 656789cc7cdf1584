"""Big-model inference: build a model without memory, fill it from a checkpoint, run it across GPU, CPU and disk.

The usual sequence, as in Accelerate:

    with init_empty_weights():
        model = MyModel(config)                       # every parameter on "meta": no memory used
    model = load_checkpoint_and_dispatch(model, "ckpt/", device_map="auto", max_memory={"cpu": "2GiB"},
                                         offload_folder="offload")

Layers that do not fit the budget stay on "disk" (memory-mapped from the safetensors shards themselves, never
copied) or in CPU RAM, and hooks bring them onto the execution device one layer at a time during forward.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from .hooks import (
    AlignDevicesHook,
    CpuOffload,
    UserCpuOffloadHook,
    add_hook_to_module,
    attach_align_device_hook,
    attach_align_device_hook_on_blocks,
    attach_layerwise_casting_hooks,
)

__all__ = [
    "attach_layerwise_casting_hooks", "cpu_offload", "cpu_offload_with_hook", "disk_offload", "dispatch_model",
    "init_empty_weights", "init_on_device", "load_checkpoint_and_dispatch",
]
from .utils.modeling import (
    check_device_map,
    check_devices_exist,
    find_tied_parameters,
    get_balanced_memory,
    infer_auto_device_map,
    load_checkpoint_in_model,
    retie_parameters,
)
from .utils.offload import OffloadedWeightsLoader, extract_submodules_state_dict, offload_state_dict
from .utils.tensor_placement import _normalize_device

logger = logging.getLogger(__name__)

_AUTO_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")


def _flag_from_env(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on", "y")


@contextlib.contextmanager
def init_empty_weights(include_buffers: bool | None = None) -> Iterator[None]:
    """Build models inside this block with every parameter on the "meta" device: shapes and dtypes without
    memory, so a model of any size is created instantly. Fill it with `load_checkpoint_and_dispatch`.

    `include_buffers=True` puts buffers (and tensors made with torch.empty/zeros/ones/full) on "meta" too;
    default from NBACCEL_INIT_INCLUDE_BUFFERS / ACCELERATE_INIT_INCLUDE_BUFFERS, else False.
    """
    if include_buffers is None:
        include_buffers = _flag_from_env("NBACCEL_INIT_INCLUDE_BUFFERS") or _flag_from_env(
            "ACCELERATE_INIT_INCLUDE_BUFFERS")
    with init_on_device(torch.device("meta"), include_buffers=include_buffers) as handle:
        yield handle


@contextlib.contextmanager
def init_on_device(device: torch.device | str, include_buffers: bool | None = None) -> Iterator[None]:
    """Build models inside this block with their parameters created on `device` (buffers too with
    `include_buffers=True`)."""
    if include_buffers is None:
        include_buffers = _flag_from_env("NBACCEL_INIT_INCLUDE_BUFFERS") or _flag_from_env(
            "ACCELERATE_INIT_INCLUDE_BUFFERS")
    device = torch.device(device)
    if include_buffers:
        with device:  # torch's device context: every factory call without an explicit device lands here
            yield
        return

    original = nn.Module.register_parameter

    def register_on_device(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is None:
            return
        created = module._parameters[name]
        if created.device == device:  # already there (e.g. tying to an existing parameter): keep the object
            return
        extra = dict(created.__dict__)
        moved = type(created)(created.to(device), requires_grad=created.requires_grad)
        for key, value in extra.items():
            setattr(moved, key, value)
        module._parameters[name] = moved

    nn.Module.register_parameter = register_on_device
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def cpu_offload(
    model: nn.Module,
    execution_device: torch.device | str | int | None = None,
    offload_buffers: bool = False,
    state_dict: dict[str, torch.Tensor] | None = None,
    preload_module_classes: list[str] | None = None,
) -> nn.Module:
    """Keep one copy of the weights on the CPU and bring each layer's weights to `execution_device` only for
    its forward (lowest accelerator memory, slowest)."""
    if execution_device is None:
        execution_device = next(iter(model.parameters())).device
    if state_dict is None:
        state_dict = {name: tensor.to("cpu") for name, tensor in model.state_dict().items()}
    add_hook_to_module(model, AlignDevicesHook(io_same_device=True), append=True)
    attach_align_device_hook(model, execution_device=execution_device, offload=True,
                             offload_buffers=offload_buffers, weights_map=state_dict,
                             preload_module_classes=preload_module_classes)
    return model


def cpu_offload_with_hook(
    model: nn.Module,
    execution_device: int | str | torch.device | None = None,
    prev_module_hook: UserCpuOffloadHook | None = None,
) -> tuple[nn.Module, UserCpuOffloadHook]:
    """Move the whole model to `execution_device` at its first forward and keep it there until the returned
    hook's `offload()` (or the next model in a pipeline built with `prev_module_hook`) sends it back."""
    hook = CpuOffload(execution_device=execution_device, prev_module_hook=prev_module_hook)
    add_hook_to_module(model, hook, append=True)
    return model, UserCpuOffloadHook(model, hook)


def disk_offload(
    model: nn.Module,
    offload_dir: str | os.PathLike,
    execution_device: torch.device | str | int | None = None,
    offload_buffers: bool = False,
    preload_module_classes: list[str] | None = None,
) -> nn.Module:
    """Write the weights to `offload_dir` (unless it already holds an offload index) as memory-mapped files and
    read each layer's weights from there for its forward."""
    if not os.path.isfile(os.path.join(os.fspath(offload_dir), "index.json")):
        offload_state_dict(offload_dir, model.state_dict())
    if execution_device is None:
        execution_device = next(iter(model.parameters())).device
    weights_map = OffloadedWeightsLoader(save_folder=offload_dir)
    add_hook_to_module(model, AlignDevicesHook(io_same_device=True), append=True)
    attach_align_device_hook(model, execution_device=execution_device, offload=True,
                             offload_buffers=offload_buffers, weights_map=weights_map,
                             preload_module_classes=preload_module_classes)
    return model


def _refuse_recurrent_layers_under_sequence_parallelism(model: Any) -> None:
    """Raise ValueError when `model`'s config lists linear-attention layers (`config.layer_types`).

    Accelerate calls this before sharding the sequence: such layers keep a state that runs along the
    sequence, computed in the model's own code, so each rank would restart it from zero and the gradients
    would be silently wrong. nbaccel refuses sequence parallelism as a whole (`sp_size > 1`); the check is
    here for code that calls it, with the same outcome."""
    config = getattr(model, "config", None)
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    kinds = sorted({kind for kind in getattr(config, "layer_types", None) or [] if "linear_attention" in kind})
    if kinds:
        raise ValueError(
            f"{type(model).__name__} has attention layers of type {kinds}, which carry a state along the "
            "sequence; sequence parallelism would restart that state on every rank and give wrong gradients "
            "without an error. Use a model with full attention only, or turn sequence parallelism off."
        )


def _warn_on_move(method: Any, model: nn.Module) -> Any:
    """Wrap `model.to`/`model.cuda`: moving a dispatched model breaks its placement (refused when offloaded)."""

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if method.__name__ != "to" or torch._C._nn._parse_to(*args, **kwargs)[0] is not None:
            logger.warning("You shouldn't move a model that is dispatched using nbaccel hooks.")
            if any(p.device.type == "meta" for p in model.parameters()):
                raise RuntimeError("You can't move a model that has some modules offloaded to cpu or disk.")
        return method(*args, **kwargs)

    return wrapper


def dispatch_model(
    model: nn.Module,
    device_map: dict[str, str | int | torch.device],
    main_device: str | int | torch.device | None = None,
    state_dict: dict[str, torch.Tensor] | None = None,
    offload_dir: str | os.PathLike | None = None,
    offload_index: dict[str, Any] | None = None,
    offload_buffers: bool = False,
    skip_keys: str | list[str] | None = None,
    preload_module_classes: list[str] | None = None,
    force_hooks: bool = False,
) -> nn.Module:
    """Place the submodules of `model` as `device_map` says and attach the hooks that make the model run:
    weights of "cpu"/"disk" modules come to `main_device` (default: the first accelerator in the map, else the
    CPU) just for their forward. The map is checked first: every tensor needs a device, every device must
    exist here. Sets `model.hf_device_map`."""
    check_device_map(model, device_map)
    check_devices_exist(device_map)
    devices = {d if not isinstance(d, torch.device) else str(d) for d in device_map.values()}
    if len(devices) > 1 or "disk" in devices or force_hooks:
        if main_device is None:
            on_device = [d for d in device_map.values() if d not in ("cpu", "disk")]
            main_device = on_device[0] if on_device else "cpu"
        if main_device != "cpu":
            cpu_modules = [name for name, device in device_map.items() if device == "cpu"]
            if state_dict is None and cpu_modules:
                state_dict = extract_submodules_state_dict(model.state_dict(), cpu_modules)
        disk_modules = [name for name, device in device_map.items() if device == "disk"]
        if disk_modules and offload_dir is None and offload_index is None:
            raise ValueError(
                "We need an `offload_dir` to dispatch this model according to this `device_map`, the following "
                f"submodules need to be offloaded: {', '.join(disk_modules)}."
            )
        if disk_modules and offload_index is None and not os.path.isfile(
                os.path.join(os.fspath(offload_dir), "index.json")):
            offload_state_dict(offload_dir, extract_submodules_state_dict(model.state_dict(), disk_modules))

        execution_device = {
            name: main_device if device in ("cpu", "disk") else device for name, device in device_map.items()
        }
        execution_device[""] = main_device
        offloaded = ("disk",) if str(main_device) in ("cpu", "mps") else ("cpu", "disk")
        offload = {name: device in offloaded for name, device in device_map.items()}
        folder = offload_dir if disk_modules else None
        weights_map = None
        if state_dict is not None or folder is not None or offload_index is not None:
            weights_map = OffloadedWeightsLoader(state_dict=state_dict, save_folder=folder, index=offload_index,
                                                 device=main_device if offload_index is not None else None)
        tied = find_tied_parameters(model)
        tied_params_map: dict[int, dict] = {}
        for group in tied:
            for name in group:
                param = model.get_parameter(name)
                if param.device.type != "meta":
                    tied_params_map[param.data_ptr()] = {}
        attach_align_device_hook_on_blocks(
            model, execution_device=execution_device, offload=offload, offload_buffers=offload_buffers,
            weights_map=weights_map, skip_keys=skip_keys, preload_module_classes=preload_module_classes,
            tied_params_map=tied_params_map,
        )
        offloaded_to = sorted({d for d in device_map.values() if isinstance(d, str) and d in ("cpu", "disk")})
        if offloaded_to:  # Accelerate's note, in the same case (its devices in set order; sorted here)
            logger.warning("Some parameters are on the meta device because they were offloaded to the %s: each "
                           "module's weights come to its execution device for its forward.", " and ".join(offloaded_to))
        retie_parameters(model, tied)
        model.to = _warn_on_move(model.to, model)
        model.cuda = _warn_on_move(model.cuda, model)
    else:
        model.to(_normalize_device(next(iter(device_map.values()))))
    model.hf_device_map = dict(device_map)
    return model


def load_checkpoint_and_dispatch(
    model: nn.Module,
    checkpoint: str | os.PathLike,
    device_map: str | dict[str, int | str | torch.device] | None = None,
    max_memory: dict[int | str, int | str] | None = None,
    no_split_module_classes: list[str] | None = None,
    offload_folder: str | os.PathLike | None = None,
    offload_buffers: bool = False,
    dtype: str | torch.dtype | None = None,
    offload_state_dict: bool | None = None,
    skip_keys: str | list[str] | None = None,
    preload_module_classes: list[str] | None = None,
    force_hooks: bool = False,
    strict: bool = False,
    full_state_dict: bool = True,
    broadcast_from_rank0: bool = False,
) -> nn.Module:
    """Load a checkpoint (one file, a sharded folder with `*.index.json`, or the index file) into `model` and
    dispatch it. `device_map` is a dict, or "auto"/"balanced"/"balanced_low_0"/"sequential" to compute one
    within `max_memory`; None only loads (no hooks)."""
    if isinstance(device_map, str):
        if device_map not in _AUTO_MAPS:
            raise ValueError(
                f"device_map={device_map!r} is not supported: pass a dict {{module name: device}} or one of "
                f"{', '.join(repr(m) for m in _AUTO_MAPS)}."
            )
        if device_map != "sequential":
            max_memory = get_balanced_memory(model, max_memory=max_memory,
                                             no_split_module_classes=no_split_module_classes, dtype=dtype,
                                             low_zero=(device_map == "balanced_low_0"))
        device_map = infer_auto_device_map(model, max_memory=max_memory,
                                           no_split_module_classes=no_split_module_classes, dtype=dtype,
                                           offload_buffers=offload_buffers)
    if offload_state_dict is None and device_map is not None and "disk" in device_map.values():
        offload_state_dict = True
    load_checkpoint_in_model(model, checkpoint, device_map=device_map, offload_folder=offload_folder, dtype=dtype,
                             offload_state_dict=bool(offload_state_dict), offload_buffers=offload_buffers,
                             strict=strict, full_state_dict=full_state_dict,
                             broadcast_from_rank0=broadcast_from_rank0)
    if device_map is None:
        return model
    return dispatch_model(model, device_map=device_map, offload_dir=offload_folder, offload_buffers=offload_buffers,
                          skip_keys=skip_keys, preload_module_classes=preload_module_classes,
                          force_hooks=force_hooks)
