"""Reading the process environment: flags, choices, the launcher's rank variables, notebook detection.

Everything here is pure standard library (no torch import), so the kernel side can call it cheaply. The
rank variables a launcher sets are documented in docs/internals.md ("Environment contract").
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from .env_flags import _FALSE, _TRUE, parse_flag_from_env, patch_environment, str_to_bool, tpu_requested  # noqa: F401

T = TypeVar("T")


def parse_choice_from_env(key: str, default: str = "no") -> str:
    """The value of environment variable `key`, or `default` when it is unset."""
    return os.environ.get(key, str(default))


def get_int_from_env(env_keys: Iterable[str], default: int) -> int:
    """The first non-negative integer among the environment variables `env_keys`, else `default`."""
    for key in env_keys:
        raw = os.environ.get(key, "").strip()
        if not raw:
            continue
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(f"environment variable {key}={raw!r} must be an integer") from None
        if value >= 0:
            return value
    return default


def first_env(*keys: str, default: str | None = None) -> str | None:
    """The value of the first set (non-empty) variable among `keys`; nbaccel's names come before Accelerate's."""
    for key in keys:
        value = os.environ.get(key)
        if value:
            return value
    return default


def are_libraries_initialized(*library_names: str) -> list[str]:
    """Those of `library_names` already imported in this process."""
    return [name for name in library_names if name in sys.modules]


@contextmanager
def clear_environment() -> Iterator[None]:
    """Run the body with an empty `os.environ`; the previous environment comes back exactly afterwards."""
    saved = dict(os.environ)
    os.environ.clear()
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


_PURGED_PREFIXES = ("ACCELERATE_", "NBACCEL_")


def purge_accelerate_environment(func_or_cls: T) -> T:
    """Decorator: environment variables starting with ACCELERATE_ or NBACCEL_ that the decorated function (or
    each test method of the decorated class, and of the classes derived from it) sets are removed afterwards;
    changed ones are restored."""

    def wrap(func: Callable[..., Any]) -> Callable[..., Any]:
        if getattr(func, "_nbaccel_purges_environment", False):
            return func

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            before = {k: v for k, v in os.environ.items() if k.startswith(_PURGED_PREFIXES)}
            try:
                return func(*args, **kwargs)
            finally:
                for key in [k for k in os.environ if k.startswith(_PURGED_PREFIXES)]:
                    if key not in before:
                        del os.environ[key]
                os.environ.update(before)

        wrapper._nbaccel_purges_environment = True  # type: ignore[attr-defined]
        return wrapper

    def wrap_tests(cls: type) -> None:
        for name in dir(cls):
            if name.startswith("test") and callable(getattr(cls, name)):
                setattr(cls, name, wrap(getattr(cls, name)))

    if not isinstance(func_or_cls, type):
        return wrap(func_or_cls)  # type: ignore[return-value]
    wrap_tests(func_or_cls)
    decorated = func_or_cls

    def init_subclass(cls: type, **kwargs: Any) -> None:  # a derived class's tests are wrapped too
        super(decorated, cls).__init_subclass__(**kwargs)
        wrap_tests(cls)

    func_or_cls.__init_subclass__ = classmethod(init_subclass)  # type: ignore[assignment]
    return func_or_cls


# --- the launcher's rank variables ---------------------------------------------------------------------

_RANK_KEYS = ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK")
_WORLD_KEYS = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")
_LOCAL_RANK_KEYS = ("LOCAL_RANK", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_RANK")
_LOCAL_WORLD_KEYS = ("LOCAL_WORLD_SIZE", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE")
_NODE_RANK_KEYS = ("GROUP_RANK", "NODE_RANK", "OMPI_COMM_WORLD_NODE_RANK")


@dataclass(frozen=True)
class CPUInformation:
    """Where this process sits in the run: global and local rank and sizes, node rank, and who said so.

    `source` is "torch" (torchrun / elastic / nbaccel's launchers: RANK, WORLD_SIZE, ...), "mpi" (mpirun:
    OMPI_COMM_WORLD_*, PMI_*, MV2_*) or "none" (a plain single process).
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    source: str = "none"

    @property
    def num_nodes(self) -> int:
        """Machines in the run (world size over processes per machine, rounded up)."""
        return max(1, -(-self.world_size // max(1, self.local_world_size)))


def get_cpu_distributed_information() -> CPUInformation:
    """Read rank, world size, local rank and local world size from torch's or MPI's variables.

    torch's names (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK) win; MPI's are read when they
    are absent. Missing local values are derived: local rank = rank, local world size = world size (one node).
    """
    if "WORLD_SIZE" in os.environ or "RANK" in os.environ:
        source = "torch"
    elif any(key in os.environ for key in _WORLD_KEYS[1:] + _RANK_KEYS[1:]):
        source = "mpi"
    else:
        source = "none"
    world_size = get_int_from_env(_WORLD_KEYS, 1)
    rank = get_int_from_env(_RANK_KEYS, 0)
    local_world_size = get_int_from_env(_LOCAL_WORLD_KEYS, -1)
    local_rank = get_int_from_env(_LOCAL_RANK_KEYS, -1)
    if world_size < 1:
        raise ValueError(f"WORLD_SIZE must be at least 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"RANK={rank} is outside the world of {world_size} processes (0..{world_size - 1})")
    if local_world_size < 1:
        local_world_size = world_size
    if local_rank < 0:
        local_rank = rank % local_world_size
    node_rank = get_int_from_env(_NODE_RANK_KEYS, rank // local_world_size)
    return CPUInformation(rank, world_size, local_rank, local_world_size, node_rank, source)


# --- accelerators that need no torch import to detect --------------------------------------------------

# --- notebooks -----------------------------------------------------------------------------------------


def in_notebook() -> bool:
    """Whether this code runs inside a Jupyter kernel (JupyterLab, Notebook, Colab, Kaggle, VS Code)."""
    if "IPython" not in sys.modules:
        return False
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    if shell is None:
        return False
    if type(shell).__name__ in ("ZMQInteractiveShell", "Shell"):  # Jupyter; "Shell" is Colab's
        return True
    return "IPKernelApp" in getattr(shell, "config", {})


def is_colab() -> bool:
    """Whether this is a Google Colab runtime."""
    return "google.colab" in sys.modules or bool(os.environ.get("COLAB_RELEASE_TAG") or os.environ.get("COLAB_GPU"))


def is_kaggle() -> bool:
    """Whether this is a Kaggle notebook or script runtime."""
    return bool(os.environ.get("KAGGLE_KERNEL_RUN_TYPE") or os.environ.get("KAGGLE_URL_BASE"))


# --- GPUs, asked without initializing CUDA ---------------------------------------------------------------


def get_current_device_type() -> tuple[str, str]:
    """The accelerator type of this machine and its multi-process `DistributedType` value, e.g.
    ("cuda", "MULTI_GPU"), decided without initializing any device (safe before `fork`). Falls back to
    ("cuda", "MULTI_GPU") like Accelerate when no other accelerator library is present."""
    from .imports import (
        is_hpu_available,
        is_mlu_available,
        is_musa_available,
        is_neuron_available,
        is_npu_available,
        is_sdaa_available,
        is_xpu_available,
    )

    for check, device, distributed in (
        (is_mlu_available, "mlu", "MULTI_MLU"),
        (is_sdaa_available, "sdaa", "MULTI_SDAA"),
        (is_musa_available, "musa", "MULTI_MUSA"),
        (is_npu_available, "npu", "MULTI_NPU"),
        (is_hpu_available, "hpu", "MULTI_HPU"),
        (is_xpu_available, "xpu", "MULTI_XPU"),
        (is_neuron_available, "neuron", "MULTI_NEURON"),
    ):
        if check():
            return device, distributed
    return "cuda", "MULTI_GPU"


def _nvidia_smi(*query: str) -> list[str]:
    """Lines of `nvidia-smi --query-gpu=<query> --format=csv,noheader` (one per GPU)."""
    import shutil
    import subprocess

    command = shutil.which("nvidia-smi")
    if command is None and sys.platform == "win32":
        command = os.path.join(os.environ.get("SYSTEMDRIVE", "C:"), "\\Program Files\\NVIDIA Corporation\\NVSMI\\nvidia-smi.exe")
    if command is None:
        raise FileNotFoundError("nvidia-smi was not found: is the NVIDIA driver installed?")
    output = subprocess.run(
        [command, f"--query-gpu={','.join(query)}", "--format=csv,noheader"],
        capture_output=True, text=True, timeout=30, check=True,
    ).stdout
    return [line.strip() for line in output.strip().splitlines() if line.strip()]


def get_gpu_info() -> tuple[list[str], int]:
    """Names and number of the NVIDIA GPUs, from nvidia-smi (so CUDA stays uninitialized)."""
    names = _nvidia_smi("name")
    return names, len(names)


def get_driver_version() -> str:
    """The NVIDIA driver version (of the first GPU), from nvidia-smi."""
    return _nvidia_smi("driver_version")[0]


def check_cuda_p2p_ib_support() -> bool:
    """False when several consumer RTX 40xx GPUs run a driver older than 550.40.07, whose peer-to-peer and
    InfiniBand paths hang NCCL (NCCL_P2P_DISABLE=1 and NCCL_IB_DISABLE=1 are then needed)."""
    try:
        names, count = get_gpu_info()
        if count > 1 and any("RTX 40" in name for name in names):
            from packaging.version import parse

            return parse(get_driver_version()) >= parse("550.40.07")
    except Exception:
        pass
    return True


@functools.lru_cache(maxsize=1)
def check_cuda_fp8_capability() -> bool:
    """Whether the (first) GPU can run FP8 kernels: compute capability 8.9 (Ada) or newer."""
    try:
        capability = tuple(int(part) for part in _nvidia_smi("compute_cap")[0].split("."))
    except Exception:
        import torch

        capability = torch.cuda.get_device_capability()
    return capability >= (8, 9)


def convert_dict_to_env_variables(current_env: dict) -> list[str]:
    """`KEY=value\n` lines for a dict of environment variables (a launcher's env file). An entry with an empty
    key or value, or a `;`, `<`, `>`, space or newline in either, is left out with a warning."""
    forbidden = (";", "\n", "<", ">", " ")
    lines = []
    for key, value in current_env.items():
        if key and value and not any(c in key + value for c in forbidden):
            lines.append(f"{key}={value}\n")
        else:
            import logging

            logging.getLogger(__name__).warning("Skipping %s=%s: it has forbidden characters or an empty part",
                                                key, value)
    return lines


def override_numa_affinity(local_process_index: int, verbose: bool | None = None) -> None:
    """Pin this process to the CPU cores nearest its GPU (NVIDIA, through NVML). Needs pynvml
    (`pip install nvidia-ml-py`) and a CUDA GPU; `verbose` (default: ACCELERATE_DEBUG_MODE) prints the cores."""
    import math

    from .imports import is_pynvml_available

    if not is_pynvml_available():
        raise ImportError("CPU affinity per GPU needs NVML's Python bindings: pip install nvidia-ml-py")
    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(local_process_index)
    words = pynvml.nvmlDeviceGetCpuAffinity(handle, math.ceil((os.cpu_count() or 1) / 64))
    cores = [64 * word_index + bit for word_index, word in enumerate(words) for bit in range(64) if word >> bit & 1]
    os.sched_setaffinity(0, cores)
    if verbose if verbose is not None else parse_flag_from_env("ACCELERATE_DEBUG_MODE"):
        print(f"Assigning {len(cores)} CPU cores to process {local_process_index}: {cores}")


@functools.lru_cache
def set_numa_affinity(local_process_index: int, verbose: bool | None = None) -> None:
    """`override_numa_affinity`, done once per process (Accelerate calls it when ACCELERATE_CPU_AFFINITY=1)."""
    override_numa_affinity(local_process_index, verbose=verbose)
