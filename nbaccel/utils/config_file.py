"""The launch configuration file: the YAML that `nbaccel config` writes and `nbaccel launch` reads.

It reads the keys of Accelerate's `default_config.yaml`, so an existing Accelerate config works as is. Where
it lives: `$NBACCEL_CONFIG_FILE`, else `$XDG_CACHE_HOME/nbaccel/default_config.yaml` (`~/.cache/...`); when
that does not exist (and NBACCEL_CONFIG_FILE is unset), Accelerate's own `$HF_HOME/accelerate/default_config.yaml`.

API: `default_config_file()`, `find_config_file(path=None)`, `load_config(path=None) -> LaunchConfig | None`,
`LaunchConfig.validate() -> {field: message}`, `LaunchConfig.save(path=None) -> Path`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .atomic_files import atomic_write
from .constants import MIXED_PRECISION_CHOICES, RDZV_BACKENDS, START_METHODS
from .dataclasses import ComputeEnvironment, DistributedType, DynamoBackend, enum_value
from .safe_yaml import DocumentTooLargeError, load_yaml, short_keys, short_repr

CONFIG_FILE_ENV = "NBACCEL_CONFIG_FILE"
CONFIG_FILE_NAME = "default_config.yaml"


class ConfigError(ValueError):
    """A configuration file that cannot be read or holds invalid values; the message names file and key."""


# The paths are built with os.path and made Path objects at the end: every launch looks for the config file,
# and pathlib's parsing made that ~0.4 ms of a ~40 ms launch.
def _cache_home() -> str:
    return os.path.expanduser(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"))


def _default_config_path() -> str:
    explicit = os.environ.get(CONFIG_FILE_ENV)
    if explicit:
        return os.path.expanduser(explicit)
    return os.path.join(_cache_home(), "nbaccel", CONFIG_FILE_NAME)


def _accelerate_config_path() -> str:
    hf_home = os.environ.get("HF_HOME")
    base = os.path.expanduser(hf_home) if hf_home else os.path.join(_cache_home(), "huggingface")
    return os.path.join(base, "accelerate", CONFIG_FILE_NAME)


def default_config_file() -> Path:
    """Where nbaccel reads and writes its config: $NBACCEL_CONFIG_FILE or <cache>/nbaccel/default_config.yaml."""
    return Path(_default_config_path())


def accelerate_config_file() -> Path:
    """Accelerate's default config location: $HF_HOME/accelerate/default_config.yaml (HF_HOME: <cache>/huggingface)."""
    return Path(_accelerate_config_path())


def find_config_file(path: str | os.PathLike | None = None) -> Path | None:
    """The config file in use: `path` if given, else nbaccel's default, else Accelerate's; None if none exists."""
    if path is not None:
        return Path(path).expanduser()
    own = _default_config_path()
    if os.path.isfile(own):
        return Path(own)
    if not os.environ.get(CONFIG_FILE_ENV):
        theirs = _accelerate_config_path()
        if os.path.isfile(theirs):
            return Path(theirs)
    return None


def read_config_data(path: str | os.PathLike) -> Any:
    """The content of config file `path` (YAML; JSON is YAML too); ConfigError when it is not valid YAML, or
    when its value is absurdly large once aliases are expanded (nbaccel.utils.safe_yaml)."""
    try:
        with open(path, encoding="utf-8") as handle:
            return load_yaml(handle)
    except DocumentTooLargeError as exc:
        raise ConfigError(f"{display_path(path)}: refused: {exc}. A launch config holds a few dozen values: "
                          "write the file without such aliases.") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{display_path(path)}: not valid YAML: {exc}") from exc


def display_path(path: str | os.PathLike) -> str:
    """`path` with the home directory written as ~ (shorter error messages)."""
    text = str(path)
    home = str(Path.home())
    return "~" + text[len(home):] if home != "/" and text.startswith(home + os.sep) else text


_BOOL_TEXT = {"yes": True, "true": True, "1": True, "no": False, "false": False, "0": False}

