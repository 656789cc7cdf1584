"""Which optional libraries and devices are there: `is_*_available`, version comparisons.

Package checks only look at import metadata (`importlib.util.find_spec` and `importlib.metadata`), never
import the package, and are cached: asking is cheap enough for any code path. Device checks import torch
(already loaded wherever they matter) and, for CUDA, use torch's NVML-based check so that asking does not
initialize CUDA in the notebook kernel (which would make `fork` unsafe later).
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import operator
import sys
from collections.abc import Callable
from typing import Any

from packaging.version import Version, parse

from .env_flags import parse_flag_from_env, patch_environment, tpu_requested

STR_OPERATION_TO_FUNC: dict[str, Callable[[Any, Any], bool]] = {
    ">": operator.gt,
    ">=": operator.ge,
    "==": operator.eq,
    "!=": operator.ne,
    "<=": operator.le,
    "<": operator.lt,
}


@functools.cache
def _package_version(import_name: str, *distribution_names: str) -> str | None:
    """The installed version of the distribution providing `import_name`, or None when it is not installed.

    A module that is importable but has no distribution metadata (a stray folder of the same name) does not
    count as installed.
    """
    try:
        if importlib.util.find_spec(import_name) is None:
            return None
    except (ImportError, ValueError):
        return None
    for name in distribution_names or (import_name,):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _is_package_available(import_name: str, *distribution_names: str) -> bool:
    return _package_version(import_name, *distribution_names) is not None


def compare_versions(library_or_version: str | Version, operation: str, requirement_version: str) -> bool:
    """Compare an installed library's version (by name) or a version to `requirement_version` with
    `operation`, one of `>`, `>=`, `==`, `!=`, `<=`, `<`."""
    if operation not in STR_OPERATION_TO_FUNC:
        raise ValueError(f"`operation` must be one of {list(STR_OPERATION_TO_FUNC)}, got {operation!r}")
    if isinstance(library_or_version, str):
        try:
            library_or_version = parse(importlib.metadata.version(library_or_version))
        except importlib.metadata.PackageNotFoundError:
            raise ValueError(f"{library_or_version!r} is not an installed library; pass a version instead") from None
    return STR_OPERATION_TO_FUNC[operation](library_or_version, parse(requirement_version))


@functools.cache
def _torch_version() -> Version:
    return parse(parse(importlib.metadata.version("torch")).base_version)


def is_torch_version(operation: str, version: str) -> bool:
    """Compare the installed PyTorch's version (without local tags like `+cpu`) to `version`."""
    return compare_versions(_torch_version(), operation, version)


# --- devices -------------------------------------------------------------------------------------------


def is_torch_distributed_available() -> bool:
    import torch

    return torch.distributed.is_available()


def is_cuda_available() -> bool:
    """Whether a CUDA (or ROCm) GPU is usable, asked through NVML so CUDA stays uninitialized."""
    import torch

    with patch_environment(PYTORCH_NVML_BASED_CUDA_CHECK="1"):
        return torch.cuda.is_available()


def is_rocm_available() -> bool:
    import torch

    return getattr(torch.version, "hip", None) is not None


def is_torch_xla_available(check_is_tpu: bool = False, check_is_gpu: bool = False) -> bool:
    """Whether torch_xla is installed (and, with `check_is_tpu`/`check_is_gpu`, whether it drives that device).

    `USE_TORCH_XLA=0` makes this False, to run plain PyTorch where torch_xla happens to be installed.
    """
    if check_is_tpu and check_is_gpu:
        raise ValueError("check_is_tpu and check_is_gpu cannot both be True")
    if not parse_flag_from_env("USE_TORCH_XLA", True):
        return False
    return _xla_device_check(check_is_tpu, check_is_gpu)


@functools.cache
def _xla_device_check(check_is_tpu: bool, check_is_gpu: bool) -> bool:
    if not _is_package_available("torch_xla", "torch_xla", "torch-xla"):
        return False
    if not (check_is_tpu or check_is_gpu):
        return True
    try:
        import torch_xla.runtime as xr

        device_type = xr.device_type()
    except Exception:
        return False
    if check_is_tpu:
        return device_type == "TPU"
    return device_type in ("GPU", "CUDA")


def is_mps_available(min_version: str = "1.12") -> bool:
    """Whether Apple's Metal (MPS) device is usable."""
    import torch

    mps = getattr(torch.backends, "mps", None)
    return is_torch_version(">=", min_version) and mps is not None and mps.is_available() and mps.is_built()


def is_xpu_available(check_device: bool = False) -> bool:
    """Whether an Intel XPU is usable through stock PyTorch."""
    import torch

    xpu = getattr(torch, "xpu", None)
    if xpu is None:
        return False
    try:
        return bool(xpu.is_available()) and (not check_device or xpu.device_count() > 0)
    except RuntimeError:
        return False


def _device_module_available(package: str, module: str, check_device: bool) -> bool:
    if not _is_package_available(package, package, package.replace("_", "-")):
        return False
    import importlib

    import torch

    try:
        importlib.import_module(package)
        device = getattr(torch, module, None)
        return device is not None and bool(device.is_available()) and (not check_device or device.device_count() > 0)
    except Exception:
        return False


