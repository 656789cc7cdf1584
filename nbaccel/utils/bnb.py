"""`accelerate.utils.bnb` under its names. Quantized loading with bitsandbytes is not driven by nbaccel (see
docs/compat.md): `load_and_quantize_model` and the layer replacement raise (see `nbaccel.utils.integration`);
the inspection helpers answer for real."""

from __future__ import annotations

import importlib.util
from typing import Any

from .integration import BITSANDBYTES

__all__ = ["get_keys_to_not_convert", "get_parameter_device", "get_quantized_model_device_map",
           "has_4bit_bnb_layers", "load_and_quantize_model", "quantize_and_offload_8bit", "replace_with_bnb_layers"]

load_and_quantize_model = BITSANDBYTES.function("load_and_quantize_model")
get_quantized_model_device_map = BITSANDBYTES.function("get_quantized_model_device_map")
quantize_and_offload_8bit = BITSANDBYTES.function("quantize_and_offload_8bit")
replace_with_bnb_layers = BITSANDBYTES.function("replace_with_bnb_layers")


def has_4bit_bnb_layers(model: Any) -> bool:
    """Whether `model` contains bitsandbytes 4-bit linear layers (False when bitsandbytes is not installed)."""
    if importlib.util.find_spec("bitsandbytes") is None:
        return False
    import bitsandbytes as bnb

    return any(isinstance(module, bnb.nn.Linear4bit) for module in model.modules())


def get_parameter_device(parameter: Any) -> Any:
    """The device of the first parameter of a module."""
    return next(parameter.parameters()).device


def get_keys_to_not_convert(model: Any) -> list[str]:
    """Module names to keep in full precision when quantizing: the output head and whatever is tied to an input
    embedding (quantizing those hurts accuracy). Returns names without their `.weight`/`.bias` suffix."""
    from .modeling import find_tied_parameters

    tied = find_tied_parameters(model)
    tied_names = [name for group in tied for name in group[1:]] if tied else []
    named = list(model.named_children())
    last = [named[-1][0]] if named else []
    keep = set(tied_names) | set(last)
    cleaned = []
    for name in sorted(keep):
        for suffix in (".weight", ".bias"):
            name = name.removesuffix(suffix)
        cleaned.append(name)
    return sorted(set(cleaned))