# Fields whose values are plain dicts in the YAML (sub-configurations, passed through).
_DICT_FIELDS = ("dynamo_config", "fsdp_config", "deepspeed_config", "megatron_lm_config", "parallelism_config",
                "mpirun_config", "fp8_config")


@dataclass
class LaunchConfig:
    """One launch configuration: how many processes, on which machines, with which precision and plugins.

    Field names are the keys of Accelerate's `default_config.yaml`. Unknown keys read from a file are kept in
    `extra` (and written back on save) but otherwise ignored.
    """

    compute_environment: str = "LOCAL_MACHINE"
    distributed_type: str = "NO"
    mixed_precision: str = "no"
    use_cpu: bool = False
    debug: bool = False
    num_processes: int | None = None
    num_machines: int = 1
    machine_rank: int = 0
    gpu_ids: str | None = None
    main_process_ip: str | None = None
    main_process_port: int | None = None
    rdzv_backend: str = "static"
    # nbaccel's own keys (Accelerate's file has neither; both optional): the Accelerator's default
    # accumulation (None: not set) and how notebook_launcher starts processes (None: its own choice).
    gradient_accumulation_steps: int | None = None
    start_method: str | None = None
    same_network: bool = False
    main_training_function: str = "main"
    enable_cpu_affinity: bool = False
    # Accelerate's type and default (`config default` writes false); its interactive `config` writes "no"/"yes",
    # so either form is read and written back as it was
    downcast_bf16: bool | str = False
    dynamo_config: dict = field(default_factory=dict)
    fsdp_config: dict = field(default_factory=dict)
    deepspeed_config: dict = field(default_factory=dict)
    megatron_lm_config: dict = field(default_factory=dict)
    parallelism_config: dict = field(default_factory=dict)
    mpirun_config: dict = field(default_factory=dict)
    fp8_config: dict = field(default_factory=dict)
    tpu_name: str | None = None
    tpu_zone: str | None = None
    tpu_use_cluster: bool = False
    tpu_use_sudo: bool = False
    tpu_vm: list | None = None
    tpu_env: list | None = None
    command_file: str | None = None
    commands: list | None = None
    extra: dict = field(default_factory=dict)
    path: Path | None = field(default=None, compare=False)

    # ---------------------------------------------------------------- reading and writing
    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str | os.PathLike | None = None) -> LaunchConfig:
        """Build from a YAML mapping; bad values raise ConfigError naming `source` and the key."""
        where = display_path(source) if source is not None else "config"
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: the file must hold a mapping of keys to values, got {type(data).__name__} "
                              f"{short_repr(data)}")
        data = dict(data)
        # Older Accelerate formats: `fp16: true` and a top-level `dynamo_backend`.
        if "fp16" in data:
            fp16 = data.pop("fp16")
            data.setdefault("mixed_precision", "fp16" if fp16 else "no")
        if "dynamo_backend" in data:
            backend = data.pop("dynamo_backend")
            data.setdefault("dynamo_config", {} if str(backend).upper() == "NO" else {"dynamo_backend": backend})
        known = {f.name for f in dataclasses.fields(cls)} - {"extra", "path"}
        unknown = {k: v for k, v in data.items() if k not in known}
        if unknown and enum_value(data.get("compute_environment", "")) != "AMAZON_SAGEMAKER":  # SageMaker's keys: refused later
            warnings.warn(
                f"{where}: ignoring unknown key(s) {short_keys(unknown)} "
                "(kept in the file, not used by nbaccel)",
                stacklevel=2,
            )
        values = {k: v for k, v in data.items() if k in known}
        for key in _DICT_FIELDS:
            if key in values and values[key] is None:
                values[key] = {}
        if values.get("mixed_precision") is None and "mixed_precision" in values:
            values["mixed_precision"] = "no"
        if values.get("num_processes") == -1:  # Accelerate's "not set" (e.g. SLURM-driven configs)
            values["num_processes"] = None
        if values.get("gpu_ids") is not None:
            values["gpu_ids"] = str(values["gpu_ids"])
        if "same_network" in values and values["same_network"] is None:
            values["same_network"] = False
        for key in ("use_cpu", "debug", "same_network", "enable_cpu_affinity", "tpu_use_cluster", "tpu_use_sudo"):
            if isinstance(values.get(key), str) and values[key].strip().lower() in _BOOL_TEXT:
                values[key] = _BOOL_TEXT[values[key].strip().lower()]
        config = cls(**values, extra=unknown, path=Path(source) if source is not None else None)
        errors = config.validate()
        if errors:
            raise ConfigError("\n".join(f"{where}: {key}: {message}" for key, message in errors.items()))
        return config

    @classmethod
    def load(cls, path: str | os.PathLike | None = None) -> LaunchConfig | None:
        """Read the config file in use (see `find_config_file`); None when there is none."""
        found = find_config_file(path)
        if found is None:
            return None
        if not found.is_file():
            if path is not None:
                raise ConfigError(f"{display_path(found)}: no such config file")
            return None
        return cls.from_dict(read_config_data(found), source=found)

    def to_dict(self) -> dict[str, Any]:
        """The mapping written to YAML: Accelerate's keys (empty sub-configs and None left out) plus `extra`."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name in ("extra", "path"):
                continue
            value = getattr(self, f.name)
            if value is None or (f.name in _DICT_FIELDS and not value):
                continue
            out[f.name] = value.value if hasattr(value, "value") else value
        out.update(self.extra)
        return out

    def save(self, path: str | os.PathLike | None = None, as_json: bool | None = None) -> Path:
        """Validate and write the file (to `path`, else where it was loaded from, else the default file): JSON
        when its name ends in .json (or `as_json`), as Accelerate writes (and then reads) such a file, else YAML."""
        target = Path(path).expanduser() if path is not None else (self.path or default_config_file())
        errors = self.validate()
        if errors:
            raise ConfigError("\n".join(f"{display_path(target)}: {k}: {m}" for k, m in errors.items()))
        target.parent.mkdir(parents=True, exist_ok=True)
        with atomic_write(target) as handle:  # a reader never sees half a file, nor two writers' mix
            if as_json or (as_json is None and str(target).endswith(".json")):
                handle.write(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")
            else:
                yaml.safe_dump(self.to_dict(), handle, sort_keys=True)
        self.path = target
        return target

    def to_yaml_file(self, yaml_file: str | os.PathLike) -> None:
        """Accelerate's name: write this config as YAML to `yaml_file` (`save`)."""
        self.save(yaml_file, as_json=False)

    def to_json_file(self, json_file: str | os.PathLike) -> None:
        """Accelerate's name: write this config as JSON to `json_file`, whatever its name."""
        self.save(json_file, as_json=True)

    # ---------------------------------------------------------------- checking
    def validate(self) -> dict[str, str]:
        """Check every field; return {field: what is wrong} (empty when the config is valid)."""
        errors: dict[str, str] = {}

        def one_of(name: str, allowed: list[str] | tuple[str, ...]) -> None:
            value = getattr(self, name)
            text = value.value if hasattr(value, "value") else value
            if text not in allowed:
                errors[name] = f"{short_repr(value)} is not one of {', '.join(allowed)}"

        def integer(name: str, minimum: int, maximum: int | None = None, optional: bool = False) -> None:
            value = getattr(self, name)
            if value is None and optional:
                return
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum or (
                maximum is not None and value > maximum
            ):
                bound = f"between {minimum} and {maximum}" if maximum is not None else f">= {minimum}"
                errors[name] = f"{short_repr(value)} is not an integer {bound}"

        one_of("compute_environment", ComputeEnvironment.list())
        sagemaker = enum_value(self.compute_environment) == "AMAZON_SAGEMAKER"
        one_of("distributed_type", DistributedType.list() + (["DATA_PARALLEL", "MODEL_PARALLEL"] if sagemaker else []))
        one_of("mixed_precision", MIXED_PRECISION_CHOICES)
        one_of("rdzv_backend", RDZV_BACKENDS)
        if self.downcast_bf16 not in (False, True, "no", "yes"):
            errors["downcast_bf16"] = f"{short_repr(self.downcast_bf16)} is not one of false, true, no, yes"
        for name in ("use_cpu", "debug", "same_network", "enable_cpu_affinity", "tpu_use_cluster", "tpu_use_sudo"):
            if not isinstance(getattr(self, name), bool):
                errors[name] = f"{short_repr(getattr(self, name))} is not true or false"
        integer("num_processes", 1, optional=True)
        integer("num_machines", 1)
        integer("machine_rank", 0)
        integer("main_process_port", 0, 65535, optional=True)  # 0: pick a free port, as in Accelerate
        integer("gradient_accumulation_steps", 1, optional=True)
        if self.start_method is not None and self.start_method not in START_METHODS:
            errors["start_method"] = f"{short_repr(self.start_method)} is not one of {', '.join(START_METHODS)} (or unset)"
        if "machine_rank" not in errors and "num_machines" not in errors and self.machine_rank >= self.num_machines:
            errors["machine_rank"] = f"{short_repr(self.machine_rank)} must be below num_machines ({short_repr(self.num_machines)})"
        if (
            "num_machines" not in errors
            and self.num_machines > 1
            and self.machine_rank != 0
            and not self.main_process_ip
        ):
            errors["main_process_ip"] = "needed when num_machines > 1 (the address of the machine with rank 0)"
        if self.gpu_ids not in (None, "all"):
            parts = [p.strip() for p in str(self.gpu_ids).split(",")]
            if not all(p.isdigit() for p in parts):
                errors["gpu_ids"] = f"{short_repr(self.gpu_ids)} is not 'all' or a comma-separated list of GPU indices"
        for name in _DICT_FIELDS:
            if not isinstance(getattr(self, name), dict):
                errors[name] = f"must be a mapping of keys to values, got {type(getattr(self, name)).__name__}"
        if isinstance(self.dynamo_config, dict) and "dynamo_backend" in self.dynamo_config:
            backend = str(self.dynamo_config["dynamo_backend"]).upper()
            if backend not in DynamoBackend.list():
                errors["dynamo_config.dynamo_backend"] = (
                    f"{short_repr(self.dynamo_config['dynamo_backend'])} is not one of {', '.join(DynamoBackend.list())}"
                )
        if isinstance(self.fsdp_config, dict):
            errors.update(_check_fsdp(self.fsdp_config))
        if isinstance(self.deepspeed_config, dict) and "zero_stage" in self.deepspeed_config:
            if self.deepspeed_config["zero_stage"] not in (0, 1, 2, 3):
                errors["deepspeed_config.zero_stage"] = f"{short_repr(self.deepspeed_config['zero_stage'])} is not one of 0, 1, 2, 3"
        return errors

    # ---------------------------------------------------------------- derived
    @property
    def uses_fsdp(self) -> bool:
        return enum_value(self.distributed_type) == DistributedType.FSDP.value

    @property
    def uses_deepspeed(self) -> bool:
        return enum_value(self.distributed_type) == DistributedType.DEEPSPEED.value


_FSDP_CHOICES = {
    "fsdp_version": (1, 2),
    "fsdp_sharding_strategy": ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2",
                               1, 2, 3, 4, 5),
    "fsdp_state_dict_type": ("FULL_STATE_DICT", "LOCAL_STATE_DICT", "SHARDED_STATE_DICT"),
    "fsdp_auto_wrap_policy": ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"),
    "fsdp_backward_prefetch": ("BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH"),
}


def _check_fsdp(fsdp: dict) -> dict[str, str]:
    errors = {}
    for key, allowed in _FSDP_CHOICES.items():
        if key in fsdp and fsdp[key] is not None:
            value = fsdp[key].upper() if isinstance(fsdp[key], str) else fsdp[key]
            if value not in allowed:
                names = ", ".join(str(a) for a in allowed if isinstance(a, str)) or ", ".join(map(str, allowed))
                errors[f"fsdp_config.{key}"] = f"{short_repr(fsdp[key])} is not one of {names}"
    return errors


def load_config(path: str | os.PathLike | None = None) -> LaunchConfig | None:
    """The launch configuration in use, or None when no config file exists. Invalid files raise ConfigError."""
    return LaunchConfig.load(path)
