"""`accelerate.utils.launch`: the helpers Accelerate's launchers use, under its names.

They work on an `accelerate launch`-style argparse namespace (`nbaccel.commands.launch.launch_command_parser()`
makes one) and return the environment for the workers. `nbaccel launch` itself builds the worker environment
in `nbaccel.commands.launch`; these exist for code that drives Accelerate's helpers directly.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any

from .constants import INTEL_OPENMP_CPU_ENV
from .dataclasses import DistributedType
from .integration import DEEPSPEED, SAGEMAKER, refuses
from .other import get_free_port, is_port_in_use

__all__ = ["PrepareForLaunch", "env_var_path_add", "prepare_deepspeed_cmd_env",
           "prepare_extend_env_parallelism_config", "prepare_multi_gpu_env", "prepare_sagemager_args_inputs",
           "prepare_simple_launcher_cmd_env", "prepare_tpu", "setup_fp8_env"]

_MULTI_PROCESS = {"MULTI_GPU", "MULTI_MLU", "MULTI_MUSA", "MULTI_NPU", "MULTI_XPU", "MULTI_CPU", "MULTI_NEURON"}


def env_var_path_add(env_var_name: str, path_to_add: str | os.PathLike) -> str:
    """The value of the `:`-separated path variable `env_var_name` with `path_to_add` appended (not set)."""
    paths = [p for p in os.environ.get(env_var_name, "").split(":") if p]
    return ":".join([*paths, str(path_to_add)])


class PrepareForLaunch:
    """Wrap `launcher` for a process started with its index (as `torch.multiprocessing.start_processes` does):
    the call sets LOCAL_RANK and RANK for a multi-process `distributed_type` (or, with `debug`, joins a gloo
    group through the file store `ACCELERATE_DEBUG_RDV_FILE`), then runs `launcher(*args)`."""

    def __init__(self, launcher: Callable[..., Any], distributed_type: str = "NO", debug: bool = False) -> None:
        self.launcher = launcher
        self.distributed_type = DistributedType(distributed_type)
        self.debug = debug

    def __call__(self, index: int, *args: Any) -> None:
        if self.debug:
            import torch.distributed as dist

            world_size = int(os.environ["WORLD_SIZE"])
            store = dist.FileStore(os.environ["ACCELERATE_DEBUG_RDV_FILE"], world_size)
            dist.init_process_group("gloo", rank=index, store=store, world_size=world_size)
        elif self.distributed_type.value in _MULTI_PROCESS:
            os.environ["LOCAL_RANK"] = str(index)
            per_node = int(os.environ.get("NPROC", 1))
            os.environ["RANK"] = str(per_node * int(os.environ.get("NODE_RANK", 0)) + index)
        os.environ["FORK_LAUNCHED"] = "1"
        self.launcher(*args)


def setup_fp8_env(args: argparse.Namespace, current_env: dict[str, str]) -> dict[str, str]:
    """Copy every `fp8_*` argument that is set into `current_env` as ACCELERATE_FP8_* (the linear precision
    override as its three FPROP/DGRAD/WGRAD parts); returns `current_env`."""
    for name, value in vars(args).items():
        if not name.startswith("fp8_") or value is None:
            continue
        if name == "fp8_override_linear_precision":
            for part, flag in zip(("FPROP", "DGRAD", "WGRAD"), value):
                current_env[f"ACCELERATE_FP8_OVERRIDE_{part}"] = str(flag)
        else:
            current_env[f"ACCELERATE_{name.upper()}"] = str(value)
    return current_env


def prepare_extend_env_parallelism_config(args: argparse.Namespace, current_env: dict) -> dict[str, str]:
    """Add the `--parallelism_config_*` sizes to `current_env` as PARALLELISM_CONFIG_* (read by
    `ParallelismConfig()`); returns `current_env`."""
    current_env["ACCELERATE_USE_PARALLELISM_CONFIG"] = "true"
    for part in ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "cp_backend", "sp_size", "sp_backend"):
        current_env[f"PARALLELISM_CONFIG_{part.upper()}"] = str(getattr(args, f"parallelism_config_{part}"))
    if args.parallelism_config_cp_size > 1:
        current_env["PARALLELISM_CONFIG_CP_COMM_STRATEGY"] = str(args.parallelism_config_cp_comm_strategy)
    if args.parallelism_config_sp_size > 1:
        current_env["PARALLELISM_CONFIG_SP_SEQ_LENGTH"] = str(args.parallelism_config_sp_seq_length)
        current_env["PARALLELISM_CONFIG_SP_SEQ_LENGTH_IS_VARIABLE"] = str(
            args.parallelism_config_sp_seq_length_is_variable)
        current_env["PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION"] = str(args.parallelism_config_sp_attn_implementation)
    return current_env


def _common_env(args: argparse.Namespace) -> dict[str, str]:
    env = os.environ.copy()
    env["ACCELERATE_MIXED_PRECISION"] = str(getattr(args, "mixed_precision", None) or "no")
    if getattr(args, "debug", False):
        env["ACCELERATE_DEBUG_MODE"] = "true"
    gpu_ids = getattr(args, "gpu_ids", None)
    if gpu_ids not in (None, "all"):
        env["CUDA_VISIBLE_DEVICES"] = str(gpu_ids)
    env["ACCELERATE_DYNAMO_BACKEND"] = str(getattr(args, "dynamo_backend", None) or "no").upper()
    for name in ("dynamo_mode", "dynamo_use_fullgraph", "dynamo_use_dynamic", "dynamo_use_regional_compilation"):
        if getattr(args, name, None) is not None:
            env[f"ACCELERATE_{name.upper()}"] = str(getattr(args, name))
    if getattr(args, "num_cpu_threads_per_process", None) is not None:
        env["OMP_NUM_THREADS"] = str(args.num_cpu_threads_per_process)
    if getattr(args, "enable_cpu_affinity", False):
        env["ACCELERATE_CPU_AFFINITY"] = "1"
    if getattr(args, "mixed_precision", None) == "fp8":
        setup_fp8_env(args, env)
    return env


def prepare_simple_launcher_cmd_env(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """The command (`python [-m] script args`, or the program itself with `--no_python`) and the environment
    for running one process without torchrun."""
    if getattr(args, "module", False) and getattr(args, "no_python", False):
        raise ValueError("--module and --no_python cannot be used together")
    cmd = [] if getattr(args, "no_python", False) else [sys.executable, *(["-m"] if args.module else [])]
    cmd += [args.training_script, *args.training_script_args]
    env = _common_env(args)
    env["ACCELERATE_USE_CPU"] = str(bool(getattr(args, "cpu", False) or getattr(args, "use_cpu", False)))
    if env["ACCELERATE_USE_CPU"] == "True":
        env.update(INTEL_OPENMP_CPU_ENV)
    if getattr(args, "num_machines", 1) and args.num_machines > 1:
        env["MASTER_ADDR"] = str(args.main_process_ip)
        env["MASTER_PORT"] = str(args.main_process_port)
    return cmd, env


def prepare_multi_gpu_env(args: argparse.Namespace) -> dict[str, str]:
    """Fill the torch.distributed.run fields of `args` (nproc_per_node, nnodes, node_rank, master_addr/port or
    rdzv_endpoint) and return the workers' environment.

    `main_process_port` 0 picks a free port, None means 29500. Several machines meet at
    `main_process_ip:main_process_port` through the rendezvous endpoint, or, with `same_network`, as torchrun's
    master address and port. A busy port on one machine switches to torchrun's standalone mode (with a warning);
    on the main machine of several it raises ConnectionError.
    """
    if args.main_process_port == 0:
        args.main_process_port = get_free_port()
    elif args.main_process_port is None:
        args.main_process_port = 29500
    port = args.main_process_port
    if args.num_machines > 1:
        args.nproc_per_node = str(args.num_processes // args.num_machines)
        args.nnodes = str(args.num_machines)
        args.node_rank = int(args.machine_rank)
        if getattr(args, "same_network", False):
            args.master_addr, args.master_port = str(args.main_process_ip), str(port)
        else:
            args.rdzv_endpoint = f"{args.main_process_ip}:{port}"
    else:
        args.nproc_per_node = str(args.num_processes)
        args.master_port = str(port)
    if (args.num_machines <= 1 or int(args.machine_rank) == 0) and is_port_in_use(port):
        if args.num_machines > 1:
            raise ConnectionError(f"Port {port} is in use on the main machine: pass another --main_process_port "
                                  "(or set main_process_port in the config file).")
        args.standalone = True
        warnings.warn(f"Port {port} is in use: launching in standalone mode on a free port instead (pass "
                      "--main_process_port 0 to always pick a free one).", stacklevel=2)
    if getattr(args, "module", False) and getattr(args, "no_python", False):
        raise ValueError("--module and --no_python cannot be used together")
    env = _common_env(args)
    if getattr(args, "use_fsdp", False):
        env["ACCELERATE_USE_FSDP"] = "true"
        for name, value in vars(args).items():
            if name.startswith("fsdp_") and value is not None:
                env[name.upper()] = str(value)
    if getattr(args, "use_parallelism_config", False):
        prepare_extend_env_parallelism_config(args, env)
    return env


def prepare_tpu(args: argparse.Namespace, current_env: dict[str, str],
                pod: bool = False) -> tuple[argparse.Namespace, dict[str, str]]:
    """Add the XLA variables to `current_env`: bf16 on a TPU as XLA_USE_BF16 (or XLA_DOWNCAST_BF16 with
    `downcast_bf16`), debug mode; for a pod, copy `tpu_vm`/`tpu_name` to `vm`/`tpu`."""
    from .imports import is_torch_xla_available

    if args.mixed_precision == "bf16" and is_torch_xla_available(check_is_tpu=True):
        current_env["XLA_DOWNCAST_BF16" if args.downcast_bf16 else "XLA_USE_BF16"] = "1"
    if args.debug:
        current_env["ACCELERATE_DEBUG_MODE"] = "true"
    if pod:
        args.vm, args.tpu = args.tpu_vm, args.tpu_name
    return args, current_env


@refuses(DEEPSPEED)
def prepare_deepspeed_cmd_env(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """Accelerate's DeepSpeed launcher command: refused (DeepSpeed is not driven by nbaccel)."""


