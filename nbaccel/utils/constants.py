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
MIXED_PRECISION_CHOICES = ("no", "fp16", "bf16", "fp8")
START_METHODS = ("fork", "spawn", "forkserver")  # multiprocessing start methods a launch may use

# Variables the launcher sets in a worker besides torch's (docs/internals.md)
LAUNCH_DEVICE_ENV = "NBACCEL_LAUNCH_DEVICE"  # the device string a worker shows in its status messages
MEMORY_INTERVAL_ENV = "NBACCEL_MEMORY_INTERVAL"  # seconds between memory messages (0: none)
INIT_METHOD_ENV = "NBACCEL_INIT_METHOD"  # the process group's rendezvous, when a launcher gives a private one
