"""Enums, configuration classes, plugins and kwargs handlers, with Accelerate's names, fields and defaults.

The enums compare equal to their string values (`DistributedType.MULTI_CPU == "MULTI_CPU"`,
`PrecisionType.BF16 == "bf16"`), so configuration files and user code may use either.
"""

from __future__ import annotations

import contextlib
import copy
import enum
import importlib.util
import json
import operator
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any


class _ContainsValues(enum.EnumMeta):
    """Lets `"bf16" in PrecisionType` test membership by value."""

    def __contains__(cls, item: object) -> bool:
        try:
            cls(item)
        except (ValueError, TypeError):
            return False
        return True


class _NamedEnum(str, enum.Enum, metaclass=_ContainsValues):
    """A string enum that lists its values with `.list()`; str() and f-strings follow Python's enum rules
    (`DistributedType.MULTI_CPU` on Python 3.11+), as Accelerate's plain `(str, enum.Enum)` types do."""

    @classmethod
    def list(cls) -> list[str]:
        return [member.value for member in cls]


class _ValueEnum(_NamedEnum):
    """A string enum whose str() is its value (Accelerate's `BaseEnum` types)."""

    def __str__(self) -> str:
        return self.value


def enum_value(item: Any) -> str:
    """The string an enum member or a plain string stands for: `MULTI_CPU` for `DistributedType.MULTI_CPU`
    (whose str() names the class) and for `"MULTI_CPU"` read from a config file alike."""
    return str(getattr(item, "value", item))


class DistributedType(_NamedEnum):
    """How the processes of a run are spread: one process, several CPU processes, GPUs, sharded, TPU..."""

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    MULTI_NPU = "MULTI_NPU"
    MULTI_MLU = "MULTI_MLU"
    MULTI_SDAA = "MULTI_SDAA"
    MULTI_MUSA = "MULTI_MUSA"
    MULTI_XPU = "MULTI_XPU"
    DEEPSPEED = "DEEPSPEED"
    FSDP = "FSDP"
    XLA = "XLA"
    MEGATRON_LM = "MEGATRON_LM"
    MULTI_HPU = "MULTI_HPU"
    MULTI_NEURON = "MULTI_NEURON"


class PrecisionType(_ValueEnum):
    """Floating-point precision of the forward pass."""

    NO = "no"
    FP8 = "fp8"
    FP16 = "fp16"
    BF16 = "bf16"


class LoggerType(_ValueEnum):
    """Experiment trackers `Accelerator(log_with=...)` understands."""

    ALL = "all"
    AIM = "aim"
    TENSORBOARD = "tensorboard"
    WANDB = "wandb"
    TRACKIO = "trackio"
    COMETML = "comet_ml"
    MLFLOW = "mlflow"
    CLEARML = "clearml"
    DVCLIVE = "dvclive"
    SWANLAB = "swanlab"


class RNGType(_ValueEnum):
    """Random number generators that can be synchronized across processes."""

    TORCH = "torch"
    CUDA = "cuda"
    MLU = "mlu"
    SDAA = "sdaa"
    MUSA = "musa"
    NPU = "npu"
    XLA = "xla"
    XPU = "xpu"
    HPU = "hpu"
    NEURON = "neuron"
    GENERATOR = "generator"


class ComputeEnvironment(_NamedEnum):
    """Where the run happens (the `compute_environment` key of the config file)."""

    LOCAL_MACHINE = "LOCAL_MACHINE"
    AMAZON_SAGEMAKER = "AMAZON_SAGEMAKER"


class DynamoBackend(_ValueEnum):
    """`torch.compile` backends, by the upper-case names Accelerate's config uses."""

    NO = "NO"
    EAGER = "EAGER"
    AOT_EAGER = "AOT_EAGER"
    INDUCTOR = "INDUCTOR"
    AOT_TS_NVFUSER = "AOT_TS_NVFUSER"
    NVPRIMS_NVFUSER = "NVPRIMS_NVFUSER"
    CUDAGRAPHS = "CUDAGRAPHS"
    OFI = "OFI"
    FX2TRT = "FX2TRT"
    ONNXRT = "ONNXRT"
    TENSORRT = "TENSORRT"
    AOT_TORCHXLA_TRACE_ONCE = "AOT_TORCHXLA_TRACE_ONCE"
    TORCHXLA_TRACE_ONCE = "TORCHXLA_TRACE_ONCE"
    TVM = "TVM"
    HPU_BACKEND = "HPU_BACKEND"
    NEURON = "NEURON"


class DDPCommunicationHookType(_ValueEnum):
    """Gradient communication hooks for DistributedDataParallel."""

    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    POWER_SGD = "power_sgd"
    BATCHED_POWER_SGD = "batched_power_sgd"


class CustomDtype(enum.Enum):
    """Sizes below one byte or outside torch's dtypes, for memory estimates."""

    FP8 = "fp8"
    INT4 = "int4"
    INT2 = "int2"


# --------------------------------------------------------------------------------------------------------------
# Configuration classes, plugins and kwargs handlers
# --------------------------------------------------------------------------------------------------------------


# Environment prefixes whose variables feed plugin defaults; `to_kwargs` hides them to find the class defaults.
_CONFIG_ENV_PREFIXES = ("ACCELERATE_", "NBACCEL_", "FSDP_")
_TRUE = ("1", "true", "yes", "y", "on", "t")
_FALSE = ("0", "false", "no", "n", "off", "f")


def _env_bool(name: str, default: bool = False) -> bool:
    """Read a yes/no environment variable; an unreadable value is an error naming the variable."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    lowered = raw.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError(f"environment variable {name}={raw!r} is not a yes/no value (use true or false)")


def _env(name: str, default: Any = None) -> Any:
    """First set value among NBACCEL_<name> and ACCELERATE_<name>."""
    for prefix in ("NBACCEL_", "ACCELERATE_"):
        value = os.environ.get(prefix + name)
        if value not in (None, ""):
            return value
    return default


def whole_number(value: Any, *, text: bool = False) -> int | None:
    """`value` as an int when it is one: an int, or another library's integer (numpy's int64); with `text`, also
    a string of digits (Accelerate calls int() on gradient_accumulation_steps). None otherwise; a bool is not."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        return int(value) if text and value.strip().isdigit() else None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _to_bool(field_name: str, value: Any) -> bool:
    """Accept a bool (numpy's too) or a yes/no string (config files and env vars write strings)."""
    if isinstance(value, bool):
        return value
    if type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError(f"`{field_name}` must be True or False, got {value!r}")


