"""Helpers over nested data: lists, tuples, namedtuples, dicts and Mapping subclasses holding tensors.

Every helper rebuilds containers with their own type (a namedtuple stays that namedtuple, an OrderedDict
or a `BatchEncoding` stays what it was), so code that walks a batch or a model output gets back the shape
it gave. These are local operations: nothing here communicates between processes.
"""

from __future__ import annotations

import collections
import copy
import functools
import pickle
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import Any

import torch

from .dataclasses import TensorInformation


def is_torch_tensor(tensor: Any) -> bool:
    """True for a `torch.Tensor` (parameters and subclasses included)."""
    return isinstance(tensor, torch.Tensor)


def is_tensor_information(tensor_info: Any) -> bool:
    """True for a `TensorInformation` (the shape and dtype placeholders of `get_data_structure`)."""
    return isinstance(tensor_info, TensorInformation)


def is_namedtuple(data: Any) -> bool:
    """True for an instance of a `collections.namedtuple` / `typing.NamedTuple` class."""
    return isinstance(data, tuple) and hasattr(data, "_asdict") and hasattr(data, "_fields")


def honor_type(obj: Any, generator: Any) -> Any:
    """Build a container of `obj`'s type (list, tuple, namedtuple, subclass) from the items of `generator`."""
    if is_namedtuple(obj):
        return type(obj)(*list(generator))
    return type(obj)(generator)


def honor_mapping(obj: Mapping, items: dict) -> Mapping:
    """Build a mapping of `obj`'s type holding `items` (defaultdict keeps its factory)."""
    kind = type(obj)
    if kind is dict:
        return items
    if isinstance(obj, collections.defaultdict):
        return kind(obj.default_factory, items)
    try:
        return kind(items)
    except TypeError:
        if isinstance(obj, MutableMapping):
            rebuilt = copy.copy(obj)
            rebuilt.clear()
            rebuilt.update(items)
            return rebuilt
        raise TypeError(
            f"cannot rebuild a {kind.__name__}: its constructor does not accept a dict of items. "
            "Pass a dict (or a Mapping whose constructor takes one) instead."
        ) from None


def recursively_apply(
    func: Callable[..., Any],
    data: Any,
    *args: Any,
    test_type: Callable[[Any], bool] = is_torch_tensor,
    error_on_other_type: bool = False,
    **kwargs: Any,
) -> Any:
    """Apply `func(leaf, *args, **kwargs)` to every leaf of `data` for which `test_type(leaf)` is true.

    Containers keep their type. Other leaves are returned unchanged, or raise a TypeError naming where they
    are when `error_on_other_type` is true.
    """
    return _apply(func, data, args, kwargs, test_type, error_on_other_type, "data")


def _apply(func, data, args, kwargs, test_type, error_on_other_type, path):
    if isinstance(data, (tuple, list)):
        return honor_type(
            data,
            (
                _apply(func, item, args, kwargs, test_type, error_on_other_type, f"{path}[{i}]")
                for i, item in enumerate(data)
            ),
        )
    if isinstance(data, Mapping):
        return honor_mapping(
            data,
            {
                key: _apply(func, value, args, kwargs, test_type, error_on_other_type, f"{path}[{key!r}]")
                for key, value in data.items()
            },
        )
    if test_type(data):
        return func(data, *args, **kwargs)
    if error_on_other_type:
        name = getattr(func, "__name__", repr(func))
        raise TypeError(  # starts with the phrase Accelerate's message starts with (code may match on it)
            f"Unsupported types ({type(data)}) passed to `{name}`: {path} is a {type(data).__name__}; pass nested "
            f"lists, tuples and dicts of objects accepted by `{getattr(test_type, '__name__', test_type)}`."
        )
    return data


def iter_leaves(data: Any, path: str = "data") -> Iterator[tuple[str, Any]]:
    """Yield `(path, leaf)` for every non-container leaf of `data`, e.g. `("data['labels'][1]", value)`."""
    if isinstance(data, (tuple, list)):
        for i, item in enumerate(data):
            yield from iter_leaves(item, f"{path}[{i}]")
    elif isinstance(data, Mapping):
        for key, value in data.items():
            yield from iter_leaves(value, f"{path}[{key!r}]")
    else:
        yield path, data


def flatten_tensors(data: Any, out: list[torch.Tensor]) -> bool:
    """Append every tensor leaf of `data` to `out` in traversal order; False if a non-tensor leaf exists."""
    if isinstance(data, torch.Tensor):
        out.append(data)
        return True
    if isinstance(data, (tuple, list)):
        items = data
    elif isinstance(data, Mapping):
        items = data.values()
    else:
        return False
    ok = True
    for item in items:  # tensors inline: this runs on every collective
        if isinstance(item, torch.Tensor):
            out.append(item)
        elif not flatten_tensors(item, out):
            ok = False
    return ok


