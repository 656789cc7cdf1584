"""Mixed precision: validating the mode, the autocast context, the fp16 gradient scaler, fp8 backends.

`Accelerator` composes these; they hold no state of their own. bf16 and fp16 use `torch.autocast` on the
device's type (CPU autocast supports both in current torch), fp16 adds a `torch.amp.GradScaler` for that
device type. fp8 needs an external backend; without one the error says which package to install.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Callable
from typing import Any

import torch

from .utils.dataclasses import PrecisionType
from .utils.operations import convert_outputs_to_fp32

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


def find_fp8_backend(preferred: str | None = None) -> str:
    """The fp8 backend to use ("AO": torchao), or ImportError naming what to install.

    Accelerate also drives transformer_engine and MS-AMP; nbaccel converts models with torchao's
    `convert_to_float8_training`, so those two give an error that says so.
    """
    name = (preferred or "AO").upper()
    if name not in FP8_BACKENDS:
        raise ValueError(f"Unknown fp8 backend {preferred!r}: choose one of {list(FP8_BACKENDS)}.")
    if name not in DRIVEN_FP8_BACKENDS:
        raise ImportError(
            f"fp8 backend {name} ({FP8_BACKENDS[name]}) is not driven by nbaccel: use the torchao backend "
            "(`pip install torchao`, AORecipeKwargs) or run this script with Hugging Face Accelerate."
        )
    if importlib.util.find_spec("torchao") is None:
        raise ImportError(
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
    """A fresh `torch.autocast` for the mode on `device_type`, or a null context for "no"."""
    dtype = autocast_dtype(mixed_precision)
    if dtype is None or not enabled:
        return contextlib.nullcontext()
    kwargs = {} if cache_enabled is None else {"cache_enabled": cache_enabled}
    return torch.autocast(device_type=device_type, dtype=dtype, **kwargs)


def make_grad_scaler(mixed_precision: str, device_type: str, scaler_kwargs: dict | None = None):
    """A `torch.amp.GradScaler` for fp16 on `device_type`, else None (bf16 and fp32 need no scaling)."""
    if mixed_precision != "fp16":
        return None
    return torch.amp.GradScaler(device_type, **(scaler_kwargs or {}))


class AutocastForward:
    """A model's forward run under autocast, with floating outputs returned in fp32.

    Set as the instance attribute `model.forward`; the original bound forward stays reachable as
    `.original` (and as `model._original_forward`, Accelerate's name) so `unwrap_model` can restore it.
    """

    def __init__(self, forward: Callable, make_context: Callable[[], contextlib.AbstractContextManager]):
        self.original = forward
        self.make_context = make_context
        self._fp32 = convert_outputs_to_fp32(self._run)

    def _run(self, *args: Any, **kwargs: Any) -> Any:
        with self.make_context():
            return self.original(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._fp32(*args, **kwargs)


def wrap_forward(model: torch.nn.Module, make_context: Callable[[], contextlib.AbstractContextManager]) -> None:
    """Make `model`'s forward run under `make_context()` and return fp32 outputs (idempotent)."""
    if isinstance(model.__dict__.get("forward"), AutocastForward):
        return
    model._original_forward = model.forward
    model.forward = AutocastForward(model.forward, make_context)


def unwrap_forward(model: torch.nn.Module) -> None:
    """Undo `wrap_forward`: the model's forward runs in its own precision again."""
    wrapper = model.__dict__.get("forward")
    if isinstance(wrapper, AutocastForward):
        original = wrapper.original
        del model.forward
        if getattr(original, "__self__", None) is not model:  # a forward the user had set on the instance
            model.forward = original
        model.__dict__.pop("_original_forward", None)