def _choice(field_name: str, value: Any, allowed: list[str] | tuple[str, ...], *, case: str | None = None) -> str:
    """Return `value` (normalized to `case` 'upper'/'lower') if it is one of `allowed`, else a ValueError."""
    text = value.value if isinstance(value, enum.Enum) else value
    if isinstance(text, str) and case == "upper":
        text = text.upper()
    elif isinstance(text, str) and case == "lower":
        text = text.lower()
    if text not in allowed:
        raise ValueError(f"`{field_name}` must be one of {', '.join(map(str, allowed))}; got {value!r}")
    return text


def _enum_choice(field_name: str, value: Any, enum_cls: type[_ValueEnum], *, case: str | None = None):
    return enum_cls(_choice(field_name, value, enum_cls.list(), case=case))


def _positive_int(field_name: str, value: Any, *, allow_none: bool = False, minimum: int = 1) -> int | None:
    if value is None and allow_none:
        return None
    number = whole_number(value)
    if number is None or number < minimum:
        raise ValueError(f"`{field_name}` must be an integer >= {minimum}, got {value!r}")
    return number


def _is_available(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _require(module: str, pip_name: str, feature: str) -> None:
    """Raise a clear ImportError when an optional library a feature needs is missing."""
    if not _is_available(module):
        raise ImportError(f"{feature} needs the `{module}` package, which is not installed: pip install {pip_name}")


@contextlib.contextmanager
def _without_config_env() -> Iterator[None]:
    """Temporarily hide the environment variables that feed plugin defaults."""
    saved = {k: v for k, v in os.environ.items() if k.startswith(_CONFIG_ENV_PREFIXES)}
    for key in saved:
        del os.environ[key]
    try:
        yield
    finally:
        os.environ.update(saved)


class KwargsHandler:
    """Mixin for the kwargs-handler dataclasses: `to_dict()` and `to_kwargs()` (only what differs from defaults)."""

    def to_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self.__dict__)

    def to_kwargs(self) -> dict[str, Any]:
        """The attributes whose value differs from a default-constructed instance (environment ignored)."""
        with _without_config_env():
            defaults = self.__class__().to_dict()
        return {key: value for key, value in self.to_dict().items() if defaults.get(key) != value}


@dataclass
class AutocastKwargs(KwargsHandler):
    """Arguments for `torch.autocast` inside `Accelerator.autocast()` (`enabled`, `cache_enabled`)."""

    enabled: bool = True
    cache_enabled: bool | None = None

    def __post_init__(self) -> None:
        self.enabled = _to_bool("enabled", self.enabled)
        if self.cache_enabled is not None:
            self.cache_enabled = _to_bool("cache_enabled", self.cache_enabled)


@dataclass
class DistributedDataParallelKwargs(KwargsHandler):
    """Arguments for `torch.nn.parallel.DistributedDataParallel`, plus a gradient communication hook.

    `comm_hook` (no, fp16, bf16, power_sgd, batched_power_sgd), `comm_wrapper` (no, fp16, bf16) and
    `comm_state_option` (PowerSGDState arguments) are applied by `register_comm_hook(model)` after wrapping.
    """

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    comm_hook: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_wrapper: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_state_option: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.comm_hook = _enum_choice("comm_hook", self.comm_hook, DDPCommunicationHookType, case="lower")
        self.comm_wrapper = DDPCommunicationHookType(
            _choice("comm_wrapper", self.comm_wrapper, ("no", "fp16", "bf16"), case="lower")
        )
        if not isinstance(self.comm_state_option, dict):
            raise ValueError(f"`comm_state_option` must be a dict, got {type(self.comm_state_option).__name__}")
        if isinstance(self.bucket_cap_mb, bool) or not isinstance(self.bucket_cap_mb, (int, float)) or self.bucket_cap_mb <= 0:
            raise ValueError(f"`bucket_cap_mb` must be a positive number, got {self.bucket_cap_mb!r}")

    def to_dict(self, ignore_keys: tuple[str, ...] = ("comm_hook", "comm_wrapper", "comm_state_option")) -> dict:
        return {k: v for k, v in super().to_dict().items() if k not in ignore_keys}

    def register_comm_hook(self, model) -> None:
        """Register the configured communication hook on a DDP-wrapped `model` (no-op for `comm_hook="no"`)."""
        if self.comm_hook == DDPCommunicationHookType.NO:
            return
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        hooks = {
            DDPCommunicationHookType.FP16: default_hooks.fp16_compress_hook,
            DDPCommunicationHookType.BF16: default_hooks.bf16_compress_hook,
            DDPCommunicationHookType.POWER_SGD: powerSGD_hook.powerSGD_hook,
            DDPCommunicationHookType.BATCHED_POWER_SGD: powerSGD_hook.batched_powerSGD_hook,
        }
        wrappers = {
            DDPCommunicationHookType.FP16: default_hooks.fp16_compress_wrapper,
            DDPCommunicationHookType.BF16: default_hooks.bf16_compress_wrapper,
        }
        hook = hooks[self.comm_hook]
        if self.comm_wrapper in wrappers:
            hook = wrappers[self.comm_wrapper](hook)
        state = None
        if self.comm_hook in (DDPCommunicationHookType.POWER_SGD, DDPCommunicationHookType.BATCHED_POWER_SGD):
            state = powerSGD_hook.PowerSGDState(None, **self.comm_state_option)
        model.register_comm_hook(state=state, hook=hook)


@dataclass
class GradScalerKwargs(KwargsHandler):
    """Arguments for the `torch.amp.GradScaler` used with fp16."""

    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.init_scale, (int, float)) or self.init_scale <= 0:
            raise ValueError(f"`init_scale` must be a positive number, got {self.init_scale!r}")
        if not isinstance(self.growth_factor, (int, float)) or self.growth_factor <= 1.0:
            raise ValueError(f"`growth_factor` must be a number > 1.0, got {self.growth_factor!r}")
        if not isinstance(self.backoff_factor, (int, float)) or not 0.0 < self.backoff_factor < 1.0:
            raise ValueError(f"`backoff_factor` must be a number between 0 and 1 (exclusive), got {self.backoff_factor!r}")
        _positive_int("growth_interval", self.growth_interval)
        self.enabled = _to_bool("enabled", self.enabled)


@dataclass
class InitProcessGroupKwargs(KwargsHandler):
    """Arguments for `torch.distributed.init_process_group`.

    `timeout` is a `datetime.timedelta` (a number of seconds is accepted too); `None` means 600 s for nccl and
    1800 s for every other backend, as in Accelerate.
    """

    backend: str | None = "nccl"
    init_method: str | None = None
    timeout: timedelta | None = None

    def __post_init__(self) -> None:
        if self.backend is not None and not isinstance(self.backend, str):
            raise ValueError(f"`backend` must be a string such as 'nccl', 'gloo', 'mpi', 'xla', got {self.backend!r}")
        if self.timeout is None:
            self.timeout = timedelta(seconds=600 if self.backend == "nccl" else 1800)
        elif isinstance(self.timeout, (int, float)) and not isinstance(self.timeout, bool):
            self.timeout = timedelta(seconds=self.timeout)
        if not isinstance(self.timeout, timedelta) or self.timeout.total_seconds() <= 0:
            raise ValueError(f"`timeout` must be a positive datetime.timedelta (or seconds), got {self.timeout!r}")


