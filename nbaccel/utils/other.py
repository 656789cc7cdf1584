"""Small utilities of Accelerate's reference: write_basic_config, extract_model_from_parallel, save, and helpers.

Nothing here imports nbaccel's state classes: the process rank comes from torch.distributed or the launcher's
environment variables.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

from .atomic_files import atomic_path
from .config_file import LaunchConfig, default_config_file, display_path
from .constants import DEFAULT_MAIN_PROCESS_PORT, MIXED_PRECISION_CHOICES
from .operations import wait_for_everyone as wait_for_everyone  # Accelerate exposes it from this module too

logger = logging.getLogger(__name__)  # these two notices are log records, as in Accelerate, not warnings


def _count_devices(use_xpu: bool) -> tuple[str, int]:
    """(kind, count) of the accelerators torch sees here: ('cuda', n), ('xpu', n), ('npu', n), or ('cpu', 0)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return "cuda", torch.cuda.device_count()
    xpu = getattr(torch, "xpu", None)
    if use_xpu and xpu is not None and xpu.is_available():
        return "xpu", xpu.device_count()
    npu = getattr(torch, "npu", None)
    if npu is not None and npu.is_available():
        return "npu", npu.device_count()
    return "cpu", 0


def basic_config(mixed_precision: str = "no", use_xpu: bool = False) -> LaunchConfig:
    """A LaunchConfig for this machine: one process per accelerator, or one CPU process without one."""
    mixed_precision = str(mixed_precision).lower()
    if mixed_precision not in MIXED_PRECISION_CHOICES:
        raise ValueError(
            f"`mixed_precision` must be one of {', '.join(MIXED_PRECISION_CHOICES)}; got {mixed_precision!r}"
        )
    kind, count = _count_devices(use_xpu)
    multi = {"cuda": "MULTI_GPU", "xpu": "MULTI_XPU", "npu": "MULTI_NPU"}
    if kind == "cpu":
        return LaunchConfig(mixed_precision=mixed_precision, use_cpu=True, num_processes=1, distributed_type="NO")
    return LaunchConfig(
        mixed_precision=mixed_precision,
        use_cpu=False,
        num_processes=count,
        distributed_type=multi[kind] if count > 1 else "NO",
    )


def write_basic_config(
    mixed_precision: str = "no", save_location: str | os.PathLike | None = None, use_xpu: bool = False
) -> Path | bool:
    """Write a basic launch config for this machine and return its path.

    An existing file is left alone: a message is printed and False returned (as in Accelerate). The default
    location is `default_config_file()` (`$NBACCEL_CONFIG_FILE` or `~/.cache/nbaccel/default_config.yaml`).
    """
    path = Path(save_location).expanduser() if save_location is not None else default_config_file()
    if path.exists():
        print(
            f"Configuration already exists at {display_path(path)}, will not override. Run `nbaccel config` "
            "manually or pass a different `save_location`."
        )
        return False
    config = basic_config(mixed_precision, use_xpu=use_xpu)
    return config.save(path)


def is_compiled_module(module: Any) -> bool:
    """Whether `module` is the result of `torch.compile` (an OptimizedModule)."""
    # A compiled module exists only once torch._dynamo was imported; looking it up through `torch` would
    # import it (seconds), so ask sys.modules instead.
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    optimized = getattr(eval_frame, "OptimizedModule", None)
    return optimized is not None and isinstance(module, optimized)


def extract_model_from_parallel(model: Any, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True,
                                recursive: bool = False) -> Any:
    """Return the user's model from inside DDP / DataParallel / FSDP / DeepSpeed wrappers.

    `keep_torch_compile=False` also drops the `torch.compile` wrapper (its `_orig_mod`), or returns the model
    `compile_regions` copied;
    `keep_fp32_wrapper=False` removes the autocast wrapper `Accelerator.prepare` put around `forward`;
    `recursive=True` also unwraps wrapped sub-modules.
    """
    import torch

    wrappers: tuple[type, ...] = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel

        wrappers += (FullyShardedDataParallel,)
    except ImportError:  # torch built without distributed
        pass
    try:
        from deepspeed import DeepSpeedEngine  # type: ignore[import-not-found]

        wrappers += (DeepSpeedEngine,)
    except ImportError:
        pass

    compiled = regional = None
    if is_compiled_module(model):
        compiled, model = model, model._orig_mod
    elif isinstance(model, torch.nn.Module) and "_orig_mod" in model.__dict__ and has_compiled_regions(model):
        regional, model = model, model.__dict__["_orig_mod"]  # compile_regions' copy of the model
    while isinstance(model, wrappers):
        model = model.module

    if recursive:
        def unwrap(module):
            while isinstance(module, wrappers) or (hasattr(module, "module") and isinstance(module.module, torch.nn.Module)):
                module = module.module
            for name, child in module.named_children():
                setattr(module, name, unwrap(child))
            return module

        model = unwrap(model)

    if not keep_fp32_wrapper:
        original = model.__dict__.pop("_original_forward", None)
        if original is not None:
            if getattr(original, "__func__", None) is getattr(type(model), "forward", None):
                model.__dict__.pop("forward", None)  # back to the class's own forward
            else:
                model.forward = original

    if keep_torch_compile and compiled is not None:
        compiled._orig_mod = model
        return compiled
    if keep_torch_compile and regional is not None:
        regional.__dict__["_orig_mod"] = model
        return regional
    return model


