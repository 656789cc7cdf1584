"""nbaccel.utils: every utility name of Accelerate's utilities reference, under the same names.

Names are loaded from their home module on first use (see `nbaccel._lazy`). `utils` imports nothing of
nbaccel above it: collectives here talk to `torch.distributed` directly, never to the state classes.
"""

from .._lazy import lazy_namespace

_MODULES: dict[str, list[str]] = {
    ".operations": [
        "broadcast", "broadcast_object_list", "concatenate", "convert_outputs_to_fp32", "convert_to_fp32",
        "copy_tensor_to_devices", "find_batch_size", "find_device", "gather", "gather_object",
        "get_data_structure", "honor_type", "ignorant_find_batch_size", "initialize_tensors",
        "is_namedtuple", "is_tensor_information", "is_torch_tensor", "listify", "pad_across_processes",
        "pad_input_tensors", "recursively_apply", "reduce", "send_to_device", "slice_tensors",
        "wait_for_everyone", "DistributedOperationException", "debug_mode_enabled", "CannotPadNestedTensorWarning",
        "GatheredParameters",
    ],
    ".dataclasses": [
        "AutocastKwargs", "BnbQuantizationConfig", "ComputeEnvironment", "CustomDtype",
        "DataLoaderConfiguration", "DDPCommunicationHookType", "DeepSpeedPlugin",
        "DistributedDataParallelKwargs", "DistributedType", "DynamoBackend", "FP8RecipeKwargs",
        "FullyShardedDataParallelPlugin", "GradScalerKwargs", "GradientAccumulationPlugin",
        "InitProcessGroupKwargs", "KwargsHandler", "LoggerType", "PrecisionType", "ProfileKwargs",
        "ProjectConfiguration", "RNGType", "TensorInformation", "TorchDynamoPlugin",
        "TorchTensorParallelPlugin", "TERecipeKwargs", "MSAMPRecipeKwargs", "AORecipeKwargs", "SageMakerDistributedType",
    ],
    ".environment": [
        "clear_environment", "get_int_from_env", "in_notebook", "is_colab", "is_kaggle",
        "parse_choice_from_env", "parse_flag_from_env", "patch_environment", "str_to_bool",
        "are_libraries_initialized", "get_cpu_distributed_information", "purge_accelerate_environment",
        "check_cuda_fp8_capability", "check_cuda_p2p_ib_support", "get_current_device_type",
        "get_driver_version", "get_gpu_info", "convert_dict_to_env_variables", "set_numa_affinity",
    ],
    ".imports": [
        "is_aim_available", "is_bf16_available", "is_bnb_available", "is_clearml_available",
        "is_comet_ml_available", "is_cuda_available", "is_datasets_available", "is_deepspeed_available",
        "is_dvclive_available", "is_fp16_available", "is_fp8_available", "is_ipex_available",
        "is_lomo_available", "is_mlflow_available", "is_mps_available", "is_npu_available",
        "is_pandas_available", "is_peft_available", "is_rich_available", "is_safetensors_available",
        "is_tensorboard_available", "is_torch_version", "is_torch_xla_available",
        "is_transformer_engine_available", "is_transformers_available", "is_wandb_available",
        "is_xpu_available", "compare_versions",
        "deepspeed_required", "is_4bit_bnb_available", "is_8bit_bnb_available", "is_boto3_available",
        "is_habana_gaudi1", "is_hpu_available", "is_matplotlib_available", "is_megatron_lm_available",
        "is_mlu_available", "is_msamp_available", "is_musa_available", "is_neuron_available",
        "is_pippy_available", "is_pynvml_available", "is_pytest_available", "is_rocm_available",
        "is_sagemaker_available", "is_schedulefree_available", "is_sdaa_available", "is_swanlab_available",
        "is_timm_available", "is_torch_distributed_available", "is_torchao_available", "is_torchdata_available",
        "is_torchdata_stateful_dataloader_available", "is_torchvision_available", "is_tqdm_available",
        "is_trackio_available", "is_triton_available", "is_weights_only_available", "is_xccl_available",
        "torchao_required", "is_amdsmi_available", "is_bitsandbytes_multi_backend_available",
        "is_import_timer_available", "is_transformer_engine_mxfp8_available",
    ],
    ".parallelism_config": ["ParallelismConfig", "DeepSpeedSequenceParallelConfig", "TorchContextParallelConfig",
                            "TorchTensorParallelConfig"],
    ".random": ["set_seed", "synchronize_rng_state", "synchronize_rng_states"],
    ".modeling": [
        "calculate_maximum_sizes", "check_device_map", "compute_module_sizes", "convert_file_size_to_int",
        "dtype_byte_size", "find_tied_parameters", "get_balanced_memory", "get_max_layer_size",
        "get_max_memory", "id_tensor_storage", "infer_auto_device_map", "load_checkpoint_in_model",
        "load_state_dict", "named_module_tensors", "retie_parameters", "set_module_tensor_to_device",
        "align_module_device", "check_tied_parameters_on_same_device", "clean_device_map",
        "get_state_dict_offloaded_model", "has_offloaded_params", "check_tied_parameters_in_config",
        "get_grad_scaler", "get_mixed_precision_context_manager", "is_peft_model",
    ],
    ".fsdp_utils": [
        "load_fsdp_model", "load_fsdp_optimizer", "merge_fsdp_weights", "save_fsdp_model", "save_fsdp_optimizer",
        "ensure_weights_retied", "enable_fsdp_ram_efficient_loading", "disable_fsdp_ram_efficient_loading",
        "fsdp2_canonicalize_names", "fsdp2_switch_optimizer_parameters",
        "fsdp2_apply_ac", "fsdp2_load_full_state_dict", "get_fsdp2_grad_scaler",
    ],
    ".offload": [
        "OffloadedWeightsLoader", "PrefixedDataset", "extract_submodules_state_dict",
        "load_offloaded_weight", "load_offloaded_weights", "offload_state_dict", "offload_weight",
        "save_offload_index",
    ],
    ".other": [
        "convert_bytes", "extract_model_from_parallel", "get_pretty_name", "is_port_in_use",
        "merge_dicts", "save", "write_basic_config", "is_compiled_module", "get_free_port",
        "clean_state_dict_for_safetensors", "compile_regions", "has_compiled_regions",
        "get_module_children_bottom_up", "load",
        "check_os_kernel", "compile_regions_deepspeed", "get_model_tp_size", "model_has_dtensor", "recursive_getattr",
        "compile_regions_fsdp2",
    ],
    ".constants": [
        "MODEL_NAME", "OPTIMIZER_NAME", "RNG_STATE_NAME", "SAFE_MODEL_NAME", "SAFE_WEIGHTS_INDEX_NAME",
        "SAFE_WEIGHTS_NAME", "SAFE_WEIGHTS_PATTERN_NAME", "SAMPLER_NAME", "SCALER_NAME", "SCHEDULER_NAME",
        "WEIGHTS_INDEX_NAME", "WEIGHTS_NAME", "WEIGHTS_PATTERN_NAME", "FSDP_MODEL_NAME", "PROFILE_PATTERN_NAME",
        "MITA_PROFILING_AVAILABLE_PYTORCH_VERSION", "XPU_PROFILING_AVAILABLE_PYTORCH_VERSION",
        "TORCH_DISTRIBUTED_OPERATION_TYPES", "TORCH_LAUNCH_PARAMS",
    ],
    ".memory": [
        "clear_device_cache", "find_executable_batch_size", "release_memory", "should_reduce_batch_size",
    ],
    ".megatron_lm": [
        "AbstractTrainStep", "BertTrainStep", "GPTTrainStep", "T5TrainStep", "MegatronEngine", "MegatronLMDummyDataLoader",
        "MegatronLMDummyScheduler", "MegatronLMOptimizerWrapper", "MegatronLMSchedulerWrapper", "MegatronLMPlugin",
        "add_model_config_to_megatron_parser", "avg_losses_across_data_parallel_group",
        "gather_across_data_parallel_groups", "megatron_lm_initialize", "megatron_lm_prepare_data_loader",
        "megatron_lm_prepare_model_optimizer_scheduler", "megatron_lm_prepare_optimizer",
        "megatron_lm_prepare_scheduler",
    ],
    ".deepspeed": [
        "DeepSpeedEngineWrapper", "DeepSpeedOptimizerWrapper", "DeepSpeedSchedulerWrapper", "DummyOptim",
        "DummyScheduler", "HfDeepSpeedConfig", "get_active_deepspeed_plugin", "map_pytorch_optim_to_deepspeed",
    ],
    ".launch": [
        "PrepareForLaunch", "prepare_deepspeed_cmd_env", "prepare_multi_gpu_env", "prepare_sagemager_args_inputs",
        "prepare_simple_launcher_cmd_env", "prepare_tpu",
    ],
    ".transformer_engine": ["apply_fp8_autowrap", "contextual_fp8_autocast", "convert_model",
                            "has_transformer_engine_layers"],
    ".ao": ["convert_model_to_fp8_ao", "filter_first_and_last_linear_layers", "has_ao_layers"],
    ".bnb": ["has_4bit_bnb_layers", "load_and_quantize_model"],
    ".torch_xla": ["install_xla"],
}

# `tqdm` is both a function and a submodule (nbaccel.utils.tqdm), as in Accelerate: bound eagerly (the module is
# cheap; it imports the tqdm library on first call), so importing the submodule never rebinds the name.
from .tqdm import tqdm  # noqa: E402

_EXPORTS = {name: module for module, names in _MODULES.items() for name in names}
__all__ = sorted([*_EXPORTS, "tqdm"])
__getattr__, __dir__ = lazy_namespace(__name__, _EXPORTS)
