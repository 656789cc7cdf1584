"""The three process-wide states: `PartialState`, `AcceleratorState`, `GradientState`.

Each class is a shared-state singleton (every instance reads and writes one dict), as in Accelerate: the
first `PartialState()` in a process detects the environment, picks device and backend and initializes the
process group once; later instances just see the result. Tests reset them with `_reset_state()` or the
`isolated_states()` context manager. What detection does is described in docs/state.md.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from functools import partial
from typing import Any

import torch

from .utils import collective_trace, constants, file_rendezvous
from .utils import xla as _xla
from .utils.dataclasses import DistributedType, PrecisionType, whole_number
from .utils.environment import (
    check_cuda_p2p_ib_support,
    first_env,
    get_cpu_distributed_information,
    parse_flag_from_env,
    tpu_requested,
)
from .utils.imports import (
    is_cuda_available,
    is_deepspeed_available,
    is_fp8_available,
    is_megatron_lm_available,
    is_mps_available,
    is_npu_available,
    is_torch_xla_available,
    is_xpu_available,
)
from .utils.process_group_exit import destroy_process_group_at_exit, keep_group_past_its_users

logger = logging.getLogger(__name__)

DEFAULT_PG_TIMEOUT_SECONDS = 600.0
"""Process-group timeout when neither `timeout=` nor NBACCEL_PG_TIMEOUT says otherwise: a collective that not
every rank enters fails after 10 minutes instead of torch's 30."""

_INIT_PROCESS_GROUP_ARGS = (
    "backend", "init_method", "timeout", "world_size", "rank", "store", "group_name", "pg_options", "device_id",
)

# device type -> (distributed type with several processes, default backend)
_DEVICE_BACKENDS: dict[str, tuple[DistributedType, str]] = {
    "cuda": (DistributedType.MULTI_GPU, "nccl"),
    "xpu": (DistributedType.MULTI_XPU, "xccl"),
    "npu": (DistributedType.MULTI_NPU, "hccl"),
    "mlu": (DistributedType.MULTI_MLU, "cncl"),
    "musa": (DistributedType.MULTI_MUSA, "mccl"),
    "sdaa": (DistributedType.MULTI_SDAA, "tccl"),
    "hpu": (DistributedType.MULTI_HPU, "hccl"),
    "cpu": (DistributedType.MULTI_CPU, "gloo"),
    "xla": (DistributedType.XLA, "xla"),
}
_BARRIER_TYPES = {kind for kind, _ in _DEVICE_BACKENDS.values()} | {
    DistributedType.DEEPSPEED, DistributedType.FSDP, DistributedType.MEGATRON_LM, DistributedType.MULTI_NEURON,
}


def _do_nothing(*args: Any, **kwargs: Any) -> None:
    """What an `on_*_process` decorated function becomes on the processes that must not run it."""
    return None


class _ThreadLocalDict(threading.local):
    """A class attribute whose dict is per thread: torch_xla's PJRT runs one TPU core per thread on v2/v3."""

    def __init__(self) -> None:
        self.storage: dict[str, Any] = {}

    def __get__(self, obj: Any, objtype: Any = None) -> dict[str, Any]:
        return self.storage

    def __set__(self, obj: Any, value: dict[str, Any]) -> None:
        self.storage = value


def _shared_dict() -> Any:
    """Per thread where torch_xla is installed (as in Accelerate): its replicas may be threads of one process."""
    return _ThreadLocalDict() if is_torch_xla_available() else {}


def _drop_if_inherited(shared: dict[str, Any]) -> None:
    """Forget a state created in another process and inherited through `fork` (e.g. a `PartialState()` made
    in the notebook kernel before `notebook_launcher` forked the workers): each process detects its own."""
    if shared and shared.get("_pid") != os.getpid():
        shared.clear()


def _env_mixed_precision() -> str:
    """NBACCEL_MIXED_PRECISION, else ACCELERATE_MIXED_PRECISION, else "no"; checked, naming the variable."""
    for key in ("NBACCEL_MIXED_PRECISION", "ACCELERATE_MIXED_PRECISION"):
        if os.environ.get(key):
            return _check_mixed_precision(os.environ[key], key)
    return "no"


def _check_mixed_precision(value: Any, source: str = "mixed_precision") -> str:
    """The lower-case precision name, or ValueError naming the allowed values."""
    text = str(value.value if isinstance(value, PrecisionType) else value).strip().lower()
    if text not in PrecisionType.list():
        raise ValueError(f"{source}={value!r} is not a precision: use one of {PrecisionType.list()}")
    return text


def _read_debug_flag() -> bool:
    if os.environ.get("NBACCEL_DEBUG_MODE", "").strip():
        return parse_flag_from_env("NBACCEL_DEBUG_MODE")
    return parse_flag_from_env("ACCELERATE_DEBUG_MODE")


def _pg_timeout(value: Any) -> timedelta:
    """`timeout=` (timedelta or seconds), else NBACCEL_PG_TIMEOUT (seconds), else 10 minutes."""
    source = "timeout"
    if value is None:
        raw = os.environ.get("NBACCEL_PG_TIMEOUT", "").strip()
        if not raw:
            return timedelta(seconds=DEFAULT_PG_TIMEOUT_SECONDS)
        source = "NBACCEL_PG_TIMEOUT"
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"NBACCEL_PG_TIMEOUT={raw!r} must be a number of seconds") from None
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise TypeError(f"timeout must be a datetime.timedelta or seconds, got {type(value).__name__}")
    if seconds <= 0:
        raise ValueError(f"{source} must be positive, got {seconds} s")
    return timedelta(seconds=seconds)


def _accelerator_type(cpu: bool, multi_process: bool) -> str:
    """The device type this process computes on, before any process group exists."""
    if cpu:
        return "cpu"
    forced = first_env("NBACCEL_TORCH_DEVICE", "ACCELERATE_TORCH_DEVICE")
    if forced:
        return torch.device(forced).type
    if is_cuda_available():
        return "cuda"
    if is_xpu_available():
        return "xpu"
    if is_npu_available():
        return "npu"
    if not multi_process and is_mps_available():
        return "mps"  # MPS has no collective backend: several processes on a Mac run on the CPU with gloo
    return "cpu"


def _launched_alone(cpu: bool) -> bool:
    """Whether a launcher started this process as the only one (LOCAL_RANK set: torchrun, `accelerate launch
    --use_fsdp`), without cpu=True. Accelerate then builds a process group of one: on an accelerator a
    distributed one (MULTI_GPU, so FSDP applies), elsewhere a gloo group while it reports one plain process.
    nbaccel's one-process launches that Accelerate runs without a launcher set ONE_PROCESS_ENV: no group. So
    does a LOCAL_RANK without the rendezvous address a launcher sets (Accelerate's group would fail there)."""
    return (not cpu and os.environ.get("LOCAL_RANK") is not None and not os.environ.get(constants.ONE_PROCESS_ENV)
            and bool(os.environ.get("MASTER_ADDR")) and bool(os.environ.get("MASTER_PORT")))


