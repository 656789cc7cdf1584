"""`nbaccel launch [options] script.py [script args]`: run a script on every process, through torchrun's agent.

Options not given on the command line come from the config file (`--config_file`, else the default one, see
`nbaccel.utils.config_file`), then from defaults. `--num_processes` is the TOTAL over all machines, as in
Accelerate. The workers get the torch launcher variables (RANK, WORLD_SIZE, MASTER_ADDR...) from
torch.distributed.run and nbaccel's (NBACCEL_MIXED_PRECISION, NBACCEL_USE_CPU, ...) from here; see
docs/internals.md for the list.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import os
import signal
import sys
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..utils.config_file import ConfigError, LaunchConfig, display_path, load_config
from ..utils.constants import (
    MIXED_PRECISION_CHOICES,
    RDZV_BACKENDS,
)
from ..utils.dataclasses import DynamoBackend, enum_value
from ..utils.process_limits import ProcessCountError, check_process_count
from ..utils.safe_yaml import short_keys, short_repr
from .launch_options import FP8_DEFAULTS as _FP8_DEFAULTS
from .launch_options import FROM_CONFIG, FSDP_DEFAULTS, add_launch_arguments

if TYPE_CHECKING:
    from ..launch.hang_report import Diagnosis
    from ..launch.kernel.plan import LaunchPlan
    from ..launch.kernel.threaded import ThreadedBackend
    from ..launch.rank_environment import WorkerConfig


class LaunchOptionError(ValueError):
    """A launch option (or config value) that cannot work; reported as a one-line usage error."""


@dataclass
class LaunchSettings:
    """Everything a launch needs, after merging command line, config file and defaults, and checking it."""

    script: str
    script_args: list[str]
    module: bool = False
    num_processes: int = 1
    num_machines: int = 1
    machine_rank: int = 0
    main_process_ip: str | None = None
    main_process_port: int | None = None
    mixed_precision: str = "no"
    use_cpu: bool = False
    gpu_ids: str | None = None
    rdzv_backend: str = "static"
    rdzv_conf: str = ""
    same_network: bool = False
    max_restarts: int = 0
    monitor_interval: float = 0.1
    dynamo_config: dict = field(default_factory=dict)
    gradient_accumulation_steps: int | None = None
    use_fsdp: bool = False
    fsdp_config: dict = field(default_factory=dict)
    use_deepspeed: bool = False
    debug: bool = False
    num_cpu_threads_per_process: int | None = None
    log_dir: str | None = None
    tee: str | None = None
    config_path: Path | None = None
    no_python: bool = False
    role: str = "default"
    quiet: bool = False
    multi_gpu: bool = False
    enable_cpu_affinity: bool = False
    extra_env: dict = field(default_factory=dict)  # ACCELERATE_* variables of fp8 / DeepSpeed options

    @property
    def nproc_per_node(self) -> int:
        return self.num_processes // self.num_machines


def _device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _given(args: argparse.Namespace, name: str):
    """The value of option `name` when the user gave it, else None (store_true options default to False)."""
    value = getattr(args, name, None)
    return None if value is False else value


def resolve_settings(args: argparse.Namespace, config: LaunchConfig | None) -> LaunchSettings:
    """Merge `args` over `config` over defaults; raise LaunchOptionError for anything that cannot work."""
    cfg = config or LaunchConfig()
    _check_supported(cfg)
    _refuse_unsupported_options(args)

    def pick(name: str, default=None):
        value = _given(args, name)
        if value is not None:
            return value
        from_config = getattr(cfg, name, None) if config is not None else None
        return default if from_config is None else from_config

    use_cpu = True if args.cpu else bool(cfg.use_cpu) or enum_value(cfg.distributed_type) == "MULTI_CPU"
    num_machines = pick("num_machines", 1)
    settings = LaunchSettings(
        script=args.training_script,
        script_args=list(args.training_script_args or []),
        module=bool(getattr(args, "module", False)),
        num_processes=pick("num_processes", 0),
        num_machines=num_machines,
        machine_rank=pick("machine_rank", 0),
        main_process_ip=pick("main_process_ip", None),
        main_process_port=pick("main_process_port", None),
        mixed_precision=str(pick("mixed_precision", "no")).lower(),
        use_cpu=use_cpu,
        gpu_ids=pick("gpu_ids", None),
        rdzv_backend=pick("rdzv_backend", FROM_CONFIG["rdzv_backend"]),
        rdzv_conf=args.rdzv_conf or "",
        same_network=bool(pick("same_network", False)),
        max_restarts=args.max_restarts,
        monitor_interval=args.monitor_interval,
        dynamo_config=dict(cfg.dynamo_config or {}),
        # the option reaches the workers only with DeepSpeed, as Accelerate exports it only there (elsewhere
        # its Accelerator keeps 1); the config file's top-level key (nbaccel's, for notebook_launcher too) always
        gradient_accumulation_steps=(pick("gradient_accumulation_steps", None)
                                     if bool(args.use_deepspeed) or cfg.uses_deepspeed
                                     else cfg.gradient_accumulation_steps if config is not None else None),
        use_fsdp=bool(args.use_fsdp) or cfg.uses_fsdp,
        fsdp_config=dict(cfg.fsdp_config or {}),
        use_deepspeed=bool(args.use_deepspeed) or cfg.uses_deepspeed,
        debug=bool(args.debug) if args.debug is not None else bool(cfg.debug),
        num_cpu_threads_per_process=_threads_per_process(args, config, num_machines),
        log_dir=args.log_dir,
        tee=None if args.tee in (None, "0") else args.tee,
        config_path=cfg.path if config is not None else None,
        no_python=bool(getattr(args, "no_python", False)),
        role=getattr(args, "role", "default") or "default",
        quiet=bool(getattr(args, "quiet", False)),
        multi_gpu=bool(getattr(args, "multi_gpu", False)) or enum_value(cfg.distributed_type) == "MULTI_GPU",
        enable_cpu_affinity=bool(pick("enable_cpu_affinity", False)),
    )
    _apply_option_groups(args, settings)
    _apply_config_sections(cfg, settings, args)
    _report_inert_options(args, settings)
    given = args.num_processes is not None or (config is not None and config.num_processes is not None)
    _check(settings, given_processes=given)
    _check_srun_tasks(settings, machine_rank_given=pick("machine_rank") is not None)
    if settings.main_process_port == 0:  # as Accelerate: 0 means "pick a free port" (on this machine)
        from ..utils.other import get_free_port

        settings.main_process_port = get_free_port()
    if settings.num_processes == 0:  # unset: one process per GPU of each machine, else one (checked above)
        devices = 0 if settings.use_cpu else _device_count()
        settings.num_processes = max(devices, 1) * settings.num_machines
    return settings


def _check_srun_tasks(s: LaunchSettings, machine_rank_given: bool) -> None:
    """Under `srun -n N` (N > 1) every task runs this very command: with the static rendezvous and no
    --machine_rank each task would be machine 0, and they wait for each other until the rendezvous times out
    (or fail on the port the first one holds). Refused before anything starts (Accelerate: the same wait)."""
    tasks = os.environ.get("SLURM_STEP_NUM_TASKS", "")
    if (s.num_machines > 1 and s.rdzv_backend == "static" and not machine_rank_given and tasks.isdigit()
            and int(tasks) > 1):
        raise LaunchOptionError(
            f"srun runs this command as {tasks} tasks (SLURM_STEP_NUM_TASKS), and without --machine_rank every "
            f"one would be machine 0 of --num_machines {s.num_machines}: give each its own, `srun bash -c "
            "'nbaccel launch --machine_rank $SLURM_PROCID ...'`, or pass --rdzv_backend c10d, whose rendezvous "
            "numbers the machines itself")


def _threads_per_process(args: argparse.Namespace, config: LaunchConfig | None, num_machines: int) -> int:
    """OMP_NUM_THREADS for every process, as Accelerate's `_validate_launch_command` fills
    `--num_cpu_threads_per_process` when not given: OMP_NUM_THREADS of this shell, else 1; but a CPU launch with
    OMP_NUM_THREADS unset gives each local process its share of the physical cores, when that share is above 1.
    As in Accelerate, "CPU launch" is the config file's `use_cpu` when a config file is read (none is under
    `--cpu` without `--config_file`: `read_launch_config`), else `--cpu`, and the process count is the one
    given (else the config file's, else the CUDA device count), before any default process count is filled in."""
    if args.num_cpu_threads_per_process is not None:
        if args.num_cpu_threads_per_process < 1:  # Accelerate passes it on; no OpenMP runtime takes it
            raise LaunchOptionError(f"--num_cpu_threads_per_process must be >= 1, got "
                                    f"{args.num_cpu_threads_per_process}")
        return args.num_cpu_threads_per_process
    from ..utils.environment import get_int_from_env

    # the shell's OMP_NUM_THREADS goes on as it is, even 0 (as Accelerate: the user's own setting, which
    # torch then ignores), never refused under an option's name the user did not give

    threads = get_int_from_env(["OMP_NUM_THREADS"], 1)
    use_cpu = bool(config.use_cpu) if config is not None else bool(args.cpu)
    processes = args.num_processes
    if processes is None:
        processes = (config.num_processes or 0) if config is not None else _device_count()
    if use_cpu and processes >= 1 and get_int_from_env(["OMP_NUM_THREADS"], 0) == 0:
        import psutil

        local_size = get_int_from_env(["MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE"],
                                      max(int(processes / max(num_machines, 1)), 1))
        share = int((psutil.cpu_count(logical=False) or os.cpu_count() or 1) / local_size)
        if share > 1:
            threads = share
    return threads


def _refuse_unsupported_options(args: argparse.Namespace) -> None:
    """Options of `accelerate launch` that cannot work here: refused with the reason (never silently ignored).
    Options that only matter together with one of these (the --megatron_lm_*, TPU pod and AWS options) are
    refused with it; alone they change nothing, in Accelerate too."""
    if sum(bool(getattr(args, name, False)) for name in ("multi_gpu", "cpu", "tpu", "use_deepspeed", "use_fsdp")) > 1:
        raise LaunchOptionError("You can only use one of `--cpu`, `--multi_gpu`, `--tpu`, `--use_deepspeed`, "
                                "`--use_fsdp` at a time.")
    if args.multi_gpu and args.num_processes is not None and args.num_processes < 2:
        raise LaunchOptionError("You need to use at least 2 processes to use `--multi_gpu`.")
    if getattr(args, "use_parallelism_config", False):
        if not args.use_fsdp or str(args.fsdp_version or "2") == "1":
            raise LaunchOptionError("You cannot use `--use_parallelism_config` without `--use_fsdp` and "
                                    "`--fsdp_version=2`.")
        raise LaunchOptionError("--use_parallelism_config: nbaccel's Accelerator does not build a ParallelismConfig "
                                "from launcher variables; pass parallelism_config=ParallelismConfig(...) to "
                                "Accelerator in the script instead")
    if getattr(args, "tpu", False) or getattr(args, "tpu_use_cluster", False) is True:
        raise LaunchOptionError("--tpu: TPU processes are started by notebook_launcher (torch_xla) in a TPU "
                                "notebook, not by nbaccel launch")
    if getattr(args, "use_megatron_lm", False):
        raise LaunchOptionError("--use_megatron_lm: Megatron-LM is not supported by nbaccel")
    if getattr(args, "mpirun_hostfile", None):
        raise LaunchOptionError("--mpirun_hostfile: nbaccel launch starts processes through torchrun, not mpirun; "
                                "run `nbaccel launch --num_machines N --machine_rank R --main_process_ip IP` on each "
                                "machine instead")
    if getattr(args, "module", False) and getattr(args, "no_python", False):
        raise LaunchOptionError("--module and --no_python cannot be used together")


# The DeepSpeed options as the variables DeepSpeedPlugin reads (Accelerate's names).
_DEEPSPEED_ENV = {
    "zero_stage": "ACCELERATE_DEEPSPEED_ZERO_STAGE", "offload_optimizer_device": "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
    "offload_param_device": "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE",
    "offload_optimizer_nvme_path": "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH",
    "offload_param_nvme_path": "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH",
    "gradient_clipping": "ACCELERATE_GRADIENT_CLIPPING", "zero3_init_flag": "ACCELERATE_DEEPSPEED_ZERO3_INIT",
    "zero3_save_16bit_model": "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL",
    "deepspeed_config_file": "ACCELERATE_DEEPSPEED_CONFIG_FILE",
    "deepspeed_moe_layer_cls_names": "ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES",
}


def _apply_option_groups(args: argparse.Namespace, s: LaunchSettings) -> None:
    """The dynamo, FSDP, fp8 and DeepSpeed options given on the command line, over the config file's."""
    if args.dynamo_backend is not None:
        s.dynamo_config["dynamo_backend"] = args.dynamo_backend
    if args.dynamo_mode is not None:
        s.dynamo_config["dynamo_mode"] = args.dynamo_mode
    for name in ("dynamo_use_fullgraph", "dynamo_use_dynamic", "dynamo_use_regional_compilation"):
        if getattr(args, name, False):
            s.dynamo_config[name] = True
    if args.fsdp_version is not None:
        s.fsdp_config["fsdp_version"] = int(args.fsdp_version)
    for key, default in FSDP_DEFAULTS.items():  # an FSDP option left at Accelerate's default keeps the config's
        value = getattr(args, key, default)
        if value is not None and value != default:
            s.fsdp_config[key] = value
    if s.mixed_precision == "fp8":
        from ..utils.launch import setup_fp8_env

        fp8 = {k: v for k, v in vars(args).items() if k.startswith("fp8_")}
        s.extra_env.update(setup_fp8_env(argparse.Namespace(**fp8), {}))
    if s.use_deepspeed:
        for key, name in _DEEPSPEED_ENV.items():
            if getattr(args, key, None) is not None:
                s.extra_env[name] = str(getattr(args, key))


# Keys of an Accelerate config file that `nbaccel launch` does not use, with the reason; each is reported in one
# line when the file sets it (a value other than the default), never silently ignored.
_UNUSED_KEYS = {
    "downcast_bf16": (False, "it applies to TPU runs, which notebook_launcher starts"),
    "main_training_function": ("main", "it names the function of a TPU run, which notebook_launcher starts"),
    "megatron_lm_config": ({}, "Megatron-LM is not supported"),
    "tpu_use_cluster": (False, "TPU pods are set up with `nbaccel tpu-config` and run through notebook_launcher"),
    "tpu_use_sudo": (False, "TPU pods are set up with `nbaccel tpu-config` and run through notebook_launcher"),
    "tpu_vm": (None, "TPU pods are set up with `nbaccel tpu-config` and run through notebook_launcher"),
    "tpu_env": (None, "TPU pods are set up with `nbaccel tpu-config` and run through notebook_launcher"),
}
# deepspeed_config keys that reach the workers (as the matching launch option would); the others are refused.
_DEEPSPEED_KEYS = {"zero_stage", "offload_optimizer_device", "offload_param_device", "offload_optimizer_nvme_path",
                   "offload_param_nvme_path", "gradient_accumulation_steps", "gradient_clipping", "zero3_init_flag",
                   "zero3_save_16bit_model", "deepspeed_config_file", "deepspeed_moe_layer_cls_names"}


def _apply_config_sections(cfg: LaunchConfig, s: LaunchSettings, args: argparse.Namespace) -> None:
    """The config file's fp8_config, deepspeed_config, parallelism_config and mpirun_config sections, and a
    one-line report of the keys `nbaccel launch` does not use (see `_UNUSED_KEYS`)."""
    where = f"{display_path(cfg.path)}: " if cfg.path is not None else ""
    if cfg.parallelism_config:
        raise LaunchOptionError(f"{where}parallelism_config: nbaccel's Accelerator does not build a ParallelismConfig "
                                "from the launcher; pass parallelism_config=ParallelismConfig(...) to Accelerator in the "
                                "script, and remove the section")
    if (cfg.mpirun_config or {}).get("mpirun_hostfile"):
        raise LaunchOptionError(f"{where}mpirun_config: nbaccel launch starts processes through torchrun, not mpirun; "
                                "run nbaccel launch on each machine (--machine_rank) and remove the section")
    if s.mixed_precision == "fp8" and cfg.fp8_config:
        from ..utils.launch import setup_fp8_env

        given = {k: v for k, v in vars(args).items() if k.startswith("fp8_") and v != _FP8_DEFAULTS.get(k)}
        from_file = {(k if k.startswith("fp8_") else f"fp8_{k}"): v for k, v in cfg.fp8_config.items()}
        fp8 = {**_FP8_DEFAULTS, **from_file, **given}  # the command line wins over the file, as in Accelerate
        s.extra_env.update(setup_fp8_env(argparse.Namespace(**fp8), {}))
    if s.use_deepspeed and cfg.deepspeed_config:
        unknown = sorted(set(cfg.deepspeed_config) - _DEEPSPEED_KEYS)
        if unknown:
            raise LaunchOptionError(f"{where}deepspeed_config: {short_keys(unknown)} not supported by nbaccel launch "
                                    "(DeepSpeed's own multi-node launcher is not used); remove them")
        for key, value in cfg.deepspeed_config.items():
            name = _DEEPSPEED_ENV.get(key)
            if name is not None and name not in s.extra_env and value is not None:
                s.extra_env[name] = str(value)
            elif key == "gradient_accumulation_steps" and s.gradient_accumulation_steps is None:
                s.gradient_accumulation_steps = int(value)
    unused = [f"{key} ({reason})" for key, (default, reason) in _UNUSED_KEYS.items()
              if getattr(cfg, key, default) not in (default, None, {}, [], "no", False)]
    from ..launch.rank_environment import DYNAMO_ENV, FSDP_ENV  # here: `nbaccel --help` does not load launch

    for section, known in (("fsdp_config", FSDP_ENV), ("dynamo_config", DYNAMO_ENV)):
        unknown = sorted(set(getattr(cfg, section) or {}) - set(known))
        if unknown:
            unused.append(f"{section}: {short_keys(unknown)} (not an Accelerate {section} key)")
    if unused and not s.quiet:
        print(f"nbaccel launch: {where}not used: {'; '.join(unused)}", file=sys.stderr)


# Options that only act together with another choice: (condition on the settings, what they need).
_INERT_UNLESS = [
    (("downcast_bf16", "vm", "env", "tpu_use_sudo", "main_training_function"), lambda s: False,
     "they apply to TPU runs, which notebook_launcher starts"),
    (("megatron_lm_",), lambda s: False, "Megatron-LM is not supported"),
    (("aws_",), lambda s: False, "they apply to SageMaker jobs, which are not supported"),
    (("parallelism_config_",), lambda s: False, "pass a ParallelismConfig to the Accelerator instead"),
    (("fsdp_",), lambda s: s.use_fsdp, "they need --use_fsdp"),
    (("fp8_",), lambda s: s.mixed_precision == "fp8", "they need --mixed_precision fp8"),
    (("zero_stage", "offload_", "gradient_clipping", "gradient_accumulation_steps", "zero3_", "deepspeed_"),
     lambda s: s.use_deepspeed,
     "they need --use_deepspeed"),
]


def _parsed_default(action: argparse.Action):
    """The value argparse stores when the option is not given (a string default goes through `type`)."""
    if isinstance(action.default, str) and callable(action.type):
        try:
            return action.type(action.default)
        except (TypeError, ValueError, argparse.ArgumentTypeError):
            return action.default
    return action.default


def _report_inert_options(args: argparse.Namespace, s: LaunchSettings) -> None:
    """Name, in one line, the options given that change nothing in this launch (as in Accelerate, where they
    change nothing either), so that none is ignored silently."""
    parser = getattr(args, "_parser", None)
    if parser is None or s.quiet:
        return
    given = {a.dest: a.option_strings[0] for a in parser._actions
             if a.option_strings and a.dest in vars(args) and getattr(args, a.dest) != _parsed_default(a)}
    notes = []
    for prefixes, active, reason in _INERT_UNLESS:
        names = sorted(option for dest, option in given.items() if dest.startswith(prefixes))
        if names and not active(s):
            notes.append(f"{', '.join(names)} ({reason})")
    if notes:
        print(f"nbaccel launch: not used: {'; '.join(notes)}", file=sys.stderr)


def _check_supported(cfg: LaunchConfig) -> None:
    """Configurations `nbaccel launch` cannot run, said before anything starts."""
    where = f"{cfg.path}: " if cfg.path is not None else ""
    if enum_value(cfg.compute_environment) == "AMAZON_SAGEMAKER":
        raise LaunchOptionError(f"{where}compute_environment AMAZON_SAGEMAKER: nbaccel launch runs on this machine "
                                "only; use `accelerate launch` for SageMaker jobs")
    unsupported = {
        "XLA": "TPU processes are started by notebook_launcher (torch_xla) in a TPU notebook, not by nbaccel launch",
        "MEGATRON_LM": "Megatron-LM is not supported by nbaccel",
    }
    distributed_type = enum_value(cfg.distributed_type)
    if distributed_type in unsupported:
        raise LaunchOptionError(f"{where}distributed_type {distributed_type}: {unsupported[distributed_type]}")


def check_script(s: LaunchSettings) -> None:
    """The training script (or `-m` module) exists: checked when the launch starts, not when the options are
    validated (as in Accelerate, `_validate_launch_command` accepts a script written later)."""
    if s.module:
        local = Path(s.script.replace(".", "/"))
        if importlib.util.find_spec(s.script.split(".")[0]) is None and not (
            local.is_dir() or local.with_suffix(".py").is_file()
        ):
            raise LaunchOptionError(f"module {s.script!r} not found (with -m, give an importable module name)")
    elif not s.no_python and Path(s.script).is_dir():
        # `python DIR` runs DIR/__main__.py, as `accelerate launch DIR` does (a zip app is a file, run the same way)
        if not any((Path(s.script) / name).is_file() for name in ("__main__.py", "__main__.pyc")):
            raise LaunchOptionError(f"training script {s.script!r} is a directory without a __main__.py "
                                    "(python runs a directory through its __main__.py)")
    elif not s.no_python and not Path(s.script).is_file():
        raise LaunchOptionError(f"training script {s.script!r} not found")


class UnknownConfigKeys(ConfigError):
    """A config file with keys Accelerate does not know (Accelerate raises ValueError for it too)."""


def refuse_unknown_keys(config: LaunchConfig | None) -> None:
    """A config file with keys Accelerate does not know is refused, as Accelerate refuses it (ValueError)."""
    if config is None or not config.extra or enum_value(config.compute_environment) == "AMAZON_SAGEMAKER":
        return  # (a SageMaker file's own keys: `nbaccel launch` refuses the file, saying why)
    where = display_path(config.path) if config.path is not None else "the config"
    keys = ", ".join(repr(k) for k in sorted(config.extra, key=str))
    raise UnknownConfigKeys(f"The config file at {where} had unknown keys ({keys}): remove them (or fix their names), or "
                      "upgrade nbaccel if a newer Accelerate wrote them.")


def read_launch_config(path: str | os.PathLike | None, cpu: bool = False) -> LaunchConfig | None:
    """The config file a launch uses (see `load_config`), refused when it holds unknown keys (the warning
    `load_config` gives for them is replaced by that error). With `cpu` (`--cpu`) only a `path` given is read:
    Accelerate's launch skips the default config file under `--cpu`."""
    if cpu and path is None:
        return None
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*ignoring unknown key")
        config = load_config(path)
    refuse_unknown_keys(config)
    return config


def _check(s: LaunchSettings, given_processes: bool = True) -> None:
    def fail(message: str) -> None:
        raise LaunchOptionError(message)

    if s.num_machines < 1:
        fail(f"--num_machines must be >= 1, got {s.num_machines}")
    if (s.multi_gpu and s.num_machines <= 1 and s.gpu_ids not in (None, "all")
            and len(str(s.gpu_ids).split(",")) < 2):
        fail("Less than two GPU ids were configured and tried to run on multiple GPUs: give at least two with "
             "--gpu_ids, or --gpu_ids all")
    if s.num_processes < 0 or (s.num_processes == 0 and given_processes):
        fail(f"--num_processes must be >= 1, got {s.num_processes}")
    if s.num_processes % s.num_machines:
        fail(f"--num_processes ({s.num_processes}, the total over all machines) must be a multiple of "
             f"--num_machines ({s.num_machines})")
    try:
        check_process_count(s.nproc_per_node, name="--num_processes")
    except ProcessCountError as error:
        fail(str(error))
    if not 0 <= s.machine_rank < s.num_machines:
        fail(f"--machine_rank must be between 0 and {s.num_machines - 1}, got {s.machine_rank}")
    if s.num_machines > 1 and not s.main_process_ip:
        fail("--main_process_ip is needed with --num_machines > 1 (the address of the machine with rank 0)")
    if s.main_process_port is not None and not 0 <= s.main_process_port < 65536:
        fail(f"--main_process_port must be between 1 and 65535 (or 0 for a free port), got {s.main_process_port}")
    if s.mixed_precision not in MIXED_PRECISION_CHOICES:
        fail(f"--mixed_precision must be one of {', '.join(MIXED_PRECISION_CHOICES)}, got {short_repr(s.mixed_precision)}")
    if s.mixed_precision == "fp8" and not any(
        importlib.util.find_spec(m) for m in ("transformer_engine", "msamp", "torchao")
    ):
        fail("--mixed_precision fp8 needs Transformer Engine, MS-AMP or torchao: pip install torchao")
    if s.rdzv_backend not in RDZV_BACKENDS:
        fail(f"--rdzv_backend must be one of {', '.join(RDZV_BACKENDS)}, got {short_repr(s.rdzv_backend)}")
    if s.max_restarts < 0:
        fail(f"--max_restarts must be >= 0, got {s.max_restarts}")
    # nan, inf and more than time.sleep takes too: torch's agent sleeps it, and would fail after the ranks started
    if not 0 < s.monitor_interval <= threading.TIMEOUT_MAX:
        fail(f"--monitor_interval must be a number of seconds > 0 (at most {threading.TIMEOUT_MAX:.0f}), "
             f"got {s.monitor_interval}")
    if s.gradient_accumulation_steps is not None and s.gradient_accumulation_steps < 1:
        fail(f"--gradient_accumulation_steps must be >= 1, got {s.gradient_accumulation_steps}")
    if s.gpu_ids not in (None, "all") and not all(p.strip().isdigit() for p in str(s.gpu_ids).split(",")):
        fail(f"--gpu_ids must be 'all' or a comma-separated list of GPU indices, got {short_repr(s.gpu_ids)}")
    backend = str(s.dynamo_config.get("dynamo_backend", "no")).upper()
    if backend not in DynamoBackend.list():
        fail(f"--dynamo_backend must be one of {', '.join(b.lower() for b in DynamoBackend.list())}, got {short_repr(backend.lower())}")
    fp8_backend = s.extra_env.get("ACCELERATE_FP8_BACKEND", "ao").lower()
    if s.mixed_precision == "fp8" and fp8_backend != "ao":
        fail(f"--fp8_backend {fp8_backend}: nbaccel drives fp8 through torchao only (--fp8_backend ao)")
    if s.use_deepspeed and importlib.util.find_spec("deepspeed") is None:
        fail("DeepSpeed is selected but not installed: pip install deepspeed")
    if s.use_fsdp and s.use_deepspeed:
        fail("choose one of FSDP and DeepSpeed, not both")
    from ..launch.hang_report import exit_hang_grace  # here: `nbaccel --help` does not load launch

    try:
        exit_hang_grace()  # NBACCEL_EXIT_HANG_GRACE, refused with the options (build_plan reads it for the launch)
    except ValueError as error:
        fail(str(error))


def worker_config(s: LaunchSettings) -> WorkerConfig:
    """The settings that reach the workers, for the one environment builder (nbaccel.launch.rank_environment)."""
    from ..launch.rank_environment import (
        WorkerConfig,  # here: `nbaccel --help` does not load the launch package
    )

    return WorkerConfig(
        mixed_precision=s.mixed_precision, use_cpu=s.use_cpu, loopback=s.num_machines == 1, num_nodes=s.num_machines,
        nproc_per_node=s.nproc_per_node, debug=s.debug, gradient_accumulation_steps=s.gradient_accumulation_steps,
        dynamo_config=dict(s.dynamo_config), use_fsdp=s.use_fsdp, fsdp_config=dict(s.fsdp_config),
        use_deepspeed=s.use_deepspeed, gpu_ids=s.gpu_ids, num_cpu_threads_per_process=s.num_cpu_threads_per_process,
        config_path=str(s.config_path) if s.config_path is not None else None, explicit_flags=True,
        cpu_affinity=s.enable_cpu_affinity, extra_env=dict(s.extra_env),
    )


def worker_environment(s: LaunchSettings) -> dict[str, str]:
    """The variables (besides torchrun's) every worker gets; each nbaccel one also under its ACCELERATE_ name."""
    from ..launch.rank_environment import worker_environment as build

    return build(worker_config(s))


def script_plan(s: LaunchSettings) -> LaunchPlan:
    """The launch's plan, from the one plan builder (nbaccel.launch.kernel.plan `build_plan`, program script):
    this machine's ranks, the rendezvous, the script and every rank's environment, final before anything starts
    (as notebook_launcher's and RankPool's)."""
    from ..launch.kernel.plan import LaunchRequest, Program, ScriptTarget, build_plan

    script = ScriptTarget(script=s.script, args=tuple(s.script_args), module=s.module, no_python=s.no_python,
                          role=s.role, log_dir=s.log_dir, tee=s.tee, quiet=s.quiet, same_network=s.same_network)
    return build_plan(LaunchRequest(
        function=None, program=Program.SCRIPT, script=script, worker=worker_config(s), use_cpu=s.use_cpu,
        num_processes=s.nproc_per_node, mixed_precision=s.mixed_precision, num_nodes=s.num_machines,
        node_rank=s.machine_rank, master_addr=s.main_process_ip or "", use_port=s.main_process_port,
        rdzv_backend=s.rdzv_backend, rdzv_conf=_rdzv_conf(s.rdzv_conf), max_restarts=s.max_restarts,
        monitor_interval=s.monitor_interval))


def _rdzv_conf(text: str) -> dict[str, str]:
    """`--rdzv_conf "key=value,key2=value2"` as torchrun reads it."""
    conf = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise LaunchOptionError(f"--rdzv_conf: {short_repr(item)} is not key=value (give "
                                    "'key=value,key2=value2')")
        conf[key.strip()] = value.strip()
    return conf


def torchrun_arguments(s: LaunchSettings, watched: bool = False) -> list[str]:
    """The torch.distributed.run command line for these settings (this machine's part of the run); see
    nbaccel.launch.kernel.torchrun.torchrun_arguments."""
    from ..launch.kernel.torchrun import torchrun_arguments as from_plan

    return from_plan(script_plan(s), watched)


def run_settings(s: LaunchSettings) -> int:
    """Launch the workers (blocking) and return the exit status: 0, or 1 when a worker failed or the ranks
    deadlocked in collectives (named within seconds: launch/kernel/collective_watch.py).

    The plan goes the way of every launch (kernel/launcher.py `run_plan`): its backend (placement elastic,
    kernel/elastic.py, with torchrun's agent: kernel/torchrun.py) starts the ranks, the supervisor watches them and stops them on a deadlock, ranks stuck
    after their script, or a signal to this process."""
    from ..launch.errors import LaunchError
    from ..launch.kernel.launcher import run_plan
    from ..launch.kernel.observers import Reporting
    from ..launch.kernel.placements import select_backend

    plan = script_plan(s)
    backend = select_backend(plan)
    script = getattr(backend, "script", None)  # placement elastic's script part (kernel/torchrun.py)
    if script is None:
        raise LaunchError(f"placement {plan.placement.value!r} runs no script for nbaccel launch")
    try:
        with _signals_stop_the_launch(backend):
            run_plan(plan, backend, None, Reporting(dashboard=False))
    except LaunchError as error:
        if script.deadlock is not None:
            print(f"nbaccel launch: {_deadlock_report(script.deadlock)}", file=sys.stderr)
            return 1
        reasons = {rank: _exit_reason(f.exitcode) for rank, f in error.failures.items() if f.exitcode is not None}
        first = error.first_rank if error.first_rank in reasons else next(iter(reasons), None)
        if first is None:
            raise
        print(f"nbaccel launch: rank {first} failed ({reasons[first]}); {len(reasons)} process(es) failed in all",
              file=sys.stderr)
        diagnosis = script.after_failure(reasons)
        if diagnosis is not None:
            print(f"nbaccel launch: {_deadlock_report(diagnosis)}", file=sys.stderr)
        return 1
    except _Stopped as stop:
        _last_line(f"nbaccel launch: stopped by {signal.Signals(stop.signum).name}; workers stopped")
        return 128 + stop.signum
    if script.exit_hang is not None:  # every script completed; a process hung in its teardown
        print(f"nbaccel launch: {script.exit_hang.summary()}", file=sys.stderr)
    return 0


def _last_line(line: str) -> None:
    """The stopped launch's line on stderr. A closed terminal (its SIGHUP stopped the launch) fails the write with
    EIO: the launch still ends with its status (128 + the signal), not with a traceback and 1."""
    try:
        print(line, file=sys.stderr, flush=True)
    except OSError:
        pass


class _Stopped(BaseException):
    """A signal asked this process to stop: the supervisor stops every rank on the way out."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def _signals_stop_the_launch(backend: ThreadedBackend) -> Iterator[None]:
    """SIGINT, SIGTERM, SIGHUP and SIGQUIT stop the launch (every rank), as torchrun's agent does when it runs
    in the main thread (here it runs beside the supervisor), and end it with 128 + the signal (torchrun: exit 1
    and SignalException's traceback; docs/compat.md). The ranks get the signal the launch got, as torchrun
    passes it on: Ctrl-C reaches a script as KeyboardInterrupt (its `except KeyboardInterrupt:` saves). A signal
    while the ranks are being stopped sends SIGTERM, as torchrun's does: a rank that did not end on Ctrl-C (in a
    C call, which sees it only when it returns) ends then, not after the grace."""
    signalled: list[int] = []

    def stop(signum: int, frame: object) -> None:
        backend.stop_signal = signal.SIGTERM if signalled else signum
        signalled.append(signum)
        raise _Stopped(signum)

    names = [name for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT") if hasattr(signal, name)]
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {name: signal.signal(getattr(signal, name), stop) for name in names}
    try:
        yield
    finally:
        for name, handler in previous.items():
            signal.signal(getattr(signal, name), handler)


def _exit_reason(exitcode: int) -> str:
    if exitcode == -signal.SIGKILL:  # torchrun's agent samples no memory: the hint without a sample
        return "signal 9, SIGKILL: out of memory? the OOM killer sends SIGKILL"
    return f"exit code {exitcode}" if exitcode >= 0 else f"signal {-exitcode}"


def _deadlock_report(diagnosis: Diagnosis) -> str:
    from ..launch.kernel.collective_watch import report

    return report(diagnosis)


def launch_command(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    """`nbaccel launch`: read the config, check the options, run. Bad options exit 2 with one line."""
    parser = parser or args._parser
    try:
        config = read_launch_config(args.config_file, cpu=args.cpu)
    except UnknownConfigKeys as exc:  # a ValueError raised to the caller, as in Accelerate (the CLI: one line)
        if getattr(args, "_from_cli", False):
            parser.error(str(exc))
        raise
    except ConfigError as exc:
        parser.error(str(exc).replace("\n", "; "))
    try:
        settings = resolve_settings(args, config)
        check_script(settings)
    except (ConfigError, LaunchOptionError) as exc:
        parser.error(str(exc).replace("\n", "; "))
    return run_settings(settings)


# --- Accelerate's names in this module ------------------------------------------------------------------------
description = ("Run a script on every process (torch.distributed.run underneath). Options take hyphens "
               "(`--num-processes 2`) or underscores (`--num_processes 2`); the help lists the underscore form.")

# The option that shows each group of options in Accelerate's help.
options_to_group = {"multi_gpu": "Distributed GPUs", "tpu": "TPU", "use_deepspeed": "DeepSpeed Arguments",
                    "use_fsdp": "FSDP Arguments", "use_megatron_lm": "Megatron-LM Arguments",
                    "fp8_backend": "FP8 Arguments"}


def clean_option(option: str) -> str:
    """`--num-processes` -> `num_processes`: an option string as its dest."""
    return option.lstrip("-").replace("-", "_")


class CustomHelpFormatter(argparse.HelpFormatter):
    """Help text with the options listed under their groups (the format `nbaccel launch --help` uses). An
    option accepted with hyphens and with underscores is listed once, with underscores, as Accelerate lists
    it (`--num_processes`, not also `--num-processes`)."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        strings = action.option_strings
        shown = [o for o in strings if not (o.startswith("--") and "-" in o[2:] and "--" + clean_option(o) in strings)]
        if len(shown) == len(strings):
            return super()._format_action_invocation(action)
        trimmed = copy.copy(action)
        trimmed.option_strings = shown
        return super()._format_action_invocation(trimmed)


def launch_command_parser(subparsers=None) -> argparse.ArgumentParser:
    """The `launch` parser with every option of `accelerate launch` (added to `subparsers` when given)."""
    from .main import command_parser

    parser = command_parser(subparsers, "launch", launch_command, description, allow_abbrev=False,
                            formatter_class=CustomHelpFormatter)
    add_launch_arguments(parser)
    parser.set_defaults(_parser=parser)
    return parser


def _validate_launch_command(args: argparse.Namespace) -> tuple[argparse.Namespace, LaunchConfig | None, bool]:
    """Check `args` and fill what was not given from the config file and defaults, as Accelerate's function of
    this name does. Returns (args, the config read or None, whether mixed_precision came from the config);
    raises LaunchOptionError (a ValueError) for options that cannot work."""
    config = read_launch_config(args.config_file, cpu=args.cpu)
    settings = resolve_settings(args, config)
    mp_from_config = _given(args, "mixed_precision") is None and config is not None and config.mixed_precision is not None
    for name in ("num_processes", "num_machines", "machine_rank", "main_process_ip", "main_process_port",
                 "mixed_precision", "gpu_ids", "rdzv_backend", "same_network", "debug", "use_fsdp", "use_deepspeed",
                 "multi_gpu", "gradient_accumulation_steps", "num_cpu_threads_per_process"):
        setattr(args, name, getattr(settings, name))
    args.use_cpu = args.cpu = settings.use_cpu
    _copy_sections_to_args(args, settings, config)
    args.dynamo_backend = str(settings.dynamo_config.get("dynamo_backend", "no")).lower()
    args._settings = settings
    return args, config, mp_from_config


def _copy_sections_to_args(args: argparse.Namespace, settings: LaunchSettings, config: LaunchConfig | None) -> None:
    """As Accelerate's validation does: the config's `fsdp_config` / `dynamo_config` keys become the `fsdp_*` /
    `dynamo_*` options (the merged values: a command-line option given wins), and `deepspeed_config` keys fill
    the DeepSpeed options not given."""
    for section, prefix in ((settings.fsdp_config, "fsdp_"), (settings.dynamo_config, "dynamo_")):
        for key, value in section.items():
            setattr(args, key if key.startswith(prefix) else prefix + key, value)
    for key, value in ((config.deepspeed_config or {}) if config is not None else {}).items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)


