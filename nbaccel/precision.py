"""Mixed precision: validating the mode, the autocast context, the fp16 gradient scaler, fp8 backends.

`Accelerator` composes these; they hold no state of their own. bf16 and fp16 use `torch.autocast` on the
device's type (CPU autocast supports both in current torch), fp16 adds a `torch.amp.GradScaler` for that
device type. fp8 needs an external backend; without one the error says which package to install.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import types
from collections.abc import Callable
from typing import Any

import torch

from .utils.dataclasses import PrecisionType
from .utils.operations import convert_to_fp32

FP8_BACKENDS = {"AO": "torchao", "TE": "transformer_engine", "MSAMP": "msamp"}
DRIVEN_FP8_BACKENDS = ("AO",)  # nbaccel converts models for fp8 through torchao only


def validate_mixed_precision(mixed_precision: Any, any_case: bool = True) -> str:
    """Return the mode as its string ("no", "fp16", "bf16", "fp8"), or raise naming the allowed values.
    `any_case=False`: "BF16" is refused, as Accelerator's argument is in Accelerate (its environment variable
    and AcceleratorState's argument are read in any case there)."""
    value = "no" if mixed_precision is None else str(mixed_precision)
    value = value.lower() if any_case else value
    if value not in PrecisionType:
        raise ValueError(f"Unknown mixed_precision={mixed_precision!r}: choose one of {PrecisionType.list()}.")
    return value


class FP8BackendMissingError(ImportError, ValueError):
    """mixed_precision="fp8" without a backend nbaccel drives: an ImportError (a package is missing) that is
    also the ValueError Accelerate raises there, so code written for either catches it."""


def find_fp8_backend(preferred: str | None = None) -> str:
    """The fp8 backend to use ("AO": torchao), or FP8BackendMissingError naming what to install.

    Accelerate also drives transformer_engine and MS-AMP; nbaccel converts models with torchao's
    `convert_to_float8_training`, so those two give an error that says so.
    """
    name = (preferred or "AO").upper()
    if name not in FP8_BACKENDS:
        raise ValueError(f"Unknown fp8 backend {preferred!r}: choose one of {list(FP8_BACKENDS)}.")
    if name not in DRIVEN_FP8_BACKENDS:
        raise FP8BackendMissingError(
            f"fp8 backend {name} ({FP8_BACKENDS[name]}) is not driven by nbaccel: use the torchao backend "
            "(`pip install torchao`, AORecipeKwargs) or run this script with Hugging Face Accelerate."
        )
    if importlib.util.find_spec("torchao") is None:
        raise FP8BackendMissingError(
            "mixed_precision='fp8' needs an fp8 backend, and none nbaccel drives is installed: install `torchao` "
            "(`pip install torchao`; nbaccel does not drive `transformer_engine` or `msamp`), or use "
            "mixed_precision='bf16'."
        )
    return name


def convert_to_fp8(model: torch.nn.Module, recipe: Any = None) -> torch.nn.Module:
    """Swap `model`'s Linear layers for torchao's float8 training layers (not the first and last layers,
    and only those whose dimensions are multiples of 16, which float8 matmuls need)."""
    from torchao.float8 import convert_to_float8_training

    linears = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    edges = {linears[0], linears[-1]} if linears else set()

    def keep(module: torch.nn.Module, name: str) -> bool:
        if not isinstance(module, torch.nn.Linear) or name in edges:
            return False
        return module.in_features % 16 == 0 and module.out_features % 16 == 0

    config = getattr(recipe, "config", None)
    kwargs = {"config": config} if config is not None else {}
    convert_to_float8_training(model, module_filter_fn=keep, **kwargs)
    return model


def autocast_dtype(mixed_precision: str) -> torch.dtype | None:
    """The dtype autocast runs the forward in for this mode (fp8 runs the non-fp8 parts in bf16)."""
    return {"fp16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.bfloat16}.get(mixed_precision)


def autocast_context(
    device_type: str, mixed_precision: str, enabled: bool = True, cache_enabled: bool | None = None
) -> contextlib.AbstractContextManager:
    """A fresh `torch.autocast` for the mode on `device_type`, or a null context for "no".

    `enabled=False` (AutocastKwargs(enabled=False)) is a disabled `torch.autocast`, not a null context: inside an
    enclosing autocast block it turns autocast off, which is what the handler is for (fp32 for part of a model)."""
    dtype = autocast_dtype(mixed_precision)
    if dtype is None:
        return contextlib.nullcontext()
    kwargs = {} if cache_enabled is None else {"cache_enabled": cache_enabled}
    return torch.autocast(device_type=device_type, dtype=dtype, enabled=enabled, **kwargs)


def make_grad_scaler(mixed_precision: str, device_type: str, scaler_kwargs: dict | None = None):
    """A `torch.amp.GradScaler` for fp16 on `device_type`, else None (bf16 and fp32 need no scaling)."""
    if mixed_precision != "fp16":
        return None
    return torch.amp.GradScaler(device_type, **(scaler_kwargs or {}))


_WRAPPED_MARK = "_nbaccel_autocast_forward"


def wrap_forward(model: torch.nn.Module, make_context: Callable[[], contextlib.AbstractContextManager]) -> None:
    """Make `model`'s forward run under `make_context()` and return fp32 outputs (idempotent).

    The class's forward becomes a method bound to the model, as in Accelerate: `inspect.signature(model.forward)`
    still names the model's arguments (code that picks the inputs a forward takes reads it), `copy.deepcopy`
    binds the copy's forward to the copy, and pickling the model (`torch.save(model)`) stores no wrapper. The
    original forward stays reachable as `model._original_forward`, Accelerate's name, for `unwrap_model`.
    """
    current = model.forward
    if getattr(current, _WRAPPED_MARK, False):
        return
    model._original_forward = current
    if getattr(current, "__self__", None) is model:  # the class's forward (or a method bound to the model)
        function = current.__func__

        @functools.wraps(function)
        def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            with make_context():
                return convert_to_fp32(function(self, *args, **kwargs))

        setattr(forward, _WRAPPED_MARK, True)
        model.forward = types.MethodType(forward, model)
        return

    @functools.wraps(current)  # a callable set on the instance (hooks): wrap it as it is
    def plain_forward(*args: Any, **kwargs: Any) -> Any:
        with make_context():
            return convert_to_fp32(current(*args, **kwargs))

    setattr(plain_forward, _WRAPPED_MARK, True)
    model.forward = plain_forward


def unwrap_forward(model: torch.nn.Module) -> None:
    """Undo `wrap_forward`: the model's forward runs in its own precision again."""
    wrapper = model.__dict__.get("forward")
    if not getattr(wrapper, _WRAPPED_MARK, False):
        return
    original = wrapper.__func__.__wrapped__ if isinstance(wrapper, types.MethodType) else wrapper.__wrapped__
    del model.forward
    model.__dict__.pop("_original_forward", None)
    if isinstance(wrapper, types.MethodType):
        if original is not getattr(type(model), "forward", None):  # a method the user had bound to the instance
            model.forward = types.MethodType(original, model)
    else:
        model.forward = original
