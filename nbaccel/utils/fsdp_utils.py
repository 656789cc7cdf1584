"""Accelerate's FSDP checkpoint functions (`save_fsdp_model`, `load_fsdp_model`, `save_fsdp_optimizer`,
`load_fsdp_optimizer`, `merge_fsdp_weights`), for FSDP1 (`FullyShardedDataParallel`) and FSDP2 (`fully_shard`)
models, on torch.distributed.checkpoint and its `get/set_model_state_dict` helpers (which handle both).

File layout as Accelerate's, so checkpoints move between the two libraries:
SHARDED_STATE_DICT -> `<dir>/pytorch_model_fsdp_<i>/` and `<dir>/optimizer_<i>/` (torch.distributed.checkpoint
folders: every rank writes its own shard); FULL_STATE_DICT -> `<dir>/pytorch_model_fsdp[_<i>].bin` and
`<dir>/optimizer[_<i>].bin`, written by rank 0 from the gathered full state; LOCAL_STATE_DICT (FSDP1 only) ->
`<dir>/pytorch_model_fsdp[_<i>]_rank<r>.bin`, each rank's flat shard as is (the optimizer as SHARDED). Every
function is a collective: call it on every rank.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch

from .atomic_files import atomic_path

FSDP_MODEL_NAME = "pytorch_model_fsdp"
OPTIMIZER_NAME = "optimizer"


def state_dict_kind(fsdp_plugin: Any) -> str:
    """"FULL", "SHARDED" or "LOCAL": the plugin's state_dict_type (a StateDictType or its name)."""
    kind = getattr(fsdp_plugin, "state_dict_type", None)
    name = getattr(kind, "name", str(kind)).upper().rsplit(".", 1)[-1]
    for known in ("FULL", "SHARDED", "LOCAL"):
        if name.startswith(known):
            return known
    raise ValueError(f"state_dict_type {kind!r} is not FULL_STATE_DICT, SHARDED_STATE_DICT or LOCAL_STATE_DICT.")


def _is_full(fsdp_plugin: Any) -> bool:
    return state_dict_kind(fsdp_plugin) == "FULL"


def local_weights_name(model_index: int, rank: int) -> str:
    """The per-rank file of a LOCAL_STATE_DICT model checkpoint (Accelerate's name)."""
    stem = FSDP_MODEL_NAME if model_index == 0 else f"{FSDP_MODEL_NAME}_{model_index}"
    return f"{stem}_rank{rank}.bin"


def _rank_file(stem: str, index: int) -> str:
    """Accelerate's per-rank file name of `use_dcp=False` checkpoints."""
    return f"{stem}_{index}_rank{_rank()}.bin"


def _load_rank_file(input_dir: str | os.PathLike, stem: str, index: int) -> dict:
    path = os.path.join(os.fspath(input_dir), _rank_file(stem, index))
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing: a use_dcp=False checkpoint has one file per rank and must be "
                                "loaded with use_dcp=False and the number of processes that saved it.")
    return torch.load(path, map_location="cpu", weights_only=False)  # holds DTensors / ShardedTensors


def _fsdp1_local_context(model: torch.nn.Module):
    """FSDP1's LOCAL_STATE_DICT context around `model`; refuses models that are not FSDP1."""
    from torch.distributed.fsdp import FullyShardedDataParallel, StateDictType

    if not any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        raise ValueError("LOCAL_STATE_DICT exists only for FSDP1 (FullyShardedDataParallel) models; use "
                         "SHARDED_STATE_DICT or FULL_STATE_DICT.")
    return FullyShardedDataParallel.state_dict_type(model, StateDictType.LOCAL_STATE_DICT)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _fsdp1_on_cpu(model: torch.nn.Module) -> bool:
    """An FSDP1 model whose shards live on the CPU: torch's offload_to_cpu would free the gathered tensors
    (its `.cpu()` is a no-op there), so full state dicts are gathered without it."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return any(isinstance(m, FullyShardedDataParallel) and m.compute_device.type == "cpu" for m in model.modules())


def gather_full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                      cpu_offload: bool = True) -> dict[str, Any]:
    """The unsharded state dict of an FSDP1/FSDP2 model (or of its `optimizer`). A collective. With
    `cpu_offload=True` only rank 0 receives it, on the CPU; the other ranks get {}."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    workaround = cpu_offload and _fsdp1_on_cpu(model)
    options = StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload and not workaround)
    if optimizer is None:
        state = get_model_state_dict(model, options=options)
    else:
        state = get_optimizer_state_dict(model, optimizer, options=options)
    if workaround:
        return _cloned(state) if _rank() == 0 else {}
    return state


