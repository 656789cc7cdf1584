"""Regenerate the frozen Accelerate surface used by tests/test_public_surface.py.

Run once with Accelerate installed (`python tests/compat/freeze_surface.py > tests/compat/accelerate_surface.py`).
The test itself never imports accelerate: it reads the frozen lists. Exclusions are listed (with reasons) in
EXCLUDED below and in docs/compat.md.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pprint
import re

import accelerate
import accelerate.logging
import accelerate.state
import accelerate.utils
import accelerate.utils.dataclasses as acc_dataclasses

# name pattern -> reason. Accelerate-internal helpers, or helpers of backends nbaccel declares unsupported
# (docs/accelerator.md "Not supported": DeepSpeed, Megatron-LM, transformer_engine, MS-AMP, context/sequence
# parallelism, SageMaker).
EXCLUDED: dict[str, str] = {
    r"^(Megatron|BertTrainStep|GPTTrainStep|T5TrainStep|AbstractTrainStep|add_model_config_to_megatron_parser"
    r"|avg_losses_across_data_parallel_group)": "Megatron-LM: not supported by nbaccel",
    r"^fsdp2_prepare_model$": "FSDP2 preparation step of Accelerator.prepare (nbaccel.sharding.apply_fsdp2 does it)",
    r"^(compile_regions_deepspeed|GatheredParameters|DeepSpeedSequenceParallelConfig|prepare_deepspeed_cmd_env)":
        "DeepSpeed internals: DeepSpeed is not supported",
    r"^(apply_fp8_autowrap|contextual_fp8_autocast|convert_model$|has_transformer_engine_layers"
    r"|is_transformer_engine_mxfp8_available)": "transformer_engine fp8 internals: not driven by nbaccel",
    r"^(SageMakerDistributedType|prepare_sagemager_args_inputs)": "SageMaker: nbaccel launch runs on this machine",
    r"^(PrepareForLaunch|prepare_multi_gpu_env|prepare_simple_launcher_cmd_env|prepare_tpu|TORCH_LAUNCH_PARAMS"
    r"|convert_dict_to_env_variables|install_xla)": "Accelerate's launcher internals (nbaccel has its own launcher)",
    r"^(load_and_quantize_model|has_4bit_bnb_layers|is_bitsandbytes_multi_backend_available)":
        "bitsandbytes quantized loading: not in nbaccel's scope",
    r"^(convert_model_to_fp8_ao|has_ao_layers|filter_first_and_last_linear_layers|torchao_required)":
        "torchao model conversion internals (fp8 through AORecipeKwargs is driven by the Accelerator)",
    r"^(MITA_PROFILING_AVAILABLE_PYTORCH_VERSION|XPU_PROFILING_AVAILABLE_PYTORCH_VERSION"
    r"|TORCH_DISTRIBUTED_OPERATION_TYPES|check_os_kernel|set_numa_affinity|is_import_timer_available"
    r"|is_amdsmi_available|recursive_getattr|ThreadLocalSharedDict|do_nothing|is_initialized|BaseEnum"
    r"|EnumWithContains|FP8BackendType|CannotPadNestedTensorWarning|test_launch|move_to_device|patch_optimizer_step)":
        "Accelerate-internal",
}


def excluded(name: str) -> str | None:
    for pattern, reason in EXCLUDED.items():
        if re.match(pattern, name):
            return reason
    return None


def public(module, own_module: str | None = None) -> list[str]:
    names = []
    for name in dir(module):
        value = getattr(module, name)
        if name.startswith("_") or inspect.ismodule(value) or name == "annotations":
            continue
        if own_module and getattr(value, "__module__", None) != own_module:
            continue
        if excluded(name) is None:
            names.append(name)
    return sorted(names)


def params(fn) -> list[str]:
    for cell in getattr(fn, "__closure__", None) or ():  # Accelerate's on_main_process hides the signature
        if inspect.isfunction(cell.cell_contents) and fn.__name__ == "_inner":
            fn = cell.cell_contents
    sig = inspect.signature(fn)
    return [p.name for p in sig.parameters.values() if p.name != "self" and not p.name.startswith("_") and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


# Submodules Accelerate users import from directly (`from accelerate.tracking import GeneralTracker`, ...): the names
# each defines. Every other module (commands, test_utils, utils.launch, ...) and the names EXCLUDED above that nbaccel
# now has are checked against the installed Accelerate by tests/test_parity_modules.py, which walks the package.
SUBMODULES = ["tracking", "data_loader", "optimizer", "scheduler", "local_sgd", "launchers", "hooks", "big_modeling",
              "checkpointing", "utils.operations", "utils.memory", "utils.random", "utils.modeling", "utils.other"]



def submodule_names(name: str) -> list[str]:
    """Names defined in accelerate.<name>; for utils.* only those also exported by accelerate.utils (the rest are
    helpers of those helpers)."""
    names = public(importlib.import_module(f"accelerate.{name}"), f"accelerate.{name}")
    if name.startswith("utils."):
        names = [n for n in names if n in public(accelerate.utils)]
    return names


ACCELERATOR_MEMBERS = sorted(
    name for name in dir(accelerate.Accelerator) if not name.startswith("_") and excluded(name) is None
)

SIGNATURES: dict[str, list[str]] = {
    "Accelerator.__init__": params(accelerate.Accelerator.__init__),
    "notebook_launcher": params(accelerate.notebook_launcher),
    "debug_launcher": params(accelerate.debug_launcher),
    "skip_first_batches": params(accelerate.skip_first_batches),
    "find_executable_batch_size": params(accelerate.find_executable_batch_size),
    "init_empty_weights": params(accelerate.init_empty_weights),
    "init_on_device": params(accelerate.init_on_device),
    "logging.get_logger": params(accelerate.logging.get_logger),
    "state.PartialState.__init__": params(accelerate.state.PartialState.__init__),
    "state.AcceleratorState.__init__": params(accelerate.state.AcceleratorState.__init__),
    "state.GradientState.__init__": params(accelerate.state.GradientState.__init__),
}
for name in ACCELERATOR_MEMBERS:
    member = inspect.getattr_static(accelerate.Accelerator, name)
    if inspect.isfunction(member):
        SIGNATURES[f"Accelerator.{name}"] = params(member)
for name in ["PartialState", "AcceleratorState"]:
    cls = getattr(accelerate.state, name)
    for member_name in dir(cls):
        member = inspect.getattr_static(cls, member_name)
        if not member_name.startswith("_") and inspect.isfunction(member):
            SIGNATURES[f"state.{name}.{member_name}"] = params(member)
for name in [
    "broadcast", "broadcast_object_list", "concatenate", "convert_outputs_to_fp32", "convert_to_fp32", "find_batch_size",
    "find_device", "gather", "gather_object", "get_data_structure", "honor_type", "is_tensor_information",
    "is_torch_tensor", "pad_across_processes", "recursively_apply", "reduce", "send_to_device", "slice_tensors",
    "wait_for_everyone", "set_seed", "synchronize_rng_state", "synchronize_rng_states", "write_basic_config",
    "extract_model_from_parallel", "get_max_memory", "get_max_layer_size", "offload_state_dict", "is_torch_version",
    "release_memory", "patch_environment", "load_checkpoint_in_model", "infer_auto_device_map",
    "get_balanced_memory", "compute_module_sizes", "set_module_tensor_to_device", "save",
]:
    SIGNATURES[f"utils.{name}"] = params(getattr(accelerate.utils, name))

CONFIG_FIELDS: dict[str, list[str]] = {}
for name in public(acc_dataclasses, "accelerate.utils.dataclasses"):
    cls = getattr(acc_dataclasses, name)
    if dataclasses.is_dataclass(cls):
        CONFIG_FIELDS[name] = [f.name for f in dataclasses.fields(cls) if f.init]


def main() -> None:
    out = {
        "ACCELERATE_VERSION": accelerate.__version__,
        "TOP_LEVEL": public(accelerate),
        "UTILS": public(accelerate.utils),
        "STATE": public(accelerate.state, "accelerate.state"),
        "DATACLASSES": [n for n in public(acc_dataclasses, "accelerate.utils.dataclasses")
                        if inspect.isclass(getattr(acc_dataclasses, n))],
        "LOGGING": ["get_logger", "MultiProcessAdapter"],
        "SUBMODULES": {name: submodule_names(name) for name in SUBMODULES},
        "ACCELERATOR_MEMBERS": ACCELERATOR_MEMBERS,
        "SIGNATURES": SIGNATURES,
        "CONFIG_FIELDS": CONFIG_FIELDS,
    }
    print('"""Accelerate\'s public surface, frozen by tests/compat/freeze_surface.py. Do not edit by hand."""\n')
    for key, value in out.items():
        print(f"{key} = {pprint.pformat(value, width=118, compact=True)}\n")


if __name__ == "__main__":
    main()
