"""Sizes, device maps and checkpoint loading for models that do not fit in one device's memory.

Everything here works on the *shapes and dtypes* of a model's tensors, so a model built under
`init_empty_weights` (all tensors on the "meta" device) can be measured, mapped onto devices and then filled
from a checkpoint one tensor at a time. Names, arguments and defaults follow Accelerate's `utils.modeling`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import warnings
from collections import OrderedDict, defaultdict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from .dataclasses import CustomDtype
from .offload import load_offloaded_weights as load_offloaded_weights  # also Accelerate's home
from .tensor_placement import _NOT_CAST_PREFIXES, Device, _as_dtype, _normalize_device  # noqa: F401
from .tensor_placement import id_tensor_storage as id_tensor_storage  # Accelerate's home for these two
from .tensor_placement import set_module_tensor_to_device as set_module_tensor_to_device

logger = logging.getLogger(__name__)

WEIGHTS_NAME = "pytorch_model.bin"
SAFE_WEIGHTS_NAME = "model.safetensors"

# --------------------------------------------------------------------------------------------------------------
# sizes and dtypes
# --------------------------------------------------------------------------------------------------------------

_SIZE_UNITS = [  # (suffix, bytes per unit); checked longest first so "GIB" wins over "B"
    ("GIB", 2**30), ("MIB", 2**20), ("KIB", 2**10), ("TIB", 2**40),
    ("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3),
]


def convert_file_size_to_int(size: int | str) -> int:
    """Turn a size such as `"10GiB"`, `"500MB"`, `"5.5GB"` or an int (bytes) into a number of bytes.

    A lowercase final `b` (`"8Gb"`) means bits, as in Accelerate.
    """
    if isinstance(size, bool):
        raise ValueError(f"`size` {size!r} is not a valid size: use an int (bytes) or a string like '10GiB'.")
    if isinstance(size, int):
        if size < 0:
            raise ValueError(f"`size` {size} is negative: sizes are numbers of bytes >= 0.")
        return size
    if isinstance(size, float) and size >= 0:
        return int(size)
    if not isinstance(size, str):
        raise ValueError(f"`size` {size!r} is not a valid size: use an int (bytes) or a string like '10GiB'.")
    text = size.strip()
    for suffix, unit in _SIZE_UNITS:
        if text.upper().endswith(suffix):
            number = text[: -len(suffix)].strip()
            try:
                value = int(float(number) * unit)
            except ValueError:
                break
            if suffix.endswith("B") and not suffix.endswith("IB") and text.endswith("b"):
                value //= 8  # "Gb": gigabits
            if value < 0:
                break
            return value
    if text.isdigit():
        return int(text)
    raise ValueError(
        f"`size` {size!r} is not in a valid format. Use an int for bytes or a string with a unit: "
        "'10GiB', '500MiB', '5GB', '500MB', '100KB'."
    )


def dtype_byte_size(dtype: torch.dtype | CustomDtype) -> float:
    """Bytes taken by one element of `dtype` (fractions for bool and sub-byte custom types, as in Accelerate)."""
    if dtype == torch.bool:
        return 1 / 8
    if dtype == CustomDtype.INT2:
        return 1 / 4
    if dtype == CustomDtype.INT4:
        return 1 / 2
    if dtype == CustomDtype.FP8:
        return 1
    if isinstance(dtype, torch.dtype):
        return dtype.itemsize
    bits = re.search(r"[^\d](\d+)_?$", str(dtype))
    if bits is None:
        raise ValueError(f"`dtype` is not a valid dtype: {dtype}.")
    return int(bits.group(1)) // 8


def get_non_persistent_buffers(module: nn.Module, recurse: bool = False, fqns: bool = False) -> set[str]:
    """Names of the buffers registered with `persistent=False` (not part of the state dict)."""
    names = set(module._non_persistent_buffers_set)
    if recurse:
        for prefix, sub in module.named_modules():
            if prefix:
                names |= {f"{prefix}.{n}" if fqns else n for n in sub._non_persistent_buffers_set}
    return names


def named_module_tensors(
    module: nn.Module, include_buffers: bool = True, recurse: bool = False, remove_non_persistent: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(name, tensor)` for the parameters and then (optionally) the buffers of `module`."""
    yield from module.named_parameters(recurse=recurse)
    if include_buffers:
        skip = get_non_persistent_buffers(module, recurse=recurse, fqns=True) if remove_non_persistent else set()
        for name, buffer in module.named_buffers(recurse=recurse):
            if name not in skip:
                yield name, buffer


def compute_module_sizes(
    model: nn.Module,
    dtype: str | torch.dtype | None = None,
    special_dtypes: dict[str, str | torch.dtype] | None = None,
    buffers_only: bool = False,
) -> dict[str, int]:
    """Bytes used by every submodule (key "" is the whole model), as if loaded in `dtype`.

    `dtype` only shrinks floating tensors (a float16 tensor is not grown to float32); integer and bool tensors
    keep their size, since loading does not cast them.
    """
    target = _as_dtype(dtype)
    special = {k: dtype_byte_size(_as_dtype(v)) for k, v in (special_dtypes or {}).items()}
    sizes: dict[str, int] = defaultdict(int)
    tensors = model.named_buffers(recurse=True) if buffers_only else named_module_tensors(model, recurse=True)
    for name, tensor in tensors:
        if name in special:
            size = tensor.numel() * special[name]
        elif target is None or str(tensor.dtype).startswith(_NOT_CAST_PREFIXES):
            size = tensor.numel() * dtype_byte_size(tensor.dtype)
        else:
            size = tensor.numel() * min(dtype_byte_size(target), dtype_byte_size(tensor.dtype))
        parts = name.split(".")
        for depth in range(len(parts) + 1):
            sizes[".".join(parts[:depth])] += size
    return sizes


def compute_module_total_buffer_size(
    model: nn.Module, dtype: str | torch.dtype | None = None, special_dtypes: dict | None = None
) -> int:
    """Bytes used by all the buffers of `model`."""
    return compute_module_sizes(model, dtype=dtype, special_dtypes=special_dtypes, buffers_only=True).get("", 0)


