"""`accelerate.utils.versions`: version comparisons (`compare_versions`, `is_torch_version`) and
`torch_version`, the installed torch's version (read from package metadata, without importing torch)."""

from __future__ import annotations

import importlib.metadata

from packaging.version import parse

from .imports import compare_versions, is_torch_version

__all__ = ["compare_versions", "is_torch_version", "torch_version"]

torch_version = parse(importlib.metadata.version("torch"))
