"""Where the training modules get the states, the collectives and the configuration classes.

TEMPORARY: while `nbaccel.utils.operations` is being written on another branch, its names come from the
private stand-ins in `nbaccel._standins`. Once they are merged every name below resolves to the real module and this
file shrinks to plain imports.
"""

from __future__ import annotations

from .state import AcceleratorState, GradientState, PartialState

try:
    from .utils.operations import (
        broadcast,
        broadcast_object_list,
        convert_outputs_to_fp32,
        gather,
        gather_object,
        pad_across_processes,
        recursively_apply,
        reduce,
        send_to_device,
    )
except ImportError:  # stand-in until nbaccel.utils.operations lands
    from ._standins import (
        broadcast,
        broadcast_object_list,
        convert_outputs_to_fp32,
        gather,
        gather_object,
        pad_across_processes,
        recursively_apply,
        reduce,
        send_to_device,
    )

from .utils.dataclasses import (
    AutocastKwargs,
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
    ProjectConfiguration,
    TorchDynamoPlugin,
)

__all__ = [
    "AcceleratorState", "AutocastKwargs", "DataLoaderConfiguration", "DistributedDataParallelKwargs",
    "GradScalerKwargs", "GradientAccumulationPlugin", "GradientState", "InitProcessGroupKwargs",
    "KwargsHandler", "PartialState", "ProjectConfiguration", "TorchDynamoPlugin", "broadcast",
    "broadcast_object_list", "convert_outputs_to_fp32", "gather", "gather_object", "pad_across_processes",
    "recursively_apply", "reduce", "send_to_device",
]