_FP8_FORMATS = ("HYBRID", "E4M3", "E5M2")
_AMAX_ALGOS = ("max", "most_recent")
_MSAMP_LEVELS = ("O1", "O2")


@dataclass
class AORecipeKwargs(KwargsHandler):
    """FP8 training recipe with torchao (`Float8LinearConfig`). Needs `pip install torchao`."""

    config: Any = None
    module_filter_func: Callable | None = None
    pad_inner_dim: bool | None = None
    enable_fsdp_float8_all_gather: bool | None = None

    def __post_init__(self) -> None:
        _require("torchao", "torchao", "AORecipeKwargs (FP8 with torchao)")
        if self.config is None:
            from torchao.float8 import Float8LinearConfig

            if self.pad_inner_dim is None:
                self.pad_inner_dim = _env_bool("ACCELERATE_FP8_PAD_INNER_DIM", True)
            if self.enable_fsdp_float8_all_gather is None:
                self.enable_fsdp_float8_all_gather = _env_bool("ACCELERATE_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER", True)
            self.config = Float8LinearConfig(
                pad_inner_dim=self.pad_inner_dim, enable_fsdp_float8_all_gather=self.enable_fsdp_float8_all_gather
            )


def _fill_te_recipe(kw: Any) -> None:
    """Defaults (from ACCELERATE_FP8_* variables) and checks shared by TERecipeKwargs and FP8RecipeKwargs."""
    if kw.use_autocast_during_eval is None:
        kw.use_autocast_during_eval = _env_bool("ACCELERATE_FP8_USE_AUTOCAST_DURING_EVAL")
    if kw.margin is None:
        kw.margin = int(os.environ.get("ACCELERATE_FP8_MARGIN", 0))
    if kw.interval is None:
        kw.interval = int(os.environ.get("ACCELERATE_FP8_INTERVAL", 1))
    if kw.fp8_format is None:
        kw.fp8_format = os.environ.get("ACCELERATE_FP8_FORMAT", "HYBRID")
    kw.fp8_format = _choice("fp8_format", kw.fp8_format, _FP8_FORMATS, case="upper")
    if kw.amax_compute_algo is None:
        kw.amax_compute_algo = os.environ.get("ACCELERATE_FP8_AMAX_COMPUTE_ALGO", "most_recent")
    kw.amax_compute_algo = _choice("amax_compute_algo", kw.amax_compute_algo, _AMAX_ALGOS, case="lower")
    if kw.amax_history_len is None:
        kw.amax_history_len = int(os.environ.get("ACCELERATE_FP8_AMAX_HISTORY_LEN", 1024))
    _positive_int("amax_history_len", kw.amax_history_len)
    if kw.override_linear_precision is None:
        kw.override_linear_precision = tuple(
            _env_bool(f"ACCELERATE_FP8_OVERRIDE_{gemm}") for gemm in ("FPROP", "DGRAD", "WGRAD")
        )
    if kw.use_mxfp8_block_scaling is None:
        kw.use_mxfp8_block_scaling = _env_bool("ACCELERATE_FP8_USE_MXFP8_BLOCK_SCALING")


@dataclass
class TERecipeKwargs(KwargsHandler):
    """FP8 training recipe with NVIDIA Transformer Engine. Needs `pip install transformer-engine[pytorch]`."""

    use_autocast_during_eval: bool | None = None
    margin: int | None = None
    interval: int | None = None
    fp8_format: str | None = None
    amax_history_len: int | None = None
    amax_compute_algo: str | None = None
    override_linear_precision: tuple[bool, bool, bool] | None = None
    use_mxfp8_block_scaling: bool | None = None

    def __post_init__(self) -> None:
        _fill_te_recipe(self)
        _require("transformer_engine", "transformer-engine[pytorch]", "TERecipeKwargs (FP8 with Transformer Engine)")


@dataclass
class MSAMPRecipeKwargs(KwargsHandler):
    """FP8 training recipe with MS-AMP (`opt_level` O1 or O2)."""

    opt_level: str | None = None

    def __post_init__(self) -> None:
        if self.opt_level is None:
            self.opt_level = os.environ.get("ACCELERATE_FP8_OPT_LEVEL", "O2")
        self.opt_level = _choice("opt_level", self.opt_level, _MSAMP_LEVELS, case="upper")


@dataclass
class FP8RecipeKwargs(TERecipeKwargs, MSAMPRecipeKwargs):
    """Deprecated in Accelerate in favour of TERecipeKwargs / MSAMPRecipeKwargs / AORecipeKwargs; kept for old code.

    `backend` is "TE" or "MSAMP" (default from ACCELERATE_FP8_BACKEND, else TE).
    """

    backend: str | None = None

    def __post_init__(self) -> None:
        warnings.warn(
            "FP8RecipeKwargs is deprecated (as in Accelerate): use TERecipeKwargs, MSAMPRecipeKwargs or AORecipeKwargs",
            FutureWarning,
            stacklevel=3,
        )
        if self.backend is None:
            self.backend = os.environ.get("ACCELERATE_FP8_BACKEND", "MSAMP" if _is_available("msamp") else "TE")
        self.backend = _choice("backend", self.backend, ("TE", "MSAMP"), case="upper")
        MSAMPRecipeKwargs.__post_init__(self)
        _fill_te_recipe(self)
        if self.backend == "TE":
            _require("transformer_engine", "transformer-engine[pytorch]", "FP8RecipeKwargs(backend='TE')")
        else:
            _require("msamp", "ms-amp (see github.com/Azure/MS-AMP)", "FP8RecipeKwargs(backend='MSAMP')")


_PROFILER_ACTIVITIES = ("cpu", "xpu", "mtia", "cuda", "hpu")
_SCHEDULE_KEYS = ("wait", "warmup", "active", "repeat", "skip_first")