def _run(args: argparse.Namespace) -> int:
    settings = getattr(args, "_settings", None) or _validate_launch_command(args)[0]._settings
    check_script(settings)
    return run_settings(settings)


def simple_launcher(args: argparse.Namespace) -> int:
    """Run `args` (a parsed launch command line) through torchrun; nbaccel has one launcher for one process
    and many, so this is `multi_gpu_launcher`."""
    return _run(args)


def multi_gpu_launcher(args: argparse.Namespace) -> int:
    """Run `args` (a parsed launch command line) on its processes through torchrun."""
    return _run(args)


def deepspeed_launcher(args: argparse.Namespace) -> int:
    """Accelerate's DeepSpeed launcher: refused, DeepSpeed is not driven by nbaccel."""
    from ..utils.integration import DEEPSPEED

    DEEPSPEED.refuse("deepspeed_launcher")


def tpu_launcher(args: argparse.Namespace) -> int:
    """Accelerate's TPU launcher: refused, TPU runs go through notebook_launcher (torch_xla)."""
    raise LaunchOptionError("TPU processes are started by notebook_launcher (torch_xla) in a TPU notebook, not by "
                            "nbaccel launch")


def tpu_pod_launcher(args: argparse.Namespace) -> int:
    """Accelerate's TPU pod launcher: refused, as `tpu_launcher`."""
    return tpu_launcher(args)


def sagemaker_launcher(sagemaker_config, args: argparse.Namespace) -> int:
    """Accelerate's SageMaker launcher: refused, SageMaker is not supported."""
    from ..utils.integration import SAGEMAKER

    SAGEMAKER.refuse("sagemaker_launcher")


def main(argv: list[str] | None = None) -> int:
    """`python -m nbaccel.commands.launch ...` (and the `nbaccel-launch` script): `nbaccel launch`, through the
    `nbaccel` command's entry point, so its errors, Ctrl-C and exit status are the same."""
    from .main import run_as

    return run_as("launch", argv)


def register(subparsers) -> None:
    launch_command_parser(subparsers)


if __name__ == "__main__":
    raise SystemExit(main())
