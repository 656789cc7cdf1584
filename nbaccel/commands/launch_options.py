"""The options of `nbaccel launch`: every option of `accelerate launch`, with its dest, default and nargs.

Defaults are Accelerate's, except where `None` means "not given, take the config file's value" (see
`FROM_CONFIG`). Options nbaccel cannot honour are accepted here and refused, with the reason, by
`nbaccel.commands.launch` when they matter; none is silently ignored.
"""

from __future__ import annotations

import argparse

from ..utils.constants import MIXED_PRECISION_CHOICES, TORCH_DYNAMO_MODES
from ..utils.environment import str_to_bool

# Options whose nbaccel default is None where Accelerate's is a value, because nbaccel reads them from the config
# file when not given (Accelerate's launcher ignores those config keys): documented in docs/compat.md.
FROM_CONFIG = {"rdzv_backend": "static", "dynamo_mode": "default"}


def _opt(*names: str) -> list[str]:
    """Accept `--num_processes` and `--num-processes`, as Accelerate does."""
    out = []
    for name in names:
        out.append(name)
        if name.startswith("--") and "_" in name:
            out.append(name.replace("_", "-"))
    return out


def _fp8_override(value: str) -> tuple[bool, bool, bool]:
    """`--fp8_override_linear_precision`: three true/false values for fprop, dgrad, wgrad."""
    parts = [part.strip() for part in value.strip("()[] ").split(",")]
    if len(parts) != 3:
        raise argparse.ArgumentTypeError("give three true/false values, e.g. 'false,false,true'")
    return tuple(bool(str_to_bool(part)) for part in parts)  # type: ignore[return-value]


