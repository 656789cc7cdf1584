"""FSDP2 and tensor parallelism for the Accelerator (FSDP1 lives in nbaccel.fsdp1): sharding a model, fixing its optimizer, checkpoints.

Everything runs on torch's own machinery: `torch.distributed.fsdp.fully_shard` (FSDP2, parameters become
DTensors sharded over a DeviceMesh), `torch.distributed.tensor.parallel.parallelize_module` (tensor
parallelism with ColwiseParallel/RowwiseParallel plans), and `torch.distributed.checkpoint` (each rank writes
its own shard; full state dicts are gathered with `get_model_state_dict`). The Accelerator calls
`prepare_fsdp2` from `prepare` when its state says `DistributedType.FSDP` with `fsdp_version=2`, and
`prepare_tensor_parallel` when a `TorchTensorParallelPlugin` / `parallelism_config` asks for tp_size > 1.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from .utils.atomic_files import atomic_path

_MIXED_PRECISION_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.bfloat16}


# --------------------------------------------------------------------------------------------------------------
# FSDP2
# --------------------------------------------------------------------------------------------------------------


def _require_process_group(what: str) -> None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{what} needs torch.distributed to be initialized: create the Accelerator (or PartialState) inside "
            "the launched function (notebook_launcher / nbaccel launch / torchrun)."
        )


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def default_mesh(device: torch.device | str | None = None, shape: Sequence[int] | None = None,
                 names: Sequence[str] | None = None):
    """A DeviceMesh over all ranks (1-D by default) on the device type of `device`."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    device_type = torch.device(device).type if device is not None else _default_device().type
    shape = tuple(shape) if shape is not None else (dist.get_world_size(),)
    return init_device_mesh(device_type, shape, mesh_dim_names=tuple(names) if names else None)


def _wrap_policy(plugin: Any, model: nn.Module) -> Callable[[nn.Module], bool]:
    """Which submodules become their own FSDP unit: transformer layer classes (by name, default
    `model._no_split_modules`), or modules holding at least `min_num_params` parameters, or none."""
    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

    policy = getattr(plugin, "auto_wrap_policy", None)
    base = getattr(policy, "func", policy)
    names = getattr(plugin, "transformer_cls_names_to_wrap", None)
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    classes = getattr(policy, "keywords", {}).get("transformer_layer_cls") if hasattr(policy, "keywords") else None
    if base is transformer_auto_wrap_policy or (classes is None and names):
        if classes is None:
            names = list(names or getattr(model, "_no_split_modules", None) or [])
            present = {type(m).__name__: type(m) for m in model.modules()}
            missing = [n for n in names if n not in present]
            if missing or not names:
                raise ValueError(
                    f"FSDP auto wrap: transformer_cls_names_to_wrap={names} names no layer class of the model "
                    f"({'missing ' + str(missing) if missing else 'none given'}); classes present: "
                    f"{', '.join(sorted(present)[:20])}."
                )
            classes = {present[n] for n in names}
        classes = tuple(classes)
        return lambda module: isinstance(module, classes)
    if base is size_based_auto_wrap_policy:
        min_params = getattr(policy, "keywords", {}).get("min_num_params") if hasattr(policy, "keywords") else None
        min_params = int(min_params or getattr(plugin, "min_num_params", 0) or 0)
        if min_params <= 0:
            return lambda module: False
        return lambda module: sum(p.numel() for p in module.parameters()) > min_params  # Accelerate: more than
    if callable(policy) and base not in (transformer_auto_wrap_policy, size_based_auto_wrap_policy):
        return lambda module: bool(policy(module=module, recurse=False, nonwrapped_numel=0))
    return lambda module: False


