"""Memory helpers: free device caches, drop references, and retry a function with a smaller batch on OOM.

`find_executable_batch_size` is Accelerate's decorator: the wrapped function takes the batch size as its
first argument, is called with `starting_batch_size`, and on an out-of-memory error (CUDA, ROCm, XPU, NPU,
MPS, HPU, or the CPU allocator) is called again with a smaller batch size until it fits.
"""

from __future__ import annotations

import functools
import gc
import inspect
from collections.abc import Callable
from typing import Any

import torch

from .dataclasses import whole_number

# Substrings of the messages torch raises when an allocation fails, per backend.
_OUT_OF_MEMORY_MESSAGES = (
    " out of memory.",  # CUDA, ROCm/HIP, XPU: "CUDA out of memory." / "XPU out of memory."
    "CUDA out of memory",
    "HIP out of memory",
    "XPU out of memory",
    "NPU out of memory",
    "MPS backend out of memory",
    "DefaultCPUAllocator: can't allocate memory",  # CPU
    "can't allocate memory",
    "PT_DEVMEM Allocation failed",  # HPU
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",  # cuDNN fails this way when its workspace does not fit
    "CUDNN_STATUS_ALLOC_FAILED",
)


def clear_device_cache(garbage_collection: bool = False) -> None:
    """Return cached, unused device memory to the driver (`torch.<backend>.empty_cache()`).

    With `garbage_collection=True`, run `gc.collect()` first so tensors kept alive only by reference cycles
    are freed too; that is slow, so it is off by default.
    """
    if garbage_collection:
        gc.collect()
    for backend in ("cuda", "xpu", "npu", "mlu", "musa", "sdaa", "mps"):
        module = getattr(torch, backend, None)
        if module is None:
            continue
        try:
            available = module.is_available()
        except Exception:  # a backend module present but unusable on this machine
            continue
        if available:
            module.empty_cache()
            return


def release_memory(*objects: Any) -> list[None]:
    """Drop this function's references to `objects`, collect garbage, clear the device cache.

    Returns one `None` per object: assign the result back (`a, b = release_memory(a, b)`) so the caller's
    names stop holding the objects too.
    """
    released: list[None] = [None] * len(objects)
    del objects
    clear_device_cache(garbage_collection=True)
    return released


def should_reduce_batch_size(exception: BaseException) -> bool:
    """True when `exception` is an out-of-memory error of some device (or the CPU allocator).

    Recognises `torch.OutOfMemoryError` and the RuntimeError messages of CUDA, ROCm, XPU, NPU, MPS, HPU,
    cuDNN workspace failures and `DefaultCPUAllocator: can't allocate memory`; also a plain `MemoryError`.
    """
    out_of_memory = getattr(torch, "OutOfMemoryError", None)
    if out_of_memory is not None and isinstance(exception, out_of_memory):
        return True
    if isinstance(exception, MemoryError):
        return True
    if isinstance(exception, RuntimeError) and exception.args and isinstance(exception.args[0], str):
        message = exception.args[0]
        return any(pattern in message for pattern in _OUT_OF_MEMORY_MESSAGES)
    return False


def find_executable_batch_size(
    function: Callable[..., Any] | None = None,
    starting_batch_size: int = 128,
    reduce_batch_size_fn: Callable[[], int] | None = None,
) -> Callable[..., Any]:
    """Decorator: call `function(batch_size, *args, **kwargs)`, retrying with a smaller batch size on OOM.

    `function` must take the batch size as its first parameter; callers do not pass it (the decorator
    does). After each out-of-memory error (see `should_reduce_batch_size`) the device cache is cleared and
    the batch size becomes `reduce_batch_size_fn()` if given, else `int(batch_size * 0.9)` (Accelerate
    1.15's factor). Other exceptions propagate unchanged. When the batch size reaches 0, a RuntimeError
    says no batch size fits. Usable bare (`@find_executable_batch_size`) or with arguments.
    """
    if function is None:
        return functools.partial(
            find_executable_batch_size,
            starting_batch_size=starting_batch_size,
            reduce_batch_size_fn=reduce_batch_size_fn,
        )
    if not callable(function):
        raise TypeError(f"find_executable_batch_size wraps a function; got {type(function).__name__}.")
    start = whole_number(starting_batch_size)  # numpy integers too, as Accelerate takes them
    if start is None or start < 0:  # 0: the call says so (Accelerate)
        raise ValueError(f"starting_batch_size must be an int >= 0, got {starting_batch_size!r}.")

    batch_size = start

    def _reduce_default() -> int:
        return int(batch_size * 0.9)

    reduce = reduce_batch_size_fn if reduce_batch_size_fn is not None else _reduce_default
    name = getattr(function, "__name__", repr(function))

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        nonlocal batch_size
        _check_batch_size_not_passed(function, name, args, kwargs)
        clear_device_cache(garbage_collection=True)
        tried: list[int] = []
        while True:
            if batch_size <= 0:
                why = (f"`{name}` ran out of memory with each of {tried}" if tried
                       else "starting_batch_size was 0")
                raise RuntimeError(
                    f"No executable batch size found, reached zero: {why}. Reduce the model or sequence size, or "
                    "use gradient accumulation / mixed precision."
                )
            try:
                return function(batch_size, *args, **kwargs)
            except Exception as error:
                if not should_reduce_batch_size(error):
                    raise
            # Outside the except block, so the failed attempt's frames (and tensors) can be freed.
            tried.append(batch_size)
            clear_device_cache(garbage_collection=True)
            batch_size = int(reduce())

    return wrapper


def _check_batch_size_not_passed(function: Callable[..., Any], name: str, args: tuple, kwargs: dict) -> None:
    """Raise TypeError when the caller passes the batch size that the decorator supplies itself."""
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):  # builtins without a signature: nothing to check
        return
    if not parameters:
        raise TypeError(f"`{name}` must take the batch size as its first argument.")
    first = parameters[0]
    if first.name in kwargs:
        raise TypeError(
            f"`{first.name}` was passed to `{name}`, but find_executable_batch_size supplies it: "
            f"call `{name}(...)` without it."
        )
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters):
        return
    positional = [
        p for p in parameters
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    if len(args) + 1 > len(positional):
        shown = ", ".join(f"{p.name}={value!r}" for p, value in zip(positional[1:], args[1:]))
        raise TypeError(
            f"The batch size was passed to `{name}` as its first argument, but find_executable_batch_size "
            f"supplies it: call `{name}({shown})` instead."
        )
