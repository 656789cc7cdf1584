"""Accelerate's FSDP checkpoint functions (`save_fsdp_model`, `load_fsdp_model`, `save_fsdp_optimizer`,
`load_fsdp_optimizer`, `merge_fsdp_weights`), for FSDP2 models, on torch.distributed.checkpoint.

File layout as Accelerate's, so checkpoints move between the two libraries:
SHARDED_STATE_DICT -> `<dir>/pytorch_model_fsdp_<i>/` and `<dir>/optimizer_<i>/` (torch.distributed.checkpoint
folders: every rank writes its own shard); FULL_STATE_DICT -> `<dir>/pytorch_model_fsdp[_<i>].bin` and
`<dir>/optimizer[_<i>].bin`, written by rank 0 from the gathered full state. Every function is a collective:
call it on every rank.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch

FSDP_MODEL_NAME = "pytorch_model_fsdp"
OPTIMIZER_NAME = "optimizer"


def _is_full(fsdp_plugin: Any) -> bool:
    kind = getattr(fsdp_plugin, "state_dict_type", None)
    return getattr(kind, "name", str(kind)).upper().endswith("FULL_STATE_DICT")


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _weights_name(model_index: int) -> str:
    return f"{FSDP_MODEL_NAME}.bin" if model_index == 0 else f"{FSDP_MODEL_NAME}_{model_index}.bin"


def _optimizer_name(optimizer_index: int) -> str:
    return f"{OPTIMIZER_NAME}.bin" if optimizer_index == 0 else f"{OPTIMIZER_NAME}_{optimizer_index}.bin"


def save_fsdp_model(fsdp_plugin: Any, accelerator: Any, model: torch.nn.Module, output_dir: str | os.PathLike,
                    model_index: int = 0, adapter_only: bool = False) -> None:
    """Write the weights of an FSDP2 model: one shard per rank (sharded) or one file from rank 0 (full)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    os.makedirs(output_dir, exist_ok=True)
    if _is_full(fsdp_plugin):
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if _rank() == 0:
            torch.save(state, os.path.join(os.fspath(output_dir), _weights_name(model_index)))
        _barrier()
        return
    state = {"model": get_model_state_dict(model)}
    dcp.save(state, checkpoint_id=os.path.join(os.fspath(output_dir), f"{FSDP_MODEL_NAME}_{model_index}"))


def load_fsdp_model(fsdp_plugin: Any, accelerator: Any, model: torch.nn.Module, input_dir: str | os.PathLike,
                    model_index: int = 0, adapter_only: bool = False) -> None:
    """Read what `save_fsdp_model` wrote into the (already sharded) model."""
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
    folder = os.fspath(input_dir)
    if FSDP_MODEL_NAME not in folder:
        folder = os.path.join(folder, f"{FSDP_MODEL_NAME}_{model_index}")
    if not os.path.isfile(os.path.join(folder, ".metadata")):
        raise FileNotFoundError(f"{folder} is not a sharded FSDP model checkpoint (no .metadata file).")
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=folder)
    set_model_state_dict(model, state["model"])


def save_fsdp_optimizer(fsdp_plugin: Any, accelerator: Any, optimizer: torch.optim.Optimizer,
                        model: torch.nn.Module, output_dir: str | os.PathLike, optimizer_index: int = 0) -> None:
    """Write the optimizer state of an FSDP2 model (sharded per rank, or full from rank 0)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    optimizer = getattr(optimizer, "optimizer", optimizer)  # an AcceleratedOptimizer wraps the torch one
    os.makedirs(output_dir, exist_ok=True)
    if _is_full(fsdp_plugin):
        state = get_optimizer_state_dict(model, optimizer,
                                         options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if _rank() == 0:
            torch.save(state, os.path.join(os.fspath(output_dir), _optimizer_name(optimizer_index)))
        _barrier()
        return
    state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.save(state, checkpoint_id=os.path.join(os.fspath(output_dir), f"{OPTIMIZER_NAME}_{optimizer_index}"))


def load_fsdp_optimizer(fsdp_plugin: Any, accelerator: Any, optimizer: torch.optim.Optimizer,
                        model: torch.nn.Module, input_dir: str | os.PathLike, optimizer_index: int = 0,
                        adapter_only: bool = False) -> None:
    """Read what `save_fsdp_optimizer` wrote into the optimizer of the sharded model."""
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
    folder = os.fspath(input_dir)
    if OPTIMIZER_NAME not in os.path.basename(folder):
        folder = os.path.join(folder, f"{OPTIMIZER_NAME}_{optimizer_index}")
    if not os.path.isfile(os.path.join(folder, ".metadata")):
        raise FileNotFoundError(f"{folder} is not a sharded FSDP optimizer checkpoint (no .metadata file).")
    state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=folder)
    set_optimizer_state_dict(model, optimizer, state["optimizer"])


def merge_fsdp_weights(checkpoint_dir: str | os.PathLike, output_path: str | os.PathLike,
                       safe_serialization: bool = True, remove_checkpoint_dir: bool = False) -> str:
    """Turn a sharded FSDP model checkpoint folder into one `model.safetensors` (or `pytorch_model.bin`) in
    `output_path`, in a single process (no process group needed). Returns the file written."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    checkpoint_dir = os.fspath(checkpoint_dir)
    if not os.path.isfile(os.path.join(checkpoint_dir, ".metadata")):
        raise ValueError(f"{checkpoint_dir} is not a torch.distributed.checkpoint folder (no .metadata file).")
    os.makedirs(output_path, exist_ok=True)
    tmp = os.path.join(os.fspath(output_path), ".merged.tmp")
    dcp_to_torch_save(checkpoint_dir, tmp)
    state = torch.load(tmp, map_location="cpu", weights_only=True)
    os.remove(tmp)
    if set(state) == {"model"}:
        state = state["model"]
    if safe_serialization:
        from safetensors.torch import save_file

        unique, seen = {}, set()
        for name, tensor in state.items():
            key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
            if key not in seen:
                seen.add(key)
                unique[name] = tensor.contiguous()
        path = os.path.join(os.fspath(output_path), "model.safetensors")
        save_file(unique, path, metadata={"format": "pt"})
    else:
        path = os.path.join(os.fspath(output_path), "pytorch_model.bin")
        torch.save(state, path)
    if remove_checkpoint_dir:
        shutil.rmtree(checkpoint_dir)
    return path