def get_max_layer_size(
    modules: list[tuple[str, Any]], module_sizes: dict[str, int], no_split_module_classes: list[str]
) -> tuple[int, list[str]]:
    """Largest "layer" among `modules` and the names reaching that size.

    A layer is a module without children, a tensor, or a module whose class is in `no_split_module_classes`
    (it must stay whole on one device).
    """
    best, names = 0, []
    pending = list(modules)
    while pending:
        name, module = pending.pop(0)
        children = list(module.named_children()) if isinstance(module, nn.Module) else []
        if not children or module.__class__.__name__ in no_split_module_classes:
            size = module_sizes.get(name, 0)
            if size > best:
                best, names = size, [name]
            elif size == best:
                names.append(name)
        else:
            pending = [(f"{name}.{n}", m) for n, m in children] + pending
    return best, names


def calculate_maximum_sizes(model: nn.Module) -> tuple[int, tuple[int, list[str]]]:
    """(total bytes, (largest layer bytes, its names)), using `model._no_split_modules` when it exists."""
    sizes = compute_module_sizes(model)
    no_split = list(getattr(model, "_no_split_modules", None) or [])
    return sizes[""], get_max_layer_size(_top_level_entries(model), sizes, no_split)


def _top_level_entries(model: nn.Module) -> list[tuple[str, Any]]:
    return (
        list(model.named_parameters(recurse=False))
        + list(model.named_children())
        + list(model.named_buffers(recurse=False))
    )


# --------------------------------------------------------------------------------------------------------------
# devices and memory budgets
# --------------------------------------------------------------------------------------------------------------


def _accelerator_count() -> int:
    if torch.cuda.is_available():
        return torch.cuda.device_count()
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        return xpu.device_count()
    return 0


def check_devices_exist(device_map: Mapping[str, Device]) -> None:
    """Raise a ValueError naming the first entry of `device_map` whose device this machine does not have."""
    for key, device in device_map.items():
        _check_device_exists(device, f"device_map[{key!r}]")


def _check_device_exists(device: Device, where: str) -> None:
    """Raise a ValueError naming `where` when `device` is not a device of this machine (or "disk")."""
    if isinstance(device, str) and device in ("cpu", "disk", "meta"):
        return
    count = _accelerator_count()
    if isinstance(device, int) and not isinstance(device, bool):
        if 0 <= device < count:
            return
        raise ValueError(
            f"{where} names accelerator {device}, but this machine has {count} accelerator(s) "
            f"({'none' if count == 0 else f'indices 0..{count - 1}'}). Use 'cpu', 'disk' or an existing index."
        )
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(
            f"{where} names {device!r}, which is not a device: use 'cpu', 'disk', an accelerator index "
            "such as 0, or a torch device string such as 'cuda:0'."
        ) from error
    if parsed.type in ("cpu", "meta"):
        return
    if parsed.type == "mps":
        if torch.backends.mps.is_available():
            return
    else:
        backend = getattr(torch, parsed.type, None)
        available = backend is not None and hasattr(backend, "device_count") and backend.is_available()
        if available and (parsed.index or 0) < backend.device_count():
            return
    raise ValueError(f"{where} names device {device!r}, which does not exist on this machine.")


def get_max_memory(max_memory: dict[int | str, int | str] | None = None) -> dict[int | str, int]:
    """Bytes each device may hold: measured (free accelerator memory, available RAM via psutil) when None,
    otherwise `max_memory` with sizes like "10GiB" converted and devices ordered accelerators, mps, cpu, disk."""
    import psutil

    if max_memory is None:
        found: dict[int | str, int] = {}
        for index in range(_accelerator_count()):
            try:
                if torch.cuda.is_available():
                    found[index] = torch.cuda.mem_get_info(index)[0]
                else:
                    found[index] = torch.xpu.mem_get_info(index)[0]
            except Exception:  # a device that cannot be queried is left out, as Accelerate does
                logger.info("Device %s could not be queried; leaving it out.", index)
        if torch.backends.mps.is_available():
            found["mps"] = psutil.virtual_memory().available
        else:
            found["cpu"] = psutil.virtual_memory().available
        return found

    if not isinstance(max_memory, Mapping):
        raise TypeError(f"`max_memory` must be a dict like {{0: '10GiB', 'cpu': '30GiB'}}, got {type(max_memory)}.")
    converted = {key: convert_file_size_to_int(value) for key, value in max_memory.items()}
    count = _accelerator_count()
    indices = sorted(key for key in converted if isinstance(key, int) and not isinstance(key, bool))
    for index in indices:
        if index >= count or index < 0:
            logger.warning("Device %s is not available, available devices are %s", index, list(range(count)))
    unknown = [key for key in converted if key not in indices and key not in ("mps", "cpu", "disk")]
    if unknown:
        raise ValueError(
            f"`max_memory` has device(s) {unknown} that are not recognized: use integers for accelerators, "
            "'mps', 'cpu' and 'disk'."
        )
    order = indices + [k for k in ("mps", "cpu", "disk") if k in converted]
    return {key: converted[key] for key in order}


def get_balanced_memory(
    model: nn.Module,
    max_memory: dict[int | str, int | str] | None = None,
    no_split_module_classes: list[str] | None = None,
    dtype: str | torch.dtype | None = None,
    special_dtypes: dict[str, str | torch.dtype] | None = None,
    low_zero: bool = False,
) -> dict[int | str, int]:
    """A `max_memory` for `infer_auto_device_map` that spreads the model evenly over the accelerators.

    With no accelerator it returns the (converted) budgets unchanged. `low_zero=True` leaves accelerator 0 as
    empty as possible (for generation, which puts its own tensors there).
    """
    user_set = max_memory is not None
    budgets = get_max_memory(max_memory)
    accelerators = sorted(k for k, v in budgets.items() if isinstance(k, int) and v > 0)
    if not accelerators:
        return budgets
    if len(accelerators) == 1:
        low_zero = False
        if not user_set:
            budgets[accelerators[0]] = int(budgets[accelerators[0]] * 0.9)  # headroom for activations
    sizes = compute_module_sizes(model, dtype=dtype, special_dtypes=special_dtypes)
    share = sizes[""] // (len(accelerators) - 1 if low_zero else len(accelerators))

    no_split = _as_class_list(no_split_module_classes)
    whole_block = 0
    if no_split:
        for name, module in model.named_modules():
            if name and module.__class__.__name__ in no_split:
                whole_block = max(whole_block, sizes.get(name, 0))
    leaf_modules = [n for n, m in model.named_modules() if n and not list(m.children())]
    mean_leaf = int(sum(sizes.get(n, 0) for n in leaf_modules) / max(len(leaf_modules), 1))
    share += int(1.25 * max(whole_block, mean_leaf))
    for index in accelerators[:-1]:  # the last one keeps its whole budget in case the margin is not enough
        budgets[index] = min(budgets[0] if low_zero and index == 0 else share, budgets[index])
    if low_zero:
        rest = sum(budgets[i] for i in accelerators[1:])
        budgets[accelerators[0]] = min(max(0, sizes[""] - rest), budgets[accelerators[0]])
    return budgets