@functools.cache
def is_npu_available(check_device: bool = False) -> bool:
    """Whether an Ascend NPU is usable (needs torch_npu)."""
    return _device_module_available("torch_npu", "npu", check_device)


@functools.cache
def is_mlu_available(check_device: bool = False) -> bool:
    """Whether a Cambricon MLU is usable (needs torch_mlu)."""
    return _device_module_available("torch_mlu", "mlu", check_device)


@functools.cache
def is_musa_available(check_device: bool = False) -> bool:
    """Whether a Moore Threads MUSA device is usable (needs torch_musa)."""
    return _device_module_available("torch_musa", "musa", check_device)


@functools.cache
def is_sdaa_available(check_device: bool = False) -> bool:
    """Whether a Tecorigin SDAA device is usable (needs torch_sdaa)."""
    return _device_module_available("torch_sdaa", "sdaa", check_device)


@functools.cache
def is_hpu_available(init_hccl: bool = False) -> bool:
    """Whether an Intel Gaudi HPU is usable (needs habana_frameworks)."""
    if not _is_package_available("habana_frameworks", "habana-torch-plugin", "habana_frameworks"):
        return False
    import torch

    try:
        import habana_frameworks.torch  # noqa: F401

        if init_hccl:
            import habana_frameworks.torch.distributed.hccl  # noqa: F401
        return bool(torch.hpu.is_available())
    except Exception:
        return False


def is_neuron_available(check_device: bool = False) -> bool:
    """Whether an AWS Neuron device is usable (needs torch_neuronx)."""
    return _device_module_available("torch_neuronx", "neuron", check_device)


def is_xccl_available() -> bool:
    """Whether torch.distributed has the XCCL backend (Intel GPUs)."""
    import torch.distributed as dist

    return is_torch_version(">=", "2.7.0") and dist.is_available() and dist.is_backend_available("xccl")


def is_bf16_available(ignore_tpu: bool = False) -> bool:
    """Whether bfloat16 mixed precision can run here: on the GPU when there is one, and on the CPU (which
    PyTorch supports) otherwise. On TPU True unless `ignore_tpu`."""
    if tpu_requested() and is_torch_xla_available():
        return not ignore_tpu
    import torch

    if is_cuda_available():
        return bool(torch.cuda.is_bf16_supported())
    if is_xpu_available():
        return bool(torch.xpu.is_bf16_supported())
    if is_mlu_available():
        return bool(torch.mlu.is_bf16_supported())
    if is_mps_available():
        return sys.platform == "darwin" and bool(torch.backends.mps.is_macos_or_newer(14, 0))
    return True


def is_habana_gaudi1() -> bool:
    if not is_hpu_available():
        return False
    import habana_frameworks.torch.utils.experimental as htexp

    return htexp._get_device_type() == htexp.synDeviceType.synDeviceGaudi


def is_fp16_available() -> bool:
    """Whether float16 mixed precision is supported (everywhere but first-generation Gaudi)."""
    return not is_habana_gaudi1()


# --- libraries -----------------------------------------------------------------------------------------


def is_msamp_available() -> bool:
    return _is_package_available("msamp", "ms-amp", "msamp")


def is_transformer_engine_available() -> bool:
    if _is_package_available("habana_frameworks", "habana-torch-plugin"):
        return _is_package_available("intel_transformer_engine", "intel-transformer-engine")
    return _is_package_available("transformer_engine", "transformer-engine", "transformer_engine")


def is_torchao_available() -> bool:
    version = _package_version("torchao")
    return version is not None and compare_versions(parse(version), ">=", "0.6.1")


def is_fp8_available() -> bool:
    """Whether an FP8 library is installed: MS-AMP, Transformer Engine or torchao."""
    return is_msamp_available() or is_transformer_engine_available() or is_torchao_available()


def is_deepspeed_available() -> bool:
    return _is_package_available("deepspeed")


def is_bnb_available(min_version: str | None = None) -> bool:
    version = _package_version("bitsandbytes")
    if version is None:
        return False
    return min_version is None or compare_versions(parse(version), ">=", min_version)


def is_4bit_bnb_available() -> bool:
    return is_bnb_available("0.39.0")


def is_8bit_bnb_available() -> bool:
    return is_bnb_available("0.37.2")


def is_megatron_lm_available() -> bool:
    return _is_package_available("megatron", "megatron-core", "megatron_core", "megatron-lm")


def is_aim_available() -> bool:
    version = _package_version("aim")
    return version is not None and compare_versions(parse(version), "<", "4.0.0")


def is_tensorboard_available() -> bool:
    return _is_package_available("tensorboard") or _is_package_available("tensorboardX", "tensorboardX")


def is_wandb_available() -> bool:
    return _is_package_available("wandb")


def is_comet_ml_available() -> bool:
    return _is_package_available("comet_ml", "comet_ml", "comet-ml")


def is_swanlab_available() -> bool:
    return _is_package_available("swanlab")


def is_trackio_available() -> bool:
    return _is_package_available("trackio")