def _mp_policy(plugin: Any, mixed_precision: str | None):
    """The FSDP2 MixedPrecisionPolicy: the plugin's, else one built from the Accelerator's mixed_precision
    (parameters and forward in half precision, gradients reduced in float32)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = getattr(plugin, "mixed_precision_policy", None)
    if isinstance(policy, MixedPrecisionPolicy):
        return policy
    if policy is not None:
        raise ValueError(
            f"FSDP2 needs a torch.distributed.fsdp.MixedPrecisionPolicy as mixed_precision_policy, got "
            f"{type(policy).__name__} (an FSDP1 MixedPrecision? set fsdp_version=1 or pass 'bf16')."
        )
    dtype = _MIXED_PRECISION_DTYPES.get(str(mixed_precision or "no"))
    if dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def _offload_policy(plugin: Any):
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    offload = getattr(plugin, "cpu_offload", None)
    if isinstance(offload, OffloadPolicy):
        return offload
    if offload is True or getattr(offload, "offload_params", False):
        return CPUOffloadPolicy()
    return OffloadPolicy()


def apply_fsdp2(
    model: nn.Module,
    plugin: Any,
    mixed_precision: str | None = "no",
    device: torch.device | str | None = None,
    mesh: Any = None,
) -> nn.Module:
    """Shard `model` in place with FSDP2 (`fully_shard`) following `plugin` (a FullyShardedDataParallelPlugin):
    each auto-wrapped submodule (innermost first) and then the root become FSDP units; activation
    checkpointing wraps the same submodules first when asked. Returns the model."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    version = getattr(plugin, "fsdp_version", 2)
    if version != 2:
        raise ValueError(
            f"apply_fsdp2 got a plugin with fsdp_version={version}: FSDP1 models are wrapped by "
            "nbaccel.fsdp1.wrap_fsdp1 (Accelerator.prepare picks the right one)."
        )
    _require_process_group("FSDP")
    if isinstance(model, FSDPModule):
        return model
    device = torch.device(device) if device is not None else _default_device()
    mesh = mesh if mesh is not None else default_mesh(device)
    should_wrap = _wrap_policy(plugin, model)
    offload = _offload_policy(plugin)
    import torch.distributed as dist

    efficient = bool(getattr(plugin, "cpu_ram_efficient_loading", False))
    if efficient:
        # Only rank 0 needs real weights (the others may build the model under init_empty_weights): shard an
        # empty model everywhere, then rank 0 broadcasts the weights into the shards.
        full_state = model.state_dict() if dist.get_rank() == 0 else {}
        persistent = set(model.state_dict())
        extra_buffers = {n: (b.detach().to("cpu") if dist.get_rank() == 0 else None)
                         for n, b in model.named_buffers() if n not in persistent}
        if dist.get_rank() == 0 and any(t.is_meta for t in full_state.values()):
            raise ValueError("FSDP cpu_ram_efficient_loading: rank 0 must hold the real weights, but its model "
                             "has tensors on the meta device.")
        model.to("meta")
    elif any(p.is_meta for p in model.parameters()):
        raise ValueError(
            "FSDP: the model has parameters on the meta device; load its weights before prepare (e.g. "
            "load_checkpoint_in_model), build it normally, or set cpu_ram_efficient_loading=True with the real "
            "weights on rank 0."
        )
    elif type(offload).__name__ != "CPUOffloadPolicy":
        model.to(device)

    targets = [m for m in model.modules() if m is not model and should_wrap(m)]
    if getattr(plugin, "activation_checkpointing", False) and targets:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for name, module in list(model.named_modules()):
            if module in targets and name:
                model.set_submodule(name, checkpoint_wrapper(module, preserve_rng_state=False))

    kwargs = {
        "mesh": mesh,
        "reshard_after_forward": _as_reshard(getattr(plugin, "reshard_after_forward", True)),
        "mp_policy": _mp_policy(plugin, mixed_precision),
        "offload_policy": offload,
    }
    ignored = _ignored_params(plugin, model)
    if ignored:
        kwargs["ignored_params"] = ignored
    for module in reversed(list(model.modules())):  # innermost first: parents see their children as units
        if module is not model and should_wrap(module):
            fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)
    if efficient:
        _fill_from_rank0(model, full_state, extra_buffers, device, offload)
    return model


