"""Small utilities of Accelerate's reference: write_basic_config, extract_model_from_parallel, save, and helpers.

Nothing here imports nbaccel's state classes: the process rank comes from torch.distributed or the launcher's
environment variables.
"""

from __future__ import annotations

import os
import socket
import sys
import warnings
from pathlib import Path
from typing import Any

from .config_file import LaunchConfig, default_config_file, display_path
from .constants import DEFAULT_MAIN_PROCESS_PORT, MIXED_PRECISION_CHOICES


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

    `keep_torch_compile=False` also drops the `torch.compile` wrapper (its `_orig_mod`);
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

    compiled = None
    if is_compiled_module(model):
        compiled, model = model, model._orig_mod
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
    return model


def _rank_from_env() -> tuple[int, int]:
    """(global rank, local rank) from torch.distributed when initialized, else the launcher's variables."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            rank = dist.get_rank()
            return rank, int(os.environ.get("LOCAL_RANK", rank))
    except ImportError:
        pass
    rank = int(os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", 0))))
    local = int(os.environ.get("LOCAL_RANK", os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", rank)))
    return rank, local


def _dedupe_shared_tensors(state_dict: dict) -> dict:
    """safetensors refuses tensors sharing storage: keep the first name of each shared group, contiguous."""
    seen: dict[tuple, str] = {}
    cleaned = {}
    dropped = []
    for name, tensor in state_dict.items():
        if not hasattr(tensor, "untyped_storage"):
            cleaned[name] = tensor
            continue
        key = (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if tensor.untyped_storage().data_ptr() != 0 and key in seen:
            dropped.append(name)
            continue
        seen[key] = name
        cleaned[name] = tensor.contiguous()
    if dropped:
        warnings.warn(
            f"Removed shared tensor(s) {', '.join(dropped)} while saving with safetensors; tie them again after "
            "loading (e.g. with `model.tie_weights()`).",
            stacklevel=3,
        )
    return cleaned


def save(obj: Any, f: str | os.PathLike, save_on_each_node: bool = False, safe_serialization: bool = False) -> None:
    """Save `obj` to `f` from the main process only (the local main process of each node with `save_on_each_node`).

    `safe_serialization=True` writes safetensors (for a dict of tensors), otherwise `torch.save`.
    """
    rank, local_rank = _rank_from_env()
    if (local_rank if save_on_each_node else rank) != 0:
        return
    if safe_serialization:
        from safetensors.torch import save_file

        if not isinstance(obj, dict):
            raise TypeError(f"safe_serialization=True saves a dict of tensors; got {type(obj).__name__}")
        save_file(_dedupe_shared_tensors(obj), os.fspath(f), metadata={"format": "pt"})
    else:
        import torch

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


def get_free_port() -> int:
    """A TCP port on localhost that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


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
