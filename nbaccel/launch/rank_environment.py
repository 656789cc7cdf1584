"""The one place that builds a worker's environment, for notebook_launcher, RankPool and `nbaccel launch`.

`WorkerConfig` is what decides the variables (precision, CPU, debug, gradient accumulation, dynamo, FSDP,
DeepSpeed, devices, threads, the config file used); `worker_environment(config)` turns it into the
variables every rank of a launch shares, and `rank_environment` adds one rank's identity (torch's RANK,
LOCAL_RANK, ... and the device it shows). docs/internals.md lists the variables.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..utils.constants import INTEL_OPENMP_CPU_ENV, LAUNCH_DEVICE_ENV, ONE_PROCESS_ENV, RICH_DISPLAY_ENV

# fsdp_config keys (Accelerate's config file) -> FSDP_* variables read by FullyShardedDataParallelPlugin.
FSDP_ENV = {
    "fsdp_version": "FSDP_VERSION",
    "fsdp_sharding_strategy": "FSDP_SHARDING_STRATEGY",
    "fsdp_reshard_after_forward": "FSDP_RESHARD_AFTER_FORWARD",
    "fsdp_offload_params": "FSDP_OFFLOAD_PARAMS",
    "fsdp_min_num_params": "FSDP_MIN_NUM_PARAMS",
    "fsdp_auto_wrap_policy": "FSDP_AUTO_WRAP_POLICY",
    "fsdp_transformer_layer_cls_to_wrap": "FSDP_TRANSFORMER_CLS_TO_WRAP",
    "fsdp_backward_prefetch": "FSDP_BACKWARD_PREFETCH",
    "fsdp_state_dict_type": "FSDP_STATE_DICT_TYPE",
    "fsdp_forward_prefetch": "FSDP_FORWARD_PREFETCH",
    "fsdp_use_orig_params": "FSDP_USE_ORIG_PARAMS",
    "fsdp_cpu_ram_efficient_loading": "FSDP_CPU_RAM_EFFICIENT_LOADING",
    "fsdp_sync_module_states": "FSDP_SYNC_MODULE_STATES",
    "fsdp_activation_checkpointing": "FSDP_ACTIVATION_CHECKPOINTING",
    "fsdp_activation_checkpointing_offload": "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD",
}

# What `accelerate launch` sets for an FSDP run when neither the config file nor a flag names the value.
FSDP_LAUNCH_DEFAULTS = {
    "fsdp_version": 1, "fsdp_sharding_strategy": "FULL_SHARD", "fsdp_reshard_after_forward": True,
    "fsdp_offload_params": False, "fsdp_min_num_params": 100_000_000, "fsdp_forward_prefetch": False,
    "fsdp_use_orig_params": True, "fsdp_cpu_ram_efficient_loading": True, "fsdp_sync_module_states": True,
    "fsdp_activation_checkpointing": False, "fsdp_activation_checkpointing_offload": False,
}

# dynamo_config keys -> NBACCEL_/ACCELERATE_ variables read by TorchDynamoPlugin.
DYNAMO_ENV = {
    "dynamo_backend": "DYNAMO_BACKEND",
    "dynamo_mode": "DYNAMO_MODE",
    "dynamo_use_fullgraph": "DYNAMO_USE_FULLGRAPH",
    "dynamo_use_dynamic": "DYNAMO_USE_DYNAMIC",
    "dynamo_use_regional_compilation": "DYNAMO_USE_REGIONAL_COMPILATION",
}
# What `accelerate launch` sets for the keys neither the config file nor a flag names: it always writes all five,
# so a value left in the caller's shell (ACCELERATE_DYNAMO_BACKEND=EAGER) does not reach the script.
DYNAMO_LAUNCH_DEFAULTS = {"dynamo_backend": "NO", "dynamo_mode": "default", "dynamo_use_fullgraph": False,
                          "dynamo_use_dynamic": False, "dynamo_use_regional_compilation": False}


@dataclass(frozen=True)
class WorkerConfig:
    """What decides the environment of a launch's workers (the same for each of its ranks).

    `explicit_flags`: write on/off switches as `True`/`False`, off ones too, as `accelerate launch` does
    (the command line); the notebook launcher and RankPool write `1` for an on switch and leave off ones out.
    """

    mixed_precision: str = "no"
    use_cpu: bool = False
    loopback: bool = True  # every rank of the launch runs on this machine (gloo may use the loopback device)
    num_nodes: int = 1
    nproc_per_node: int = 1
    debug: bool = False
    gradient_accumulation_steps: int | None = None
    dynamo_config: Mapping[str, Any] = field(default_factory=dict)
    use_fsdp: bool = False
    fsdp_config: Mapping[str, Any] = field(default_factory=dict)
    use_deepspeed: bool = False
    gpu_ids: str | None = None
    num_cpu_threads_per_process: int | None = None
    config_path: str | None = None
    explicit_flags: bool = False
    cpu_affinity: bool = False  # pin each GPU process to its NUMA node's cores (--enable_cpu_affinity)
    extra_env: Mapping[str, str] = field(default_factory=dict)  # ACCELERATE_* variables of fp8/DeepSpeed options
    rich_display: bool = False  # launched from a notebook: spawned ranks make a display publisher of their own
    fork_launched: bool = False  # FORK_LAUNCHED=1: the launcher owns the process group (debug_launcher, TPU, RankPool)
    pg_timeout: float | None = None  # NBACCEL_PG_TIMEOUT (seconds): the process group's timeout (RankPool's backstop)

    @classmethod
    def from_saved(cls, config: Any, **settings: Any) -> WorkerConfig:
        """The settings of a saved launch configuration (`LaunchConfig`, or None) that reach the workers, with
        `settings` (the launcher's resolved values: precision, CPU, process counts) taking precedence."""
        if config is None:
            return cls(**settings)
        values: dict[str, Any] = dict(
            debug=bool(getattr(config, "debug", False)),
            gradient_accumulation_steps=config.gradient_accumulation_steps,
            dynamo_config=dict(config.dynamo_config or {}),
            use_fsdp=bool(config.uses_fsdp),
            fsdp_config=dict(config.fsdp_config or {}),
            use_deepspeed=bool(config.uses_deepspeed),
            config_path=str(config.path) if config.path is not None else None,
        )
        values.update(settings)
        return cls(**values)


def _flag(value: Any) -> str:
    """Environment text for a config value: bools as true/false, everything else as str()."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


@functools.cache  # where this file lies does not change: resolved once, not at every launch
def source_checkout_root() -> str | None:
    """The directory holding this nbaccel package when it runs from a source tree (not installed), so
    workers whose sys.path starts at a script's folder import the same nbaccel."""
    root = Path(__file__).resolve().parent.parent.parent
    if {"site-packages", "dist-packages"} & set(root.parts):
        return None
    return str(root)


def worker_environment(config: WorkerConfig) -> dict[str, str]:
    """The variables (besides torch's per-rank ones) every worker of a launch gets; each NBACCEL_ one also
    under its ACCELERATE_ name."""
    env: dict[str, str] = {}

    def both(name: str, value: str) -> None:
        env["NBACCEL_" + name] = value
        env["ACCELERATE_" + name] = value

    def switch(name: str, on: bool) -> None:
        if config.explicit_flags:
            both(name, str(on))  # "True"/"False", as `accelerate launch` writes ACCELERATE_USE_CPU
        elif on:
            both(name, "1")

    both("MIXED_PRECISION", config.mixed_precision)
    switch("USE_CPU", config.use_cpu)
    if config.use_cpu and config.loopback and sys.platform.startswith("linux") \
            and "GLOO_SOCKET_IFNAME" not in os.environ:
        env["GLOO_SOCKET_IFNAME"] = "lo"  # one machine: hostname-based interface lookup is flaky on VMs
    if config.explicit_flags and config.use_cpu and config.nproc_per_node == 1 and config.num_nodes == 1:
        env.update(INTEL_OPENMP_CPU_ENV)  # the one-process CPU launch (`accelerate launch --cpu`)
    if config.debug:
        both("DEBUG_MODE", "true")
    if config.gradient_accumulation_steps is not None:
        both("GRADIENT_ACCUMULATION_STEPS", str(config.gradient_accumulation_steps))
    for key, name in DYNAMO_ENV.items():
        value = config.dynamo_config.get(key)
        if value is None and config.explicit_flags:
            value = DYNAMO_LAUNCH_DEFAULTS[key]
        if value is not None:
            # the backend upper-case, the switches as str(bool): what `accelerate launch` writes
            both(name, str(value).upper() if key == "dynamo_backend" else str(value))
    if config.use_fsdp:
        both("USE_FSDP", "true")
        for key, name in FSDP_ENV.items():
            value = config.fsdp_config.get(key)
            value = FSDP_LAUNCH_DEFAULTS.get(key) if value is None else value
            if value is not None:
                env[name] = _flag(value)
    if config.use_deepspeed:
        both("USE_DEEPSPEED", "true")
    if config.nproc_per_node == 1 and config.num_nodes == 1 and not config.use_fsdp:
        env[ONE_PROCESS_ENV] = "1"
    if config.gpu_ids not in (None, "all"):  # with --cpu too, as `accelerate launch --cpu --gpu_ids 1`
        env["CUDA_VISIBLE_DEVICES"] = str(config.gpu_ids)
    if config.num_cpu_threads_per_process is not None:
        env["OMP_NUM_THREADS"] = str(config.num_cpu_threads_per_process)
    elif "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // max(config.nproc_per_node, 1)))
    source_root = source_checkout_root()
    if source_root is not None:
        paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        if source_root not in paths:
            env["PYTHONPATH"] = os.pathsep.join([source_root, *paths])
    if config.config_path is not None:
        env["NBACCEL_CONFIG_FILE_USED"] = str(config.config_path)
    if config.cpu_affinity:
        both("CPU_AFFINITY", "1")
    if config.rich_display:
        env[RICH_DISPLAY_ENV] = "1"  # read by launch/worker/rank_display.py
    env.update(config.extra_env)
    if config.fork_launched:
        env["FORK_LAUNCHED"] = "1"
    if config.pg_timeout is not None:
        env["NBACCEL_PG_TIMEOUT"] = str(config.pg_timeout)
    return env


@dataclass(frozen=True)
class RankSpec:
    """One rank's identity: where it sits in the launch and the device it shows."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int
    device: str  # e.g. "cpu", "cuda:1"

    def environ(self, shared: Mapping[str, str]) -> dict[str, str]:
        """The full environment of this rank: the launch's `shared` variables plus its own."""
        env = dict(shared, RANK=str(self.rank), LOCAL_RANK=str(self.local_rank), WORLD_SIZE=str(self.world_size),
                   LOCAL_WORLD_SIZE=str(self.local_world_size), GROUP_RANK=str(self.node_rank),
                   MASTER_ADDR=self.master_addr, MASTER_PORT=str(self.master_port))
        env[LAUNCH_DEVICE_ENV] = self.device
        return env


def visible_gpus() -> int:
    """CUDA/ROCm devices torch sees (without initializing CUDA in this process)."""
    import torch

    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0