@dataclass
class ProfileKwargs(KwargsHandler):
    """Arguments for `torch.profiler.profile`, used by `Accelerator.profile()`; `build()` makes the profiler."""

    activities: list[str] | None = None
    schedule_option: dict[str, int] | None = None
    on_trace_ready: Callable | None = None
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    with_flops: bool = False
    with_modules: bool = False
    output_trace_dir: str | None = None

    def __post_init__(self) -> None:
        if self.activities is not None:
            if isinstance(self.activities, str):
                self.activities = [self.activities]
            self.activities = [
                _choice("activities", a, _PROFILER_ACTIVITIES, case="lower") for a in self.activities
            ]
        if self.schedule_option is not None:
            unknown = sorted(set(self.schedule_option) - set(_SCHEDULE_KEYS))
            if unknown:
                raise ValueError(
                    f"`schedule_option` keys must be among {', '.join(_SCHEDULE_KEYS)}; unknown: {', '.join(unknown)}"
                )

    def _activity(self, name: str):
        import torch

        available = {"cpu": torch.profiler.ProfilerActivity.CPU}
        if torch.cuda.is_available():
            available["cuda"] = torch.profiler.ProfilerActivity.CUDA
        for extra in ("xpu", "mtia", "hpu"):
            backend = getattr(torch, extra, None)
            member = getattr(torch.profiler.ProfilerActivity, extra.upper(), None)
            if member is not None and backend is not None and getattr(backend, "is_available", lambda: False)():
                available[extra] = member
        if name not in available:
            raise ValueError(
                f"profiler activity {name!r} is not available on this machine; available: {', '.join(available)}"
            )
        return available[name]

    def build(self):
        """Return a `torch.profiler.profile` configured from these fields."""
        import torch

        activities = None if self.activities is None else [self._activity(a) for a in self.activities]
        schedule = None if self.schedule_option is None else torch.profiler.schedule(**self.schedule_option)
        return torch.profiler.profile(
            activities=activities,
            schedule=schedule,
            on_trace_ready=self.on_trace_ready,
            record_shapes=self.record_shapes,
            profile_memory=self.profile_memory,
            with_stack=self.with_stack,
            with_flops=self.with_flops,
            with_modules=self.with_modules,
        )


@dataclass
class DataLoaderConfiguration:
    """How `Accelerator.prepare` shards and feeds data loaders (Accelerate's fields and defaults)."""

    split_batches: bool = False
    dispatch_batches: bool | None = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: int | None = None
    non_blocking: bool = False
    use_stateful_dataloader: bool = False

    def __post_init__(self) -> None:
        for name in ("split_batches", "even_batches", "use_seedable_sampler", "non_blocking", "use_stateful_dataloader"):
            setattr(self, name, _to_bool(name, getattr(self, name)))
        if self.dispatch_batches is not None:
            self.dispatch_batches = _to_bool("dispatch_batches", self.dispatch_batches)
        if self.data_seed is not None and (isinstance(self.data_seed, bool) or not isinstance(self.data_seed, int)):
            raise ValueError(f"`data_seed` must be an integer or None, got {self.data_seed!r}")
        if self.use_stateful_dataloader:
            _require("torchdata", "'torchdata>=0.8'", "DataLoaderConfiguration(use_stateful_dataloader=True)")


@dataclass
class ProjectConfiguration:
    """Where a project writes checkpoints and logs, and how checkpoints are named and pruned."""

    project_dir: str | os.PathLike | None = None
    logging_dir: str | os.PathLike | None = None
    automatic_checkpoint_naming: bool = False
    total_limit: int | None = None
    iteration: int = 0
    save_on_each_node: bool = False

    def set_directories(self, project_dir: str | os.PathLike | None = None) -> None:
        """Set `project_dir`, and `logging_dir` to it unless one was given."""
        self.project_dir = project_dir
        if self.logging_dir is None:
            self.logging_dir = project_dir

    def __post_init__(self) -> None:
        # the folders stay as given (a pathlib.Path stays one, as in Accelerate: `accelerator.project_dir / "x"`)
        self.automatic_checkpoint_naming = _to_bool("automatic_checkpoint_naming", self.automatic_checkpoint_naming)
        self.save_on_each_node = _to_bool("save_on_each_node", self.save_on_each_node)
        _positive_int("total_limit", self.total_limit, allow_none=True)
        _positive_int("iteration", self.iteration, minimum=0)
        self.set_directories(self.project_dir)


@dataclass
class GradientAccumulationPlugin(KwargsHandler):
    """Gradient accumulation: `num_steps`, `adjust_scheduler`, `sync_with_dataloader`, `sync_each_batch`."""

    num_steps: int | None = None
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False

    def __post_init__(self) -> None:
        _positive_int("num_steps", self.num_steps, allow_none=True)
        for name in ("adjust_scheduler", "sync_with_dataloader", "sync_each_batch"):
            setattr(self, name, _to_bool(name, getattr(self, name)))


_DYNAMO_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass
class TorchDynamoPlugin(KwargsHandler):
    """`torch.compile` settings. Unset fields come from ACCELERATE_DYNAMO_* (or NBACCEL_DYNAMO_*) variables.

    `backend` accepts a `DynamoBackend` or its name in any case ("inductor" -> DynamoBackend.INDUCTOR).
    """

    backend: DynamoBackend | None = None
    mode: str | None = None
    fullgraph: bool | None = None
    dynamic: bool | None = None
    options: Any = None
    disable: bool = False
    use_regional_compilation: bool | None = None

    def __post_init__(self) -> None:
        if self.backend is None:
            self.backend = _env("DYNAMO_BACKEND", "no")
        self.backend = _enum_choice("backend", self.backend, DynamoBackend, case="upper")
        if self.mode is None:
            self.mode = _env("DYNAMO_MODE", "default")
        self.mode = _choice("mode", self.mode, _DYNAMO_MODES, case="lower")
        if self.fullgraph is None:
            self.fullgraph = _to_bool("fullgraph", _env("DYNAMO_USE_FULLGRAPH", False))
        if self.use_regional_compilation is None:
            self.use_regional_compilation = _to_bool(
                "use_regional_compilation", _env("DYNAMO_USE_REGIONAL_COMPILATION", False)
            )
        if self.dynamic is None and _env("DYNAMO_USE_DYNAMIC") is not None:
            self.dynamic = _to_bool("dynamic", _env("DYNAMO_USE_DYNAMIC"))
        self.disable = _to_bool("disable", self.disable)
        if self.options is not None and not isinstance(self.options, dict):
            raise ValueError(f"`options` must be a dict of backend options, got {type(self.options).__name__}")

    def to_dict(self) -> dict[str, Any]:
        config = copy.deepcopy(self.__dict__)
        config["backend"] = config["backend"].value.lower()
        return config

    def to_kwargs(self) -> dict[str, Any]:
        """The `torch.compile` keyword arguments that differ from the defaults."""
        kwargs = super().to_kwargs()
        kwargs.pop("use_regional_compilation", None)
        return kwargs


@dataclass
class TorchTensorParallelPlugin:
    """Tensor parallelism with torch's DTensor: `tp_size` ranks per model replica, an optional device mesh."""

    tp_size: int = 1
    torch_device_mesh: Any = None

    def __post_init__(self) -> None:
        _positive_int("tp_size", self.tp_size)


_SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
_BACKWARD_PREFETCH = ("BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH")
_STATE_DICT_TYPES = ("FULL_STATE_DICT", "LOCAL_STATE_DICT", "SHARDED_STATE_DICT")
_AUTO_WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")
_FSDP_MIXED_PRECISION = {"fp8": "bfloat16", "fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}


def _fsdp_env_bool(name: str, default: bool = False) -> bool:
    return _env_bool("FSDP_" + name, default)


def _enum_member(field_name: str, value: Any, enum_cls: Any, names: tuple[str, ...]) -> Any:
    """Turn a name ("FULL_SHARD"), its 1-based index ("1" or 1) or a member into a member of a torch enum."""
    if isinstance(value, enum_cls):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if isinstance(value, str):
        text = value.strip().upper()
        if text.isdigit() and 1 <= int(text) <= len(names):
            text = names[int(text) - 1]
        if text in names:  # torch numbers these members from 1 in this order (HYBRID_SHARD_ZERO2 is private)
            return enum_cls(names.index(text) + 1)
    raise ValueError(f"`{field_name}` must be one of {', '.join(names)}; got {value!r}")


@dataclass
class FullyShardedDataParallelPlugin:
    """Fully Sharded Data Parallel settings (Accelerate's fields and defaults): `fsdp_version=1` (torch's
    `FullyShardedDataParallel` wrapper) unless `fsdp_version=2` (`fully_shard`) or FSDP_VERSION says otherwise.
    Both run on CPU processes (gloo) as well as on GPUs.

    Unset fields come from the FSDP_* environment variables that `nbaccel launch` / `accelerate launch` set from
    the config file's `fsdp_config`. Strings are accepted where Accelerate accepts them (sharding strategy, state
    dict type, auto wrap policy, mixed precision "bf16"...). FSDP1-only settings given with `fsdp_version=2`
    (backward_prefetch, use_orig_params, sync_module_states) are dropped with one warning, as Accelerate does.
    """

    fsdp_version: int | None = None
    sharding_strategy: Any = None
    reshard_after_forward: Any = None
    backward_prefetch: Any = None
    mixed_precision_policy: Any = None
    auto_wrap_policy: Any = None
    cpu_offload: Any = None
    ignored_modules: Any = None
    state_dict_type: Any = None
    state_dict_config: Any = None
    optim_state_dict_config: Any = None
    limit_all_gathers: bool = True
    use_orig_params: bool | None = None
    param_init_fn: Callable | None = None
    sync_module_states: bool | None = None
    forward_prefetch: bool | None = None
    activation_checkpointing: bool | None = None
    activation_checkpointing_offload: bool | None = None
    cpu_ram_efficient_loading: bool | None = None
    transformer_cls_names_to_wrap: list[str] | None = None
    min_num_params: int | None = None

    def __post_init__(self) -> None:
        from torch.distributed.fsdp import BackwardPrefetch, ShardingStrategy

        dropped: list[str] = []  # FSDP1-only settings given with FSDP2: dropped with one warning, as Accelerate
        if self.fsdp_version is None:
            self.fsdp_version = int(os.environ.get("FSDP_VERSION", "1"))
        if self.fsdp_version not in (1, 2):
            raise ValueError(f"`fsdp_version` must be 1 or 2, got {self.fsdp_version!r}")
        v2 = self.fsdp_version == 2

        if self.sharding_strategy is not None and v2:
            raise ValueError(
                "`sharding_strategy` is an FSDP1 setting; with fsdp_version=2 use `reshard_after_forward` (bool)"
            )
        if not v2:
            # Accelerate's rule: FSDP1 always has a sharding_strategy (FULL_SHARD unless FSDP_SHARDING_STRATEGY);
            # it wins over reshard_after_forward, which is only converted when given.
            if self.sharding_strategy is None:
                self.sharding_strategy = os.environ.get("FSDP_SHARDING_STRATEGY", "FULL_SHARD")
            self.sharding_strategy = _enum_member(
                "sharding_strategy", self.sharding_strategy, ShardingStrategy, _SHARDING_STRATEGIES
            )
            if isinstance(self.reshard_after_forward, bool):
                raise ValueError(
                    f"reshard_after_forward={self.reshard_after_forward}: FSDP1 takes a sharding strategy here "
                    "(a name such as 'FULL_SHARD' or a ShardingStrategy); a bool is for fsdp_version=2"
                )
            if self.reshard_after_forward is not None:
                self.reshard_after_forward = _enum_member(
                    "reshard_after_forward", self.reshard_after_forward, ShardingStrategy, _SHARDING_STRATEGIES
                )
        else:
            if self.reshard_after_forward is None:
                self.reshard_after_forward = os.environ.get("FSDP_RESHARD_AFTER_FORWARD", "true")
            self.reshard_after_forward = _to_bool("reshard_after_forward", self.reshard_after_forward)

        if self.cpu_offload is None:
            self.cpu_offload = _fsdp_env_bool("OFFLOAD_PARAMS")
        self.set_cpu_offload()
        self.validate_cpu_offload()

        if self.backward_prefetch is None:
            self.backward_prefetch = os.environ.get("FSDP_BACKWARD_PREFETCH")
        if isinstance(self.backward_prefetch, str) and self.backward_prefetch.upper() == "NO_PREFETCH":
            self.backward_prefetch = None
        if self.backward_prefetch is not None:
            self.backward_prefetch = _enum_member(
                "backward_prefetch", self.backward_prefetch, BackwardPrefetch, _BACKWARD_PREFETCH
            )
            if v2:
                dropped.append("backward_prefetch (FSDP2 prefetches on its own)")
                self.backward_prefetch = None

        self.set_state_dict_type()

        if self.auto_wrap_policy is None:
            self.auto_wrap_policy = os.environ.get("FSDP_AUTO_WRAP_POLICY", "NO_WRAP")
        if isinstance(self.auto_wrap_policy, str):
            from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

            policy = _choice("auto_wrap_policy", self.auto_wrap_policy, _AUTO_WRAP_POLICIES, case="upper")
            if policy == "TRANSFORMER_BASED_WRAP":
                self.auto_wrap_policy = transformer_auto_wrap_policy
                if self.transformer_cls_names_to_wrap is None:
                    self.transformer_cls_names_to_wrap = os.environ.get("FSDP_TRANSFORMER_CLS_TO_WRAP")
            elif policy == "SIZE_BASED_WRAP":
                self.auto_wrap_policy = size_based_auto_wrap_policy
                if self.min_num_params is None:
                    self.min_num_params = int(os.environ.get("FSDP_MIN_NUM_PARAMS", 0))
            else:
                self.auto_wrap_policy = None
        if isinstance(self.transformer_cls_names_to_wrap, str):
            self.transformer_cls_names_to_wrap = [n.strip() for n in self.transformer_cls_names_to_wrap.split(",") if n.strip()]
        if self.min_num_params is not None:
            _positive_int("min_num_params", self.min_num_params, minimum=0)

        if v2:
            # FSDP2 always uses the original parameters and needs no module-state sync: Accelerate drops both.
            if self.use_orig_params is not None:
                dropped.append("use_orig_params (FSDP2 always uses the original parameters)")
            if self.sync_module_states is not None:
                dropped.append("sync_module_states (FSDP2 does not need it)")
            self.use_orig_params = None
            self.sync_module_states = None
            if self.forward_prefetch is not None:
                raise ValueError("`forward_prefetch` is not implemented in FSDP2; leave it unset or use fsdp_version=1")
        else:
            if self.use_orig_params is None:
                self.use_orig_params = _fsdp_env_bool("USE_ORIG_PARAMS")
            if self.sync_module_states is None:
                self.sync_module_states = _fsdp_env_bool("SYNC_MODULE_STATES")
            if self.forward_prefetch is None:
                self.forward_prefetch = _fsdp_env_bool("FORWARD_PREFETCH")

        if self.activation_checkpointing is None:
            self.activation_checkpointing = _fsdp_env_bool("ACTIVATION_CHECKPOINTING")
        if self.activation_checkpointing_offload is None:
            self.activation_checkpointing_offload = _fsdp_env_bool("ACTIVATION_CHECKPOINTING_OFFLOAD")
        if self.activation_checkpointing_offload and not self.activation_checkpointing:
            raise ValueError("`activation_checkpointing_offload=True` needs `activation_checkpointing=True`")
        if self.activation_checkpointing_offload and not v2:
            raise ValueError("`activation_checkpointing_offload=True` needs `fsdp_version=2`")
        if self.ignored_modules is None:
            self.ignored_modules = os.environ.get("FSDP_IGNORED_MODULES")
        if self.cpu_ram_efficient_loading is None:
            self.cpu_ram_efficient_loading = _fsdp_env_bool("CPU_RAM_EFFICIENT_LOADING")
        else:
            self.cpu_ram_efficient_loading = _to_bool("cpu_ram_efficient_loading", self.cpu_ram_efficient_loading)
            os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = str(self.cpu_ram_efficient_loading)  # transformers reads it
        if not v2 and self.cpu_ram_efficient_loading and not self.sync_module_states:
            warnings.warn("cpu_ram_efficient_loading needs sync_module_states: setting sync_module_states=True", stacklevel=2)
            self.sync_module_states = True

        if isinstance(self.mixed_precision_policy, str):
            self.set_mixed_precision(self.mixed_precision_policy, override=True)
        elif isinstance(self.mixed_precision_policy, dict):
            self.set_mixed_precision(self.mixed_precision_policy)
        if self.mixed_precision_policy is not None:
            self.validate_mixed_precision_policy()

        if self.sync_module_states and self.param_init_fn is None:
            device = self._current_device()
            self.param_init_fn = lambda module: module.to_empty(device=device, recurse=False)
        if dropped:
            import logging

            logging.getLogger(__name__).warning(
                "FSDP2 ignores these FSDP1 settings, set to None: %s", "; ".join(dropped)
            )

    @staticmethod
    def _current_device():
        import torch

        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        xpu = getattr(torch, "xpu", None)
        if xpu is not None and xpu.is_available():
            return torch.device("xpu", xpu.current_device())
        return torch.device("cpu")

    def set_state_dict_type(self, state_dict_type: Any = None) -> None:
        """Set `state_dict_type` (name or StateDictType) and the matching state dict configs (CPU offload)."""
        from torch.distributed.fsdp import (
            FullOptimStateDictConfig,
            FullStateDictConfig,
            ShardedOptimStateDictConfig,
            ShardedStateDictConfig,
            StateDictType,
        )

        if state_dict_type is not None:
            self.state_dict_type = state_dict_type
        if self.state_dict_type is None:
            self.state_dict_type = os.environ.get(
                "FSDP_STATE_DICT_TYPE", "FULL_STATE_DICT" if self.fsdp_version == 1 else "SHARDED_STATE_DICT"
            )
        self.state_dict_type = _enum_member("state_dict_type", self.state_dict_type, StateDictType, _STATE_DICT_TYPES)
        if self.fsdp_version == 2 and self.state_dict_type == StateDictType.LOCAL_STATE_DICT:
            raise ValueError("`state_dict_type` LOCAL_STATE_DICT is not supported by FSDP2: use SHARDED_STATE_DICT or FULL_STATE_DICT")
        if self.state_dict_type == StateDictType.FULL_STATE_DICT:
            if self.state_dict_config is None:
                self.state_dict_config = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
            if self.optim_state_dict_config is None:
                self.optim_state_dict_config = FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)
        elif self.state_dict_type == StateDictType.SHARDED_STATE_DICT:
            if self.state_dict_config is None:
                self.state_dict_config = ShardedStateDictConfig(offload_to_cpu=True)
            if self.optim_state_dict_config is None:
                self.optim_state_dict_config = ShardedOptimStateDictConfig(offload_to_cpu=True)

    def set_auto_wrap_policy(self, model) -> None:
        """Bind the wrap policy to `model`: resolve transformer class names (default: `model._no_split_modules`)."""
        import functools

        from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

        if self.auto_wrap_policy is transformer_auto_wrap_policy:
            if self.transformer_cls_names_to_wrap is None:
                self.transformer_cls_names_to_wrap = list(getattr(model, "_no_split_modules", None) or [])
            by_name = {type(m).__name__: type(m) for m in model.modules()}
            classes = set()
            for name in self.transformer_cls_names_to_wrap:
                if name not in by_name:
                    raise ValueError(
                        f"`transformer_cls_names_to_wrap`: no layer class {name!r} in the model "
                        f"(classes present: {', '.join(sorted(by_name))})"
                    )
                classes.add(by_name[name])
            self.auto_wrap_policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=classes)
        elif self.auto_wrap_policy is size_based_auto_wrap_policy:
            if self.min_num_params:
                self.auto_wrap_policy = functools.partial(size_based_auto_wrap_policy, min_num_params=self.min_num_params)
            else:
                self.auto_wrap_policy = None

    def set_mixed_precision(self, mixed_precision: Any, buffer_autocast: bool = False, override: bool = False) -> None:
        """Build the FSDP mixed precision policy from "fp16"/"bf16"/"fp32"/"fp8", a torch dtype, or a dict."""
        import torch

        dtypes = {name: getattr(torch, attr) for name, attr in _FSDP_MIXED_PRECISION.items()}
        if self.fsdp_version == 2:
            from torch.distributed.fsdp import MixedPrecisionPolicy as policy_cls
        else:
            from torch.distributed.fsdp import MixedPrecision as policy_cls
        if isinstance(mixed_precision, dict) and not override and isinstance(self.mixed_precision_policy, dict):
            keys = ["param_dtype", "reduce_dtype"] + (["output_dtype"] if self.fsdp_version == 2 else ["buffer_dtype"])
            policy = dict(mixed_precision)
            for key, value in list(policy.items()):
                if isinstance(value, str) and value in dtypes:
                    policy[key] = dtypes[value]
            bad = [k for k in policy if k not in keys] + [k for k, v in policy.items() if v not in dtypes.values()]
            if bad:
                raise ValueError(
                    f"`mixed_precision_policy`: keys must be among {keys} and values among fp16, bf16, fp32 "
                    f"(or torch dtypes); problem with {bad}"
                )
            self.mixed_precision_policy = policy_cls(**policy)
            return
        dtype = mixed_precision
        if isinstance(mixed_precision, str):
            if mixed_precision not in dtypes:
                raise ValueError(f"`mixed_precision_policy` must be one of {', '.join(dtypes)}; got {mixed_precision!r}")
            dtype = dtypes[mixed_precision]
        elif not isinstance(mixed_precision, torch.dtype) or mixed_precision not in dtypes.values():
            raise ValueError(f"`mixed_precision_policy` must be one of {', '.join(dtypes)}; got {mixed_precision!r}")
        if override or self.mixed_precision_policy is None:
            args = {"param_dtype": dtype, "reduce_dtype": dtype}
            if self.fsdp_version == 2:
                args["output_dtype"] = dtype
            else:
                args["buffer_dtype"] = torch.float32 if buffer_autocast else dtype
            self.mixed_precision_policy = policy_cls(**args)

    def validate_mixed_precision_policy(self) -> None:
        if self.fsdp_version == 2:
            from torch.distributed.fsdp import MixedPrecisionPolicy as policy_cls
        else:
            from torch.distributed.fsdp import MixedPrecision as policy_cls
        if not isinstance(self.mixed_precision_policy, policy_cls):
            raise ValueError(
                f"`mixed_precision_policy` must be a torch.distributed.fsdp.{policy_cls.__name__} for "
                f"fsdp_version={self.fsdp_version} (or 'fp16'/'bf16'/'fp32', or a dict of dtypes)"
            )

    def set_cpu_offload(self) -> None:
        """Turn a bool `cpu_offload` into the policy object of the FSDP version in use."""
        if isinstance(self.cpu_offload, str):
            self.cpu_offload = _to_bool("cpu_offload", self.cpu_offload)
        if not isinstance(self.cpu_offload, bool):
            return
        if self.fsdp_version == 2:
            from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

            self.cpu_offload = CPUOffloadPolicy() if self.cpu_offload else OffloadPolicy()
        else:
            from torch.distributed.fsdp import CPUOffload

            self.cpu_offload = CPUOffload(offload_params=self.cpu_offload)

    def validate_cpu_offload(self) -> None:
        if self.fsdp_version == 2:
            from torch.distributed.fsdp import OffloadPolicy as expected
        else:
            from torch.distributed.fsdp import CPUOffload as expected
        if not isinstance(self.cpu_offload, expected):
            raise ValueError(
                f"`cpu_offload` must be a bool or a torch.distributed.fsdp.{expected.__name__} for "
                f"fsdp_version={self.fsdp_version}, got {self.cpu_offload!r}"
            )