def _cloned(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _cloned(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cloned(v) for v in value)
    return value


def _weights_name(model_index: int) -> str:
    return f"{FSDP_MODEL_NAME}.bin" if model_index == 0 else f"{FSDP_MODEL_NAME}_{model_index}.bin"


def _optimizer_name(optimizer_index: int) -> str:
    return f"{OPTIMIZER_NAME}.bin" if optimizer_index == 0 else f"{OPTIMIZER_NAME}_{optimizer_index}.bin"


def save_fsdp_model(fsdp_plugin: Any, accelerator: Any, model: torch.nn.Module, output_dir: str | os.PathLike,
                    model_index: int = 0, adapter_only: bool = False, use_dcp: bool = True) -> None:
    """Write the weights of an FSDP model: one shard per rank (sharded, local) or one file from rank 0 (full).
    With `use_dcp=False` a sharded state is written by each rank alone with torch.save
    (`pytorch_model_fsdp_<i>_rank<r>.bin`: no collective; reload with the same number of processes)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    os.makedirs(output_dir, exist_ok=True)
    if _is_full(fsdp_plugin):
        state = gather_full_state(model)
        if _rank() == 0:
            torch.save(state, os.path.join(os.fspath(output_dir), _weights_name(model_index)))
        _barrier()
        return
    if state_dict_kind(fsdp_plugin) == "LOCAL":
        with _fsdp1_local_context(model):
            state = model.state_dict()
        torch.save(state, os.path.join(os.fspath(output_dir), local_weights_name(model_index, _rank())))
        _barrier()
        return
    if not use_dcp:
        torch.save(get_model_state_dict(model),
                   os.path.join(os.fspath(output_dir), _rank_file(FSDP_MODEL_NAME, model_index)))
        _barrier()
        return
    state = {"model": get_model_state_dict(model)}
    dcp.save(state, checkpoint_id=os.path.join(os.fspath(output_dir), f"{FSDP_MODEL_NAME}_{model_index}"))


def load_fsdp_model(fsdp_plugin: Any, accelerator: Any, model: torch.nn.Module, input_dir: str | os.PathLike,
                    model_index: int = 0, adapter_only: bool = False, use_dcp: bool = True) -> None:
    """Read what `save_fsdp_model` wrote (with the same `use_dcp`) into the (already sharded) model."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    if _is_full(fsdp_plugin):
        path = os.path.join(os.fspath(input_dir), _weights_name(model_index))
        state = torch.load(path, map_location="cpu", weights_only=True) if _rank() == 0 else {}
        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        return
    if state_dict_kind(fsdp_plugin) == "LOCAL":
        path = os.path.join(os.fspath(input_dir), local_weights_name(model_index, _rank()))
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} is missing: a LOCAL_STATE_DICT checkpoint has one file per rank and "
                                    "must be loaded with the number of processes that saved it.")
        state = torch.load(path, map_location="cpu", weights_only=False)  # holds ShardedTensors
        with _fsdp1_local_context(model):
            model.load_state_dict(state)
        return
    if not use_dcp:
        set_model_state_dict(model, _load_rank_file(input_dir, FSDP_MODEL_NAME, model_index))
        return
    folder = os.fspath(input_dir)
    if FSDP_MODEL_NAME not in folder:
        folder = os.path.join(folder, f"{FSDP_MODEL_NAME}_{model_index}")
    if not os.path.isfile(os.path.join(folder, ".metadata")):
        raise FileNotFoundError(f"{folder} is not a sharded FSDP model checkpoint (no .metadata file).")
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=folder)
    set_model_state_dict(model, state["model"])


