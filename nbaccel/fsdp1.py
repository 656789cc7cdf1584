"""FSDP1 for the Accelerator: torch's `FullyShardedDataParallel` wrapper, Accelerate's default `fsdp_version=1`.

`prepare` wraps each model with the plugin's settings (sharding strategy, CPU offload, auto-wrap policy, mixed
precision, backward/forward prefetch, use_orig_params, sync_module_states, ignored modules) and, when asked,
activation checkpointing on the auto-wrapped layers. It runs on GPUs and on CPU processes with gloo
(`device_id=torch.device("cpu")`). Optimizers passed in the same `prepare` call are pointed at the wrapped
model's parameters; with `use_orig_params=False` FSDP1 flattens them, so a one-group optimizer follows the flat
parameters, and with several groups the flat parameters train in the first one while every group stays, so
the schedulers made over the optimizer keep working (with a warning).
"""

from __future__ import annotations

import functools
import re
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn


def is_fsdp1(model: Any) -> bool:
    """Whether `model` is (or compiles) a `FullyShardedDataParallel` wrapper."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    model = getattr(model, "_orig_mod", model)
    return isinstance(model, FullyShardedDataParallel)


def _ignored_modules(plugin: Any, model: nn.Module, device: torch.device) -> Any:
    """The plugin's ignored modules; a string is a regular expression over module names (Accelerate's rule)."""
    ignored = getattr(plugin, "ignored_modules", None)
    if not isinstance(ignored, str):
        return ignored
    pattern = re.compile(ignored)
    modules = [m for name, m in model.named_modules() if pattern.fullmatch(name)]
    for module in modules:  # FSDP leaves them alone, so they go to the device here
        module.to(device)
    return modules


def _materialize_and_sync_from_rank0(model: nn.Module, param_init_fn: Any) -> None:
    """What FSDP1's sync_module_states does, for CPU ranks: modules on the meta device (ranks that built the
    model under init_empty_weights) get storage from `param_init_fn`, then every parameter and buffer takes
    rank 0's value (broadcast in buckets, as DDP does)."""
    import torch.distributed as dist
    from torch.distributed.utils import _sync_params_and_buffers

    for module in list(model.modules()):
        own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        if any(t.is_meta for t in own):
            if param_init_fn is None:
                raise ValueError("FSDP sync_module_states: the model has meta tensors and no param_init_fn.")
            param_init_fn(module)
    states = [t.detach() for t in (*model.parameters(), *model.buffers())]
    _sync_params_and_buffers(dist.distributed_c10d._get_default_group(), states, 250 * 1024 * 1024, 0)