_DS_OFFLOAD_DEVICES = ("none", "cpu", "nvme")


@dataclass
class DeepSpeedPlugin:
    """DeepSpeed ZeRO settings (Accelerate's fields). Needs DeepSpeed: `pip install deepspeed`.

    Unset fields come from the ACCELERATE_DEEPSPEED_* variables; `hf_ds_config` is a dict or a path to a JSON
    DeepSpeed config, whose values fill the fields it sets (its "auto" values are filled from the fields).
    """

    hf_ds_config: Any = None
    gradient_accumulation_steps: int | str | None = None
    gradient_clipping: float | str | None = None
    zero_stage: int | None = None
    is_train_batch_min: bool = True
    offload_optimizer_device: str | None = None
    offload_param_device: str | None = None
    offload_optimizer_nvme_path: str | None = None
    offload_param_nvme_path: str | None = None
    zero3_init_flag: bool | None = None
    zero3_save_16bit_model: bool | None = None
    transformer_moe_cls_names: str | None = None
    enable_msamp: bool | None = None
    msamp_opt_level: str | None = None

    def __post_init__(self) -> None:
        if self.gradient_accumulation_steps is None:
            gas = os.environ.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "auto")
            self.gradient_accumulation_steps = int(gas) if gas.isdigit() else gas
        if self.gradient_clipping is None:
            clip = os.environ.get("ACCELERATE_GRADIENT_CLIPPING", "auto")
            self.gradient_clipping = clip if clip == "auto" else float(clip)
        if self.zero_stage is None:
            self.zero_stage = int(os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", 2))
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"`zero_stage` must be one of 0, 1, 2, 3; got {self.zero_stage!r}")
        for name in ("offload_optimizer_device", "offload_param_device"):
            value = getattr(self, name)
            if value is None:
                value = os.environ.get("ACCELERATE_DEEPSPEED_" + name.upper(), "none")
            setattr(self, name, _choice(name, value, _DS_OFFLOAD_DEVICES, case="lower"))
        for name in ("offload_optimizer_nvme_path", "offload_param_nvme_path"):
            if getattr(self, name) is None:
                setattr(self, name, os.environ.get("ACCELERATE_DEEPSPEED_" + name.upper(), "none"))
        if self.zero3_init_flag is None:
            self.zero3_init_flag = _env_bool("ACCELERATE_DEEPSPEED_ZERO3_INIT")
        if self.zero3_save_16bit_model is None:
            self.zero3_save_16bit_model = _env_bool("ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL")
        if self.enable_msamp is None:
            self.enable_msamp = os.environ.get("ACCELERATE_FP8_BACKEND") == "MSAMP"
        if self.msamp_opt_level is None:
            self.msamp_opt_level = os.environ.get("ACCELERATE_FP8_OPT_LEVEL", "O1")
        self.msamp_opt_level = _choice("msamp_opt_level", self.msamp_opt_level, _MSAMP_LEVELS, case="upper")
        if self.hf_ds_config is None:
            self.hf_ds_config = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
        if isinstance(self.hf_ds_config, (str, os.PathLike)) and os.fspath(self.hf_ds_config) != "none":
            path = os.fspath(self.hf_ds_config)
            try:
                with open(path, encoding="utf-8") as handle:
                    self.hf_ds_config = json.load(handle)
            except (OSError, json.JSONDecodeError) as exc:
                raise ValueError(f"`hf_ds_config`: cannot read the DeepSpeed JSON config {path}: {exc}") from exc
        if isinstance(self.hf_ds_config, dict) and "zero_optimization" not in self.hf_ds_config:
            raise ValueError("`hf_ds_config` must contain a `zero_optimization` section (the ZeRO settings)")
        _require("deepspeed", "deepspeed", "DeepSpeedPlugin")

    @property
    def deepspeed_config(self) -> dict:
        """The DeepSpeed config dict: `hf_ds_config` if given, else one built from the fields."""
        if isinstance(self.hf_ds_config, dict):
            return self.hf_ds_config
        config: dict[str, Any] = {
            "train_batch_size": "auto",
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "zero_optimization": {
                "stage": self.zero_stage,
                "offload_optimizer": {"device": self.offload_optimizer_device},
                "offload_param": {"device": self.offload_param_device},
                "stage3_gather_16bit_weights_on_model_save": self.zero3_save_16bit_model,
            },
        }
        if self.gradient_clipping is not None:
            config["gradient_clipping"] = self.gradient_clipping
        return config