def _fill_from_rank0(model: nn.Module, full_state: dict, extra_buffers: dict, device: torch.device,
                     offload: Any) -> None:
    """Materialize a model sharded on "meta" and load rank 0's full weights into every rank's shards."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    cpu_offload = type(offload).__name__ == "CPUOffloadPolicy"
    model.to_empty(device="cpu" if cpu_offload else device)
    set_model_state_dict(model, full_state,
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for name, saved in extra_buffers.items():  # non-persistent buffers are not in any state dict
        buffer = model.get_buffer(name)
        if dist.get_rank() == 0:
            with torch.no_grad():
                buffer.copy_(saved)
        dist.broadcast(buffer, src=0)


def _as_reshard(value: Any) -> bool | int:
    if isinstance(value, (bool, int)):
        return value
    name = getattr(value, "name", str(value)).upper()  # an FSDP1 ShardingStrategy given by mistake
    return name not in ("SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD_ZERO2")


def _ignored_params(plugin: Any, model: nn.Module) -> set[nn.Parameter]:
    ignored = getattr(plugin, "ignored_modules", None)
    if not ignored:
        return set()
    if isinstance(ignored, str):
        import re

        pattern = re.compile(ignored)
        modules = [m for n, m in model.named_modules() if pattern.fullmatch(n)]
    else:
        modules = list(ignored)
    return {p for m in modules for p in m.parameters()}


def check_fsdp2_prepare_args(args: Iterable[Any]) -> None:
    """FSDP2 replaces every parameter of the model, so an optimizer can only be fixed up when it is prepared in
    the same call as its model: raise a ValueError otherwise (Accelerate's rule and message)."""
    args = list(args)
    models = sum(isinstance(a, nn.Module) for a in args)
    optimizers = sum(isinstance(a, torch.optim.Optimizer) for a in args)
    if (models < 1 and optimizers > 0) or (models > 0 and optimizers < 1):
        raise ValueError(
            "When using FSDP2, a model and optimizer must be passed together to `Accelerator.prepare()` as the "
            "optimizer needs to have its parameters modified after the model is converted."
        )
    if models > 1:
        raise ValueError("Only one model is supported when using FSDP2: prepare each model with its optimizer in "
                         "separate Accelerator.prepare calls is not possible either; combine them in one module.")


def prepare_fsdp2(
    model: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    plugin: Any,
    mixed_precision: str | None = "no",
    device: torch.device | str | None = None,
    mesh: Any = None,
) -> nn.Module:
    """Shard `model` with `apply_fsdp2` and point every optimizer at the sharded parameters (matched by
    parameter name). Raises a ValueError naming the parameters when an optimizer holds tensors that are not
    the model's: it was created for another model, or around parameters that an earlier prepare replaced."""
    from torch.distributed.fsdp import FSDPModule

    already_sharded = isinstance(model, FSDPModule)
    by_identity = {id(p): _canonical(name) for name, p in model.named_parameters(remove_duplicate=False)}
    strangers = []
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            strangers += [p for p in group["params"] if id(p) not in by_identity]
        if optimizer.state:
            raise ValueError(
                "FSDP: the optimizer has already taken steps (it has state); create it, pass it to "
                "Accelerator.prepare together with the model, and only then train."
            )
    if strangers:
        shapes = [tuple(p.shape) for p in strangers[:5]]
        why = ("the model was already sharded by an earlier prepare, which replaced its parameters"
               if already_sharded else "they belong to another model")
        raise ValueError(
            f"FSDP: the optimizer holds {len(strangers)} parameter(s) (shapes {shapes}...) that are not parameters "
            f"of the model being prepared: {why}. Create the optimizer from model.parameters() and pass model and "
            "optimizer together in one Accelerator.prepare(model, optimizer) call."
        )
    names = [[by_identity[id(p)] for p in group["params"]] for opt in optimizers for group in opt.param_groups]
    for optimizer in optimizers:  # drop references to the full parameters so their memory can be freed
        for group in optimizer.param_groups:
            group["params"] = []
    model = apply_fsdp2(model, plugin, mixed_precision=mixed_precision, device=device, mesh=mesh)
    sharded = {_canonical(n): p for n, p in model.named_parameters(remove_duplicate=False)}
    groups = iter(names)
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["params"] = [sharded[name] for name in next(groups)]
    return model


def prepare_fsdp2_args(args: Sequence[Any], plugin: Any, mixed_precision: str | None = "no",
                       device: torch.device | str | None = None, mesh: Any = None) -> list[Any]:
    """What `Accelerator.prepare(*args)` does first under FSDP2: check that the model comes with its optimizer,
    shard the model and re-point the optimizers, and hand back the arguments (the model sharded in place) for
    the usual per-object preparation, which must then leave sharded models alone (see `is_sharded`)."""
    check_fsdp2_prepare_args(args)
    args = list(args)
    model_index = next((i for i, a in enumerate(args) if isinstance(a, nn.Module)), None)
    if model_index is None:
        return args
    optimizers = [getattr(a, "optimizer", a) for a in args if isinstance(a, torch.optim.Optimizer)]
    args[model_index] = prepare_fsdp2(args[model_index], optimizers, plugin, mixed_precision=mixed_precision,
                                      device=device, mesh=mesh)
    return args


def is_sharded(model: nn.Module) -> bool:
    """Whether FSDP (1 or 2) or tensor parallelism manages this model's placement (no .to(device), no DDP)."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.distributed.tensor import DTensor

    if isinstance(getattr(model, "_orig_mod", model), (FSDPModule, FullyShardedDataParallel)):
        return True
    return any(isinstance(p, DTensor) for p in model.parameters())


def _canonical(name: str) -> str:
    """A parameter name without the wrapper prefixes activation checkpointing / compile insert."""
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip gradients that may be DTensor shards (FSDP2/TP), possibly mixed with plain replicated ones, by
    their global norm; returns that norm as a plain tensor, equal on every rank."""
    from torch.distributed.tensor import DTensor

    parameters = [p for p in parameters if p.grad is not None]
    if not parameters:
        return torch.tensor(0.0)
    norm_type = float(norm_type)
    parts = []
    for wanted in (True, False):  # DTensor gradients and plain ones cannot meet in one foreach call
        grads = [p.grad for p in parameters if isinstance(p.grad, DTensor) == wanted]
        if grads:
            part = torch.nn.utils.get_total_norm(grads, norm_type=norm_type)
            parts.append(part.full_tensor() if isinstance(part, DTensor) else part)
    if len(parts) == 1:
        total = parts[0]
    elif norm_type == float("inf"):
        total = torch.maximum(parts[0].to(parts[1].device), parts[1])
    else:
        total = sum(p.to(parts[-1].device) ** norm_type for p in parts) ** (1.0 / norm_type)
    for wanted in (True, False):
        group = [p for p in parameters if isinstance(p.grad, DTensor) == wanted]
        if group:
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


# --------------------------------------------------------------------------------------------------------------
# checkpoints of sharded models
# --------------------------------------------------------------------------------------------------------------


def get_full_state_dict(model: nn.Module, cpu_offload: bool = True) -> dict[str, torch.Tensor]:
    """The unsharded state dict of a (possibly FSDP2/TP-sharded) model. A collective: every rank must call it.
    With `cpu_offload=True` only rank 0 receives the tensors (on the CPU); the other ranks get {}."""
    from .utils.fsdp_utils import gather_full_state

    return gather_full_state(model, cpu_offload=cpu_offload)


def save_full_model(model: nn.Module, save_directory: str | os.PathLike, safe_serialization: bool = True,
                    is_main_process: bool | None = None) -> str | None:
    """Gather the full weights of a sharded model and write `model.safetensors` (or `pytorch_model.bin`) from
    the main process; returns the file path there, None elsewhere. A collective."""
    import torch.distributed as dist

    state = get_full_state_dict(model, cpu_offload=True)
    if is_main_process is None:
        is_main_process = not dist.is_initialized() or dist.get_rank() == 0
    path = None
    if is_main_process:
        os.makedirs(save_directory, exist_ok=True)
        unique, seen = {}, set()
        for name, tensor in state.items():  # tied weights: safetensors refuses shared storage, keep one name
            key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
            if key in seen and tensor.untyped_storage().data_ptr() != 0:
                continue
            seen.add(key)
            unique[name] = tensor.contiguous()
        if safe_serialization:
            from safetensors.torch import save_file

            path = os.path.join(os.fspath(save_directory), "model.safetensors")  # returned: the final name, not the partial one
            with atomic_path(path) as partial:
                save_file(unique, str(partial), metadata={"format": "pt"})
        else:
            path = os.path.join(os.fspath(save_directory), "pytorch_model.bin")  # returned: the final name, not the partial one
            with atomic_path(path) as partial:
                torch.save(unique, partial)
    if dist.is_initialized():
        dist.barrier()
    return path


def save_sharded_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                            checkpoint_dir: str | os.PathLike) -> None:
    """Write model (and optimizer) state with torch.distributed.checkpoint: every rank writes its own shard
    into `checkpoint_dir` (a .metadata file describes the whole). A collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    if optimizer is None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        state = {"model": get_model_state_dict(model)}
    else:
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optim_state}
    dcp.save(state, checkpoint_id=os.fspath(checkpoint_dir))


def load_sharded_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                            checkpoint_dir: str | os.PathLike) -> None:
    """Read what `save_sharded_checkpoint` wrote back into the sharded `model` (and `optimizer`), each rank
    reading the pieces of its own shards (the world size may differ from the one that saved). A collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    if not os.path.isfile(os.path.join(os.fspath(checkpoint_dir), ".metadata")):
        raise FileNotFoundError(f"{checkpoint_dir} is not a torch.distributed.checkpoint folder (no .metadata).")
    if optimizer is None:
        state = {"model": get_model_state_dict(model)}
        dcp.load(state, checkpoint_id=os.fspath(checkpoint_dir))
        set_model_state_dict(model, state["model"])
        return
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, checkpoint_id=os.fspath(checkpoint_dir))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