@refuses(SAGEMAKER)
def prepare_sagemager_args_inputs(sagemaker_config: Any, args: argparse.Namespace) -> tuple[dict, dict | None]:
    """Accelerate's SageMaker job arguments: refused (SageMaker is not supported)."""


def _convert_nargs_to_dict(nargs: list[str]) -> dict[str, Any]:
    """A script's `--name value` arguments as SageMaker hyperparameters: {name: value}, with numbers as int
    or float and "True"/"False" as bools (other values stay strings). Every option needs a value: a bare
    flag (an argparse `store_true`) raises ValueError, since SageMaker passes each hyperparameter with one."""
    def typed(text: str) -> Any:
        if text in ("True", "False"):
            return text == "True"
        try:
            number = float(text)
        except ValueError:
            return text
        return int(number) if number.is_integer() else number

    result: dict[str, Any] = {}
    for index, item in enumerate(nargs):
        if not item.startswith("-"):
            continue
        following = nargs[index + 1] if index + 1 < len(nargs) else None
        if following is None or following.startswith("-"):
            raise ValueError(f"{item} has no value: SageMaker cannot pass flags without one (argparse's "
                             "store_true/store_false); give the option an explicit type and value.")
        result[item.lstrip("-").replace("-", "_")] = typed(following)
    return result
