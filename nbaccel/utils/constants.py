"""File names and defaults shared with Accelerate, so checkpoints written by either library load in the other."""

from __future__ import annotations

SCALER_NAME = "scaler.pt"
MODEL_NAME = "pytorch_model"
SAFE_MODEL_NAME = "model"
RNG_STATE_NAME = "random_states"
OPTIMIZER_NAME = "optimizer"
SCHEDULER_NAME = "scheduler"
SAMPLER_NAME = "sampler"
PROFILE_PATTERN_NAME = "profile_{suffix}.json"
WEIGHTS_NAME = f"{MODEL_NAME}.bin"
WEIGHTS_PATTERN_NAME = "pytorch_model{suffix}.bin"
WEIGHTS_INDEX_NAME = f"{WEIGHTS_NAME}.index.json"
SAFE_WEIGHTS_NAME = f"{SAFE_MODEL_NAME}.safetensors"
SAFE_WEIGHTS_PATTERN_NAME = "model{suffix}.safetensors"
SAFE_WEIGHTS_INDEX_NAME = f"{SAFE_WEIGHTS_NAME}.index.json"
FSDP_MODEL_NAME = "pytorch_model_fsdp"
CHECKPOINT_DIR_PREFIX = "checkpoint_"  # automatic_checkpoint_naming: <project_dir>/checkpoints/checkpoint_<n>

# Launcher defaults
DEFAULT_MAIN_PROCESS_PORT = 29500
RDZV_BACKENDS = ("static", "c10d", "etcd", "etcd-v2")
LOOPBACK_RDZV_BACKEND = "nbaccel-loopback"  # torch elastic's name for nbaccel's one-machine rendezvous
MIXED_PRECISION_CHOICES = ("no", "fp16", "bf16", "fp8")
START_METHODS = ("fork", "spawn", "forkserver")  # multiprocessing start methods a launch may use

# A variable the user sets: 1 makes RankPool's hang reports show nbaccel's and torch's frames too
INTERNAL_FRAMES_ENV = "NBACCEL_INTERNAL_FRAMES"

# Variables the launcher sets in a worker besides torch's (docs/internals.md)
LAUNCH_DEVICE_ENV = "NBACCEL_LAUNCH_DEVICE"  # the device string a worker shows in its status messages
LAUNCH_HOST_ENV = "NBACCEL_LAUNCH_HOST"  # hosts=: the host a rank runs on (as named there), for its own errors
MEMORY_INTERVAL_ENV = "NBACCEL_MEMORY_INTERVAL"  # seconds between memory messages (0: none)
EXIT_HANG_GRACE_ENV = "NBACCEL_EXIT_HANG_GRACE"  # seconds a finished rank gets to end its process (launch/hang_report.py)
RICH_DISPLAY_ENV = "NBACCEL_RICH_DISPLAY"  # a notebook launched the ranks: send display() output to the cell
INIT_METHOD_ENV = "NBACCEL_INIT_METHOD"  # the process group's rendezvous, when a launcher gives a private one
COLLECTIVE_WATCH_ENV = "NBACCEL_COLLECTIVE_WATCH"  # `nbaccel launch`: the socket its ranks report collectives to
SCRIPT_ENTRY = "nbaccel.launch.worker.script_entry"  # `nbaccel launch`: each rank's entry (reports its collectives)
EXEC_ENTRY = "nbaccel.launch.worker.exec_entry"  # `nbaccel launch --no_python`: registers the rank, execs the program
# the launch's folder where each rank registers the process group it leads (kernel/rank_groups.py)
RANK_GROUPS_ENV = "NBACCEL_RANK_GROUPS"
LINE_LOCK_ENV = "NBACCEL_LINE_LOCK"  # `nbaccel launch`: the file its ranks lock to write whole lines (worker/line_relay.py)
# a launch of one process that Accelerate runs without a launcher (`accelerate launch` without --use_fsdp,
# notebook_launcher): no process group of one, even on a GPU where torchrun started the process
ONE_PROCESS_ENV = "NBACCEL_ONE_PROCESS"