def plain_items(data: Any) -> list[Any] | None:
    """The items of a plain dict (its values), list or tuple, in order; None for anything else (subclasses
    included: they keep their own rebuild)."""
    kind = type(data)
    if kind is dict:
        return list(data.values())
    if kind is list or kind is tuple:
        return list(data)
    return None


def flat_tensors(data: Any) -> list[torch.Tensor] | None:
    """The items of a plain dict, list or tuple when every one is a tensor, else None.

    The common shape of what is gathered (a dict of outputs, a tuple of predictions and labels): such a
    container needs neither a walk to find its tensors nor one to rebuild it (see `rebuild_flat`)."""
    items = plain_items(data)
    if items is None:
        return None
    tensor = torch.Tensor
    for item in items:
        if not isinstance(item, tensor):
            return None
    return items


def rebuild_flat(data: Any, leaves: list[Any]) -> Any:
    """`data` (for which `flat_tensors` returned a list) with its items replaced by `leaves`, in order."""
    if type(data) is dict:
        return dict(zip(data, leaves))
    return leaves if type(data) is list else tuple(leaves)


def rebuild(data: Any, leaves: Iterator[Any]) -> Any:
    """The structure of `data` with each tensor leaf replaced by the next item of `leaves`."""
    if isinstance(data, torch.Tensor):
        return next(leaves)
    if isinstance(data, (tuple, list)):
        return honor_type(data, [next(leaves) if isinstance(x, torch.Tensor) else rebuild(x, leaves) for x in data])
    if isinstance(data, Mapping):
        return honor_mapping(
            data, {k: next(leaves) if isinstance(v, torch.Tensor) else rebuild(v, leaves) for k, v in data.items()}
        )
    return data


def send_to_device(
    tensor: Any, device: Any, non_blocking: bool = False, skip_keys: list[str] | str | None = None
) -> Any:
    """Move every tensor (or object with `.to`) of a nested structure to `device`.

    Dict entries whose key is in `skip_keys` stay where they are.
    """
    if isinstance(tensor, torch.Tensor) or hasattr(tensor, "to"):  # objects with `.to` (BatchEncoding) move themselves
        try:
            return tensor.to(device, non_blocking=non_blocking)
        except TypeError:  # a `.to` that does not take non_blocking
            return tensor.to(device)
    if isinstance(tensor, (tuple, list)):
        return honor_type(
            tensor, [send_to_device(t, device, non_blocking=non_blocking, skip_keys=skip_keys) for t in tensor]
        )
    if isinstance(tensor, Mapping):
        if isinstance(skip_keys, str):
            skip_keys = [skip_keys]
        skip = set(skip_keys or ())
        return honor_mapping(
            tensor,
            {
                k: t if k in skip else send_to_device(t, device, non_blocking=non_blocking, skip_keys=skip_keys)
                for k, t in tensor.items()
            },
        )
    return tensor


def get_data_structure(data: Any) -> Any:
    """The structure of `data` with a `TensorInformation(shape, dtype)` in place of each tensor."""
    return recursively_apply(lambda t: TensorInformation(shape=t.shape, dtype=t.dtype), data)


def get_shape(data: Any) -> Any:
    """The structure of `data` with the shape (a list of ints) in place of each tensor."""
    return recursively_apply(lambda t: list(t.shape), data)


def initialize_tensors(data_structure: Any) -> Any:
    """Uninitialized tensors in place of each `TensorInformation` of `data_structure` (see `get_data_structure`)."""
    return recursively_apply(
        lambda info: torch.empty(tuple(info.shape), dtype=info.dtype), data_structure, test_type=is_tensor_information
    )


class NothingToIndexError(TypeError, IndexError):
    """`find_batch_size` of a 0-dim tensor, `concatenate` of an empty list: Accelerate's code indexes there and
    raises IndexError, so this is one (code written for Accelerate catches it); a TypeError too, as nbaccel's
    error was before."""


def find_batch_size(data: Any) -> int:
    """The size of dim 0 of the first tensor of `data` (first item of lists, first value of dicts)."""
    if isinstance(data, (tuple, list, Mapping)) and len(data) == 0:
        raise ValueError(f"cannot find the batch size of an empty {type(data).__name__}.")
    if isinstance(data, (tuple, list)):
        return find_batch_size(data[0])
    if isinstance(data, Mapping):
        return find_batch_size(next(iter(data.values())))
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"can only find the batch size of tensors, got a {type(data).__name__}.")
    if data.ndim == 0:
        raise NothingToIndexError("cannot find the batch size of a 0-dim tensor (it has no dim 0).")
    return data.shape[0]


