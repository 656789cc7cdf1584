"""The saved launch configuration (`nbaccel config`, `config_widget()`) as notebook_launcher's defaults.

An argument the caller passed always wins; one left at its default takes the config file's value. To tell
"left at its default" from "passed the same value" (e.g. `mixed_precision="no"`), the launcher's signature
defaults are marked values (`DEFAULT_NO` is a str equal to "no"; `inspect.signature` still shows 'no').
A file that cannot be read raises `ConfigError` ("<file>: <key>: <problem>") before any process starts.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from typing import Any

from ...utils.dataclasses import enum_value


class _Default:
    """Marks a signature default: the caller did not pass this argument."""

    __slots__ = ()


class _DefaultStr(_Default, str):
    __slots__ = ()


class _DefaultInt(_Default, int):
    __slots__ = ()


def default(value: Any) -> Any:
    """`value` marked as a signature default (compares, prints and hashes like `value`)."""
    if isinstance(value, str):
        return _DefaultStr(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return _DefaultInt(value)
    raise TypeError(f"no default marker for {type(value).__name__}")


def is_default(value: Any) -> bool:
    """Whether `value` is a marked signature default (None counts too: "not given")."""
    return value is None or isinstance(value, _Default)


def plain(value: Any) -> Any:
    """The value without its marker (what the rest of the launcher works with)."""
    if isinstance(value, _DefaultStr):
        return str(value)
    if isinstance(value, _DefaultInt):
        return int(value)
    return value


# Configs meant for an accelerator: on a machine without one, their process count is ignored.
_ACCELERATOR_TYPES = {"MULTI_GPU", "FSDP", "DEEPSPEED", "MEGATRON_LM", "MULTI_NPU", "MULTI_MLU", "MULTI_SDAA",
                      "MULTI_MUSA", "MULTI_XPU", "MULTI_HPU", "XLA"}


@dataclass
class LaunchDefaults:
    """The launcher's settings after the config file filled in what the caller left at its default."""

    num_processes: int | None
    mixed_precision: str
    use_port: int | str | None
    master_addr: str
    node_rank: int
    num_nodes: int
    rdzv_backend: str
    start_method: str | None
    use_cpu: bool = False
    env: dict[str, str] = field(default_factory=dict)  # extra worker environment (gradient accumulation)
    source: str | None = None  # the config file used, if any
    config: Any = None  # the LaunchConfig read (its settings for the workers: nbaccel.launch.rank_environment)


def apply_saved_config(arguments: Any, gpus: int) -> LaunchDefaults:
    """Fill the arguments left at their defaults from the config file in use (none: unchanged).

    `arguments`: the launch's arguments (a LaunchRequest: `num_processes`, `mixed_precision`, `use_port`,
    `master_addr`, `node_rank`, `num_nodes`, `rdzv_backend`, `start_method`). `gpus` is the number of visible
    GPUs: a config for GPUs (e.g. `distributed_type: MULTI_GPU`) read on a machine without one keeps CPU
    launches working (its process count is ignored, with a one-line note).
    """
    from ...utils.config_file import display_path, load_config

    num_processes, mixed_precision, use_port, start_method = (
        arguments.num_processes, arguments.mixed_precision, arguments.use_port, arguments.start_method)
    master_addr, node_rank, num_nodes, rdzv_backend = (
        arguments.master_addr, arguments.node_rank, arguments.num_nodes, arguments.rdzv_backend)
    result = LaunchDefaults(num_processes, plain(mixed_precision), use_port, plain(master_addr), plain(node_rank),
                            plain(num_nodes), plain(rdzv_backend), start_method)
    config = load_config()  # ConfigError (file and key named) propagates: nothing has started yet
    if config is None:
        return result
    where = display_path(config.path) if config.path is not None else "config"
    result.source = where
    result.config = config
    given = dataclasses.replace(result)
    result.use_cpu = bool(config.use_cpu)
    distributed_type = enum_value(config.distributed_type)
    for_accelerator = distributed_type in _ACCELERATOR_TYPES and not config.use_cpu
    multi_node = is_default(num_nodes) and config.num_machines > 1
    if multi_node:
        result.num_nodes = config.num_machines
        if is_default(node_rank):
            result.node_rank = config.machine_rank
        if is_default(master_addr) and config.main_process_ip:
            result.master_addr = config.main_process_ip
        if is_default(rdzv_backend):
            result.rdzv_backend = config.rdzv_backend
    if num_processes is None and config.num_processes is not None:
        if for_accelerator and gpus == 0:
            print(f"nbaccel: {where} is for distributed_type {distributed_type} but no GPU is visible: ignoring "
                  f"its num_processes={config.num_processes}, running on the CPU.", file=sys.stderr)
        else:  # Accelerate's file counts the processes of all machines; the launcher's are per node
            result.num_processes = max(config.num_processes // max(result.num_nodes, 1), 1) if multi_node \
                else config.num_processes
    if is_default(mixed_precision) and config.mixed_precision:
        result.mixed_precision = enum_value(config.mixed_precision)
    if start_method is None:
        result.start_method = config.start_method
    if use_port is None and config.main_process_port:  # 0 means "pick a free port", which None does too
        result.use_port = config.main_process_port
    if config.gradient_accumulation_steps is not None:
        steps = str(config.gradient_accumulation_steps)
        result.env = {"NBACCEL_GRADIENT_ACCUMULATION_STEPS": steps, "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": steps}
    _report_taken(where, given, result, config)
    return result


_REPORTED = ("num_processes", "mixed_precision", "use_port", "master_addr", "node_rank", "num_nodes", "rdzv_backend",
             "start_method", "use_cpu")


# Keys of the config file that notebook_launcher applies (the rest are for `nbaccel launch` or TPU pods).
_APPLIED = {"compute_environment", "distributed_type", "num_processes", "mixed_precision", "use_cpu",
            "main_process_port", "num_machines", "machine_rank", "main_process_ip", "rdzv_backend", "start_method",
            "gradient_accumulation_steps", "extra", "path"}


def _report_taken(where: str, given: LaunchDefaults, result: LaunchDefaults, config: Any) -> None:
    """One line on stderr naming the file, each value notebook_launcher took from it, and the keys it set that
    notebook_launcher does not apply (nbaccel's addition: Accelerate's notebook_launcher reads no config file, so
    nothing from one may pass unnoticed)."""
    from ...utils.config_file import LaunchConfig

    taken = [f"{name}={getattr(result, name)!r}" for name in _REPORTED if getattr(result, name) != getattr(given, name)]
    taken += [f"gradient_accumulation_steps={result.env['NBACCEL_GRADIENT_ACCUMULATION_STEPS']}"] if result.env else []
    defaults = LaunchConfig()

    def set_to_something(name: str) -> bool:  # a value that asks for something (not empty, off or the default)
        value = getattr(config, name)
        if name == "same_network" and config.num_machines <= 1:
            return False  # one machine: nothing to meet over, in Accelerate too
        return value != getattr(defaults, name) and value not in (None, False, "no", [], {})

    unused = sorted(f.name for f in dataclasses.fields(config) if f.name not in _APPLIED and set_to_something(f.name))
    parts = ([", ".join(taken)] if taken else []) + (
        [f"not used by notebook_launcher: {', '.join(unused)}"] if unused else [])
    if parts:
        print(f"nbaccel: notebook_launcher takes from {where}: {'; '.join(parts)}", file=sys.stderr)
