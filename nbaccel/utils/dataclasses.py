"""Enums, configuration classes, plugins and kwargs handlers, with Accelerate's names, fields and defaults.

The enums compare equal to their string values (`DistributedType.MULTI_CPU == "MULTI_CPU"`,
`PrecisionType.BF16 == "bf16"`), so configuration files and user code may use either.
"""

from __future__ import annotations

import enum


class _ContainsValues(enum.EnumMeta):
    """Lets `"bf16" in PrecisionType` test membership by value."""

    def __contains__(cls, item: object) -> bool:
        try:
            cls(item)
        except (ValueError, TypeError):
            return False
        return True


class _ValueEnum(str, enum.Enum, metaclass=_ContainsValues):
    """A string enum whose str() is its value and which lists its values with `.list()`."""

    def __str__(self) -> str:
        return self.value

    @classmethod
    def list(cls) -> list[str]:
        return [member.value for member in cls]


class DistributedType(_ValueEnum):
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


class ComputeEnvironment(_ValueEnum):
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


from dataclasses import dataclass as _dataclass  # noqa: E402 - appended section (operations)


@_dataclass
class TensorInformation:
    """The shape and dtype of a tensor, standing in for it in `get_data_structure` / `initialize_tensors`."""

    shape: torch.Size  # noqa: F821 - annotation only (postponed evaluation); no torch import at module load
    dtype: torch.dtype  # noqa: F821