def _add_hardware(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Hardware selection")
    group.add_argument("--cpu", action="store_true", help="Run on the CPU even if GPUs are present.")
    group.add_argument(*_opt("--multi_gpu"), action="store_true",
                       help="Launch one process per GPU through torchrun (needs 2 or more processes).")
    group.add_argument("--tpu", action="store_true", help="TPU training: refused, TPU runs go through notebook_launcher.")


def _add_resources(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Resource selection")
    group.add_argument(*_opt("--mixed_precision"), type=str, default=None, choices=list(MIXED_PRECISION_CHOICES),
                       help="Mixed precision mode.")
    group.add_argument(*_opt("--num_processes"), type=int, default=None,
                       help="Total number of processes over all machines (default: config, else one per GPU, else 1).")
    group.add_argument(*_opt("--num_machines"), type=int, default=None, help="Number of machines (default 1).")
    group.add_argument(*_opt("--num_cpu_threads_per_process"), type=int, default=None,
                       help="OMP_NUM_THREADS of each process (default: CPU cores / local processes).")
    group.add_argument(*_opt("--enable_cpu_affinity"), action="store_true",
                       help="Pin each GPU process to the CPU cores nearest its GPU (NVIDIA, needs nvidia-ml-py).")
    group.add_argument(*_opt("--dynamo_backend"), type=str, default=None,
                       help="torch.compile backend (e.g. inductor; 'no' turns it off).")
    group.add_argument(*_opt("--dynamo_mode"), type=str, default=None, choices=TORCH_DYNAMO_MODES,
                       help="torch.compile mode (default: config, else 'default').")
    for name, text in (("fullgraph", "require one graph"), ("dynamic", "dynamic shapes"),
                       ("regional_compilation", "compile repeated blocks one by one")):
        group.add_argument(*_opt(f"--dynamo_use_{name}"), action="store_true", help=f"torch.compile: {text}.")


def _add_paradigms(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Training paradigm")
    group.add_argument(*_opt("--use_deepspeed"), action="store_true", help="Use DeepSpeed (pip install deepspeed).")
    group.add_argument(*_opt("--use_fsdp"), action="store_true", help="Use FullyShardedDataParallel.")
    group.add_argument(*_opt("--use_parallelism_config"), action="store_true",
                       help="Build a ParallelismConfig from --parallelism_config_*: refused (pass one to Accelerator).")
    group.add_argument(*_opt("--use_megatron_lm"), action="store_true", help="Megatron-LM: refused (not supported).")


def _add_distributed(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Distributed processes")
    group.add_argument(*_opt("--gpu_ids"), default=None, help="GPUs this machine uses: 'all' or e.g. '0,1'.")
    group.add_argument(*_opt("--same_network"), action="store_true",
                       help="Machines share a network: meet at --main_process_ip as torchrun's master address "
                            "instead of a rendezvous endpoint.")
    group.add_argument(*_opt("--machine_rank"), type=int, default=None, help="Rank of this machine, 0 .. num_machines-1.")
    group.add_argument(*_opt("--main_process_ip"), type=str, default=None, help="Address of the machine with rank 0.")
    group.add_argument(*_opt("--main_process_port"), type=int, default=None,
                       help="Port on the main machine; 0 picks a free one (default: a free one on a single machine, "
                            "29500 on several).")
    group.add_argument("-t", "--tee", type=str, default="0",
                       help="torchrun --tee: also write stdout/stderr (0..3) to --log_dir.")
    group.add_argument(*_opt("--log_dir"), type=str, default=None, help="Directory for torchrun's per-rank logs.")
    group.add_argument("--role", type=str, default="default", help="torchrun --role: the workers' role name.")
    group.add_argument(*_opt("--rdzv_backend"), type=str, default=None,
                       help="torch.distributed.elastic rendezvous: static (default) or c10d (elastic, restarts).")
    group.add_argument(*_opt("--rdzv_conf"), type=str, default="", help="Extra rendezvous settings, 'k1=v1,k2=v2'.")
    group.add_argument(*_opt("--max_restarts"), type=int, default=0, help="Restart the workers this many times on failure.")
    group.add_argument(*_opt("--monitor_interval"), type=float, default=0.1, help="Seconds between worker health checks.")


def _add_tpu(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("TPU (refused: TPU runs go through notebook_launcher)")
    group.add_argument(*_opt("--tpu_cluster"), action="store_true", dest="tpu_use_cluster", help="A TPU pod.")
    group.add_argument(*_opt("--no_tpu_cluster"), action="store_const", const=False, default=True,
                       dest="tpu_use_cluster", help="One TPU VM.")
    group.add_argument(*_opt("--tpu_use_sudo"), action="store_true", help="Run the pod commands with sudo.")
    group.add_argument("--vm", type=str, action="append", help="TPU pod VMs.")
    group.add_argument("--env", type=str, action="append", help="Environment variables for the TPU pod.")
    group.add_argument(*_opt("--main_training_function"), type=str, default=None,
                       help="The function a TPU launch calls.")
    group.add_argument(*_opt("--downcast_bf16"), action="store_true", help="TPU bf16: keep float32 tensors as bf16.")


def _add_deepspeed(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("DeepSpeed (with --use_deepspeed)")
    for name, kind in (("deepspeed_config_file", str), ("zero_stage", int), ("offload_optimizer_device", str),
                       ("offload_param_device", str), ("offload_optimizer_nvme_path", str),
                       ("offload_param_nvme_path", str), ("gradient_accumulation_steps", int),
                       ("gradient_clipping", float), ("zero3_init_flag", str), ("zero3_save_16bit_model", str),
                       ("deepspeed_hostfile", str), ("deepspeed_exclusion_filter", str),
                       ("deepspeed_inclusion_filter", str), ("deepspeed_multinode_launcher", str),
                       ("deepspeed_moe_layer_cls_names", str)):
        text = "Steps to accumulate gradients over." if name == "gradient_accumulation_steps" else f"DeepSpeed {name}."
        group.add_argument(*_opt(f"--{name}"), type=kind, default=None, help=text)


_FSDP_DEFAULTS = (("fsdp_offload_params", str, "false"), ("fsdp_min_num_params", int, 100000000),
                  ("fsdp_sharding_strategy", str, "FULL_SHARD"), ("fsdp_reshard_after_forward", str, "true"),
                  ("fsdp_auto_wrap_policy", str, None), ("fsdp_transformer_layer_cls_to_wrap", str, None),
                  ("fsdp_backward_prefetch", str, None), ("fsdp_state_dict_type", str, None),
                  ("fsdp_forward_prefetch", str, "false"), ("fsdp_use_orig_params", str, "true"),
                  ("fsdp_cpu_ram_efficient_loading", str, "true"), ("fsdp_sync_module_states", str, "true"),
                  ("fsdp_activation_checkpointing", str, "false"),
                  ("fsdp_activation_checkpointing_offload", str, "false"))


FSDP_DEFAULTS = {name: default for name, _, default in _FSDP_DEFAULTS}


def _add_fsdp(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("FSDP (with --use_fsdp)")
    group.add_argument(*_opt("--fsdp_version"), type=str, default=None, choices=["1", "2"],
                       help="FSDP version (default: config, else 2).")
    for name, kind, default in _FSDP_DEFAULTS:
        group.add_argument(*_opt(f"--{name}"), type=kind, default=default, help=f"FSDP {name[5:]}.")


_MEGATRON = (("tp_degree", int, 1), ("use_custom_fsdp", bool, False), ("no_load_optim", bool, False),
             ("eod_mask_loss", bool, False), ("overlap_cpu_optimizer_d2h_h2d", bool, False),
             ("no_save_optim", bool, False), ("optimizer_cpu_offload", bool, False),
             ("use_precision_aware_optimizer", bool, False), ("decoder_last_pipeline_num_layers", int, None),
             ("pp_degree", int, 1), ("num_micro_batches", int, None), ("sequence_parallelism", str, None),
             ("recompute_activations", str, None), ("use_distributed_optimizer", str, None),
             ("gradient_clipping", float, 1.0), ("recompute_granularity", str, None), ("recompute_method", str, None),
             ("recompute_num_layers", int, None), ("attention_backend", str, None),
             ("expert_model_parallel_size", int, None), ("context_parallel_size", int, None),
             ("attention_dropout", float, None), ("hidden_dropout", float, None),
             ("attention_softmax_in_fp32", str, None), ("expert_tensor_parallel_size", int, None),
             ("calculate_per_token_loss", str, None), ("use_rotary_position_embeddings", str, None))


def _add_megatron(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Megatron-LM (refused with --use_megatron_lm: not supported)")
    for name, kind, default in _MEGATRON:
        group.add_argument(*_opt(f"--megatron_lm_{name}"), type=kind, default=default, help=f"Megatron-LM {name}.")


FP8_DEFAULTS = {"fp8_backend": None, "fp8_use_autocast_during_eval": False, "fp8_margin": 0, "fp8_interval": 1,
                "fp8_format": "HYBRID", "fp8_amax_history_len": 1024, "fp8_amax_compute_algo": "most_recent",
                "fp8_override_linear_precision": (False, False, False), "fp8_opt_level": "O2",
                "fp8_enable_fsdp_float8_all_gather": "true", "fp8_pad_inner_dim": "true"}


def _add_fp8(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("FP8 (with --mixed_precision fp8)")
    group.add_argument(*_opt("--fp8_backend"), type=str, default=None, choices=["ao", "te", "msamp"],
                       help="fp8 backend (nbaccel drives ao, torchao).")
    group.add_argument(*_opt("--fp8_use_autocast_during_eval"), action="store_true", help="fp8 autocast in eval.")
    group.add_argument(*_opt("--fp8_margin"), type=int, default=0, help="TE scaling margin.")
    group.add_argument(*_opt("--fp8_interval"), type=int, default=1, help="TE scaling interval.")
    group.add_argument(*_opt("--fp8_format"), type=str, default="HYBRID", choices=["HYBRID", "E4M3", "E5M2"],
                       help="fp8 format.")
    group.add_argument(*_opt("--fp8_amax_history_len"), type=int, default=1024, help="TE amax history length.")
    group.add_argument(*_opt("--fp8_amax_compute_algo"), type=str, default="most_recent",
                       choices=["max", "most_recent"], help="TE amax algorithm.")
    group.add_argument(*_opt("--fp8_override_linear_precision"), type=_fp8_override, default=(False, False, False),
                       help="TE: keep fprop, dgrad, wgrad in higher precision, e.g. 'false,false,true'.")
    group.add_argument(*_opt("--fp8_opt_level"), type=str, default="O2", choices=["O1", "O2"], help="MS-AMP level.")
    group.add_argument(*_opt("--fp8_enable_fsdp_float8_all_gather"), type=str_to_bool, default="true",
                       help="torchao: fp8 all-gather under FSDP2.")
    group.add_argument(*_opt("--fp8_pad_inner_dim"), type=str_to_bool, default="true",
                       help="torchao: pad inner dimensions to multiples of 16.")


def _add_parallelism(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("ParallelismConfig (with --use_parallelism_config: refused)")
    for name, kind, default, choices in (("dp_replicate_size", int, 1, None), ("dp_shard_size", int, 1, None),
                                         ("tp_size", int, 1, None), ("cp_size", int, 1, None),
                                         ("cp_backend", str, "torch", ["torch"]),
                                         ("cp_comm_strategy", str, "allgather", None), ("sp_size", int, 1, None),
                                         ("sp_backend", str, "deepspeed", ["deepspeed"]),
                                         ("sp_seq_length", str, None, None),
                                         ("sp_seq_length_is_variable", bool, True, None),
                                         ("sp_attn_implementation", str, "sdpa", None)):
        group.add_argument(*_opt(f"--parallelism_config_{name}"), type=kind, default=default, choices=choices,
                           help=f"ParallelismConfig {name}.")


def add_launch_arguments(parser: argparse.ArgumentParser, *, script: bool = True) -> None:
    """Every `accelerate launch` option on `parser` (shared with `nbaccel test`, which supplies its own script)."""
    parser.add_argument(*_opt("--config_file"), default=None,
                        help="Config file to read (default: the one in use, see `nbaccel env`).")
    parser.add_argument("--quiet", "-q", action="store_true", default=None,
                        help="Leave out nbaccel launch's own notes (options not used); torch's agent messages "
                             "show as under `accelerate launch -q` (set LOGLEVEL for those).")
    _add_hardware(parser)
    _add_resources(parser)
    _add_paradigms(parser)
    _add_distributed(parser)
    parser.add_argument("-m", "--module", action="store_true", default=None,
                        help="Run the script argument as a module (python -m).")
    parser.add_argument(*_opt("--no_python"), action="store_true", default=None,
                        help="Run the script argument as a program, without python.")
    _add_tpu(parser)
    _add_deepspeed(parser)
    _add_fsdp(parser)
    _add_megatron(parser)
    _add_fp8(parser)
    group = parser.add_argument_group("AWS SageMaker (refused with a SageMaker config)")
    group.add_argument(*_opt("--aws_access_key_id"), type=str, default=None, help="SageMaker access key.")
    group.add_argument(*_opt("--aws_secret_access_key"), type=str, default=None, help="SageMaker secret key.")
    parser.add_argument("--debug", action="store_true", default=None, help="Check collectives' shapes across processes.")
    parser.add_argument(*_opt("--mpirun_hostfile"), type=str, default=None,
                        help="mpirun hostfile for multi-CPU runs: refused (nbaccel launches through torchrun).")
    _add_parallelism(parser)
    if script:
        parser.add_argument("training_script", type=str, help="The script (or module with -m) to run on every process.")
        parser.add_argument("training_script_args", nargs=argparse.REMAINDER, help="Arguments of the script.")
