"""Launching a function on every process of the machine: notebook_launcher, debug_launcher, RankPool.

`import nbaccel.launch` stays cheap: torch and the elastic machinery load only when a launch needs them.
"""

from __future__ import annotations

from typing import Any

from .errors import LaunchError, LaunchTimeout, PortInUseError, UnpicklableError, WorkerFailure
from .launcher import debug_launcher, notebook_launcher

__all__ = [
    "LaunchError", "LaunchTimeout", "PortInUseError", "RankPool", "UnpicklableError", "WorkerFailure",
    "debug_launcher", "notebook_launcher",
]


def __getattr__(name: str) -> Any:
    if name == "RankPool":  # persistent ranks live in .pool (built on this package's modules)
        from .pool import RankPool

        return RankPool
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
