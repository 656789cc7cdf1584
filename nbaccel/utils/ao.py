"""`accelerate.utils.ao`: torchao's float8 training helpers, under Accelerate's names.

`convert_model_to_fp8_ao` swaps a model's `nn.Linear` layers for torchao's `Float8Linear` (keeping the first and
last linear layer, and any layer whose sizes are not multiples of 16, in full precision, for stability). It
and `has_ao_layers` need torchao (`pip install torchao`); the filters are plain torch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from .imports import torchao_required

__all__ = ["convert_model_to_fp8_ao", "filter_first_and_last_linear_layers", "filter_linear_layers",
           "find_first_last_linear_layers", "has_ao_layers"]


def find_first_last_linear_layers(model: Any) -> tuple[str | None, str | None]:
    """The qualified names of the first and the last `nn.Linear` of `model` (None when it has none)."""
    import torch

    names = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    return (names[0], names[-1]) if names else (None, None)


def filter_linear_layers(module: Any, fqn: str, layers_to_filter: list[str]) -> bool:
    """Whether `module` (named `fqn`) may become fp8: not listed in `layers_to_filter`, and, for a linear layer,
    with in and out features divisible by 16 (what fp8 matmuls need)."""
    import torch

    if isinstance(module, torch.nn.Linear) and (module.in_features % 16 or module.out_features % 16):
        return False
    return fqn not in layers_to_filter


def filter_first_and_last_linear_layers(module: Any, fqn: str) -> bool:
    """`filter_linear_layers` keeping `module`'s own first and last linear layers in full precision."""
    first, last = find_first_last_linear_layers(module)
    return filter_linear_layers(module, fqn, layers_to_filter=[first, last])


@torchao_required
def has_ao_layers(model: Any) -> bool:
    """Whether `model` holds torchao `Float8Linear` layers."""
    from torchao.float8.float8_linear import Float8Linear

    return any(isinstance(module, Float8Linear) for module in model.modules())


@torchao_required
def convert_model_to_fp8_ao(model: Any, config: Any = None,
                            module_filter_func: Callable[[Any, str], bool] | None = None) -> None:
    """Convert `model`'s linear layers to torchao `Float8Linear` in place (`config`: a torchao
    `Float8LinearConfig`; `module_filter_func(module, fqn)` picks the layers, default: all but the first and last
    linear layer and those whose sizes are not multiples of 16)."""
    from torchao.float8 import convert_to_float8_training

    if module_filter_func is None:
        first, last = find_first_last_linear_layers(model)
        module_filter_func = functools.partial(filter_linear_layers, layers_to_filter=[first, last])
    convert_to_float8_training(model, module_filter_fn=module_filter_func, config=config)
