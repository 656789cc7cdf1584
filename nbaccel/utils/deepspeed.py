"""`accelerate.utils.deepspeed` under its names. DeepSpeed is not driven by nbaccel: every name imports, and
using one raises (ImportError naming deepspeed when it is absent; see `nbaccel.utils.integration`)."""

from __future__ import annotations

from .integration import DEEPSPEED

_CLASSES = ["DeepSpeedEngineWrapper", "DeepSpeedOptimizerWrapper", "DeepSpeedSchedulerWrapper", "DummyOptim",
            "DummyScheduler", "HfDeepSpeedConfig"]
_FUNCTIONS = ["get_active_deepspeed_plugin", "map_pytorch_optim_to_deepspeed"]
globals().update({name: DEEPSPEED.cls(name, __name__) for name in _CLASSES})
globals().update({name: DEEPSPEED.function(name) for name in _FUNCTIONS})
__all__ = _CLASSES + _FUNCTIONS