def ignorant_find_batch_size(data: Any) -> int | None:
    """`find_batch_size`, or None where it would raise."""
    try:
        return find_batch_size(data)
    except (ValueError, TypeError):
        return None


def listify(data: Any) -> Any:
    """The structure of `data` with Python numbers (nested lists) in place of each tensor."""

    def _to_list(tensor: torch.Tensor) -> Any:
        tensor = tensor.detach().cpu()
        if tensor.dtype == torch.bfloat16:  # NumPy, which tolist goes through for some dtypes, has no bfloat16
            tensor = tensor.float()
        return tensor.tolist()

    return recursively_apply(_to_list, data)


def find_device(data: Any) -> torch.device | None:
    """The device of the first tensor found in `data`, or None."""
    if isinstance(data, torch.Tensor):
        return data.device
    if isinstance(data, Mapping):
        data = data.values()
    elif not isinstance(data, (tuple, list)):
        return None
    for item in data:
        device = find_device(item)
        if device is not None:
            return device
    return None


def slice_tensors(data: Any, tensor_slice: Any, process_index: int | None = None, num_processes: int | None = None) -> Any:
    """`tensor[tensor_slice]` for every tensor of `data` (`process_index`/`num_processes`: accepted, unused)."""
    return recursively_apply(lambda t: t[tensor_slice], data)


def concatenate(data: list | tuple, dim: int = 0) -> Any:
    """Concatenate a list of structures of the same shape into one structure, tensor by tensor, along `dim`.

    A list holding a single non-tensor batch is returned as that batch.
    """
    if not isinstance(data, (tuple, list)):
        raise TypeError(f"concatenate needs a non-empty list of batches, got {type(data).__name__}.")
    if len(data) == 0:
        raise NothingToIndexError(f"concatenate needs a non-empty list of batches, got an empty {type(data).__name__}.")
    first = data[0]
    if isinstance(first, (tuple, list)):
        return honor_type(first, [concatenate([d[i] for d in data], dim=dim) for i in range(len(first))])
    if isinstance(first, Mapping):
        return honor_mapping(first, {k: concatenate([d[k] for d in data], dim=dim) for k in first.keys()})
    if isinstance(first, torch.Tensor):
        return torch.cat(list(data), dim=dim)
    if len(data) == 1:
        return first
    raise TypeError(f"can only concatenate tensors, got a {type(first).__name__}.")


def pad_input_tensors(tensor: Any, batch_size: int, num_processes: int, dim: int = 0) -> Any:
    """Zero-pad every tensor along `dim` to the smallest multiple of `num_processes` that holds `batch_size`.

    E.g. a (3, 4, 4) batch for 4 processes becomes (4, 4, 4), so each process gets one row.
    """
    if num_processes < 1:
        raise ValueError(f"num_processes must be >= 1, got {num_processes}.")
    target = max(-(-batch_size // num_processes), 1) * num_processes

    def _pad(t: torch.Tensor) -> torch.Tensor:
        if t.ndim == 0 or t.shape[dim] >= target:
            return t
        shape = list(t.shape)
        old = shape[dim]
        shape[dim] = target
        padded = t.new_zeros(shape)
        padded.narrow(dim, 0, old).copy_(t)
        return padded

    return recursively_apply(_pad, tensor, error_on_other_type=True)


def convert_to_fp32(tensor: Any) -> Any:
    """Every float16/bfloat16 tensor of a nested structure cast to float32; other leaves unchanged."""

    def _is_half(t: Any) -> bool:
        return hasattr(t, "dtype") and t.dtype in (torch.float16, torch.bfloat16)

    return recursively_apply(lambda t: t.float(), tensor, test_type=_is_half)


class ConvertOutputsToFp32:
    """Wraps a forward function so that its half-precision outputs come back in float32."""

    def __init__(self, model_forward: Callable[..., Any]) -> None:
        self.model_forward = model_forward
        functools.update_wrapper(self, model_forward)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return convert_to_fp32(self.model_forward(*args, **kwargs))

    def __getstate__(self) -> Any:
        raise pickle.PicklingError(
            "cannot pickle a model whose forward converts mixed-precision outputs to float32: unwrap it first "
            "with `accelerator.unwrap_model(model)`."
        )


def convert_outputs_to_fp32(model_forward: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a forward function so its float16/bfloat16 outputs are returned as float32."""
    wrapped = ConvertOutputsToFp32(model_forward)

    def forward(*args: Any, **kwargs: Any) -> Any:
        return wrapped(*args, **kwargs)

    forward.__wrapped__ = wrapped  # lets extract_model_from_parallel pop the wrapper
    return forward