def save_fsdp_optimizer(fsdp_plugin: Any, accelerator: Any, optimizer: torch.optim.Optimizer,
                        model: torch.nn.Module, output_dir: str | os.PathLike, optimizer_index: int = 0,
                        use_dcp: bool = True) -> None:
    """Write the optimizer state of an FSDP model (sharded per rank, or full from rank 0; LOCAL as sharded).
    With `use_dcp=False` each rank writes its shard alone (`optimizer_<i>_rank<r>.bin`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    optimizer = getattr(optimizer, "optimizer", optimizer)  # an AcceleratedOptimizer wraps the torch one
    os.makedirs(output_dir, exist_ok=True)
    if _is_full(fsdp_plugin):
        state = gather_full_state(model, optimizer)
        if _rank() == 0:
            torch.save(state, os.path.join(os.fspath(output_dir), _optimizer_name(optimizer_index)))
        _barrier()
        return
    if not use_dcp:
        torch.save(get_optimizer_state_dict(model, optimizer),
                   os.path.join(os.fspath(output_dir), _rank_file(OPTIMIZER_NAME, optimizer_index)))
        _barrier()
        return
    state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.save(state, checkpoint_id=os.path.join(os.fspath(output_dir), f"{OPTIMIZER_NAME}_{optimizer_index}"))


def load_fsdp_optimizer(fsdp_plugin: Any, accelerator: Any, optimizer: torch.optim.Optimizer,
                        model: torch.nn.Module, input_dir: str | os.PathLike, optimizer_index: int = 0,
                        adapter_only: bool = False, use_dcp: bool = True) -> None:
    """Read what `save_fsdp_optimizer` wrote (with the same `use_dcp`) into the optimizer of the sharded model."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    optimizer = getattr(optimizer, "optimizer", optimizer)
    if _is_full(fsdp_plugin):
        path = os.path.join(os.fspath(input_dir), _optimizer_name(optimizer_index))
        state = torch.load(path, map_location="cpu", weights_only=True) if _rank() == 0 else {}
        set_optimizer_state_dict(model, optimizer, state,
                                 options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        return
    if not use_dcp:
        set_optimizer_state_dict(model, optimizer, _load_rank_file(input_dir, OPTIMIZER_NAME, optimizer_index))
        return
    folder = os.fspath(input_dir)
    if OPTIMIZER_NAME not in os.path.basename(folder):
        folder = os.path.join(folder, f"{OPTIMIZER_NAME}_{optimizer_index}")
    if not os.path.isfile(os.path.join(folder, ".metadata")):
        raise FileNotFoundError(f"{folder} is not a sharded FSDP optimizer checkpoint (no .metadata file).")
    state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=folder)
    set_optimizer_state_dict(model, optimizer, state["optimizer"])