def _rank_from_env() -> tuple[int, int]:
    """(global rank, local rank) from torch.distributed when initialized, else the launcher's variables."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            from .collectives import _rank

            rank = _rank()
            return rank, int(os.environ.get("LOCAL_RANK", rank))
    except ImportError:
        pass
    rank = int(os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", 0))))
    local = int(os.environ.get("LOCAL_RANK", os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", rank)))
    return rank, local


def clean_state_dict_for_safetensors(state_dict: dict) -> dict:
    """`state_dict` ready for safetensors, which refuses tensors that share memory: of each group of entries on
    one storage (tied weights), keep the first name and drop the others with a warning; tensors made contiguous.

    Non-tensor values (e.g. strings of bitsandbytes serialization) pass through. The input dict is not changed.
    """
    import torch

    from .tensor_placement import id_tensor_storage

    seen: set[tuple] = set()
    cleaned = {}
    dropped = []
    for name, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            cleaned[name] = value
            continue
        key = id_tensor_storage(value)
        if key[1] != 0 and key in seen:  # pointer 0: meta/empty tensors own no memory to share
            dropped.append(name)
            continue
        seen.add(key)
        cleaned[name] = value.contiguous()
    if dropped:
        logger.warning(
            "Removed shared tensor(s) %s while saving with safetensors; tie them again after loading (e.g. with "
            "`model.tie_weights()`).", ", ".join(dropped))
    return cleaned


def save(obj: Any, f: str | os.PathLike, save_on_each_node: bool = False, safe_serialization: bool = False) -> None:
    """Save `obj` to `f` from the main process only (the local main process of each node with `save_on_each_node`).

    `safe_serialization=True` writes safetensors (for a dict of tensors), otherwise `torch.save`. Of a state_dict
    (an OrderedDict) tensors sharing memory are written once; in another dict they are safetensors' error.
    """
    rank, local_rank = _rank_from_env()
    if (local_rank if save_on_each_node else rank) != 0:
        return
    if safe_serialization:
        from safetensors.torch import save_file

        if not isinstance(obj, dict):
            # ValueError, the type safetensors' own refusal has (what Accelerate raises)
            raise ValueError(f"safe_serialization=True saves a dict of tensors; got {type(obj).__name__}. Pass "
                             "safe_serialization=False to save other objects with torch.save.")
        if isinstance(obj, OrderedDict):  # a state_dict: tied weights are written once, as in Accelerate
            obj = clean_state_dict_for_safetensors(obj)
        # any other dict goes as it is: tensors sharing memory are safetensors' error, never an entry dropped
        with atomic_path(f) as path:
            save_file(obj, str(path), metadata={"format": "pt"})
    else:
        import torch

        if isinstance(f, (str, os.PathLike)):  # a path: whole or not at all; a file object: the caller's
            with atomic_path(f) as path:
                torch.save(obj, path)
        else:
            torch.save(obj, f)


def merge_dicts(source: dict, destination: dict) -> dict:
    """Merge `source` into `destination` recursively (nested dicts merged, other values replaced); returns it."""
    for key, value in source.items():
        if isinstance(value, dict):
            merge_dicts(value, destination.setdefault(key, {}))
        else:
            destination[key] = value
    return destination


def is_port_in_use(port: int | None = None) -> bool:
    """Whether something listens on `port` (default 29500) on localhost."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        return sock.connect_ex(("localhost", port or DEFAULT_MAIN_PROCESS_PORT)) == 0


# Ports are picked from LOWEST_PICKED_PORT up to the start of the system's ephemeral range, with a generator of
# their own: picking a port must not move the user's seeded `random` stream.
LOWEST_PICKED_PORT = 20000
_port_choice = random.Random()
if hasattr(os, "register_at_fork"):  # a forked rank picks other ports than its kernel (as `random` reseeds its own)
    os.register_at_fork(after_in_child=_port_choice.seed)
_EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"


def get_free_port(host: str = "") -> int:
    """A TCP port that is free on `host` ("" = every interface) right now, below the ephemeral range.

    The port goes to processes that bind it a second or more later (after torch's import). A port of the
    ephemeral range, which binding port 0 would give, can meanwhile become the source port of any outgoing
    connection on the machine (a store client or gloo pair of another launch); the store's bind then fails with
    EADDRINUSE and its peers wait for a store that never opens. The system hands out no port below that range on
    its own, so one picked there stays free until something binds it by number. Where the range leaves no room
    (or is unknown: not Linux), the system picks as with port 0."""
    below = _ephemeral_start()
    if below is not None and below - LOWEST_PICKED_PORT >= 1024:
        for _ in range(64):
            port = _port_choice.randrange(LOWEST_PICKED_PORT, below)
            if _can_bind(host, port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _ephemeral_start() -> int | None:
    """The first port of the system's ephemeral range, or None where it cannot be read."""
    try:
        with open(_EPHEMERAL_RANGE) as ports:
            return int(ports.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _can_bind(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def get_pretty_name(obj: Any) -> str:
    """A readable name for a function, class or instance (its qualified name)."""
    if not hasattr(obj, "__qualname__") and not hasattr(obj, "__name__"):
        obj = getattr(obj, "__class__", obj)
    return getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or str(obj)


def convert_bytes(size: float) -> str:
    """`size` bytes in the largest unit below 1024 ("1.5 KB", "3.0 GB")."""
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if size < 1024.0:
            return f"{round(size, 2)} {unit}"
        size /= 1024.0
    return f"{round(size, 2)} PB"


def load(f: Any, map_location: Any = None, **kwargs: Any) -> Any:
    """`torch.load` with `weights_only=True` unless given, like Accelerate 1.15.

    numpy arrays and dtypes (RNG states, metrics) are allowed for the duration of the call; other pickled
    objects need `weights_only=False` (only for files you trust).
    """
    import codecs

    import numpy as np
    import torch

    kwargs.setdefault("weights_only", True)
    multiarray = np._core.multiarray if hasattr(np, "_core") else np.core.multiarray
    allowed = [multiarray._reconstruct, np.ndarray, np.dtype, codecs.encode]
    allowed += [type(np.dtype(kind)) for kind in ("uint32", "int64", "float32", "float64")]
    with torch.serialization.safe_globals(allowed):
        return torch.load(f, map_location=map_location, **kwargs)


def get_module_children_bottom_up(model: Any, return_fqns: bool = False) -> list:
    """Every module of `model`, children before their parents, `model` itself last.

    With `return_fqns=True` the items are `(qualified name, module)` pairs; the root's name is "".
    """
    stack = [("", model)]
    top_down = []
    while stack:
        name, module = stack.pop()
        top_down.append((name, module) if return_fqns else module)
        for child_name, child in module.named_children():
            stack.append((f"{name}.{child_name}" if name else child_name, child))
    return top_down[::-1]


def _is_repeated_blocks(module: Any) -> bool:
    """A non-empty `nn.ModuleList` whose items all share the first item's class (e.g. transformer layers)."""
    import torch

    return (isinstance(module, torch.nn.ModuleList) and len(module) > 0
            and all(isinstance(item, type(module[0])) for item in module))


def has_compiled_regions(module: Any) -> bool:
    """True when `module` or a submodule of it is a `torch.compile` wrapper (`OptimizedModule`)."""
    import torch

    if not module._modules:
        return False
    optimized = torch._dynamo.eval_frame.OptimizedModule
    return any(isinstance(sub, optimized) for sub in module.modules())


def compile_regions(module: Any, **compile_kwargs: Any) -> Any:
    """Regional compilation: compile each block of a repeated-block `ModuleList` (e.g. transformer layers)
    separately, so identical blocks reuse the compiler's cache, and compile whatever has no repeated blocks whole.

    `module` is not changed: the result is a shallow copy whose parts are compiled (kept as `_orig_mod` for
    `extract_model_from_parallel`). `compile_kwargs` go to `torch.compile`.
    """
    import types

    import torch

    def has_repeated(mod: Any) -> bool:
        return bool(mod._modules) and any(_is_repeated_blocks(sub) for sub in mod.modules())

    def compile_parts(mod: Any) -> Any:
        if _is_repeated_blocks(mod):
            return torch.nn.ModuleList(torch.compile(block, **compile_kwargs) for block in mod)
        if not has_repeated(mod):
            return torch.compile(mod, **compile_kwargs)
        copy = type(mod).__new__(type(mod))
        copy.__dict__.update(mod.__dict__)
        for key, value in list(copy.__dict__.items()):  # methods bound to `mod` must act on the copy
            if isinstance(value, types.MethodType) and value.__self__ is mod:
                copy.__dict__[key] = types.MethodType(value.__func__, copy)
        copy._modules = {}
        for name, child in mod.named_children():
            copy.add_module(name, compile_parts(child))
        return copy

    compiled = compile_parts(module)
    compiled.__dict__.setdefault("_orig_mod", module)
    return compiled



def is_repeated_blocks(module: Any) -> bool:
    """Whether `module` is a repeated block: a non-empty `nn.ModuleList` of items of one class (transformer
    layers), which regional compilation compiles block by block."""
    return _is_repeated_blocks(module)


def has_repeated_blocks(module: Any) -> bool:
    """Whether `module` holds repeated blocks (see `is_repeated_blocks`) anywhere below it."""
    return bool(module._modules) and any(_is_repeated_blocks(sub) for sub in module.modules())


def model_has_dtensor(model: Any) -> bool:
    """Whether any parameter of `model` is a torch `DTensor` (the model was sharded by FSDP2 or tensor parallel)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(parameter, DTensor) for parameter in model.parameters())


def get_model_tp_size(model: Any) -> int | None:
    """The tensor-parallel degree a `transformers` model was sharded with: its `tp_size` (transformers < 5), its
    `config.distributed_config`'s (transformers >= 5; an object, or a dict after a JSON round trip), else the
    size of its device mesh's "tp" dimension; None when it was not sharded."""
    size = getattr(model, "tp_size", None) or getattr(model, "_tp_size", None)
    if not size:
        distributed = getattr(getattr(model, "config", None), "distributed_config", None)
        size = distributed.get("tp_size") if isinstance(distributed, dict) else getattr(distributed, "tp_size", None)
    if size:
        return int(size)
    mesh = getattr(model, "device_mesh", None) or getattr(model, "_device_mesh", None)
    if mesh is not None and "tp" in (getattr(mesh, "mesh_dim_names", None) or ()):
        return int(mesh["tp"].size())
    return None


def compile_regions_fsdp2(module: Any, **compile_kwargs: Any) -> Any:
    """Regional compilation in place (`module.compile()`), so hooks FSDP2 adds afterwards still run: each block of
    a repeated-block ModuleList is compiled alone, parts without repeated blocks whole. Returns `module`."""
    if _is_repeated_blocks(module):
        for block in module:
            block.compile(**compile_kwargs)
    elif any(_is_repeated_blocks(sub) for sub in module.modules()) and module._modules:
        for child in module.children():
            compile_regions_fsdp2(child, **compile_kwargs)
    else:
        module.compile(**compile_kwargs)
    return module


def recursive_getattr(obj: Any, attr: str) -> Any:
    """`getattr` along a dotted path: `recursive_getattr(model, "encoder.layer.0")`."""
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def check_os_kernel() -> None:
    """Warn on Linux kernels older than 5.5, on which processes can hang (the limit Accelerate checks)."""
    import platform
    import re

    info = platform.uname()
    if info.system != "Linux":
        return
    found = re.search(r"(\d+)\.(\d+)\.(\d+)", info.release)
    if found is None:
        return
    version = tuple(int(part) for part in found.groups())
    if version < (5, 5, 0):
        logger.warning(
            f"Linux kernel {'.'.join(map(str, version))} is older than 5.5.0: processes can hang on it. Upgrade the "
            "kernel to 5.5.0 or newer.")


def compile_regions_deepspeed(module: Any, **compile_kwargs: Any) -> None:
    """Accelerate's regional compilation of a DeepSpeed engine: refused, DeepSpeed is not driven by nbaccel."""
    raise NotImplementedError("compile_regions_deepspeed compiles a DeepSpeed engine in place; nbaccel does not "
                              "train with DeepSpeed (see docs/compat.md). Use compile_regions(model) instead.")


def __getattr__(name: str) -> Any:
    """`np_core` and `TORCH_SAFE_GLOBALS` (what `load` allows besides tensors) need numpy: built on first use."""
    if name not in ("np_core", "TORCH_SAFE_GLOBALS"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import codecs

    import numpy as np

    np_core = np._core if hasattr(np, "_core") else np.core
    safe = [np_core.multiarray._reconstruct, np.ndarray, codecs.encode, np.dtype]
    if hasattr(np, "dtypes"):
        safe.append(np.dtypes.UInt32DType)
    globals().update(np_core=np_core, TORCH_SAFE_GLOBALS=safe)
    return globals()[name]
