"""Validation of the launcher's arguments: every mistake is reported before any process starts."""

from __future__ import annotations

import inspect
from typing import Any

MIXED_PRECISION_CHOICES = ("no", "fp8", "fp16", "bf16")
RDZV_BACKENDS = ("static", "c10d", "etcd", "etcd-v2")


def check_arguments(function: Any, args: Any, kwargs: dict, num_processes: Any, mixed_precision: Any,
                     node_rank: Any, num_nodes: Any, max_restarts: Any, monitor_interval: Any,
                     rdzv_backend: Any, timeout: Any) -> str:
    """Raise ValueError/TypeError naming the bad argument; return `mixed_precision` normalized."""
    if not callable(function):
        raise TypeError(f"function must be callable, got {type(function).__name__}")
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"args must be a tuple of positional arguments, got {type(args).__name__}")
    if num_processes is not None and (not is_int(num_processes) or num_processes < 1):
        raise ValueError(f"num_processes must be a positive integer or None (all devices), got {num_processes!r}")
    if not is_int(num_nodes) or num_nodes < 1:
        raise ValueError(f"num_nodes must be a positive integer, got {num_nodes!r}")
    if not is_int(node_rank) or not 0 <= node_rank < num_nodes:
        raise ValueError(f"node_rank must be in [0, num_nodes={num_nodes}), got {node_rank!r}")
    if not is_int(max_restarts) or max_restarts < 0:
        raise ValueError(f"max_restarts must be an integer >= 0, got {max_restarts!r}")
    if not isinstance(monitor_interval, (int, float)) or isinstance(monitor_interval, bool) or monitor_interval <= 0:
        raise ValueError(f"monitor_interval must be a positive number of seconds, got {monitor_interval!r}")
    if rdzv_backend not in RDZV_BACKENDS:
        raise ValueError(f"rdzv_backend must be one of {RDZV_BACKENDS}, got {rdzv_backend!r}")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not timeout > 0):
        raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
    precision = mixed_precision.lower() if isinstance(mixed_precision, str) else mixed_precision
    precision = getattr(precision, "value", precision)  # a PrecisionType member
    if precision not in MIXED_PRECISION_CHOICES:
        raise ValueError(f"Unknown mixed_precision mode: {mixed_precision!r}. Choose between {list(MIXED_PRECISION_CHOICES)}.")
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return precision  # builtins without a signature: let the call decide
    try:
        signature.bind(*args, **kwargs)
    except TypeError as exc:
        name = getattr(function, "__qualname__", repr(function))
        raise TypeError(
            f"{name}{signature} cannot be called with args={tuple(args)!r} and kwargs={kwargs!r}: {exc}"
        ) from None
    return precision


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_port(use_port: Any) -> int | None:
    """`use_port` (int or digit string, Accelerate passes "29500") as an int; None stays None."""
    if use_port is None:
        return None
    try:
        port = int(use_port)
    except (TypeError, ValueError):
        port = -1
    if not 0 < port < 65536 or isinstance(use_port, bool):
        raise ValueError(f"use_port must be a port number 1-65535 (or None for a free port), got {use_port!r}")
    return port