def merge_fsdp_weights(checkpoint_dir: str | os.PathLike, output_path: str | os.PathLike,
                       safe_serialization: bool = True, remove_checkpoint_dir: bool = False) -> str | None:
    """Turn a sharded FSDP checkpoint folder (SHARDED_STATE_DICT, e.g. `checkpoint/pytorch_model_fsdp_0`) into one
    `model.safetensors` (or `pytorch_model.bin`) in `output_path`. Needs no process group; under one, rank 0
    merges and the others wait. Returns the file written (None on the other ranks)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    checkpoint_dir = os.fspath(checkpoint_dir)
    if not os.path.isfile(os.path.join(checkpoint_dir, ".metadata")):
        hints = [os.path.join(checkpoint_dir, name) for name in (f"{FSDP_MODEL_NAME}_0", f"{OPTIMIZER_NAME}_0")
                 if os.path.isfile(os.path.join(checkpoint_dir, name, ".metadata"))]
        hint = f" It holds sharded checkpoint folders: pass {' or '.join(hints)} instead." if hints else ""
        raise ValueError(f"{checkpoint_dir} is not a sharded FSDP checkpoint (a torch.distributed.checkpoint folder "
                         f"with a .metadata file).{hint}")
    path = None
    if _rank() == 0:
        os.makedirs(output_path, exist_ok=True)
        tmp = os.path.join(os.fspath(output_path), ".merged.tmp")
        dcp_to_torch_save(checkpoint_dir, tmp)
        state = torch.load(tmp, map_location="cpu", weights_only=True)
        os.remove(tmp)
        if len(state) == 1:  # {"model": {...}} as save_fsdp_model writes it
            state = next(iter(state.values()))
        if safe_serialization:
            from safetensors.torch import save_file

            unique, seen = {}, set()
            for name, tensor in state.items():
                key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
                if key not in seen:
                    seen.add(key)
                    unique[name] = tensor.contiguous()
            path = os.path.join(os.fspath(output_path), "model.safetensors")  # returned: the final name, not the partial one
            with atomic_path(path) as partial:
                save_file(unique, str(partial), metadata={"format": "pt"})
        else:
            path = os.path.join(os.fspath(output_path), "pytorch_model.bin")  # returned: the final name, not the partial one
            with atomic_path(path) as partial:
                torch.save(state, partial)
        if remove_checkpoint_dir:
            shutil.rmtree(checkpoint_dir)
    _barrier()
    return path


def ensure_weights_retied(param_init_fn: Any, model: torch.nn.Module, device: Any) -> Any:
    """Wrap FSDP's `param_init_fn` so weights tied in `model` stay tied after it re-creates parameters.

    The tied names come from `model._tied_weights_keys` (transformers' attribute); without any, `param_init_fn`
    is returned unchanged. The first parameter the wrapped function materializes for a tied group becomes the
    one every other member of that group is set to. `device` is accepted for Accelerate's signature.
    """
    tied_names = getattr(model, "_tied_weights_keys", None)
    if not tied_names:
        return param_init_fn
    # id of each original tied parameter -> the materialized parameter shared by its group (None until seen).
    shared: dict[int, torch.nn.Parameter | None] = {}
    for dotted in tied_names:
        owner, _, name = dotted.rpartition(".")
        shared[id(getattr(model.get_submodule(owner), name))] = None

    def init_and_retie(module: torch.nn.Module) -> torch.nn.Module:
        tied_here = [(name, id(p)) for name, p in module.named_parameters(recurse=False) if id(p) in shared]
        module = param_init_fn(module)
        for name, key in tied_here:
            if shared[key] is None:
                shared[key] = getattr(module, name)
            else:
                setattr(module, name, shared[key])
        return module

    return init_and_retie


# ---------------------------------------------------------------------------------------------------------------
# Accelerate's FSDP helper names that work on their own (the Accelerator's prepare does the rest itself)
# ---------------------------------------------------------------------------------------------------------------


def enable_fsdp_ram_efficient_loading() -> None:
    """Let transformers' `from_pretrained` load real weights on rank 0 only (the others build empty models), by
    the environment variables it reads; ACCELERATE_USE_FSDP is set unless already given."""
    os.environ.setdefault("ACCELERATE_USE_FSDP", "True")
    os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "True"


def disable_fsdp_ram_efficient_loading() -> None:
    """Undo `enable_fsdp_ram_efficient_loading`: every rank loads the weights again."""
    os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "False"


def fsdp2_canonicalize_names(named_params: dict) -> dict:
    """The same mapping with parameter names as the user's model has them: without the parts activation
    checkpointing (`._checkpoint_wrapped_module`) and torch.compile (`_orig_mod.`) insert."""
    def canonical(name: str) -> str:
        name = name.replace("._checkpoint_wrapped_module", "")
        if name.startswith("_orig_mod."):
            name = name[len("_orig_mod."):]
        return name.replace("._orig_mod", "")

    return {canonical(name): value for name, value in named_params.items()}


def fsdp2_switch_optimizer_parameters(optimizer: torch.optim.Optimizer, mapping: dict) -> None:
    """Replace every parameter of `optimizer` by `mapping[old.data_ptr]` (Accelerate's key: the bound
    `data_ptr` method, i.e. the old parameter) or `mapping[old]`; KeyError if one has no replacement, since an
    optimizer left on a replaced parameter silently stops training it."""
    for group in optimizer.param_groups:
        switched = []
        for param in group["params"]:
            new = mapping.get(param.data_ptr, mapping.get(param))
            if new is None:
                raise KeyError(f"fsdp2_switch_optimizer_parameters: no sharded parameter for an optimizer parameter "
                               f"of shape {tuple(param.shape)}; the mapping must cover every parameter.")
            switched.append(new)
        group["params"] = switched


def fsdp2_prepare_auto_wrap_policy(fsdp2_plugin: Any, model: torch.nn.Module) -> Any:
    """The FSDP2 wrap decision of `fsdp2_plugin` as `policy(module) -> bool` (None without a policy): layers of
    the transformer classes named (default `model._no_split_modules`, looked up through activation-checkpoint
    wrappers), or modules with more than `min_num_params` parameters."""
    import functools

    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

    base = fsdp2_plugin.auto_wrap_policy
    if isinstance(base, functools.partial):
        base = base.func
    if base is transformer_auto_wrap_policy:
        names = fsdp2_plugin.transformer_cls_names_to_wrap
        if names is None:
            names = list(getattr(model, "_no_split_modules", None) or [])
        present = {type(m).__name__: type(m) for m in model.modules()}
        missing = [name for name in names if name not in present]
        if missing:
            raise ValueError(f"Could not find the transformer layer class {missing[0]} in the model.")
        classes = tuple(present[name] for name in names)
        return lambda module: bool(classes) and isinstance(
            getattr(module, "_checkpoint_wrapped_module", module), classes)
    if base is size_based_auto_wrap_policy:
        minimum = fsdp2_plugin.min_num_params
        return lambda module: sum(p.numel() for p in module.parameters()) > minimum
    return None


def fsdp2_apply_ac(accelerator: Any, model: torch.nn.Module) -> torch.nn.Module:
    """Wrap every layer the plugin's wrap policy selects (bottom up, the root excepted) in an activation
    checkpoint, also offloading its saved input to the CPU with `activation_checkpointing_offload`."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        checkpoint_wrapper,
        offload_wrapper,
    )

    plugin = accelerator.state.fsdp_plugin
    policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
    if policy is None:
        raise ValueError("fsdp2_apply_ac needs an auto_wrap_policy (TRANSFORMER_BASED_WRAP or SIZE_BASED_WRAP) to "
                         "choose the layers to checkpoint.")
    for name, layer in get_module_children_bottom_up(model, return_fqns=True)[:-1]:
        if policy(layer):
            wrapped = checkpoint_wrapper(layer, preserve_rng_state=False)
            if plugin.activation_checkpointing_offload:
                wrapped = offload_wrapper(wrapped)
            model.set_submodule(name, wrapped)
    return model