# --- Accelerate's other constants (same names and values, so code reading them works unchanged) ------------
SAGEMAKER_PYTORCH_VERSION = "1.10.2"
SAGEMAKER_PYTHON_VERSION = "py38"
SAGEMAKER_TRANSFORMERS_VERSION = "4.17.0"
SAGEMAKER_PARALLEL_EC2_INSTANCES = ["ml.p3.16xlarge", "ml.p3dn.24xlarge", "ml.p4dn.24xlarge"]
FSDP_SHARDING_STRATEGY = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"]
FSDP_AUTO_WRAP_POLICY = ["TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"]
FSDP_BACKWARD_PREFETCH = ["BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH"]
FSDP_STATE_DICT_TYPE = ["FULL_STATE_DICT", "LOCAL_STATE_DICT", "SHARDED_STATE_DICT"]
FSDP2_STATE_DICT_TYPE = ["SHARDED_STATE_DICT", "FULL_STATE_DICT"]
FSDP_PYTORCH_VERSION = "2.1.0.a0+32f93b1"  # Accelerate's minimum for FSDP1 (a prerelease, on purpose)
FSDP2_PYTORCH_VERSION = "2.6.0"
DTENSOR_PYTORCH_VERSION = "2.5.0"
DEEPSPEED_MULTINODE_LAUNCHERS = ["pdsh", "standard", "openmpi", "mvapich", "mpich", "nossh", "slurm"]
TORCH_DYNAMO_MODES = ["default", "reduce-overhead", "max-autotune"]
ELASTIC_LOG_LINE_PREFIX_TEMPLATE_PYTORCH_VERSION = "2.2.0"
XPU_PROFILING_AVAILABLE_PYTORCH_VERSION = "2.4.0"
MITA_PROFILING_AVAILABLE_PYTORCH_VERSION = "2.1.0"
BETA_TP_AVAILABLE_PYTORCH_VERSION = "2.3.0"
BETA_TP_AVAILABLE_TRANSFORMERS_VERSION = "4.52.0"
BETA_CP_AVAILABLE_PYTORCH_VERSION = "2.6.0"
BETA_SP_AVAILABLE_DEEPSPEED_VERSION = "0.18.2"
# torch.distributed.run's parameter names (what a torchrun command line may carry)
TORCH_LAUNCH_PARAMS = ["nnodes", "nproc_per_node", "rdzv_backend", "rdzv_endpoint", "rdzv_id", "rdzv_conf",
                       "standalone", "max_restarts", "monitor_interval", "start_method", "role", "module", "m",
                       "no_python", "run_path", "log_dir", "r", "redirects", "t", "tee", "node_rank", "master_addr",
                       "master_port"]
CUDA_DISTRIBUTED_TYPES = ["DEEPSPEED", "MULTI_GPU", "FSDP", "MEGATRON_LM", "TP"]
TORCH_DISTRIBUTED_OPERATION_TYPES = [*CUDA_DISTRIBUTED_TYPES, "MULTI_NPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA",
                                     "MULTI_XPU", "MULTI_CPU", "MULTI_HPU", "MULTI_NEURON"]
_TORCH_VALUED = {"SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING", "STR_OPERATION_TO_FUNC"}


def __getattr__(name: str):
    """The constants whose values need torch or the operator table, built on first use (this module stays
    import-cheap: the command line and the kernel read it)."""
    if name == "SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING":  # layers layerwise casting keeps in a higher precision
        import torch

        value = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.ConvTranspose1d,
                 torch.nn.ConvTranspose2d, torch.nn.ConvTranspose3d, torch.nn.Linear)
    elif name == "STR_OPERATION_TO_FUNC":
        from .imports import STR_OPERATION_TO_FUNC as value
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | _TORCH_VALUED)

# Intel OpenMP's settings for a one-process CPU launch (`accelerate launch --cpu` sets them): pin the threads,
# and let idle ones sleep at once
INTEL_OPENMP_CPU_ENV = {"KMP_AFFINITY": "granularity=fine,compact,1,0", "KMP_BLOCKTIME": "1"}