def _as_class_list(classes: list[str] | str | None) -> list[str]:
    if classes is None:
        return []
    if isinstance(classes, str):
        return [classes]
    return list(classes)


# --------------------------------------------------------------------------------------------------------------
# tied parameters
# --------------------------------------------------------------------------------------------------------------


def find_tied_parameters(model: nn.Module, **kwargs: Any) -> list[list[str]]:
    """Groups of parameter names that refer to the same `nn.Parameter` (e.g. tied embeddings and lm head)."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return [sorted(names) for names in groups.values() if len(names) > 1]


def _get_attr_path(root: nn.Module, dotted: str) -> Any:
    obj = root
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _owner_and_name(root: nn.Module, dotted: str) -> tuple[nn.Module, str]:
    if "." not in dotted:
        return root, dotted
    owner_path, name = dotted.rsplit(".", 1)
    return _get_attr_path(root, owner_path), name


def retie_parameters(model: nn.Module, tied_params: list[list[str]]) -> None:
    """Make every name of each tied group point at one parameter again (the first one not on "meta")."""
    for group in tied_params:
        keeper = None
        for name in group:
            param = _get_attr_path(model, name)
            if param.device.type != "meta":
                keeper = param
                break
        if keeper is None:
            continue
        for name in group:
            owner, attr = _owner_and_name(model, name)
            setattr(owner, attr, keeper)


def check_tied_parameters_on_same_device(tied_params: list[list[str]], device_map: dict[str, Device]) -> None:
    """Warn when the names of one tied group are mapped to different devices; a ValueError (as Accelerate's)
    when the map gives one of them no device at all."""
    for group in tied_params:
        devices = {name: _device_for(name, device_map) for name in group}
        unplaced = [name for name, device in devices.items() if device is None]
        if unplaced:
            raise ValueError(f"The `device_map` gives no device to the tied parameter(s) {unplaced}: add their "
                             "modules (or '' for the whole model) to the map.")
        if len({str(d) for d in devices.values()}) > 1:
            logger.warning("Tied parameters are on different devices: %s. Use device_map='auto' or fix the map.",
                           devices)


# --------------------------------------------------------------------------------------------------------------
# moving one tensor
# --------------------------------------------------------------------------------------------------------------



# --------------------------------------------------------------------------------------------------------------
# device maps
# --------------------------------------------------------------------------------------------------------------


def _device_for(tensor_name: str, device_map: Mapping[str, Device]) -> Device | None:
    """The device of the longest `device_map` key that is `tensor_name` or one of its parent modules."""
    name = tensor_name
    while True:
        if name in device_map:
            return device_map[name]
        if not name:
            return None
        name = name.rsplit(".", 1)[0] if "." in name else ""


def clean_device_map(device_map: dict[str, Device], module_name: str = "") -> dict[str, Device]:
    """Merge sibling entries that share a device into their parent's entry (in place; returns the map)."""
    prefix = f"{module_name}." if module_name else ""
    keys = [k for k in device_map if k.startswith(prefix) or k == module_name]
    values = [device_map[k] for k in keys]
    if len(values) > 1 and len({str(v) for v in values}) == 1:
        for key in keys:
            del device_map[key]
        device_map[module_name] = values[0]
        return device_map
    depth = len(module_name.split(".")) + 1 if module_name else 1
    # Children in the map's (model) order. A merged entry moves to the end of the map, as in Accelerate, whose
    # children come in set order: with two merges its key order changes with PYTHONHASHSEED (docs/compat.md).
    children = dict.fromkeys(".".join(k.split(".")[:depth]) for k in keys if len(k) > len(module_name))
    for child in children:
        clean_device_map(device_map, module_name=child)
    return device_map


def check_device_map(model: nn.Module, device_map: dict[str, Device]) -> None:
    """Raise a ValueError when `device_map` leaves a tensor of `model` without a device; warn about keys that
    match no submodule. (Whether its devices exist is checked where they are used: `check_devices_exist`.)"""
    if not isinstance(device_map, Mapping):
        raise TypeError(
            f"`device_map` must be a dict {{module name: device}}, got {type(device_map).__name__}; for an "
            "automatic map use load_checkpoint_and_dispatch(..., device_map='auto') or infer_auto_device_map."
        )
    modules = dict(model.named_modules())
    tensor_names = set(model.state_dict().keys()) | {n for n, _ in model.named_parameters()}
    unknown = [k for k in device_map if k and k not in modules and k not in tensor_names]
    if unknown:
        warnings.warn(f"The following device_map keys do not match any submodules in the model: {unknown}",
                      UserWarning, stacklevel=2)
    if "" in device_map:
        return
    uncovered = [n for n in model.state_dict() if _device_for(n, device_map) is None]
    if uncovered:
        raise ValueError(
            "The device_map provided does not give any device for the following parameters: "
            + ", ".join(uncovered)
            + ". Add their modules (or '' for the whole model) to the device_map."
        )


def infer_auto_device_map(
    model: nn.Module,
    max_memory: dict[int | str, int | str] | None = None,
    no_split_module_classes: list[str] | None = None,
    dtype: str | torch.dtype | None = None,
    special_dtypes: dict[str, str | torch.dtype] | None = None,
    verbose: bool = False,
    clean_result: bool = True,
    offload_buffers: bool = False,
    fallback_allocation: bool = False,
) -> dict[str, Device]:
    """Map the submodules of `model` onto accelerators first, then the CPU, then "disk", within `max_memory`.

    Devices that execute offloaded layers (the first accelerator, or the CPU when there is none) keep room for
    the largest layer, so a layer brought back from CPU/disk always fits. Modules that do not fit are split into
    their children unless their class is in `no_split_module_classes`. A module goes with the modules holding
    the weights tied to it (one of those is split when only the module itself fits). The decisions are
    Accelerate's, so the maps are the same (docs/compat.md); so are the warning about offloaded layers'
    buffers and the INFO record naming devices that could take no module.
    """
    budgets = get_max_memory(max_memory)
    no_split = _as_class_list(no_split_module_classes)
    if no_split:
        present = {m.__class__.__name__ for m in model.modules()}
        if not present & set(no_split):
            raise ValueError(
                f"`no_split_module_classes` {no_split} names no class of this model. Use class names of its "
                f"submodules, e.g. one of {sorted(present)[:12]}."
            )
    devices: list[int | str] = list(budgets)
    if "disk" not in devices:
        devices.append("disk")
    accelerators = [d for d in devices if d not in ("cpu", "disk")]
    # the devices that run offloaded layers keep room for the largest one
    main_devices = ["mps"] if "mps" in accelerators else ([accelerators[0], "cpu"] if accelerators else ["cpu"])

    sizes = compute_module_sizes(model, dtype=dtype, special_dtypes=special_dtypes)
    tied_groups = find_tied_parameters(model)
    if not tied_groups and check_tied_parameters_in_config(model):
        logger.warning("The model's config asks for tied weights but none are tied: call `model.tie_weights()` "
                       "before infer_auto_device_map.")
    queue: list[tuple[str, Any]] = _top_level_entries(model)
    placement = _Placement(devices, budgets)
    largest, largest_names = get_max_layer_size(queue, sizes, no_split)

    def say(message: str) -> None:
        if verbose:
            print(message)

    def largest_left() -> tuple[int, list[str]]:
        return get_max_layer_size([(n, m) for n, m in queue if isinstance(m, nn.Module)], sizes, no_split)

    while queue:
        name, obj = queue.pop(0)
        largest_names = [n for n in largest_names if n != name and not n.startswith(name + ".")]
        if not largest_names:
            largest, largest_names = largest_left()
        size = sizes[name]
        # tied parameters whose module is already placed cannot come along (Accelerate fails on them with an
        # IndexError; they stay where they were placed)
        tied = [p for p in _tied_elsewhere(name, tied_groups) if any(p.startswith(n + ".") for n, _ in queue)]
        device = placement.device
        reserved = largest if device in main_devices else 0
        limit = None if device == "disk" else budgets[device] - reserved
        size_with_ties, tied_names, tied_modules = get_module_size_with_ties(tied, size, sizes, queue)
        used = placement.used[device]

        if limit is None or used + size_with_ties <= limit:  # it fits, with the modules it shares weights with
            say(f"{name} (size {size_with_ties}{' with ' + str(tied_names) if tied_names else ''}) goes on {device}.")
            placement.put(name, device, size_with_ties)
            for tied_name in tied_names:
                queue = [(n, m) for n, m in queue if n != tied_name]
                placement.put(tied_name, device, 0)
            if not offload_buffers and isinstance(obj, nn.Module):
                placement.add_buffers(device, compute_module_total_buffer_size(obj, dtype, special_dtypes))
            continue

        if tied and used + size <= limit:  # it fits alone: split a module it shares weights with, then retry
            splittable = [(n, m) for n, m in zip(tied_names, tied_modules)
                          if list(m.named_children()) and type(m).__name__ not in no_split]
            if splittable:
                tied_name, tied_module = splittable[0]
                say(f"{name} fits on {device} but not with {tied_names}: splitting {tied_name}.")
                index = next(i for i, (n, _) in enumerate(queue) if n == tied_name)
                queue = [(name, obj)] + queue[:index] + _parts(tied_name, tied_module) + queue[index + 1:]
                largest, largest_names = largest_left()
                continue
            say(f"None of {tied_names} can be split.")

        if used + size >= limit:  # it does not fit: split it when it may be split
            children = [] if isinstance(obj, torch.Tensor) else list(obj.named_children())
            if children and type(obj).__name__ not in no_split:
                say(f"Splitting {name}: {size} bytes, {limit - used} left on {device}.")
                queue = _parts(name, obj) + queue
                largest, largest_names = largest_left()
                continue

        if used == 0 and fallback_allocation and device != "disk":
            # nothing is on this device yet: rather than leave it empty, bring forward a later module (or part
            # of one) that fits
            room = budgets[device] - max(largest, size_with_ties)
            found, module, rest = fallback_allocate(queue, sizes, room, no_split, tied_groups)
            if module is not None:
                say(f"fallback_allocation: {found} goes first, to fill {device}.")
                queue = [(found, module), (name, obj)] + rest
                continue

        say(f"{name} does not fit on {device}: moving on to the next device.")
        placement.move_on(needed=size_with_ties + reserved, reserved=reserved)
        queue.insert(0, (name, obj))

    device_map = placement.device_map
    _cover_split_buffers(model, device_map)
    if clean_result:
        device_map = clean_device_map(device_map)
    placement.warn_about_buffers(offload_buffers, accelerators)
    placement.log_empty_devices()
    return device_map


def _tied_elsewhere(name: str, tied_groups: list[list[str]]) -> list[str]:
    """The parameters tied to one inside `name` (the module or tensor of that name) that are outside it.

    "Inside" is Accelerate's test, kept so that the maps stay the same: the dotted name occurs in the
    parameter's dotted name. Used by infer_auto_device_map and fallback_allocate."""
    def inside(param: str) -> bool:
        return name + "." in param + "."

    return [p for group in tied_groups if any(map(inside, group)) and not all(map(inside, group))
            for p in group if not inside(p)]


def _parts(name: str, module: nn.Module) -> list[tuple[str, Any]]:
    """What a module is split into, as in Accelerate: its own parameters, then its children. Its own buffers
    are not placed as parts (see `_cover_split_buffers`)."""
    return [(f"{name}.{n}", part) for n, part in
            list(module.named_parameters(recurse=False)) + list(module.named_children())]


def _cover_split_buffers(model: nn.Module, device_map: dict[str, Device]) -> None:
    """Give the direct buffers of split modules the device of their module's first placed part.

    Placement leaves them out (Accelerate's maps give them no device, and dispatching such a map fails);
    adding them afterwards changes no other entry, and `clean_device_map` folds them into their module's
    entry when its parts share a device."""
    for name, _ in model.named_buffers():
        if _device_for(name, device_map) is not None:
            continue
        owner = name.rsplit(".", 1)[0] if "." in name else ""
        parts = [key for key in device_map if key.startswith(owner + ".") or not owner]
        if parts:  # the new entry goes after the module's parts, so the others keep their order
            entries = list(device_map.items())
            at = max(i for i, (key, _) in enumerate(entries) if key in parts) + 1
            entries.insert(at, (name, device_map[parts[0]]))
            device_map.clear()
            device_map.update(entries)


@dataclass
class _Placement:
    """infer_auto_device_map's running state: the map so far and, per device, the bytes placed there, the
    buffers of the modules placed there, and, for a device left empty, what the first module needed."""

    devices: list[int | str]
    budgets: dict[int | str, int]
    device_map: dict[str, Device] = field(default_factory=OrderedDict)
    position: int = 0
    used: dict[int | str, int] = field(default_factory=dict)
    buffers: dict[int | str, int] = field(default_factory=dict)
    left_empty: dict[int | str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.used = dict.fromkeys(self.devices, 0)

    @property
    def device(self) -> int | str:
        return self.devices[self.position]

    def put(self, name: str, device: int | str, size: int) -> None:
        self.used[device] += size
        self.device_map[name] = device

    def add_buffers(self, device: int | str, size: int) -> None:
        self.buffers[device] = self.buffers.get(device, 0) + size

    def move_on(self, needed: int, reserved: int) -> None:
        """Close the current device (its reserve for offloaded layers counts as used) and go to the next."""
        if self.used[self.device] == 0:
            self.left_empty[self.device] = needed
        self.used[self.device] += reserved
        self.position += 1

    def warn_about_buffers(self, offload_buffers: bool, accelerators: list[int | str]) -> None:
        """Offloaded layers' buffers stay on the execution device: warn when no accelerator has room for them."""
        offloaded = self.buffers.get("cpu", 0) + self.buffers.get("disk", 0)
        if offload_buffers or not offloaded or not accelerators:
            return
        if any(self.budgets[d] >= offloaded + self.used.get(d, 0) for d in self.budgets if d not in ("cpu", "disk")):
            return
        warnings.warn(
            f"Current model requires {offloaded} bytes of buffers for its offloaded layers, which stay on the "
            "accelerator and do not fit in what is left on any of them. If you run out of memory later, pass "
            "offload_buffers=True.",
            stacklevel=3,
        )

    def log_empty_devices(self) -> None:
        if not self.left_empty:
            return
        lines = "\n".join(f"  - {device}: {size} bytes needed" for device, size in self.left_empty.items())
        logger.info(
            "No module could be placed on these devices (insufficient memory for the first module that was "
            f"tried, with the room kept for offloaded layers):\n{lines}\nThese numbers belong to this "
            "allocation; give those devices at least that much memory, or change the model's configuration."
        )


# --------------------------------------------------------------------------------------------------------------
# checkpoints
# --------------------------------------------------------------------------------------------------------------


class CheckpointFormatError(ValueError, OSError):
    """A safetensors file whose metadata names no known format: an OSError, as Accelerate raises, and a
    ValueError, as nbaccel raised before (a file of another framework, 'tf' or 'flax', stays a ValueError)."""


class ShardMissingError(ValueError, FileNotFoundError):
    """An index that lists a shard file that is not there: found before anything is loaded (Accelerate's
    FileNotFoundError comes when it reaches that shard), and both error types."""


class StrictLoadError(ValueError, RuntimeError):
    """`strict=True` and the checkpoint's keys differ from the model's: a RuntimeError, as torch's
    `load_state_dict` (which Accelerate calls) raises, and a ValueError, as nbaccel raised before."""


def _check_safetensors_format(path: str, metadata: dict[str, str] | None) -> None:
    """Refuse a safetensors file of another framework; note one without metadata, as Accelerate does."""
    if metadata is None:
        logger.warning("%s has no metadata (it was not written by save_pretrained); reading it as PyTorch ('pt') "
                       "tensors.", path)
        return
    found = metadata.get("format", "pt")
    if found == "pt":
        return
    if found not in ("tf", "flax"):
        raise CheckpointFormatError(f"{path} has metadata format {found!r}, which is no framework's: it was not "
                                    "written by save_pretrained or safetensors' save_file with format 'pt'.")
    raise ValueError(f"{path} was saved with format {found!r}; only PyTorch ('pt') safetensors checkpoints can "
                     "be loaded.")


def load_state_dict(checkpoint_file: str | os.PathLike, device_map: dict[str, Device] | None = None) -> dict:
    """Load one checkpoint file (safetensors or torch) on the CPU, or straight onto the devices of `device_map`
    for safetensors files. Tensors of a safetensors file are memory-mapped, not read, until used."""
    checkpoint_file = str(checkpoint_file)
    if checkpoint_file.endswith(".safetensors"):
        result = {}
        with safe_open(checkpoint_file, framework="pt", device="cpu") as handle:
            _check_safetensors_format(checkpoint_file, handle.metadata())
            # the file's storage order, as safetensors' load_file (and so Accelerate) returns it; keys() is sorted
            for key in getattr(handle, "offset_keys", handle.keys)():
                tensor = handle.get_tensor(key)
                device = _device_for(key, device_map) if device_map else None
                if device not in (None, "cpu", "disk"):
                    tensor = tensor.to(_normalize_device(device))
                result[key] = tensor
        return result
    return _torch_load(checkpoint_file)


def _torch_load(path: str) -> dict:
    """torch.load on the CPU, memory-mapped when the file is in the zip format (the default since torch 1.6)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as error:
        if "mmap" not in str(error) and "zip" not in str(error):
            raise
        return torch.load(path, map_location="cpu", weights_only=True)


def _checkpoint_files(checkpoint: str | os.PathLike) -> list[str]:
    """The weight files of `checkpoint`: one file, a `*.index.json` (its weight_map), or a folder holding
    `model.safetensors`, `pytorch_model.bin` or exactly one `*.index.json`."""
    checkpoint = os.fspath(checkpoint)
    index_file = None
    if os.path.isfile(checkpoint):
        if not checkpoint.endswith(".json"):
            return [checkpoint]
        index_file = checkpoint
    elif os.path.isdir(checkpoint):
        names = os.listdir(checkpoint)
        for whole in (SAFE_WEIGHTS_NAME, WEIGHTS_NAME):
            if whole in names:
                return [os.path.join(checkpoint, whole)]
        indexes = [n for n in names if n.endswith(".index.json")]
        if not indexes:
            raise ValueError(
                f"{checkpoint} is not a folder containing a `.index.json` file or a {WEIGHTS_NAME} or a "
                f"{SAFE_WEIGHTS_NAME} file."
            )
        if len(indexes) > 1:
            raise ValueError(f"{checkpoint} contains more than one `.index.json` file ({indexes}); keep only one.")
        index_file = os.path.join(checkpoint, indexes[0])
    else:
        raise ValueError(
            "`checkpoint` should be the path to a file containing a whole state dict, or the index of a sharded "
            f"checkpoint, or a folder containing a sharded checkpoint or the whole state dict, but got {checkpoint}."
        )
    with open(index_file, encoding="utf-8") as handle:
        index = json.load(handle)
    weight_map = index.get("weight_map", index)
    if not isinstance(weight_map, Mapping) or not weight_map:
        raise ValueError(f"{index_file} has no `weight_map` {{tensor name: shard file}}.")
    folder = os.path.dirname(index_file)
    files = [os.path.join(folder, f) for f in sorted(set(weight_map.values()))]
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise ShardMissingError(f"{index_file} lists shard file(s) that do not exist: {missing}.")
    return files


def _iter_checkpoint_tensors(path: str) -> Iterator[tuple[str, torch.Tensor | None, Any]]:
    """Yield (name, tensor, lazy handle) per tensor of one file, one at a time.

    For safetensors files the tensor is produced only when asked for (via the handle), so tensors bound for
    "disk" are never read: the offload index points at the file instead.
    """
    if path.endswith(".safetensors"):
        with safe_open(path, framework="pt", device="cpu") as handle:
            _check_safetensors_format(path, handle.metadata())
            for key in handle.keys():
                yield key, None, handle
    else:
        state = _torch_load(path)
        for key in list(state):
            yield key, state.pop(key), None


def load_checkpoint_in_model(
    model: nn.Module,
    checkpoint: str | os.PathLike,
    device_map: dict[str, Device] | None = None,
    offload_folder: str | os.PathLike | None = None,
    dtype: str | torch.dtype | None = None,
    offload_state_dict: bool = False,
    offload_buffers: bool = False,
    keep_in_fp32_modules: list[str] | None = None,
    offload_8bit_bnb: bool = False,
    strict: bool = False,
    full_state_dict: bool = True,
    broadcast_from_rank0: bool = False,
) -> None:
    """Fill `model` (possibly built under `init_empty_weights`) from a checkpoint, tensor by tensor, placing each
    on its `device_map` device.

    Tensors mapped to "disk" are not copied when they come from a safetensors file: the offload index in
    `offload_folder` points at the original file and they are memory-mapped when a forward needs them. Other
    files' disk tensors are written to `offload_folder` as memory-mappable `.dat` files. Only one tensor is
    materialized at a time, so `offload_state_dict` (kept for compatibility) adds nothing.

    Raises ValueError for a checkpoint that lacks tensors the model needs (when those tensors have no data,
    i.e. are on "meta", or always with `strict=True`), for unexpected keys with `strict=True`, and for a
    device map with "disk" but no `offload_folder`.
    """
    from .offload import offload_weight, save_offload_index

    if offload_8bit_bnb:
        raise NotImplementedError("offload_8bit_bnb needs bitsandbytes quantization, which nbaccel does not ship.")
    if broadcast_from_rank0:
        _load_broadcast_from_rank0(model, checkpoint, strict=strict, full_state_dict=full_state_dict)
        return
    tied = find_tied_parameters(model)
    if device_map is not None:
        check_device_map(model, device_map)
        check_devices_exist(device_map)
        check_tied_parameters_on_same_device(tied, device_map)
    uses_disk = device_map is not None and "disk" in device_map.values()
    if uses_disk:
        if offload_folder is None:
            raise ValueError(
                "At least one of the model submodule will be offloaded to disk, please pass along an "
                "`offload_folder`."
            )
        os.makedirs(offload_folder, exist_ok=True)
    dtype = _as_dtype(dtype)
    fp32_names = _as_class_list(keep_in_fp32_modules)

    state_keys = set(model.state_dict().keys())
    buffer_names = {n for n, _ in model.named_buffers()}
    aliases = {name: group for group in tied for name in group}
    loaded: set[str] = set()
    unexpected: list[str] = []
    offload_index: dict[str, dict] = {}

    for path in _checkpoint_files(checkpoint):
        for key, tensor, handle in _iter_checkpoint_tensors(path):
            if key not in state_keys and key not in aliases:
                unexpected.append(key)
                continue
            target_dtype = dtype
            # as in Accelerate, the modules kept in float32 are kept so only against float16 (bfloat16 has
            # float32's range, so they follow `dtype` there)
            if dtype == torch.float16 and any(key == m or key.startswith(m + ".") or f".{m}." in f".{key}"
                                         for m in fp32_names):
                target_dtype = torch.float32
            device = _device_for(key, device_map) if device_map is not None else None
            if device == "disk" and (offload_buffers or key not in buffer_names):
                names = aliases.get(key, [key])
                if handle is not None:
                    stored = handle.get_slice(key).get_dtype()
                    info = {"safetensors_file": os.path.abspath(path), "weight_name": key,
                            "dtype": _safetensors_dtype_name(stored, target_dtype)}
                    for name in names:
                        offload_index[name] = dict(info)
                else:
                    if target_dtype is not None and tensor.is_floating_point():
                        tensor = tensor.to(target_dtype)
                    offload_weight(tensor, key, offload_folder, index=offload_index)
                    for name in names:
                        if name != key:
                            offload_weight(tensor, name, offload_folder, index=offload_index)
                for name in names:
                    set_module_tensor_to_device(model, name, "meta", dtype=target_dtype)
                    loaded.add(name)
                continue
            if tensor is None:
                tensor = handle.get_tensor(key)
            if device is None or device == "disk":  # no map (or a disk buffer): keep the current device
                current = _get_attr_path(model, key)
                device = "cpu" if current.device.type == "meta" else current.device
            set_module_tensor_to_device(model, key, device, value=tensor, dtype=target_dtype)
            loaded.update(aliases.get(key, [key]))
            del tensor

    retie_parameters(model, tied)
    if offload_index:
        save_offload_index(offload_index, offload_folder)
    _report_key_mismatch(model, checkpoint, state_keys, loaded, unexpected, strict)


def _safetensors_dtype_name(stored: str, target: torch.dtype | None) -> str:
    """The torch dtype name an offloaded safetensors tensor should be read as."""
    if target is not None and stored not in ("I8", "I16", "I32", "I64", "U8", "BOOL"):
        return str(target).replace("torch.", "")
    names = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
             "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
             "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
    return names.get(stored, "float32")


def _report_key_mismatch(
    model: nn.Module, checkpoint: Any, state_keys: set[str], loaded: set[str], unexpected: list[str], strict: bool
) -> None:
    state = model.state_dict(keep_vars=True)
    missing = sorted(k for k in state_keys if k not in loaded)
    empty = [k for k in missing if state[k].device.type == "meta"]
    if empty:
        raise ValueError(
            f"The checkpoint {os.fspath(checkpoint)} has no value for {len(empty)} tensor(s) of "
            f"{model.__class__.__name__} that have no data (on the meta device): {empty[:10]}"
            f"{' ...' if len(empty) > 10 else ''}. Check that the checkpoint belongs to this model (same names), "
            "or build the model without init_empty_weights so these keep their initial values."
        )
    if strict and (missing or unexpected):
        raise StrictLoadError(
            f"strict=True and the checkpoint {os.fspath(checkpoint)} does not match {model.__class__.__name__}: "
            f"missing keys {missing[:10]}, unexpected keys {sorted(unexpected)[:10]}."
        )
    if unexpected:
        logger.warning("Some weights of the checkpoint at %s were not used when initializing %s: %s",
                       checkpoint, model.__class__.__name__, sorted(unexpected)[:20])
    if missing:
        logger.warning("Some weights of %s were not in the checkpoint at %s and keep their current values: %s",
                       model.__class__.__name__, checkpoint, missing[:20])


def _load_broadcast_from_rank0(model: nn.Module, checkpoint: Any, strict: bool, full_state_dict: bool) -> None:
    """Rank 0 reads the checkpoint; torch.distributed.checkpoint broadcasts it into every rank's model."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("broadcast_from_rank0=True needs an initialized process group (torch.distributed).")
    state: dict[str, torch.Tensor] = {}
    if dist.get_rank() == 0:
        for path in _checkpoint_files(checkpoint):
            state.update(load_state_dict(path))
    set_model_state_dict(
        model, state,
        options=StateDictOptions(full_state_dict=full_state_dict, strict=strict, broadcast_from_rank0=True),
    )


# --------------------------------------------------------------------------------------------------------------
# models with offloaded parts (hooks attached by dispatch_model / cpu_offload / disk_offload)
# --------------------------------------------------------------------------------------------------------------


def has_offloaded_params(module: nn.Module) -> bool:
    """Whether `module` has an offloading hook (its weights live in the hook's weights map, not on it)."""
    hook = getattr(module, "_hf_hook", None)
    hooks = getattr(hook, "hooks", None) or ([hook] if hook is not None else [])
    return any(getattr(h, "offload", False) for h in hooks)


def _offload_hook(module: nn.Module) -> Any:
    hook = getattr(module, "_hf_hook", None)
    for candidate in getattr(hook, "hooks", None) or [hook]:
        if getattr(candidate, "offload", False):
            return candidate
    return None


@contextlib.contextmanager
def align_module_device(module: nn.Module, execution_device: Device | None = None) -> Iterator[None]:
    """Inside the block, the direct weights of `module` are real tensors on `execution_device` (an offloaded
    module's weights are read from its hook's weights map; default device: the hook's execution device);
    afterwards they go back where they were."""
    hook = _offload_hook(module)
    if hook is not None:
        device = execution_device if execution_device is not None else hook.execution_device
        names = [n for n, _ in named_module_tensors(module, include_buffers=hook.offload_buffers,
                                                    recurse=hook.place_submodules, remove_non_persistent=True)]
        for name in names:
            set_module_tensor_to_device(module, name, device, value=hook.weights_map[name])
        try:
            yield
        finally:
            for name in names:
                set_module_tensor_to_device(module, name, "meta")
        return
    if execution_device is None:
        yield
        return
    original = {name: tensor.device for name, tensor in named_module_tensors(module)}
    for name in original:
        set_module_tensor_to_device(module, name, execution_device)
    try:
        yield
    finally:
        for name, device in original.items():
            set_module_tensor_to_device(module, name, device)


def get_state_dict_offloaded_model(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full state dict of a model with offloaded parts, on the CPU, one module brought in at a time."""
    state: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        with align_module_device(module, "cpu"):
            for key, tensor in module.state_dict(keep_vars=False).items():
                if "." in key or tensor.device.type == "meta":
                    continue  # submodules report their own tensors
                state[prefix + key] = tensor.to("cpu")
    missing = [k for k in model.state_dict() if k not in state]
    if missing:
        logger.warning("These tensors are still on the meta device and were left out: %s", missing[:20])
    return state


def is_peft_model(model: Any) -> bool:
    """True when `model`, once unwrapped from DDP/compile wrappers, is a `peft.PeftModel` (False without peft)."""
    from .imports import is_peft_available
    from .other import extract_model_from_parallel

    if not is_peft_available():
        return False
    from peft import PeftModel

    return isinstance(extract_model_from_parallel(model), PeftModel)


def check_tied_parameters_in_config(model: nn.Module) -> bool:
    """Whether a transformers `PreTrainedModel`'s config or modules ask for tied weights (False for other models).

    Looks at `tie_word_embeddings` (with an output embedding), `is_encoder_decoder` + `tie_encoder_decoder`, and
    any submodule defining `_tie_weights`, the cases `model.tie_weights()` handles.
    """
    if "PreTrainedModel" not in {cls.__name__ for cls in type(model).__mro__}:
        return False
    config = getattr(model, "config", None)
    text_config = config
    if config is not None and hasattr(config, "get_text_config"):
        text_config = config.get_text_config(decoder=True)
    word_embeddings = bool(
        text_config is not None and getattr(text_config, "tie_word_embeddings", False)
        and model.get_output_embeddings() is not None
    )
    encoder_decoder = bool(getattr(config, "is_encoder_decoder", False) and getattr(config, "tie_encoder_decoder", False))
    tied_module = any(hasattr(module, "_tie_weights") for module in model.modules())
    return word_embeddings or encoder_decoder or tied_module


def get_mixed_precision_context_manager(native_amp: bool = False, autocast_kwargs: Any = None
                                        ) -> contextlib.AbstractContextManager:
    """The autocast context of the current `AcceleratorState`'s mixed precision, or a null context.

    `native_amp=False` gives `contextlib.nullcontext()`. Otherwise fp16 autocasts to float16, bf16/fp8 to
    bfloat16, on the state's device type; `autocast_kwargs` (an `AutocastKwargs`) adds its options.
    """
    if not native_amp:
        return contextlib.nullcontext()
    # utils may not import the state layer (docs/internals.md): use the state only if the program created one.
    import sys

    state_module = sys.modules.get("nbaccel.state")
    if state_module is None or not state_module.AcceleratorState._shared_state:
        # ValueError, as Accelerate's AcceleratorState raises before an Accelerator is made
        raise ValueError("get_mixed_precision_context_manager(native_amp=True) needs the mixed precision of an "
                         "Accelerator: create `Accelerator(mixed_precision=...)` first.")
    state = state_module.AcceleratorState()
    kwargs = {} if autocast_kwargs is None else autocast_kwargs.to_kwargs()
    mixed_precision = getattr(state.mixed_precision, "value", state.mixed_precision)
    if mixed_precision == "fp16":
        kwargs["dtype"] = torch.float16
    elif mixed_precision in ("bf16", "fp8"):
        kwargs["dtype"] = torch.bfloat16
    return torch.autocast(device_type=state.device.type, **kwargs)


def get_grad_scaler(distributed_type: Any = None, **kwargs: Any) -> Any:
    """A gradient scaler for this machine: `ShardedGradScaler` under FSDP, else `torch.amp.GradScaler` for the
    accelerator type (CUDA when none is found, which torch disables with a warning on a CPU-only machine).

    `kwargs` go to the scaler (`init_scale`, `growth_factor`, ...).
    """
    from .dataclasses import DistributedType
    from .environment import get_current_device_type

    if distributed_type == DistributedType.FSDP:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(**kwargs)
    device_type, _ = get_current_device_type()
    return torch.amp.GradScaler(device_type, **kwargs)



# --- the helpers of Accelerate's infer_auto_device_map and offloading, under its names ----------------------
from .constants import WEIGHTS_INDEX_NAME  # noqa: E402,F401  (Accelerate's modeling module exposes it too)


def check_device_same(first_device: torch.device, second_device: torch.device) -> bool:
    """Whether two devices are the same, counting an accelerator without an index as index 0 (`cuda` is
    `cuda:0`, which `==` on torch devices denies)."""
    if first_device.type != second_device.type:
        return False

    def indexed(device: torch.device) -> torch.device:
        return torch.device(device.type, 0) if device.type != "cpu" and device.index is None else device

    return indexed(first_device) == indexed(second_device)


def get_module_leaves(module_sizes: Mapping[str, int]) -> list[str]:
    """The names in `module_sizes` (as `compute_module_sizes` returns) that have no child entry: the leaves."""
    parents = {name.rsplit(".", 1)[0] for name in module_sizes if name and "." in name}
    return [name for name in module_sizes if name and name not in parents]


def get_module_size_with_ties(tied_params: list[str], module_size: int, module_sizes: Mapping[str, int],
                              modules_to_treat: list[tuple[str, nn.Module]]) -> tuple[int, list[str], list[nn.Module]]:
    """The size of a module once the modules holding its tied parameters come along: `module_size` plus, for
    each tied parameter (found in one of `modules_to_treat`), that module's size less the shared tensor.
    Returns (size, names of those modules, the modules)."""
    names: list[str] = []
    modules: list[nn.Module] = []
    size = module_size
    for tied in tied_params:
        holders = [(n, m) for n, m in modules_to_treat if tied.startswith(n + ".")]
        if not holders:  # an IndexError, as Accelerate's
            raise IndexError(f"no module left to place holds the tied parameter {tied!r}")
        name, module = holders[0]
        names.append(name)
        modules.append(module)
        size += module_sizes[name] - module_sizes[tied]
    return size, names, modules


def fallback_allocate(modules: list[tuple[str, nn.Module]], module_sizes: Mapping[str, int], size_limit: int | str,
                      no_split_module_classes: list[str] | None = None,
                      tied_parameters: list[list[str]] | None = None
                      ) -> tuple[str | None, nn.Module | None, list[tuple[str, nn.Module]]]:
    """Breadth-first, the first module (or part of a splittable one) of `modules` that fits in `size_limit`
    with its tied parameters. Returns its name, itself, and `modules` with it taken out (its parents replaced
    by their remaining parts); (None, None, modules) when nothing fits."""
    try:
        limit = convert_file_size_to_int(size_limit)
    except ValueError:
        return None, None, modules
    no_split = set(no_split_module_classes or [])
    tied_groups = tied_parameters or []
    queue = list(modules)
    while queue:
        name, module = queue.pop(0)
        outside = _tied_elsewhere(name, tied_groups)
        size, _, _ = get_module_size_with_ties(outside, module_sizes[name], module_sizes, queue)
        if size <= limit:
            break
        children = [] if isinstance(module, torch.Tensor) else list(module.named_children())
        if not children or type(module).__name__ in no_split:
            continue
        parts = list(module.named_parameters(recurse=False)) + children
        queue = [(f"{name}.{n}", v) for n, v in parts] + queue
    else:
        return None, None, modules
    remaining = list(modules)
    for cut in [i for i, c in enumerate(name) if c == "."]:  # open the parents of the found part
        parent = name[:cut]
        names = [n for n, _ in remaining]
        if parent in names:
            index = names.index(parent)
            holder = remaining[index][1]
            parts = list(holder.named_parameters(recurse=False)) + list(holder.named_children())
            remaining = remaining[:index] + [(f"{parent}.{n}", v) for n, v in parts] + remaining[index + 1:]
    remaining = [(n, m) for n, m in remaining if n != name]
    return name, module, remaining


def get_state_dict_from_offload(module: nn.Module, module_name: str, state_dict: dict[str, Any],
                                device_to_put_offload: int | str | torch.device = "cpu") -> dict[str, Any]:
    """Fill `state_dict`'s entries for `module` (named by one of its tensors, `module_name`, e.g.
    "encoder.weight") with its real tensors, loaded onto `device_to_put_offload` when the module is offloaded."""
    root = module_name[: module_name.rfind(".")]
    device = device_to_put_offload if has_offloaded_params(module) else None
    with align_module_device(module, device):
        for key, tensor in module.state_dict().items():
            if f"{root}.{key}" in state_dict:
                state_dict[f"{root}.{key}"] = tensor
    return state_dict