def fsdp2_load_full_state_dict(accelerator: Any, model: torch.nn.Module, full_sd: dict,
                               cpu_offload: bool = False) -> torch.nn.Module:
    """Load `full_sd` (needed on rank 0 only; the other ranks may pass {}) into an FSDP2-sharded `model`, rank 0
    broadcasting each tensor into the others' shards. A model still on the meta device gets storage first (on
    the CPU with `cpu_offload`, else on the accelerator's device). A collective; returns the model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        model.to_empty(device="cpu" if cpu_offload else accelerator.device)
    set_model_state_dict(model, full_sd if _rank() == 0 else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    return model


def get_fsdp2_grad_scaler(**kwargs: Any) -> Any:
    """A `torch.amp.GradScaler` built from `kwargs` (what FSDP2 runs use for fp16)."""
    from torch.amp.grad_scaler import GradScaler

    return GradScaler(**kwargs)


def get_parameters_from_modules(modules: Any, model: torch.nn.Module, device: Any) -> set:
    """The parameters of `modules`: modules, or a regular expression over `model`'s module names (the matching
    modules are moved to `device`, as FSDP leaves ignored modules where they are). None gives an empty set."""
    import re

    if modules is None:
        return set()
    if isinstance(modules, str):
        pattern = re.compile(modules)
        modules = [m.to(device) for name, m in model.named_modules() if pattern.fullmatch(name)]
    return {p for module in modules for p in module.parameters()}


# Names Accelerate's fsdp_utils module also offers (imported at the end: utils.other imports this module back).
from .constants import SAFE_WEIGHTS_NAME, WEIGHTS_NAME  # noqa: E402, F401
from .dataclasses import get_module_class_from_name  # noqa: E402, F401
from .modeling import get_non_persistent_buffers, is_peft_model  # noqa: E402, F401
from .other import get_module_children_bottom_up, is_compiled_module  # noqa: E402, F401