def _init_process_group(backend: str, timeout: timedelta, kwargs: dict[str, Any], barrier: bool = False) -> None:
    """`torch.distributed.init_process_group`, traced as a collective: every rank must arrive, so a launcher
    that sees one rank finish (or wait in another collective) while a peer waits here reports the deadlock
    within seconds instead of letting the peer wait out the process-group timeout. `barrier`: also wait until
    every rank is connected."""
    with collective_trace.in_collective("PartialState", "init_process_group"):
        torch.distributed.init_process_group(backend=backend, timeout=timeout, **kwargs)
        if barrier:
            torch.distributed.barrier()


class PartialState:
    """Where this process runs and how to coordinate with the others; no training configuration.

    `PartialState(cpu=False, **kwargs)`: `cpu=True` (or NBACCEL_USE_CPU=1) ignores accelerators; `kwargs`
    go to `torch.distributed.init_process_group` (those of `InitProcessGroupKwargs(...).to_kwargs()`:
    backend, init_method, timeout, ...). Several processes on a machine without an accelerator run
    distributed on gloo, without `cpu=True`.

    Attributes: device, distributed_type, backend, num_processes, process_index, local_process_index,
    num_machines, machine_rank, debug, fork_launched, pg_timeout; properties initialized, use_distributed,
    is_main_process, is_local_main_process, is_last_process, mixed_precision, default_device.
    """

    _shared_state = _shared_dict()
    _known_attrs = [
        "_cpu", "_debug", "_shared_state", "backend", "device", "distributed_type", "fork_launched",
        "local_process_index", "num_processes", "process_index", "num_machines", "machine_rank", "pg_timeout",
        "local_num_processes",
    ]

    def __init__(self, cpu: bool = False, **kwargs: Any) -> None:
        self.__dict__ = self._shared_state
        _drop_if_inherited(self._shared_state)
        if not self.initialized:
            try:
                self._initialize(bool(cpu), kwargs)
            except BaseException:
                self._shared_state.clear()  # a failed start leaves no half-initialized state behind
                raise
        self.fork_launched = parse_flag_from_env("FORK_LAUNCHED", False)

    # --- detection ---------------------------------------------------------------------------------------

    def _initialize(self, cpu: bool, kwargs: dict[str, Any]) -> None:
        unknown = sorted(set(kwargs) - set(_INIT_PROCESS_GROUP_ARGS))
        if unknown:
            raise TypeError(
                f"PartialState() got unexpected keyword argument(s) {unknown}: it accepts cpu and the arguments "
                f"of torch.distributed.init_process_group {list(_INIT_PROCESS_GROUP_ARGS)}"
            )
        cpu = cpu or parse_flag_from_env("NBACCEL_USE_CPU") or parse_flag_from_env("ACCELERATE_USE_CPU")
        kwargs = dict(kwargs)
        requested_backend = kwargs.pop("backend", None)
        timeout = _pg_timeout(kwargs.pop("timeout", None))
        debug = _read_debug_flag()
        state: dict[str, Any] = {"_cpu": cpu, "pg_timeout": timeout, "device": None, "_pid": os.getpid()}

        # inside an xmp.spawn replica the state follows torch_xla on any PJRT device (the CPU device included)
        use_xla = not cpu and (tpu_requested() or _xla.inside_spawned_replica())
        if use_xla and not is_torch_xla_available():
            raise ImportError(
                "this environment asks for TPU cores (PJRT_DEVICE=TPU or a TPU runtime variable) but torch_xla is "
                "not installed: pip install nbaccel[tpu] (or torch_xla matching your torch), or set "
                "USE_TORCH_XLA=0 / pass cpu=True to run on the CPU"
            )

        if use_xla:
            state.update(self._detect_xla(requested_backend, kwargs, timeout))
        elif torch.distributed.is_available() and torch.distributed.is_initialized():
            state.update(self._adopt_process_group(cpu))
        else:
            state.update(self._detect_and_init(cpu, requested_backend, kwargs, timeout))

        self._shared_state.update(state)
        self.debug = debug
        self.set_device()
        if self.device.type == "mps":
            os.environ.setdefault("PYTORCH_ENABLE_MPS_FALLBACK", "1")

    def _detect_and_init(
        self, cpu: bool, requested_backend: str | None, kwargs: dict[str, Any], timeout: timedelta
    ) -> dict[str, Any]:
        info = get_cpu_distributed_information()
        world_size = kwargs.get("world_size", -1) if kwargs.get("world_size", -1) > 0 else info.world_size
        device_type = _accelerator_type(cpu, multi_process=world_size > 1)
        base = {
            "num_machines": info.num_nodes,
            "machine_rank": info.node_rank,
            "local_num_processes": info.local_world_size,
        }
        alone = world_size == 1 and _launched_alone(cpu)
        distributed_alone = alone and device_type in _DEVICE_BACKENDS and device_type != "cpu"  # e.g. MULTI_GPU
        if world_size == 1 and not distributed_alone:
            if alone and not torch.distributed.is_initialized():  # a gloo group of one, reported as one process
                # the caller's arguments as they are (as in Accelerate): env:// reads RANK and WORLD_SIZE, and
                # an init_method URL may name them itself (torch refuses them twice)
                _init_process_group("gloo", timeout, kwargs)
                destroy_process_group_at_exit()
            elif requested_backend is not None:
                logger.info("one process: no process group, so backend=%r is not used", requested_backend)
            return {
                **base, "backend": None, "distributed_type": DistributedType.NO, "num_processes": 1,
                "process_index": 0, "local_process_index": 0, "_device_type": device_type,
            }

        distributed_type, backend = _DEVICE_BACKENDS.get(device_type, _DEVICE_BACKENDS["cpu"])
        if device_type not in _DEVICE_BACKENDS:
            device_type = "cpu"
        backend = self._check_backend(requested_backend, backend, device_type)
        rank = kwargs.get("rank", -1) if kwargs.get("rank", -1) >= 0 else info.rank

        private_rendezvous = (kwargs.get("init_method") is None and kwargs.get("store") is None
                              and bool(os.environ.get(constants.INIT_METHOD_ENV)))
        if private_rendezvous:
            # a launcher's private rendezvous (e.g. a FileStore in an owner-only folder: nothing listens on the
            # network); MASTER_ADDR/MASTER_PORT stay set for code that reads them. A file:// one is waited on
            # without the FileStore's 10 ms polls (utils/file_rendezvous.py)
            url = os.environ[constants.INIT_METHOD_ENV]
            store = file_rendezvous.store_for(url, world_size, timeout)
            if store is None:
                kwargs["init_method"] = url
            else:
                kwargs["store"] = store
        if kwargs.get("init_method") is None and kwargs.get("store") is None:
            if info.source == "mpi":
                # mpirun does not set torch's variables; the env:// rendezvous reads them
                os.environ.setdefault("RANK", str(info.rank))
                os.environ.setdefault("WORLD_SIZE", str(info.world_size))
                os.environ.setdefault("LOCAL_RANK", str(info.local_rank))
                os.environ.setdefault("LOCAL_WORLD_SIZE", str(info.local_world_size))
                if info.num_nodes == 1:
                    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
                os.environ.setdefault("MASTER_PORT", "29500")
            missing = [key for key in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(key)]
            if missing and backend != "mpi":
                raise ValueError(
                    f"WORLD_SIZE={world_size} asks for a distributed run but {' and '.join(missing)} "
                    f"{'are' if len(missing) > 1 else 'is'} not set: start the processes with "
                    "nbaccel.notebook_launcher, `nbaccel launch` or torchrun, or export rank 0's address as "
                    "MASTER_ADDR and a free port as MASTER_PORT"
                )

        if device_type == "cpu" and not os.environ.get("OMP_NUM_THREADS"):
            import psutil

            cores = psutil.cpu_count(logical=False) or os.cpu_count() or 1
            torch.set_num_threads(max(1, cores // max(1, info.local_world_size)))
        if device_type not in ("cpu", "xla"):
            module = getattr(torch, device_type)
            count = module.device_count()
            if "nccl" in backend and not check_cuda_p2p_ib_support():
                # consumer RTX 40xx GPUs on old drivers hang NCCL over P2P/IB; Accelerate's launcher sets these
                os.environ.setdefault("NCCL_P2P_DISABLE", "1")
                os.environ.setdefault("NCCL_IB_DISABLE", "1")
                logger.warning("RTX 40xx GPUs with a driver older than 550.40.07: NCCL peer-to-peer and IB disabled")
            if "nccl" in backend and count < info.local_world_size:
                raise ValueError(
                    f"{info.local_world_size} processes on this machine but {count} CUDA device(s) visible: NCCL "
                    f"needs one GPU per process. Start {count} process(es), or pass cpu=True to run on the CPU"
                )
            module.set_device(info.local_rank % max(1, count))

        kwargs.update(rank=rank, world_size=world_size)
        # torch does not wait after building the group, so a rank that runs `PartialState()` and then returns
        # or raises (notebook_launcher's forked ranks leave with os._exit at once) could close its sockets
        # while a peer was still connecting to it ("Gloo connectFullMesh failed ... Connection closed by
        # peer"): ~1 launch in 60-150 on a loaded 2-core machine, with a private rendezvous or torch's env://
        # one (an elastic restart). A barrier returns only once every rank is connected (~0.3 ms; torch's own
        # TORCH_DIST_INIT_BARRIER costs ~10 ms on a FileStore).
        _init_process_group(backend, timeout, kwargs, barrier=backend == "gloo" and world_size > 1)
        destroy_process_group_at_exit()  # a correct script exits 0, not -6 (utils/process_group_exit.py)
        return {
            **base,
            "backend": backend,
            "distributed_type": distributed_type,
            "num_processes": torch.distributed.get_world_size(),
            "process_index": torch.distributed.get_rank(),
            "local_process_index": info.local_rank,
            "_device_type": device_type,
        }

    @staticmethod
    def _check_backend(requested: str | None, default: str, device_type: str) -> str:
        if requested is None:
            return default
        name = str(requested).lower()
        if name == "mpi" and not torch.distributed.is_mpi_available():
            raise ValueError("backend='mpi' needs a PyTorch built with MPI; use 'gloo' (CPU) or 'nccl' (CUDA)")
        if "nccl" in name and device_type != "cuda":
            raise ValueError(
                f"backend={requested!r} needs CUDA GPUs but this process runs on {device_type!r}: use "
                f"backend={default!r} (or leave backend unset)"
            )
        if name == "xla":
            raise ValueError("backend='xla' needs TPU cores: set PJRT_DEVICE=TPU with torch_xla installed")
        if "," not in name and ":" not in name and not torch.distributed.is_backend_available(name):
            raise ValueError(f"backend={requested!r} is not available in this PyTorch; use {default!r}")
        return name

    def _adopt_process_group(self, cpu: bool) -> dict[str, Any]:
        """The process group exists already (set up by the user or a test harness): describe it."""
        info = get_cpu_distributed_information()
        backend = str(torch.distributed.get_backend()).lower()
        world_size, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
        if "nccl" in backend and not cpu:
            device_type = "cuda"
        elif backend in ("gloo", "mpi") or cpu:
            device_type = "cpu"
        else:
            device_type = _accelerator_type(cpu, multi_process=True)
        distributed_type = _DEVICE_BACKENDS.get(device_type, _DEVICE_BACKENDS["cpu"])[0]
        return {
            "backend": backend,
            "distributed_type": distributed_type if world_size > 1 else DistributedType.NO,
            "num_processes": world_size,
            "process_index": rank,
            "local_process_index": info.local_rank if info.world_size == world_size else rank,
            "num_machines": info.num_nodes,
            "machine_rank": info.node_rank,
            "local_num_processes": info.local_world_size,
            "_device_type": device_type,
        }

    def _detect_xla(self, requested_backend: str | None, kwargs: dict[str, Any], timeout: timedelta) -> dict[str, Any]:
        """TPU cores through torch_xla's PJRT runtime; the `xla` process group carries torch.distributed calls."""
        if requested_backend not in (None, "xla"):
            raise ValueError(f"backend={requested_backend!r} cannot drive TPU cores: use 'xla' (or leave it unset)")
        import torch_xla.runtime as xr

        world_size, rank, local_rank = xr.world_size(), xr.global_ordinal(), xr.local_ordinal()
        if world_size > 1 and not torch.distributed.is_initialized():
            import torch_xla.distributed.xla_backend  # noqa: F401  (registers the "xla" backend)

            kwargs.setdefault("init_method", "xla://")
            _init_process_group("xla", timeout, kwargs)
            destroy_process_group_at_exit()
        local_count = max(1, xr.local_device_count()) if hasattr(xr, "local_device_count") else world_size
        return {
            "backend": "xla",
            "distributed_type": DistributedType.XLA,
            "num_processes": world_size,
            "process_index": rank,
            "local_process_index": local_rank,
            "num_machines": max(1, -(-world_size // local_count)),
            "machine_rank": rank // local_count,
            "local_num_processes": local_count,
            "_device_type": "xla",
        }

    # --- basic properties --------------------------------------------------------------------------------

    def __repr__(self) -> str:
        if not self.initialized:
            return "PartialState (not initialized)"
        backend = f"  Backend: {self.backend}" if self.backend else ""
        return (
            f"Distributed environment: {self.distributed_type}{backend}\n"
            f"Num processes: {self.num_processes}\n"
            f"Process index: {self.process_index}\n"
            f"Local process index: {self.local_process_index}\n"
            f"Device: {self.device}\n"
        )

    @staticmethod
    def _reset_state() -> None:
        """Forget the detected state (tests). The process group, if any, stays up: see destroy_process_group."""
        PartialState._shared_state.clear()
        collectives = sys.modules.get(f"{__package__}.utils.collectives")
        if collectives is not None:
            collectives.note_group_destroyed(False)

    @property
    def initialized(self) -> bool:
        """Whether a `PartialState` has been created in this process (since the last reset)."""
        return bool(self._shared_state)

    @property
    def debug(self) -> bool:
        """Debug mode (NBACCEL_DEBUG_MODE or ACCELERATE_DEBUG_MODE): collectives check shapes across ranks.

        Setting it also sets NBACCEL_DEBUG_MODE, which `nbaccel.utils` reads."""
        return self._shared_state.get("_debug", False)

    @debug.setter
    def debug(self, value: bool) -> None:
        value = bool(value)
        self._shared_state["_debug"] = value
        if value or os.environ.get("NBACCEL_DEBUG_MODE") or os.environ.get("ACCELERATE_DEBUG_MODE"):
            os.environ["NBACCEL_DEBUG_MODE"] = "1" if value else "0"

    @property
    def mixed_precision(self) -> str:
        """The precision of the run: the Accelerator's once it exists, else NBACCEL_/ACCELERATE_MIXED_PRECISION."""
        accelerator_state = AcceleratorState._shared_state
        if _ACCELERATOR_MARKER in accelerator_state:
            return _view(AcceleratorState).mixed_precision
        return _env_mixed_precision()

    @property
    def use_distributed(self) -> bool:
        """Whether more than one process takes part."""
        return self.distributed_type != DistributedType.NO and self.num_processes > 1

    @property
    def is_last_process(self) -> bool:
        return self.process_index == self.num_processes - 1

    @property
    def is_main_process(self) -> bool:
        """Rank 0 (the last rank under Megatron-LM, as in Accelerate)."""
        if self.distributed_type == DistributedType.MEGATRON_LM:
            return self.is_last_process
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        """Local rank 0 of this machine (the last rank under Megatron-LM)."""
        if self.distributed_type == DistributedType.MEGATRON_LM:
            return self.is_last_process
        return self.local_process_index == 0

    # --- process control ---------------------------------------------------------------------------------

    def wait_for_everyone(self) -> None:
        """Block until every process reaches this point (a no-op in a single process).

        A rank that never arrives makes the others fail after the process-group timeout (see pg_timeout)."""
        if not self.use_distributed or self.distributed_type not in _BARRIER_TYPES:
            return
        if self.distributed_type == DistributedType.XLA:
            import torch_xla.core.xla_model as xm

            with collective_trace.in_collective("wait_for_everyone", "xm.rendezvous"):
                xm.rendezvous("nbaccel.wait_for_everyone")
            return
        device_ids = [self.device.index] if "nccl" in str(self.backend) and self.device.index is not None else None
        with collective_trace.in_collective("wait_for_everyone", "barrier"):
            torch.distributed.barrier(device_ids=device_ids)

    def _goes_first(self, is_main: bool) -> Iterator[None]:
        if not is_main:
            self.wait_for_everyone()
        yield
        if is_main:
            self.wait_for_everyone()

    @contextmanager
    def main_process_first(self) -> Iterator[None]:
        """The main process runs the body first; the others enter it once the main process has left it."""
        yield from self._goes_first(self.is_main_process)

    @contextmanager
    def local_main_process_first(self) -> Iterator[None]:
        """Each machine's local main process runs the body first; the other local processes follow."""
        yield from self._goes_first(self.is_local_main_process)

    @contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """This process's contiguous share of `inputs` (list, tuple, range, tensor, numpy array, dict of those, or
        a `datasets.Dataset`; a string or another sized object goes whole to every process, as in Accelerate).
        The first `len % num_processes` processes get one extra element; with `apply_padding=True` the short
        shares repeat the input's last element so every share has the same length (drop the padding after a
        gather). The input itself is never modified."""
        if self.num_processes == 1:
            yield inputs
            return
        yield _split(inputs, self.num_processes, self.process_index, apply_padding)

    # --- decorators --------------------------------------------------------------------------------------

    def _runs_here(self, runs: Callable[[], bool], function: Callable[..., Any] | None, name: str) -> Callable[..., Any]:
        if not self.initialized:
            raise ValueError(f"create PartialState() or Accelerator() before using {name}")
        if function is None:
            raise TypeError(f"{name} decorates a function: use @state.{name} (without parentheses)")
        return function if not self.use_distributed or runs() else _do_nothing

    def on_main_process(self, function: Callable[..., Any] | None = None) -> Callable[..., Any]:
        """Decorator: the function runs on the main process only (elsewhere it returns None)."""
        if function is None:
            return self.on_main_process
        return self._runs_here(lambda: self.is_main_process, function, "on_main_process")

    def on_local_main_process(self, function: Callable[..., Any] | None = None) -> Callable[..., Any]:
        """Decorator: the function runs on each machine's local main process only."""
        if function is None:
            return self.on_local_main_process
        return self._runs_here(lambda: self.is_local_main_process, function, "on_local_main_process")

    def on_last_process(self, function: Callable[..., Any]) -> Callable[..., Any]:
        """Decorator: the function runs on the last process only."""
        return self._runs_here(lambda: self.is_last_process, function, "on_last_process")

    def on_process(
        self, function: Callable[..., Any] | None = None, process_index: int | None = None
    ) -> Callable[..., Any]:
        """Decorator: the function runs on the process with global index `process_index` only."""
        if function is None:
            return partial(self.on_process, process_index=process_index)
        _check_index(process_index, "process_index")
        return self._runs_here(lambda: self.process_index == process_index, function, "on_process")

    def on_local_process(
        self, function: Callable[..., Any] | None = None, local_process_index: int | None = None
    ) -> Callable[..., Any]:
        """Decorator: the function runs on the process with local index `local_process_index` of each machine."""
        if function is None:
            return partial(self.on_local_process, local_process_index=local_process_index)
        _check_index(local_process_index, "local_process_index")
        return self._runs_here(
            lambda: self.local_process_index == local_process_index, function, "on_local_process"
        )

    def print(self, *args: Any, **kwargs: Any) -> None:
        """`print` on each machine's local main process only."""
        if self.is_local_main_process:
            print(*args, **kwargs)

    # --- devices -----------------------------------------------------------------------------------------

    @property
    def default_device(self) -> torch.device:
        """The best device of this machine for one process: MPS, CUDA, XPU, NPU, else CPU."""
        if is_mps_available():
            os.environ.setdefault("PYTORCH_ENABLE_MPS_FALLBACK", "1")
            return torch.device("mps")
        if is_cuda_available():
            return torch.device("cuda")
        if is_xpu_available():
            return torch.device("xpu")
        if is_npu_available():
            return torch.device("npu")
        return torch.device("cpu")

    def set_device(self) -> None:
        """Set `self.device` from the detected environment (local rank -> device index), once."""
        if self.device is not None:
            return
        forced = first_env("NBACCEL_TORCH_DEVICE", "ACCELERATE_TORCH_DEVICE")
        device_type = self._shared_state.get("_device_type", "cpu")
        if forced and not self._cpu:
            self.device = torch.device(forced)
        elif device_type == "xla":
            import torch_xla

            self.device = torch_xla.device()
        elif device_type in ("cpu", "mps") or self.distributed_type == DistributedType.NO:
            self.device = torch.device(device_type)  # one process: "cuda" means the current device, as in Accelerate
        else:
            module = getattr(torch, device_type)
            self.device = torch.device(device_type, self.local_process_index % max(1, module.device_count()))
            module.set_device(self.device)
            if device_type == "cuda" and first_env("NBACCEL_CPU_AFFINITY", "ACCELERATE_CPU_AFFINITY") in ("1", "true"):
                # `nbaccel launch --enable_cpu_affinity`: pin to the cores nearest the GPU, as Accelerate does
                from .utils.environment import set_numa_affinity

                set_numa_affinity(self.local_process_index)

    def destroy_process_group(self, group: Any = None) -> None:
        """Destroy `group` (default: the default group), unless launched by fork and `group` is None."""
        if self.fork_launched and group is None:
            return
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            several = group is None and torch.distributed.get_world_size() > 1
            # a DDP model still alive must not be the one to free the group (utils/process_group_exit.py)
            keep_group_past_its_users(torch.distributed.group.WORLD if group is None else group)
            torch.distributed.destroy_process_group(group)
            if several:  # later collectives raise instead of acting alone (imported here: state loads without it)
                from .utils import collectives

                collectives.note_group_destroyed()

    def __getattr__(self, name: str) -> Any:
        if name in type(self)._known_attrs or (hasattr(type(self), name) and not self._shared_state):
            cls = type(self).__name__
            raise AttributeError(
                f"`{cls}` object has no attribute `{name}`. This happens if `{cls}._reset_state()` was called and "
                f"no {cls} or Accelerator was created since: create one again"
            )
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


def _check_index(index: Any, name: str) -> None:
    number = whole_number(index)
    if number is None or number < 0:
        raise ValueError(f"{name} must be a non-negative int, got {index!r}")


def _view(cls: type) -> Any:
    """An instance of `cls` on its shared state without running `__init__`."""
    instance = object.__new__(cls)
    instance.__dict__ = cls._shared_state
    return instance


# --- split_between_processes ---------------------------------------------------------------------------


def _length(inputs: Any) -> int:
    if isinstance(inputs, Mapping):
        if not inputs:
            return 0
        lengths = {key: _length(value) for key, value in inputs.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"split_between_processes: all values of the dict must have the same length, got {lengths}")
        return next(iter(lengths.values()))
    try:
        return len(inputs)
    except TypeError:
        raise TypeError(
            "split_between_processes splits a list, tuple, range, tensor, numpy array, dict of those or "
            f"datasets.Dataset; got {type(inputs).__name__}, which has no length"
        ) from None


def _split(inputs: Any, num_processes: int, index: int, apply_padding: bool) -> Any:
    length = _length(inputs)
    per_process, extras = divmod(length, num_processes)
    start = index * per_process + min(index, extras)
    end = start + per_process + (1 if index < extras else 0)
    target = per_process + (1 if extras else 0)
    if apply_padding and length == 0:
        raise ValueError("split_between_processes(apply_padding=True) cannot pad an empty input")
    return _take(inputs, start, end, target if apply_padding else None)


def _take(inputs: Any, start: int, end: int, pad_to: int | None) -> Any:
    if isinstance(inputs, Mapping):
        parts = {key: _take(value, start, end, pad_to) for key, value in inputs.items()}
        try:
            return type(inputs)(parts)
        except TypeError:
            return parts
    missing = 0 if pad_to is None else pad_to - (end - start)
    if isinstance(inputs, torch.Tensor):
        part = inputs[start:end]
        if missing:
            part = torch.cat([part, inputs[-1:].expand(missing, *inputs.shape[1:])])
        return part
    if isinstance(inputs, (list, tuple)):
        part = inputs[start:end]
        return part + type(part)([inputs[-1]] * missing) if missing else part
    if isinstance(inputs, range):
        part = inputs[start:end]
        return [*part, *[inputs[-1]] * missing] if missing else part
    if type(inputs).__module__ == "numpy" or type(inputs).__name__ == "ndarray":
        import numpy as np

        part = inputs[start:end]
        return np.concatenate([part, np.repeat(inputs[-1:], missing, axis=0)]) if missing else part
    if hasattr(inputs, "select") and hasattr(inputs, "column_names"):  # datasets.Dataset
        indices = list(range(start, end)) + [len(inputs) - 1] * missing
        return inputs.select(indices)
    return inputs  # a string or another sized object: every process gets all of it, as in Accelerate


# --- AcceleratorState ----------------------------------------------------------------------------------

_ACCELERATOR_MARKER = "_mixed_precision"
_DEVICE_PARALLEL_TYPES = {kind for kind, _ in _DEVICE_BACKENDS.values()} - {DistributedType.XLA}


def _call_if_present(obj: Any, method: str, *args: Any, **kwargs: Any) -> None:
    function = getattr(obj, method, None)
    if callable(function):
        function(*args, **kwargs)


@dataclasses.dataclass(frozen=True)
class _Plugins:
    """The plugins an AcceleratorState is configured with (travel together from __init__ to _configure)."""

    dynamo: Any
    deepspeed: Any
    fsdp: Any
    torch_tp: Any
    megatron_lm: Any
    parallelism_config: Any


class AcceleratorState:
    """The `PartialState` plus the training configuration an `Accelerator` chose: mixed precision and the
    plugins (DeepSpeed, FSDP, Megatron-LM, dynamo, tensor parallelism). Created by `Accelerator()`;
    afterwards `AcceleratorState()` anywhere returns the same state."""

    _shared_state = _shared_dict()
    _known_attrs = PartialState._known_attrs + [
        "deepspeed_plugins", "fsdp_plugin", "megatron_lm_plugin", "dynamo_plugin", "torch_tp_plugin",
        "parallelism_config", "device_mesh", "_mixed_precision",
    ]

    def __init__(
        self,
        mixed_precision: str | None = None,
        cpu: bool = False,
        dynamo_plugin: Any = None,
        deepspeed_plugin: Any = None,
        fsdp_plugin: Any = None,
        torch_tp_plugin: Any = None,
        megatron_lm_plugin: Any = None,
        parallelism_config: Any = None,
        _from_accelerator: bool = False,
        **kwargs: Any,
    ) -> None:
        self.__dict__ = self._shared_state
        _drop_if_inherited(self._shared_state)
        if parse_flag_from_env("NBACCEL_USE_CPU") or parse_flag_from_env("ACCELERATE_USE_CPU"):
            cpu = True
        if mixed_precision is not None:
            mixed_precision = _check_mixed_precision(mixed_precision)
        if self.initialized:
            if not PartialState._shared_state:  # reset alone (PartialState._reset_state()): set up again, as
                PartialState(cpu, **kwargs)      # Accelerate does
                self.__dict__.update(PartialState._shared_state)
            self._check_initialized(mixed_precision, cpu)
            return
        if not _from_accelerator:
            raise ValueError(
                "AcceleratorState is set up by the Accelerator: create `accelerator = Accelerator()` first "
                "(or use PartialState() for process control alone)"
            )
        if mixed_precision is None:
            mixed_precision = _env_mixed_precision()
        if mixed_precision == "fp8" and not is_fp8_available():
            raise ValueError(
                "mixed_precision='fp8' needs an FP8 library: pip install transformer-engine (or torchao, or MS-AMP)"
            )
        use_deepspeed = not cpu and (
            deepspeed_plugin is not None
            or parse_flag_from_env("NBACCEL_USE_DEEPSPEED") or parse_flag_from_env("ACCELERATE_USE_DEEPSPEED")
        )
        if use_deepspeed and not is_deepspeed_available():
            raise ImportError("DeepSpeed was asked for but is not installed: pip install deepspeed")
        use_megatron = parse_flag_from_env("NBACCEL_USE_MEGATRON_LM") or parse_flag_from_env("ACCELERATE_USE_MEGATRON_LM")
        if use_megatron and not is_megatron_lm_available():
            raise ImportError("Megatron-LM was asked for but is not installed: pip install megatron-core")

        PartialState(cpu, **kwargs)  # detects the environment unless a PartialState of this process exists
        try:
            plugins = _Plugins(dynamo_plugin, deepspeed_plugin, fsdp_plugin, torch_tp_plugin, megatron_lm_plugin,
                               parallelism_config)
            self._configure(mixed_precision, cpu, plugins, use_deepspeed, use_megatron)
        except BaseException:
            self._shared_state.clear()
            raise

    def _configure(self, mixed_precision: str, cpu: bool, plugins: _Plugins, use_deepspeed: bool,
                   use_megatron: bool) -> None:
        dynamo_plugin, deepspeed_plugin, fsdp_plugin = plugins.dynamo, plugins.deepspeed, plugins.fsdp
        torch_tp_plugin, megatron_lm_plugin = plugins.torch_tp, plugins.megatron_lm
        parallelism_config = plugins.parallelism_config
        self.__dict__.update(PartialState._shared_state)
        self.dynamo_plugin = dynamo_plugin
        self.torch_tp_plugin = torch_tp_plugin
        self.parallelism_config = parallelism_config
        self.device_mesh = None
        self.deepspeed_plugins = None
        self.fsdp_plugin = fsdp_plugin
        self.megatron_lm_plugin = megatron_lm_plugin
        self._mixed_precision = mixed_precision

        if self.distributed_type == DistributedType.XLA:
            if mixed_precision == "bf16" and is_torch_xla_available(check_is_tpu=True):
                downcast = bool(first_env("NBACCEL_DOWNCAST_BF16", "ACCELERATE_DOWNCAST_BF16"))
                os.environ["XLA_USE_BF16"] = "0" if downcast else "1"
                os.environ["XLA_DOWNCAST_BF16"] = "1" if downcast else "0"
                self.downcast_bfloat = downcast
        elif use_deepspeed:
            if deepspeed_plugin is None:
                raise ValueError("DeepSpeed is enabled (ACCELERATE_USE_DEEPSPEED) but no DeepSpeedPlugin was given")
            self.distributed_type = DistributedType.DEEPSPEED
            plugins = deepspeed_plugin if isinstance(deepspeed_plugin, Mapping) else {"default": deepspeed_plugin}
            for plugin in plugins.values():
                _call_if_present(plugin, "set_mixed_precision", mixed_precision)
            _call_if_present(next(iter(plugins.values())), "select", _from_accelerator_state=True)
            self.deepspeed_plugins = deepspeed_plugin
            if mixed_precision != "fp8":
                self._mixed_precision = "no"  # DeepSpeed's own config decides (see `mixed_precision`)
        elif self.distributed_type in _DEVICE_PARALLEL_TYPES:
            if fsdp_plugin is not None or parse_flag_from_env("NBACCEL_USE_FSDP") or parse_flag_from_env("ACCELERATE_USE_FSDP"):
                self.distributed_type = DistributedType.FSDP
                if mixed_precision != "no" and fsdp_plugin is not None:
                    _call_if_present(fsdp_plugin, "set_mixed_precision", mixed_precision)
            if use_megatron:
                if megatron_lm_plugin is None:
                    raise ValueError("Megatron-LM is enabled (ACCELERATE_USE_MEGATRON_LM) but no MegatronLMPlugin was given")
                self.distributed_type = DistributedType.MEGATRON_LM
                _call_if_present(megatron_lm_plugin, "set_mixed_precision", mixed_precision)

        backend = str(getattr(dynamo_plugin, "backend", "NO") or "NO").upper()
        if backend not in ("NO", "DYNAMOBACKEND.NO") and mixed_precision == "no" and self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
        PartialState._shared_state["distributed_type"] = self.distributed_type

    @property
    def initialized(self) -> bool:
        """Whether an `Accelerator` has set this state up (since the last reset)."""
        return _ACCELERATOR_MARKER in self._shared_state

    def __repr__(self) -> str:
        text = repr(PartialState()) + f"\nMixed precision type: {self.mixed_precision}\n"
        if self.distributed_type == DistributedType.DEEPSPEED:
            text += f"ds_config: {getattr(self.deepspeed_plugin, 'deepspeed_config', None)}\n"
        return text

    def _check_initialized(self, mixed_precision: str | None = None, cpu: bool | None = None) -> None:
        """A second Accelerator cannot change what the first one set up."""
        if not self.initialized:
            return
        message = (
            "AcceleratorState has already been initialized and cannot be changed: restart the kernel (or call "
            "AcceleratorState._reset_state(True) in tests) and pass {} to the first Accelerator()"
        )
        if cpu and self.device.type != "cpu":
            raise ValueError(message.format("cpu=True"))
        if (
            mixed_precision is not None
            and mixed_precision != self._mixed_precision
            and self.distributed_type != DistributedType.DEEPSPEED
        ):
            raise ValueError(message.format(f"mixed_precision={mixed_precision!r}"))

    @property
    def mixed_precision(self) -> str:
        """'no', 'fp16', 'bf16' or 'fp8' (under DeepSpeed: what its config enables)."""
        if self.distributed_type == DistributedType.DEEPSPEED and self._mixed_precision != "fp8":
            config = getattr(self.deepspeed_plugin, "deepspeed_config", None) or {}
            if config.get("fp16", {}).get("enabled", False):
                return "fp16"
            if config.get("bf16", {}).get("enabled", False):
                return "bf16"
            return "no"
        return self._mixed_precision

    @property
    def debug(self) -> bool:
        return PartialState._shared_state.get("_debug", False)

    @debug.setter
    def debug(self, value: bool) -> None:
        PartialState.debug.fset(_view(PartialState), value)  # type: ignore[attr-defined]
        self._shared_state["_debug"] = bool(value)

    @staticmethod
    def _reset_state(reset_partial_state: bool = False) -> None:
        """Forget the Accelerator's configuration (tests); with `reset_partial_state` the PartialState too."""
        AcceleratorState._shared_state.clear()
        if reset_partial_state:
            PartialState._reset_state()

    def destroy_process_group(self, group: Any = None) -> None:
        """See `PartialState.destroy_process_group`."""
        PartialState().destroy_process_group(group)

    @property
    def fork_launched(self) -> bool:
        return PartialState().fork_launched

    @property
    def use_distributed(self) -> bool:
        return PartialState().use_distributed

    @property
    def is_fsdp2(self) -> bool:
        return self.distributed_type == DistributedType.FSDP and getattr(self.fsdp_plugin, "fsdp_version", 1) == 2

    @property
    def is_last_process(self) -> bool:
        return PartialState().is_last_process

    @property
    def is_main_process(self) -> bool:
        return PartialState().is_main_process

    @property
    def is_local_main_process(self) -> bool:
        return PartialState().is_local_main_process

    @property
    def default_device(self) -> torch.device:
        return PartialState().default_device

    def wait_for_everyone(self) -> None:
        PartialState().wait_for_everyone()

    @contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """See `PartialState.split_between_processes`."""
        with PartialState().split_between_processes(inputs, apply_padding=apply_padding) as part:
            yield part

    @contextmanager
    def main_process_first(self) -> Iterator[None]:
        with PartialState().main_process_first():
            yield

    @contextmanager
    def local_main_process_first(self) -> Iterator[None]:
        with PartialState().local_main_process_first():
            yield

    def on_main_process(self, function: Callable[..., Any] | None = None) -> Callable[..., Any]:
        return PartialState().on_main_process(function)

    def on_local_main_process(self, function: Callable[..., Any] | None = None) -> Callable[..., Any]:
        return PartialState().on_local_main_process(function)

    def on_last_process(self, function: Callable[..., Any]) -> Callable[..., Any]:
        return PartialState().on_last_process(function)

    def on_process(self, function: Callable[..., Any] | None = None, process_index: int | None = None) -> Callable[..., Any]:
        return PartialState().on_process(function, process_index=process_index)

    def on_local_process(
        self, function: Callable[..., Any] | None = None, local_process_index: int | None = None
    ) -> Callable[..., Any]:
        return PartialState().on_local_process(function, local_process_index=local_process_index)

    def print(self, *args: Any, **kwargs: Any) -> None:
        PartialState().print(*args, **kwargs)

    def set_device(self) -> None:
        PartialState().set_device()
        self.device = PartialState().device

    # --- DeepSpeed ---------------------------------------------------------------------------------------

    @property
    def deepspeed_plugin(self) -> Any:
        """The active DeepSpeedPlugin, or None when DeepSpeed is not in use."""
        if self.distributed_type != DistributedType.DEEPSPEED:
            return None
        plugins = self.deepspeed_plugins
        if not isinstance(plugins, Mapping):
            return plugins
        for plugin in plugins.values():
            if getattr(plugin, "selected", False):
                return plugin
        return next(iter(plugins.values()))

    def _require_deepspeed(self, name: str) -> None:
        if self.distributed_type != DistributedType.DEEPSPEED:
            raise ValueError(f"{name} needs DeepSpeed: pass a DeepSpeedPlugin to Accelerator(deepspeed_plugin=...)")

    def get_deepspeed_plugin(self, name: str) -> Any:
        """The DeepSpeedPlugin registered under `name` (Accelerator(deepspeed_plugin={name: plugin, ...}))."""
        self._require_deepspeed("get_deepspeed_plugin")
        plugins = self.deepspeed_plugins if isinstance(self.deepspeed_plugins, Mapping) else {}
        if name not in plugins:
            raise KeyError(f"no DeepSpeedPlugin named {name!r}; known: {list(plugins)}")
        return plugins[name]

    def select_deepspeed_plugin(self, name: str | None = None) -> None:
        """Make the DeepSpeedPlugin `name` the active one and deselect the others."""
        plugin = self.get_deepspeed_plugin(name)  # type: ignore[arg-type]
        for key, other in self.deepspeed_plugins.items():
            if key != name:
                _call_if_present(other, "_unselect")
        _call_if_present(plugin, "select", _from_accelerator_state=True)

    # --- parallelism ranks -------------------------------------------------------------------------------

    def _mesh_rank(self, enabled_attr: str, mesh_dim: str, what: str) -> int:
        config = self.parallelism_config
        if not config:
            raise RuntimeError(f"{what} is not configured: pass a parallelism_config to the Accelerator first")
        if getattr(config, enabled_attr, False):
            if self.device_mesh is None:
                raise RuntimeError(f"{what} is enabled but the device mesh is not built yet (Accelerator.prepare)")
            return self.device_mesh.get_local_rank(mesh_dim)
        return 0

    @property
    def tensor_parallel_rank(self) -> int:
        """This process's rank in the tensor-parallel dimension (0 when tensor parallelism is off)."""
        return self._mesh_rank("tp_enabled", "tp", "Tensor parallelism")

    @property
    def data_parallel_rank(self) -> int:
        """This process's rank among the replicated data-parallel copies (0 when replication is off)."""
        return self._mesh_rank("dp_replicate_enabled", "dp_replicate", "Data parallelism")

    @property
    def data_parallel_shard_rank(self) -> int:
        """This process's rank in the sharded data-parallel dimension (0 when sharding is off)."""
        return self._mesh_rank("dp_shard_enabled", "dp_shard", "Shard-based data parallelism")

    @property
    def context_parallel_rank(self) -> int:
        raise NotImplementedError("Context parallelism ranks are not supported (as in Accelerate)")

    @property
    def pipeline_parallel_rank(self) -> int:
        raise NotImplementedError("Pipeline parallelism ranks are not supported (as in Accelerate)")

    def __getattr__(self, name: str) -> Any:
        if name in type(self)._known_attrs or (hasattr(type(self), name) and not self._shared_state):
            raise AttributeError(
                f"`AcceleratorState` object has no attribute `{name}`. This happens if "
                "`AcceleratorState._reset_state()` was called and no Accelerator was created since (or none was "
                "created yet): create `Accelerator()`"
            )
        raise AttributeError(f"'AcceleratorState' object has no attribute {name!r}")


# --- GradientState -------------------------------------------------------------------------------------

_PLUGIN_FIELDS = ("num_steps", "adjust_scheduler", "sync_with_dataloader", "sync_each_batch")


def _plugin_kwargs(plugin: Any) -> dict[str, Any]:
    """The settings of a GradientAccumulationPlugin (or any object / dict with its fields)."""
    if plugin is None:
        return {}
    if isinstance(plugin, Mapping):
        values = dict(plugin)
    elif callable(getattr(plugin, "to_kwargs", None)):
        values = dict(plugin.to_kwargs())
    else:
        values = {name: getattr(plugin, name) for name in _PLUGIN_FIELDS if hasattr(plugin, name)}
    unknown = sorted(set(values) - set(_PLUGIN_FIELDS))
    if unknown:
        raise TypeError(f"unknown gradient accumulation setting(s) {unknown}: known are {list(_PLUGIN_FIELDS)}")
    steps = values.get("num_steps", 1)
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise ValueError(f"num_steps must be an int >= 1, got {steps!r}")
    return values


class GradientState:
    """Gradient synchronization and the data loaders being iterated, shared by the Accelerator, the prepared
    optimizer, scheduler and data loaders.

    Data loaders register with `_add_dataloader` when iteration starts and `_remove_dataloader` when it ends;
    they must expose `end_of_dataloader` (bool) and `remainder` (int) (see docs/internals.md)."""

    _shared_state = _shared_dict()

    def __init__(self, gradient_accumulation_plugin: Any = None) -> None:
        self.__dict__ = self._shared_state
        _drop_if_inherited(self._shared_state)
        if not self.initialized:
            self._pid = os.getpid()
            self.sync_gradients = True
            self._dataloader_references_ref: list[Any] = [None]
            self.plugin_kwargs = _plugin_kwargs(gradient_accumulation_plugin)
            self._is_xla_gradients_synced = False
        elif gradient_accumulation_plugin is not None:
            self.plugin_kwargs = _plugin_kwargs(gradient_accumulation_plugin)

    @property
    def num_steps(self) -> int:
        """How many batches make one optimizer step."""
        return self.plugin_kwargs.get("num_steps", 1)

    @property
    def adjust_scheduler(self) -> bool:
        return self.plugin_kwargs.get("adjust_scheduler", False)

    @property
    def sync_with_dataloader(self) -> bool:
        return self.plugin_kwargs.get("sync_with_dataloader", True)

    @property
    def initialized(self) -> bool:
        return bool(GradientState._shared_state)

    @property
    def end_of_dataloader(self) -> bool:
        """Whether the active data loader has reached its last batch (False outside a data loader)."""
        if not self.in_dataloader:
            return False
        return self.active_dataloader.end_of_dataloader

    @property
    def remainder(self) -> int:
        """Samples added by padding in the active data loader's last batch (-1 outside a data loader)."""
        if not self.in_dataloader:
            return -1
        return self.active_dataloader.remainder

    def __repr__(self) -> str:
        return (
            f"Sync Gradients: {self.sync_gradients}\n"
            f"At end of current dataloader: {self.end_of_dataloader}\n"
            f"Extra samples added: {self.remainder}\n"
            f"Gradient accumulation plugin: {self.plugin_kwargs}\n"
        )

    @property
    def is_xla_gradients_synced(self) -> bool:
        """Whether gradients were already reduced this step on XLA (always True under FSDP)."""
        if parse_flag_from_env("NBACCEL_USE_FSDP") or parse_flag_from_env("ACCELERATE_USE_FSDP"):
            return True
        return self._is_xla_gradients_synced

    @is_xla_gradients_synced.setter
    def is_xla_gradients_synced(self, value: bool) -> None:
        self._is_xla_gradients_synced = bool(value)

    def _set_sync_gradients(self, sync_gradients: bool) -> None:
        """Set by the Accelerator at each accumulation boundary; on TPU this also cuts the XLA graph."""
        self.sync_gradients = bool(sync_gradients)
        if (
            self.sync_gradients
            and PartialState._shared_state.get("distributed_type") == DistributedType.XLA
            and is_torch_xla_available(check_is_tpu=True)
        ):
            import torch_xla.core.xla_model as xm

            xm.mark_step()

    def _add_dataloader(self, dataloader: Any) -> None:
        """A prepared data loader starts iterating: it becomes the active one."""
        self.dataloader_references = self.dataloader_references + [dataloader]

    def _remove_dataloader(self, dataloader: Any) -> None:
        """A prepared data loader stopped iterating: the previous one (if any) becomes active again."""
        self.dataloader_references = [ref for ref in self.dataloader_references if ref is not dataloader]

    @property
    def active_dataloader(self) -> Any:
        """The innermost data loader being iterated, or None."""
        return self.dataloader_references[-1]

    @property
    def dataloader_references(self) -> list[Any]:
        """The data loaders being iterated, outermost first, after a leading None. Held by weak reference so
        an abandoned loader can be garbage collected."""
        return [ref() if ref is not None else None for ref in self._dataloader_references_ref]

    @dataloader_references.setter
    def dataloader_references(self, references: list[Any]) -> None:
        self._dataloader_references_ref = [weakref.ref(item) if item is not None else None for item in references]

    @property
    def in_dataloader(self) -> bool:
        """Whether a prepared data loader is being iterated."""
        return self.active_dataloader is not None

    @staticmethod
    def _reset_state() -> None:
        """Forget gradient and data loader state (tests)."""
        GradientState._shared_state.clear()


# --- helpers for tests and launchers -------------------------------------------------------------------


def is_initialized() -> bool:
    """Whether an Accelerator has set up the `AcceleratorState` in this process."""
    return _ACCELERATOR_MARKER in AcceleratorState._shared_state


def reset_states() -> None:
    """Forget all three states (the process group, if any, stays up)."""
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@contextmanager
def isolated_states() -> Iterator[None]:
    """Run the body with fresh states and put the previous ones back afterwards: for tests, e.g.

    ```python
    @pytest.fixture
    def state():
        with isolated_states(), patch_environment(WORLD_SIZE=1):
            yield PartialState(cpu=True)
    ```"""
    saved = [(cls, dict(cls._shared_state)) for cls in (PartialState, AcceleratorState, GradientState)]
    reset_states()
    try:
        yield
    finally:
        for cls, contents in saved:
            cls._shared_state.clear()
            cls._shared_state.update(contents)