def _hybrid_mesh_on_cpu() -> Any:
    """HYBRID_SHARD's 2-D mesh for CPU ranks: shard within a machine, replicate across machines. (torch
    derives it from the accelerator count per machine, which CPU ranks do not have.)"""
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if per_node < 1 or world % per_node:
        raise ValueError(f"HYBRID_SHARD: LOCAL_WORLD_SIZE={per_node} does not divide the {world} processes.")
    return init_device_mesh("cpu", (world // per_node, per_node), mesh_dim_names=("replicate", "shard"))


def wrap_fsdp1(model: nn.Module, plugin: Any, device: torch.device | str) -> nn.Module:
    """Wrap `model` in `FullyShardedDataParallel` following `plugin` (a FullyShardedDataParallelPlugin with
    fsdp_version=1); a model that already is FSDP1 (manual wrapping) is returned as is."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel

    from .utils.fsdp_utils import ensure_weights_retied

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "FSDP needs torch.distributed to be initialized: create the Accelerator (or PartialState) inside "
            "the launched function (notebook_launcher / nbaccel launch / torchrun)."
        )
    if is_fsdp1(model):
        return model
    device = torch.device(device)
    if any(p.is_meta for p in model.parameters()) and not plugin.sync_module_states and plugin.param_init_fn is None:
        raise ValueError(
            "FSDP: the model has parameters on the meta device; load its weights before prepare, or set "
            "cpu_ram_efficient_loading=True (sync_module_states) with the real weights on rank 0."
        )
    plugin.set_auto_wrap_policy(model)
    param_init_fn = ensure_weights_retied(plugin.param_init_fn, model, device)
    sync_module_states = bool(plugin.sync_module_states)
    if sync_module_states and device.type == "cpu":
        # torch's FSDP1 syncs module states only on accelerators; on CPU ranks do the same before wrapping
        _materialize_and_sync_from_rank0(model, param_init_fn)
        sync_module_states, param_init_fn = False, None
    cpu_offload = plugin.cpu_offload
    if device.type == "cpu" and getattr(cpu_offload, "offload_params", False):
        from torch.distributed.fsdp import CPUOffload

        # the shards already live in CPU memory; torch's offload would pin memory, which needs an accelerator
        cpu_offload = CPUOffload(offload_params=False)
    kwargs = {
        # Accelerate's precedence: sharding_strategy, then reshard_after_forward (an FSDP1 ShardingStrategy)
        "sharding_strategy": plugin.sharding_strategy or plugin.reshard_after_forward,
        "cpu_offload": cpu_offload,
        "auto_wrap_policy": plugin.auto_wrap_policy,
        "mixed_precision": plugin.mixed_precision_policy,
        "sync_module_states": sync_module_states,
        "backward_prefetch": plugin.backward_prefetch,
        "forward_prefetch": bool(plugin.forward_prefetch),
        "use_orig_params": bool(plugin.use_orig_params),
        "param_init_fn": param_init_fn,
        "ignored_modules": _ignored_modules(plugin, model, device),
        "limit_all_gathers": plugin.limit_all_gathers,
        "device_id": device,
    }
    if device.type == "cpu" and "HYBRID" in kwargs["sharding_strategy"].name:
        kwargs["device_mesh"] = _hybrid_mesh_on_cpu()
    wrapped = FullyShardedDataParallel(model, **kwargs)
    if plugin.activation_checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            CheckpointImpl,
            apply_activation_checkpointing,
            checkpoint_wrapper,
        )

        apply_activation_checkpointing(
            wrapped,
            checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
            auto_wrap_policy=plugin.auto_wrap_policy,
        )
    return wrapped


def _repoint_optimizer(optimizer: torch.optim.Optimizer, originals: dict[int, str], wrapped: nn.Module,
                       use_orig_params: bool) -> None:
    """Point `optimizer` (created on the unwrapped model) at the parameters of its FSDP1 wrapper."""
    current = {id(p) for p in wrapped.parameters()}
    stale = [p for group in optimizer.param_groups for p in group["params"] if id(p) in originals and id(p) not in current]
    if not stale:
        return
    if optimizer.state:
        raise ValueError("FSDP: the optimizer has already taken steps (it has state); create it, pass it to "
                         "Accelerator.prepare together with the model, and only then train.")
    if use_orig_params:  # same names, new parameter objects: follow them one by one
        from .sharding import _canonical

        by_name = {_canonical(n.replace("_fsdp_wrapped_module.", "")): p for n, p in wrapped.named_parameters()}
        for group in optimizer.param_groups:
            group["params"] = [by_name[originals[id(p)]] if id(p) in originals else p for p in group["params"]]
        return
    replaced = set(originals) - current
    if {id(p) for p in stale} != replaced:
        raise ValueError(
            "FSDP1 with use_orig_params=False flattens the model's parameters, so an optimizer created before "
            f"prepare with {len(optimizer.param_groups)} parameter group(s) over part of the model cannot follow "
            "them. Create the optimizer after `model = accelerator.prepare(model)` from model.parameters(), or set "
            "FullyShardedDataParallelPlugin(use_orig_params=True)."
        )
    flat = [p for p in wrapped.parameters() if id(p) not in originals]
    if len(optimizer.param_groups) == 1:
        optimizer.param_groups[0]["params"] = [p for p in optimizer.param_groups[0]["params"]
                                               if id(p) not in replaced] + flat
        return
    _flat_in_first_group(optimizer, replaced, flat)


_SHOWN = ("weight_decay", "momentum", "betas")  # the group settings the warning names (a scheduler moves the lr)


def _flat_in_first_group(optimizer: torch.optim.Optimizer, replaced: set[int], flat: list[nn.Parameter]) -> None:
    """Several groups over a model FSDP1 flattened: a flat parameter mixes parameters of every group, so the flat
    parameters all go to the first group that held replaced ones, with its settings; every group stays (the
    others keep what FSDP1 did not replace, often nothing), so a learning-rate scheduler made over the optimizer
    (one lr, lambda, momentum per group) keeps working. With a warning."""
    groups = optimizer.param_groups
    target = next(i for i, group in enumerate(groups) if any(id(p) in replaced for p in group["params"]))
    settings = {key: value for key, value in groups[target].items() if key not in ("params", "initial_lr")}
    warnings.warn(
        f"FSDP1 with use_orig_params=False: the optimizer's {len(groups)} parameter groups cannot be kept over the "
        f"flattened parameters (a flat parameter mixes parameters of every group); they all train in group "
        f"{target}, with its settings ({', '.join(f'{k}={v}' for k, v in settings.items() if k in _SHOWN)}). The "
        "other groups stay, without them, so that schedulers keep working. Set "
        "FullyShardedDataParallelPlugin(use_orig_params=True) (`accelerate launch`'s default) to keep the groups.",
        UserWarning, stacklevel=4)
    for index, group in enumerate(groups):
        group["params"] = [p for p in group["params"] if id(p) not in replaced] + (flat if index == target else [])


def prepare_fsdp1_args(args: Sequence[Any], plugin: Any, device: torch.device | str) -> list[Any]:
    """Wrap every model of a `prepare` call with FSDP1 and point the optimizers of the same call at the wrapped
    parameters; the per-object preparation then leaves the wrapped models alone (see `sharding.is_sharded`)."""
    args = list(args)
    optimizers = [getattr(a, "optimizer", a) for a in args if isinstance(a, torch.optim.Optimizer)]
    for index, obj in enumerate(args):
        if not isinstance(obj, nn.Module) or is_fsdp1(obj):
            continue
        originals = {id(p): name for name, p in obj.named_parameters()}
        wrapped = wrap_fsdp1(obj, plugin, device)
        for optimizer in optimizers:
            _repoint_optimizer(optimizer, originals, wrapped, bool(plugin.use_orig_params))
        args[index] = wrapped
    return args


def sharded_grad_scaler(device_type: str, scaler_handler: Any = None) -> Any:
    """fp16's GradScaler for FSDP1: torch's ShardedGradScaler, which agrees across ranks on skipping a step
    (each rank sees only its gradient shards)."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    kwargs = scaler_handler.to_kwargs() if scaler_handler is not None else {}
    return ShardedGradScaler(device_type, **kwargs)


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """FSDP1's own gradient clipping over all shards of `model` (the root wrapper): the global norm."""
    return getattr(model, "_orig_mod", model).clip_grad_norm_(max_norm, norm_type)
