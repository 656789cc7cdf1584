"""Lazy attribute loading for package namespaces.

`import nbaccel` must stay cheap: every worker process imports it, and the notebook launcher's start-up
time is part of what users feel. Public names are resolved from their home module on first access.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_namespace(package: str, exports: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """Return `__getattr__` and `__dir__` for `package` resolving each name in `exports` from its module.

    `exports` maps a public name to the module (relative to `package`, e.g. ".state") that defines it.
    """

    def __getattr__(name: str) -> Any:
        module_name = exports.get(name)
        if module_name is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module_name, package), name)
        importlib.import_module(package).__dict__[name] = value  # cache: later lookups skip __getattr__
        return value

    def __dir__() -> list[str]:
        return sorted(set(exports) | set(importlib.import_module(package).__dict__))

    return __getattr__, __dir__
