"""nbaccel: the Accelerate API, notebook-first.

Every public name is listed here and loaded from its home module on first use; so is every submodule
(`nbaccel.utils`, `nbaccel.state`, ...), reachable as an attribute after a bare `import nbaccel`.
"""

from ._lazy import lazy_namespace
from .launch import views as _launch_views

__version__ = "0.1.0"

_OPERATIONS = [
    "broadcast", "broadcast_object_list", "concatenate", "convert_outputs_to_fp32", "convert_to_fp32",
    "copy_tensor_to_devices", "find_batch_size", "find_device", "gather", "gather_object",
    "get_data_structure", "honor_type", "is_tensor_information", "is_torch_tensor", "pad_across_processes",
    "recursively_apply", "reduce", "send_to_device", "slice_tensors", "DistributedOperationException",
]
_CONFIGURATION = [
    "AutocastKwargs", "BnbQuantizationConfig", "ComputeEnvironment", "DataLoaderConfiguration",
    "DDPCommunicationHookType", "DeepSpeedPlugin", "DistributedDataParallelKwargs", "DistributedType",
    "FP8RecipeKwargs", "FullyShardedDataParallelPlugin", "GradScalerKwargs", "GradientAccumulationPlugin",
    "InitProcessGroupKwargs", "LoggerType", "PrecisionType", "ProfileKwargs", "ProjectConfiguration",
    "RNGType", "TorchDynamoPlugin", "TorchTensorParallelPlugin",
]
_BIG_MODELING = [
    "cpu_offload", "cpu_offload_with_hook", "disk_offload", "dispatch_model", "init_empty_weights",
    "init_on_device", "load_checkpoint_and_dispatch",
]

_EXPORTS: dict[str, str] = {
    "Accelerator": ".accelerator",
    "PartialState": ".state",
    "AcceleratorState": ".state",
    "GradientState": ".state",
    "notebook_launcher": ".launch",
    "debug_launcher": ".launch",
    "LaunchError": ".launch",
    "RankPool": ".launch",
    "Dashboard": ".notebook",
    "config_widget": ".notebook",
    "skip_first_batches": ".data_loader",
    "find_executable_batch_size": ".utils",
    "ParallelismConfig": ".parallelism_config",
    "prepare_pippy": ".inference",
    "release_memory": ".utils",
    "infer_auto_device_map": ".utils",
    "load_checkpoint_in_model": ".utils",
    "get_balanced_memory": ".utils",
    "set_seed": ".utils",
    "synchronize_rng_states": ".utils",
    "wait_for_everyone": ".utils",
    "is_rich_available": ".utils",
    **{name: ".utils" for name in _OPERATIONS + _CONFIGURATION},
    **{name: ".big_modeling" for name in _BIG_MODELING},
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_namespace(__name__, _EXPORTS)


def _dashboard_type():
    from .notebook import Dashboard

    return Dashboard


def _cell_output():
    from .notebook.live_output import CellOutput

    return CellOutput()


def _in_kernel() -> bool:
    from .notebook.live_output import in_kernel

    return in_kernel()


# The launch machinery never imports the notebook views: the package root, above both, hands them in.
_launch_views.provide(_launch_views.Views(dashboard_type=_dashboard_type, cell_output=_cell_output,
                                          in_kernel=_in_kernel))


def load_ipython_extension(ipython) -> None:
    """`%load_ext nbaccel`: register the %ranks / %%ranks magics."""
    from .notebook.magics import load_ipython_extension as _load

    _load(ipython)


def unload_ipython_extension(ipython) -> None:
    """`%unload_ext nbaccel`: stop the persistent ranks, if any."""
    from .notebook.magics import unload_ipython_extension as _unload

    _unload(ipython)