def is_clearml_available() -> bool:
    return _is_package_available("clearml")


def is_mlflow_available() -> bool:
    return _is_package_available("mlflow", "mlflow", "mlflow-skinny")


def is_dvclive_available() -> bool:
    return _is_package_available("dvclive")


def is_rich_available() -> bool:
    """Whether rich is installed and rich tracebacks are asked for (NBACCEL_ENABLE_RICH or
    ACCELERATE_ENABLE_RICH), as in Accelerate."""
    if not _is_package_available("rich"):
        return False
    return parse_flag_from_env("NBACCEL_ENABLE_RICH", False) or parse_flag_from_env("ACCELERATE_ENABLE_RICH", False)


def is_pandas_available() -> bool:
    return _is_package_available("pandas")


def is_matplotlib_available() -> bool:
    return _is_package_available("matplotlib")


def is_datasets_available() -> bool:
    return _is_package_available("datasets")


def is_transformers_available() -> bool:
    return _is_package_available("transformers")


def is_peft_available() -> bool:
    return _is_package_available("peft")


def is_safetensors_available() -> bool:
    return _is_package_available("safetensors")


def is_lomo_available() -> bool:
    return _is_package_available("lomo_optim", "lomo-optim", "lomo_optim")


def is_timm_available() -> bool:
    return _is_package_available("timm")


def is_torchvision_available() -> bool:
    return _is_package_available("torchvision")


def is_triton_available() -> bool:
    return _is_package_available("triton", "triton", "pytorch-triton", "pytorch-triton-rocm")


def is_boto3_available() -> bool:
    return _is_package_available("boto3")


def is_sagemaker_available() -> bool:
    return _is_package_available("sagemaker")


def is_tqdm_available() -> bool:
    return _is_package_available("tqdm")


def is_pytest_available() -> bool:
    return _is_package_available("pytest")


def is_schedulefree_available() -> bool:
    return _is_package_available("schedulefree")


def is_torchdata_available() -> bool:
    return _is_package_available("torchdata")


def is_torchdata_stateful_dataloader_available() -> bool:
    version = _package_version("torchdata")
    return version is not None and compare_versions(parse(version), ">=", "0.8.0")


def is_pynvml_available() -> bool:
    return _is_package_available("pynvml", "pynvml", "nvidia-ml-py")


def is_ipex_available() -> bool:
    """Whether Intel Extension for PyTorch is installed for this PyTorch's major.minor version."""
    version = _package_version("intel_extension_for_pytorch", "intel_extension_for_pytorch", "intel-extension-for-pytorch")
    if version is None:
        return False
    ipex, torch_version = parse(version), _torch_version()
    return (ipex.major, ipex.minor) == (torch_version.major, torch_version.minor)


def is_weights_only_available() -> bool:
    """Whether `torch.load(weights_only=True)` is safe to use (PyTorch 2.4 and later)."""
    return is_torch_version(">=", "2.4.0")


def is_pippy_available() -> bool:
    return is_torch_version(">=", "2.4.0")


def deepspeed_required(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator for methods that only make sense with DeepSpeed: a clear error otherwise."""

    @functools.wraps(func)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not is_deepspeed_available():
            raise ImportError(f"{func.__name__} needs DeepSpeed: pip install deepspeed")
        if getattr(self, "distributed_type", None) != "DEEPSPEED":
            raise ValueError(
                f"{func.__name__} needs DeepSpeed to be enabled: pass a DeepSpeedPlugin to Accelerator(...)"
            )
        return func(self, *args, **kwargs)

    return wrapper


# --- the remaining checks of Accelerate's imports module --------------------------------------------------
# USE_TORCH_XLA=0 hides torch_xla from the checks (Accelerate's switch, read once at import as there).
USE_TORCH_XLA = parse_flag_from_env("USE_TORCH_XLA", default=True)


def is_import_timer_available() -> bool:
    return _is_package_available("import_timer")


def is_amdsmi_available() -> bool:
    return _is_package_available("amdsmi")


def is_numpy_available(min_version: str = "1.25.0") -> bool:
    version = _package_version("numpy")
    return version is not None and compare_versions(parse(version), ">=", min_version)


def is_bitsandbytes_multi_backend_available() -> bool:
    """Whether the installed bitsandbytes has its multi-backend (non-CUDA) support."""
    if not is_bnb_available():
        return False
    import bitsandbytes

    return "multi_backend" in getattr(bitsandbytes, "features", set())


def is_transformer_engine_mxfp8_available() -> bool:
    """Whether Transformer Engine is installed and this GPU runs its MXFP8 recipe."""
    if not _is_package_available("transformer_engine", "transformer-engine", "transformer_engine"):
        return False
    from transformer_engine.pytorch.fp8 import check_mxfp8_support

    return bool(check_mxfp8_support()[0])


def torchao_required(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator: calling `func` without torchao (>= 0.6.1) raises ImportError saying to install it."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not is_torchao_available():
            raise ImportError(f"{func.__name__} needs torchao >= 0.6.1: pip install torchao")
        return func(*args, **kwargs)

    return wrapper
