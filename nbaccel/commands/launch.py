"""`nbaccel launch [options] script.py [script args]`: run a script on every process, through torchrun's agent.

Options not given on the command line come from the config file (`--config_file`, else the default one, see
`nbaccel.utils.config_file`), then from defaults. `--num_processes` is the TOTAL over all machines, as in
Accelerate. The workers get the torch launcher variables (RANK, WORLD_SIZE, MASTER_ADDR...) from
torch.distributed.run and nbaccel's (NBACCEL_MIXED_PRECISION, NBACCEL_USE_CPU, ...) from here; see
docs/internals.md for the list.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..utils.config_file import ConfigError, LaunchConfig, load_config
from ..utils.constants import MIXED_PRECISION_CHOICES, RDZV_BACKENDS
from ..utils.dataclasses import DynamoBackend


class LaunchOptionError(ValueError):
    """A launch option (or config value) that cannot work; reported as a one-line usage error."""


def _opt(*names: str) -> list[str]:
    """Accept `--num_processes` and `--num-processes`, as Accelerate does."""
    out = []
    for name in names:
        out.append(name)
        if name.startswith("--") and "_" in name:
            out.append(name.replace("_", "-"))
    return out


def add_launch_arguments(parser: argparse.ArgumentParser, *, script: bool = True) -> None:
    """The launch options (shared with `nbaccel test`, which supplies its own script)."""
    parser.add_argument(*_opt("--config_file"), default=None, help="Config file to read (default: the one in use, see `nbaccel env`).")
    parser.add_argument(*_opt("--num_processes"), type=int, default=None,
                        help="Total number of processes over all machines (default: config, else one per GPU, else 1).")
    parser.add_argument(*_opt("--num_machines"), type=int, default=None, help="Number of machines (default 1).")
    parser.add_argument(*_opt("--machine_rank"), type=int, default=None, help="Rank of this machine, 0 .. num_machines-1.")
    parser.add_argument(*_opt("--main_process_ip"), default=None, help="Address of the machine with rank 0.")
    parser.add_argument(*_opt("--main_process_port"), type=int, default=None,
                        help="Port on the main machine (default: a free one on a single machine, 29500 on several).")
    parser.add_argument(*_opt("--mixed_precision"), default=None, choices=MIXED_PRECISION_CHOICES, help="Mixed precision mode.")
    parser.add_argument("--cpu", action="store_true", default=None, help="Run on the CPU even if GPUs are present.")
    parser.add_argument(*_opt("--multi_gpu"), action="store_true", default=None,
                        help="Accepted for Accelerate compatibility: the process count decides.")
    parser.add_argument(*_opt("--gpu_ids"), default=None, help="GPUs this machine uses: 'all' or e.g. '0,1'.")
    parser.add_argument(*_opt("--rdzv_backend"), default=None, choices=RDZV_BACKENDS,
                        help="torch.distributed.elastic rendezvous: static (default) or c10d (elastic, restarts).")
    parser.add_argument(*_opt("--rdzv_conf"), default="", help="Extra rendezvous settings, 'key1=value1,key2=value2'.")
    parser.add_argument(*_opt("--same_network"), action="store_true", default=None,
                        help="Machines share a local network (kept for Accelerate compatibility).")
    parser.add_argument(*_opt("--max_restarts"), type=int, default=0, help="Restart the workers this many times on failure.")
    parser.add_argument(*_opt("--monitor_interval"), type=float, default=0.1, help="Seconds between worker health checks.")
    parser.add_argument(*_opt("--dynamo_backend"), default=None, help="torch.compile backend (e.g. inductor; 'no' turns it off).")
    parser.add_argument(*_opt("--dynamo_mode"), default=None, help="torch.compile mode: default, reduce-overhead, max-autotune.")
    parser.add_argument(*_opt("--gradient_accumulation_steps"), type=int, default=None, help="Steps to accumulate gradients over.")
    parser.add_argument(*_opt("--use_fsdp"), action="store_true", default=None, help="Use FullyShardedDataParallel.")
    parser.add_argument(*_opt("--fsdp_version"), type=int, default=None, choices=(1, 2), help="FSDP version (default 1, as Accelerate).")
    parser.add_argument(*_opt("--use_deepspeed"), action="store_true", default=None, help="Use DeepSpeed (pip install deepspeed).")
    parser.add_argument(*_opt("--num_cpu_threads_per_process"), type=int, default=None,
                        help="OMP_NUM_THREADS of each process (default: CPU cores / local processes).")
    parser.add_argument("--debug", action="store_true", default=None, help="Check collectives' shapes across processes.")
    parser.add_argument(*_opt("--log_dir"), default=None, help="Directory for torchrun's per-rank logs.")
    parser.add_argument("--tee", default=None, help="torchrun --tee: also write stdout/stderr (0..3) to --log_dir.")
    if script:
        parser.add_argument("-m", "--module", action="store_true", help="Run the script argument as a module (python -m).")
        parser.add_argument("training_script", help="The script (or module with -m) to run on every process.")
        parser.add_argument("training_script_args", nargs=argparse.REMAINDER, help="Arguments of the script.")


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

    @property
    def nproc_per_node(self) -> int:
        return self.num_processes // self.num_machines


def _device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_settings(args: argparse.Namespace, config: LaunchConfig | None) -> LaunchSettings:
    """Merge `args` over `config` over defaults; raise LaunchOptionError for anything that cannot work."""
    cfg = config or LaunchConfig()
    _check_supported(cfg)

    def pick(name: str, default=None):
        value = getattr(args, name, None)
        if value is not None:
            return value
        from_config = getattr(cfg, name, None) if config is not None else None
        return default if from_config is None else from_config

    use_cpu = bool(args.cpu) if args.cpu is not None else bool(cfg.use_cpu) or str(cfg.distributed_type) == "MULTI_CPU"
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
        rdzv_backend=pick("rdzv_backend", "static"),
        rdzv_conf=args.rdzv_conf or "",
        same_network=bool(pick("same_network", False)),
        max_restarts=args.max_restarts,
        monitor_interval=args.monitor_interval,
        dynamo_config=dict(cfg.dynamo_config or {}),
        gradient_accumulation_steps=pick("gradient_accumulation_steps", None),
        use_fsdp=bool(args.use_fsdp) or cfg.uses_fsdp,
        fsdp_config=dict(cfg.fsdp_config or {}),
        use_deepspeed=bool(args.use_deepspeed) or cfg.uses_deepspeed,
        debug=bool(args.debug) if args.debug is not None else bool(cfg.debug),
        num_cpu_threads_per_process=args.num_cpu_threads_per_process,
        log_dir=args.log_dir,
        tee=args.tee,
        config_path=cfg.path if config is not None else None,
    )
    if args.dynamo_backend is not None:
        settings.dynamo_config["dynamo_backend"] = args.dynamo_backend
    if args.dynamo_mode is not None:
        settings.dynamo_config["dynamo_mode"] = args.dynamo_mode
    if args.fsdp_version is not None:
        settings.fsdp_config["fsdp_version"] = args.fsdp_version
    given = args.num_processes is not None or (config is not None and config.num_processes is not None)
    _check(settings, given_processes=given)
    if settings.num_processes == 0:  # unset: one process per GPU of each machine, else one (checked above)
        devices = 0 if settings.use_cpu else _device_count()
        settings.num_processes = max(devices, 1) * settings.num_machines
    return settings


def _check_supported(cfg: LaunchConfig) -> None:
    """Configurations `nbaccel launch` cannot run, said before anything starts."""
    where = f"{cfg.path}: " if cfg.path is not None else ""
    if str(cfg.compute_environment) == "AMAZON_SAGEMAKER":
        raise LaunchOptionError(f"{where}compute_environment AMAZON_SAGEMAKER: nbaccel launch runs on this machine "
                                "only; use `accelerate launch` for SageMaker jobs")
    unsupported = {
        "XLA": "TPU processes are started by notebook_launcher (torch_xla) in a TPU notebook, not by nbaccel launch",
        "MEGATRON_LM": "Megatron-LM is not supported by nbaccel",
    }
    if str(cfg.distributed_type) in unsupported:
        raise LaunchOptionError(f"{where}distributed_type {cfg.distributed_type}: {unsupported[str(cfg.distributed_type)]}")


def _check(s: LaunchSettings, given_processes: bool = True) -> None:
    def fail(message: str) -> None:
        raise LaunchOptionError(message)

    if s.module:
        local = Path(s.script.replace(".", "/"))
        if importlib.util.find_spec(s.script.split(".")[0]) is None and not (
            local.is_dir() or local.with_suffix(".py").is_file()
        ):
            fail(f"module {s.script!r} not found (with -m, give an importable module name)")
    elif not Path(s.script).is_file():
        fail(f"training script {s.script!r} not found" + (" (it is a directory)" if Path(s.script).is_dir() else ""))
    if s.num_machines < 1:
        fail(f"--num_machines must be >= 1, got {s.num_machines}")
    if s.num_processes < 0 or (s.num_processes == 0 and given_processes):
        fail(f"--num_processes must be >= 1, got {s.num_processes}")
    if s.num_processes % s.num_machines:
        fail(f"--num_processes ({s.num_processes}, the total over all machines) must be a multiple of "
             f"--num_machines ({s.num_machines})")
    if not 0 <= s.machine_rank < s.num_machines:
        fail(f"--machine_rank must be between 0 and {s.num_machines - 1}, got {s.machine_rank}")
    if s.num_machines > 1 and not s.main_process_ip:
        fail("--main_process_ip is needed with --num_machines > 1 (the address of the machine with rank 0)")
    if s.main_process_port is not None and not 0 < s.main_process_port < 65536:
        fail(f"--main_process_port must be between 1 and 65535, got {s.main_process_port}")
    if s.mixed_precision not in MIXED_PRECISION_CHOICES:
        fail(f"--mixed_precision must be one of {', '.join(MIXED_PRECISION_CHOICES)}, got {s.mixed_precision!r}")
    if s.mixed_precision == "fp8" and not any(
        importlib.util.find_spec(m) for m in ("transformer_engine", "msamp", "torchao")
    ):
        fail("--mixed_precision fp8 needs Transformer Engine, MS-AMP or torchao: pip install torchao")
    if s.rdzv_backend not in RDZV_BACKENDS:
        fail(f"--rdzv_backend must be one of {', '.join(RDZV_BACKENDS)}, got {s.rdzv_backend!r}")
    if s.max_restarts < 0:
        fail(f"--max_restarts must be >= 0, got {s.max_restarts}")
    if s.monitor_interval <= 0:
        fail(f"--monitor_interval must be > 0 seconds, got {s.monitor_interval}")
    if s.num_cpu_threads_per_process is not None and s.num_cpu_threads_per_process < 1:
        fail(f"--num_cpu_threads_per_process must be >= 1, got {s.num_cpu_threads_per_process}")
    if s.gradient_accumulation_steps is not None and s.gradient_accumulation_steps < 1:
        fail(f"--gradient_accumulation_steps must be >= 1, got {s.gradient_accumulation_steps}")
    if s.gpu_ids not in (None, "all") and not all(p.strip().isdigit() for p in str(s.gpu_ids).split(",")):
        fail(f"--gpu_ids must be 'all' or a comma-separated list of GPU indices, got {s.gpu_ids!r}")
    backend = str(s.dynamo_config.get("dynamo_backend", "no")).upper()
    if backend not in DynamoBackend.list():
        fail(f"--dynamo_backend must be one of {', '.join(b.lower() for b in DynamoBackend.list())}, got {backend.lower()!r}")
    if s.use_deepspeed and importlib.util.find_spec("deepspeed") is None:
        fail("DeepSpeed is selected but not installed: pip install deepspeed")
    if s.use_fsdp and s.use_deepspeed:
        fail("choose one of FSDP and DeepSpeed, not both")


def _flag(value) -> str:
    """Environment text for a config value: bools as true/false, everything else as str()."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


