"""Weights kept outside the model: in a CPU state dict, in memory-mapped `.dat` files, or in safetensors files.

An offload folder holds `index.json` ({name: {"dtype", "shape"}} for `.dat` files, or {"safetensors_file",
"weight_name", "dtype"} for tensors read straight from a checkpoint) and one `<name>.dat` raw array per
weight. The layout is Accelerate's, so folders written by either library can be read by the other.
Reading is lazy: a `.dat` file or safetensors tensor is memory-mapped, and its pages are read from disk only
when a forward pass touches them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from torch import nn

from .atomic_files import atomic_write

_NUMPY_STAND_IN = {"bfloat16": "int16"}  # numpy has no bfloat16 / float8: store their bits as integers


def _stand_in(dtype_name: str) -> str:
    if dtype_name.startswith("float8_"):
        return "int8"
    return _NUMPY_STAND_IN.get(dtype_name, dtype_name)


def offload_weight(
    weight: torch.Tensor, weight_name: str, offload_folder: str | os.PathLike, index: dict | None = None
) -> dict | None:
    """Write `weight` to `<offload_folder>/<weight_name>.dat` and record its dtype and shape in `index`."""
    dtype_name = str(weight.dtype).replace("torch.", "")
    data = weight.detach().cpu()
    stand_in = _stand_in(dtype_name)
    if stand_in != dtype_name:
        data = data.view(getattr(torch, stand_in))
    array = data.contiguous().numpy()
    if index is not None:
        index[weight_name] = {"dtype": dtype_name, "shape": list(array.shape)}
    if array.ndim == 0:
        array = array.reshape(1)  # numpy memmaps need at least one dimension
    target = np.memmap(os.path.join(os.fspath(offload_folder), f"{weight_name}.dat"), dtype=array.dtype,
                       mode="w+", shape=array.shape)
    target[:] = array
    target.flush()
    del target
    return index


def load_offloaded_weight(weight_file: str | os.PathLike, weight_info: Mapping[str, Any]) -> torch.Tensor:
    """Memory-map one `.dat` weight (copy-on-write: the file is never modified, pages are read on use)."""
    shape = tuple(weight_info["shape"])
    dtype_name = weight_info["dtype"]
    array = np.memmap(weight_file, dtype=_stand_in(dtype_name), mode="c", shape=shape or (1,))
    tensor = torch.from_numpy(array)
    if not shape:
        tensor = tensor.reshape(())
    if _stand_in(dtype_name) != dtype_name:
        tensor = tensor.view(getattr(torch, dtype_name))
    return tensor


def save_offload_index(index: Mapping[str, Any] | None, offload_folder: str | os.PathLike) -> None:
    """Merge `index` into `<offload_folder>/index.json`."""
    if not index:
        return
    path = os.path.join(os.fspath(offload_folder), "index.json")
    current = {}
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as handle:
            current = json.load(handle)
    current.update(index)
    with atomic_write(path) as handle:
        json.dump(current, handle, indent=2)


def offload_state_dict(save_dir: str | os.PathLike, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Write every tensor of `state_dict` to `save_dir` as `.dat` files plus `index.json`."""
    os.makedirs(save_dir, exist_ok=True)
    index: dict[str, Any] = {}
    for name, tensor in state_dict.items():
        offload_weight(tensor, name, save_dir, index=index)
    save_offload_index(index, save_dir)


def load_offloaded_weights(model: nn.Module, index: Mapping[str, Any] | None, offload_folder: str | os.PathLike
                           ) -> None:
    """Put every weight listed in `index` (from `offload_folder`) back into `model` on the CPU."""
    from .tensor_placement import set_module_tensor_to_device

    if not index:
        return
    loader = OffloadedWeightsLoader(save_folder=offload_folder, index=dict(index))
    for name in index:
        set_module_tensor_to_device(model, name, "cpu", value=loader[name])


class PrefixedDataset(Mapping):
    """A read-only view of `dataset` in which key `k` means `prefix + k` (one submodule's weights)."""

    def __init__(self, dataset: Mapping, prefix: str):
        self.dataset = dataset
        self.prefix = prefix

    def __getitem__(self, key: str) -> Any:
        return self.dataset[f"{self.prefix}{key}"]

    def __iter__(self) -> Iterator[str]:
        return iter([key for key in self.dataset if key.startswith(self.prefix)])

    def __len__(self) -> int:
        return sum(1 for key in self.dataset if key.startswith(self.prefix))


class OffloadedWeightsLoader(Mapping):
    """Weights by name, from a CPU `state_dict` (checked first) or an offload folder / index, read lazily.

    `device`: where safetensors tensors are materialized (default CPU). A safetensors file is opened for each
    read and not kept open: safetensors maps the whole file once per handle and the mapping (with every page a
    forward touched) lives as long as the handle or any tensor read from it, so a cached handle would keep every
    offloaded layer resident after its forward.
    """

    def __init__(
        self,
        state_dict: Mapping[str, torch.Tensor] | None = None,
        save_folder: str | os.PathLike | None = None,
        index: Mapping[str, Any] | None = None,
        device: Any = None,
    ):
        if state_dict is None and save_folder is None and index is None:
            raise ValueError("Need either a `state_dict`, a `save_folder` or an `index` containing offloaded weights.")
        self.state_dict = {} if state_dict is None else state_dict
        self.save_folder = None if save_folder is None else os.fspath(save_folder)
        if index is None and self.save_folder is not None:
            path = os.path.join(self.save_folder, "index.json")
            if not os.path.isfile(path):
                raise ValueError(f"{self.save_folder} has no index.json: it is not an offload folder.")
            with open(path, encoding="utf-8") as handle:
                index = json.load(handle)
        self.index = {} if index is None else index
        self.all_keys = list(self.state_dict) + [k for k in self.index if k not in self.state_dict]
        self.device = device

    def __getitem__(self, key: str) -> torch.Tensor:
        if key in self.state_dict:
            return self.state_dict[key]
        info = self.index[key]
        if info.get("safetensors_file") is not None:
            with safe_open(info["safetensors_file"], framework="pt", device="cpu") as handle:
                tensor = handle.get_tensor(info.get("weight_name", key))
            if "dtype" in info:
                tensor = tensor.to(getattr(torch, info["dtype"]))
            if self.device is not None and str(self.device) != "cpu":
                tensor = tensor.to(self.device)
            return tensor
        if self.save_folder is None:
            raise KeyError(f"{key} is indexed as a .dat file but this loader has no save_folder.")
        return load_offloaded_weight(os.path.join(self.save_folder, f"{key}.dat"), info)

    def __iter__(self) -> Iterator[str]:
        return iter(self.all_keys)

    def __len__(self) -> int:
        return len(self.all_keys)


def extract_submodules_state_dict(state_dict: Mapping[str, torch.Tensor], submodule_names: list[str]
                                  ) -> dict[str, torch.Tensor]:
    """The entries of `state_dict` that belong to the named submodules ("h.1" takes "h.1.x", not "h.10.x")."""
    result = {}
    for module_name in submodule_names:
        prefix = module_name + "."
        result.update({k: v for k, v in state_dict.items() if k == module_name or k.startswith(prefix)
                       or module_name == ""})
    return result