_BNB_DTYPES = ("fp32", "fp16", "bf16")


def _bnb_dtype(field_name: str, value: Any):
    import torch

    if isinstance(value, torch.dtype):
        return value
    name = _choice(field_name, value, _BNB_DTYPES, case="lower")
    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[name]


@dataclass
class BnbQuantizationConfig:
    """bitsandbytes 8-bit / 4-bit quantization settings for `load_and_quantize_model` (Accelerate's fields)."""

    load_in_8bit: bool = False
    llm_int8_threshold: float = 6.0
    load_in_4bit: bool = False
    bnb_4bit_quant_type: str = "fp4"
    bnb_4bit_use_double_quant: bool = False
    bnb_4bit_compute_dtype: Any = "fp16"
    torch_dtype: Any = None
    skip_modules: list[str] | None = None
    keep_in_fp32_modules: list[str] | None = None

    def __post_init__(self) -> None:
        import torch

        for name in ("load_in_8bit", "load_in_4bit", "bnb_4bit_use_double_quant"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"`{name}` must be True or False, got {getattr(self, name)!r}")
        if self.load_in_4bit == self.load_in_8bit:
            raise ValueError("set exactly one of `load_in_4bit` and `load_in_8bit` to True")
        if isinstance(self.llm_int8_threshold, bool) or not isinstance(self.llm_int8_threshold, (int, float)):
            raise ValueError(f"`llm_int8_threshold` must be a number, got {self.llm_int8_threshold!r}")
        self.bnb_4bit_quant_type = _choice("bnb_4bit_quant_type", self.bnb_4bit_quant_type, ("fp4", "nf4"))
        self.bnb_4bit_compute_dtype = _bnb_dtype("bnb_4bit_compute_dtype", self.bnb_4bit_compute_dtype)
        for name in ("skip_modules", "keep_in_fp32_modules"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), list):
                raise ValueError(f"`{name}` must be a list of module names")
        self.target_dtype = CustomDtype.INT4 if self.load_in_4bit else torch.int8
        if self.load_in_4bit and self.llm_int8_threshold != 6.0:
            warnings.warn("`llm_int8_threshold` only applies to 8-bit loading", stacklevel=2)
        if self.torch_dtype is None:
            self.torch_dtype = torch.float16 if self.load_in_8bit else self.bnb_4bit_compute_dtype
        self.torch_dtype = _bnb_dtype("torch_dtype", self.torch_dtype)