# What `accelerate launch` sets for an FSDP run when neither the config file nor a flag names the value.
_FSDP_LAUNCH_DEFAULTS = {
    "fsdp_version": 1, "fsdp_sharding_strategy": "FULL_SHARD", "fsdp_reshard_after_forward": True,
    "fsdp_offload_params": False, "fsdp_min_num_params": 100_000_000, "fsdp_forward_prefetch": False,
    "fsdp_use_orig_params": True, "fsdp_cpu_ram_efficient_loading": True, "fsdp_sync_module_states": True,
    "fsdp_activation_checkpointing": False, "fsdp_activation_checkpointing_offload": False,
}

# fsdp_config keys (Accelerate's config file) -> FSDP_* variables read by FullyShardedDataParallelPlugin.
_FSDP_ENV = {
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

_DYNAMO_ENV = {
    "dynamo_backend": "DYNAMO_BACKEND",
    "dynamo_mode": "DYNAMO_MODE",
    "dynamo_use_fullgraph": "DYNAMO_USE_FULLGRAPH",
    "dynamo_use_dynamic": "DYNAMO_USE_DYNAMIC",
    "dynamo_use_regional_compilation": "DYNAMO_USE_REGIONAL_COMPILATION",
}


def _source_checkout_root() -> str | None:
    """The directory holding this nbaccel package when it runs from a source tree (not installed), so the
    workers, whose sys.path starts at the script's folder, import the same nbaccel."""
    root = Path(__file__).resolve().parent.parent.parent
    if {"site-packages", "dist-packages"} & set(root.parts):
        return None
    return str(root)


def worker_environment(s: LaunchSettings) -> dict[str, str]:
    """The variables (besides torchrun's) every worker gets; each nbaccel one also under its ACCELERATE_ name."""
    env: dict[str, str] = {}

    def both(name: str, value: str) -> None:
        env["NBACCEL_" + name] = value
        env["ACCELERATE_" + name] = value

    both("MIXED_PRECISION", s.mixed_precision)
    both("USE_CPU", _flag(s.use_cpu))
    if s.debug:
        both("DEBUG_MODE", "true")
    if s.gradient_accumulation_steps is not None:
        both("GRADIENT_ACCUMULATION_STEPS", str(s.gradient_accumulation_steps))
    for key, name in _DYNAMO_ENV.items():
        if key in s.dynamo_config and s.dynamo_config[key] is not None:
            value = s.dynamo_config[key]
            both(name, str(value).upper() if key == "dynamo_backend" else _flag(value))
    if s.use_fsdp:
        both("USE_FSDP", "true")
        for key, name in _FSDP_ENV.items():
            value = s.fsdp_config.get(key)
            value = _FSDP_LAUNCH_DEFAULTS.get(key) if value is None else value
            if value is not None:
                env[name] = _flag(value)
    if s.use_deepspeed:
        both("USE_DEEPSPEED", "true")
    if s.gpu_ids not in (None, "all") and not s.use_cpu:
        env["CUDA_VISIBLE_DEVICES"] = str(s.gpu_ids)
    if s.num_cpu_threads_per_process is not None:
        env["OMP_NUM_THREADS"] = str(s.num_cpu_threads_per_process)
    elif "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // s.nproc_per_node))
    source_root = _source_checkout_root()
    if source_root is not None:
        paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        if source_root not in paths:
            env["PYTHONPATH"] = os.pathsep.join([source_root, *paths])
    if s.config_path is not None:
        env["NBACCEL_CONFIG_FILE_USED"] = str(s.config_path)
    return env


def torchrun_arguments(s: LaunchSettings) -> list[str]:
    """The torch.distributed.run command line for these settings (this machine's part of the run)."""
    argv = [f"--nnodes={s.num_machines}", f"--nproc-per-node={s.nproc_per_node}",
            f"--max-restarts={s.max_restarts}", f"--monitor-interval={s.monitor_interval}"]
    if s.num_machines > 1:
        port = s.main_process_port or 29500
        if s.rdzv_backend == "static":
            argv += ["--rdzv-backend=static", f"--node-rank={s.machine_rank}",
                     f"--master-addr={s.main_process_ip}", f"--master-port={port}"]
        else:
            argv += [f"--rdzv-backend={s.rdzv_backend}", f"--rdzv-endpoint={s.main_process_ip}:{port}",
                     f"--rdzv-id=nbaccel-{port}"]
    else:
        argv.append(f"--rdzv-backend={s.rdzv_backend}")
        if s.main_process_port is not None:
            if s.rdzv_backend == "static":
                argv += ["--master-addr=127.0.0.1", f"--master-port={s.main_process_port}"]
            else:
                argv += [f"--rdzv-endpoint=127.0.0.1:{s.main_process_port}", f"--rdzv-id=nbaccel-{s.main_process_port}"]
        # no port: torch.distributed.run picks a free one on a single machine
    if s.rdzv_conf:
        argv.append(f"--rdzv-conf={s.rdzv_conf}")
    if s.log_dir:
        argv.append(f"--log-dir={s.log_dir}")
    if s.tee is not None:
        argv.append(f"--tee={s.tee}")
    if s.module:
        argv.append("--module")
    return argv + [s.script, *s.script_args]


def run_settings(s: LaunchSettings) -> int:
    """Launch the workers (blocking) and return the exit status: 0, or 1 when a worker failed."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    os.environ.update(worker_environment(s))
    args = torchrun.get_args_parser().parse_args(torchrun_arguments(s))
    try:
        torchrun.run(args)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        reason = f"exit code {failure.exitcode}" if failure.exitcode >= 0 else f"signal {-failure.exitcode}"
        print(f"nbaccel launch: rank {rank} failed ({reason}); {len(exc.failures)} process(es) failed in all",
              file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("nbaccel launch: interrupted; workers stopped", file=sys.stderr)
        return 130
    except SignalException as exc:  # the agent turns SIGTERM/SIGINT/... into this after stopping the workers
        print(f"nbaccel launch: stopped by {exc.sigval.name}; workers stopped", file=sys.stderr)
        return 128 + int(exc.sigval)
    return 0


def launch_command(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    """`nbaccel launch`: read the config, check the options, run. Bad options exit 2 with one line."""
    parser = parser or args._parser
    try:
        config = load_config(args.config_file)
        settings = resolve_settings(args, config)
    except (ConfigError, LaunchOptionError) as exc:
        parser.error(str(exc).replace("\n", "; "))
    return run_settings(settings)


def register(subparsers) -> None:
    from .main import add_command

    parser = add_command(subparsers, "launch", launch_command,
                         help="Run a script on every process (torch.distributed.run underneath).",
                         allow_abbrev=False)
    add_launch_arguments(parser)
    parser.set_defaults(_parser=parser)