# --------------------------------------------------------------------------------------------------------------
# tensor parallelism
# --------------------------------------------------------------------------------------------------------------


def default_tp_plan(model: nn.Module) -> dict[str, Any]:
    """A Megatron-style plan for plain MLP/attention stacks: inside each parent, consecutive pairs of
    `nn.Linear` children are split column-wise then row-wise (the pair needs only one all-reduce).

    Models from transformers bring their own plan (`model._tp_plan` / `config.base_model_tp_plan`), which is
    used instead when present."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {}
    for parent_name, parent in model.named_modules():
        linears = [(n, c) for n, c in parent.named_children() if isinstance(c, nn.Linear)]
        for i in range(0, len(linears) - 1, 2):
            (first, a), (second, b) = linears[i], linears[i + 1]
            if a.out_features != b.in_features:
                continue
            prefix = f"{parent_name}." if parent_name else ""
            plan[prefix + first] = ColwiseParallel()
            plan[prefix + second] = RowwiseParallel()
    return plan


def _plan_from_model(model: nn.Module) -> dict[str, Any] | None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = getattr(model, "_tp_plan", None) or getattr(getattr(model, "config", None), "base_model_tp_plan", None)
    if not plan:
        return None
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    converted = {}
    for pattern, style in plan.items():
        if isinstance(style, str):
            if style not in styles:
                raise ValueError(f"tensor parallel plan entry {pattern!r}: style {style!r} is not 'colwise' or "
                                 "'rowwise'; pass a ParallelStyle object instead.")
            style = styles[style]()
        converted[pattern] = style
    return converted


def prepare_tensor_parallel(
    model: nn.Module,
    tp_size: int | None = None,
    mesh: Any = None,
    plan: dict[str, Any] | None = None,
    device: torch.device | str | None = None,
) -> nn.Module:
    """Split the layers of `model` across the `tp_size` ranks of a tensor-parallel mesh with
    `parallelize_module` (plan: given, the model's own, or `default_tp_plan`). Each rank keeps its slice of
    every split weight; outputs equal the unsharded model's. Returns the model."""
    import torch.distributed as dist
    from torch.distributed.tensor.parallel import parallelize_module

    _require_process_group("Tensor parallelism")
    device = torch.device(device) if device is not None else _default_device()
    world = dist.get_world_size()
    if mesh is None:
        tp_size = int(tp_size or world)
        if tp_size < 1 or world % tp_size:
            raise ValueError(f"tp_size={tp_size} must divide the number of processes ({world}).")
        mesh = default_mesh(device, (world // tp_size, tp_size), ("dp", "tp"))["tp"]
    elif mesh.mesh_dim_names and "tp" in mesh.mesh_dim_names and mesh.ndim > 1:
        mesh = mesh["tp"]
    plan = plan if plan is not None else (_plan_from_model(model) or default_tp_plan(model))
    if not plan:
        raise ValueError(
            "tensor parallelism: no plan for this model. It has no pair of consecutive nn.Linear layers to split "
            "(and no `_tp_plan`); pass plan={'module.name': ColwiseParallel(), ...}."
        )
    size = mesh.size()
    for name, style in plan.items():
        if "*" in name:
            continue
        module = model.get_submodule(name)
        if isinstance(module, nn.Linear):
            dim = module.out_features if type(style).__name__ == "ColwiseParallel" else module.in_features
            if dim % size:
                raise ValueError(f"tensor parallelism: {name} has {dim} features to split, not divisible by "
                                 f"tp_size={size}.")
    model.to(device)
    return parallelize_module(model, mesh, plan)


# --------------------------------------------------------------------------------------------------------------
# what the Accelerator calls
# --------------------------------------------------------------------------------------------------------------


def default_plugins(fsdp_plugin: Any, torch_tp_plugin: Any) -> tuple[Any, Any]:
    """Check the plugins given to an Accelerator (TypeError/ValueError naming the argument), or build an FSDP
    plugin from the FSDP_* environment when the launcher set NBACCEL_USE_FSDP / ACCELERATE_USE_FSDP (as
    `accelerate launch --use_fsdp` does)."""
    from .utils.dataclasses import FullyShardedDataParallelPlugin, TorchTensorParallelPlugin
    from .utils.environment import parse_flag_from_env

    if fsdp_plugin is None and (parse_flag_from_env("NBACCEL_USE_FSDP") or parse_flag_from_env("ACCELERATE_USE_FSDP")):
        fsdp_plugin = FullyShardedDataParallelPlugin()
    if fsdp_plugin is not None:
        if not isinstance(fsdp_plugin, FullyShardedDataParallelPlugin):
            raise TypeError(f"fsdp_plugin must be a FullyShardedDataParallelPlugin, got {type(fsdp_plugin).__name__}.")
    if torch_tp_plugin is not None and not isinstance(torch_tp_plugin, TorchTensorParallelPlugin):
        raise TypeError(f"torch_tp_plugin must be a TorchTensorParallelPlugin, got {type(torch_tp_plugin).__name__}.")
    return fsdp_plugin, torch_tp_plugin


def check_parallelism_config(parallelism_config: Any) -> None:
    """TypeError unless `parallelism_config` is None or a ParallelismConfig."""
    from .parallelism_config import ParallelismConfig

    if parallelism_config is not None and not isinstance(parallelism_config, ParallelismConfig):
        raise TypeError(f"parallelism_config must be a nbaccel.ParallelismConfig, got "
                        f"{type(parallelism_config).__name__}.")
    if parallelism_config is not None and (parallelism_config.cp_size > 1 or parallelism_config.sp_size > 1):
        raise NotImplementedError(  # the config itself may be built (and its mesh), as with Accelerate
            "context/sequence parallelism (cp_size/sp_size > 1) is not implemented by nbaccel; use "
            "dp_replicate_size, dp_shard_size (FSDP) and tp_size."
        )


def fsdp_mesh(device_mesh: Any, parallelism_config: Any) -> Any:
    """The sub-mesh FSDP shards over when a ParallelismConfig built the mesh (None: all ranks)."""
    if device_mesh is None or parallelism_config is None:
        return None
    names = tuple(parallelism_config.fsdp_dim_names)
    try:
        return device_mesh[names]
    except (KeyError, RuntimeError, ValueError):
        return None


def prepare_tensor_parallel_if_asked(model: nn.Module, state: Any, device: torch.device | str | None) -> nn.Module:
    """Apply tensor parallelism when the state carries a ParallelismConfig with tp_size > 1 or a
    TorchTensorParallelPlugin with tp_size > 1; otherwise return `model` unchanged."""
    if is_sharded(model):
        return model
    config = getattr(state, "parallelism_config", None)
    plugin = getattr(state, "torch_tp_plugin", None)
    if config is not None and getattr(config, "tp_enabled", False):
        mesh = getattr(state, "device_mesh", None)
        plan = getattr(getattr(config, "tp_handler", None), "plan", None)
        return prepare_tensor_parallel(model, mesh=mesh["tp"] if mesh is not None else None,
                                       tp_size=config.tp_size, plan=plan, device=device)
    if plugin is not None and int(getattr(plugin, "tp_size", 1) or 1) > 1:
        return prepare_tensor_parallel(model, tp_size=plugin.tp_size, mesh=getattr(plugin, "torch_device_mesh", None),
                                       device=device)
    return model
