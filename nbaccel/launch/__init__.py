"""Launching a function on every process of the machine: notebook_launcher, debug_launcher, RankPool.

`import nbaccel.launch` imports torch (LaunchError is a torch ChildFailedError); the elastic agent, cloudpickle's
use and the notebook views load only when a launch needs them.
"""

from __future__ import annotations

from typing import Any

from .errors import LaunchError, LaunchTimeout, PortInUseError, UnpicklableError, WorkerFailure
from .kernel.launcher import debug_launcher, notebook_launcher

__all__ = [
    "CollectiveMismatchError", "LaunchError", "LaunchTimeout", "PortInUseError", "RankFailedError", "RankPool",
    "RankPoolError", "RankTimeoutError", "UnpicklableError", "WorkerFailure", "debug_launcher", "notebook_launcher",
]


_POOL_NAMES = ("RankPool", "CollectiveMismatchError", "RankTimeoutError", "RankFailedError", "RankPoolError")


def __getattr__(name: str) -> Any:
    if name in _POOL_NAMES:  # persistent ranks live in .pool (built on this package's modules)
        from . import pool

        return getattr(pool, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
