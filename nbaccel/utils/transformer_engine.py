"""`accelerate.utils.transformer_engine` under its names. nbaccel's fp8 runs through torchao; Transformer
Engine's model conversion is not driven by nbaccel, so those functions raise (see `nbaccel.utils.integration`).
`has_transformer_engine_layers` answers for real."""

from __future__ import annotations

import importlib.util
from typing import Any

from .integration import TRANSFORMER_ENGINE

__all__ = ["apply_fp8_autowrap", "contextual_fp8_autocast", "convert_model", "has_transformer_engine_layers"]

apply_fp8_autowrap = TRANSFORMER_ENGINE.function("apply_fp8_autowrap")
contextual_fp8_autocast = TRANSFORMER_ENGINE.function("contextual_fp8_autocast")
convert_model = TRANSFORMER_ENGINE.function("convert_model")


def has_transformer_engine_layers(model: Any) -> bool:
    """Whether `model` contains Transformer Engine layers (False when Transformer Engine is not installed)."""
    if importlib.util.find_spec("transformer_engine") is None:
        return False
    import transformer_engine.pytorch as te

    return any(isinstance(m, (te.LayerNorm, te.Linear, te.TransformerLayer)) for m in model.modules())
