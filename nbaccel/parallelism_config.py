"""`nbaccel.parallelism_config.ParallelismConfig`, as in Accelerate: the class lives in
`nbaccel.utils.parallelism_config` (so `nbaccel.utils` can export it without importing upward)."""

from __future__ import annotations

from .utils.parallelism_config import ParallelismConfig

__all__ = ["ParallelismConfig"]