@dataclass
class TensorInformation:
    """The shape and dtype of a tensor, standing in for it in `get_data_structure` / `initialize_tensors`."""

    shape: torch.Size  # noqa: F821 - annotation only (postponed evaluation); no torch import at module load
    dtype: torch.dtype  # noqa: F821


# --- Accelerate's remaining utils.dataclasses names (enums, type aliases, per-dimension parallelism configs, the
# Megatron-LM names that raise on use). Kept at the end of the module, apart from the plugin classes. ----------
from typing import Literal  # noqa: E402

from .constants import (  # noqa: E402,F401  (Accelerate's dataclasses module exposes these constants too)
    BETA_CP_AVAILABLE_PYTORCH_VERSION,
    BETA_TP_AVAILABLE_PYTORCH_VERSION,
    BETA_TP_AVAILABLE_TRANSFORMERS_VERSION,
    FSDP2_PYTORCH_VERSION,
    FSDP_AUTO_WRAP_POLICY,
    FSDP_BACKWARD_PREFETCH,
    FSDP_SHARDING_STRATEGY,
    MITA_PROFILING_AVAILABLE_PYTORCH_VERSION,
    XPU_PROFILING_AVAILABLE_PYTORCH_VERSION,
)
from .megatron_lm import (  # noqa: E402,F401
    MODEL_CONFIGS_TO_MEGATRON_PARSERS,
    MegatronLMPlugin,
    add_model_config_to_megatron_parser,
    parse_bert_config,
    parse_glm4_moe_config,
    parse_gpt2_config,
    parse_llama_config,
    parse_t5_config,
)
from .parallelism_config import (  # noqa: E402,F401
    DeepSpeedSequenceParallelConfig,
    TorchContextParallelConfig,
    TorchTensorParallelConfig,
)

Backend = Literal["MSAMP", "TE"]
OptLevel = Literal["O1", "O2"]
FP8Format = Literal["HYBRID", "E4M3", "E5M2"]
AmaxComputeAlgorithm = Literal["max", "most_recent"]
ProfilerActivity = Literal["cpu", "xpu", "mtia", "cuda", "hpu"]


class EnumWithContains(enum.EnumMeta):
    """Enum metaclass: `"value" in MyEnum` tests the values."""

    def __contains__(cls, item: Any) -> bool:
        try:
            cls(item)
        except ValueError:
            return False
        return True


class BaseEnum(enum.Enum, metaclass=EnumWithContains):
    """An enum whose `str()` is its value, with `list()` of the values (Accelerate's base for its enums)."""

    def __str__(self) -> str:
        return self.value

    @classmethod
    def list(cls) -> list:
        return [member.value for member in cls]


class SageMakerDistributedType(str, enum.Enum):
    """SageMaker's distributed modes (SageMaker launches are not supported by nbaccel; the enum is for reading)."""

    NO = "NO"
    DATA_PARALLEL = "DATA_PARALLEL"
    MODEL_PARALLEL = "MODEL_PARALLEL"


class FP8BackendType(str, enum.Enum):
    """The fp8 backends by Accelerate's names (nbaccel drives AO, torchao)."""

    NO = "NO"
    TE = "TE"
    MSAMP = "MSAMP"
    AO = "AO"


def get_module_class_from_name(module: Any, name: str) -> type | None:
    """The class named `name` among `module` and its submodules (depth first), or None (used to resolve
    `transformer_layer_cls_to_wrap` names)."""
    if type(module).__name__ == name:
        return type(module)
    for child in module.children():
        found = get_module_class_from_name(child, name)
        if found is not None:
            return found
    return None
