"""Lazy attribute loading for package namespaces.

`import nbaccel` must stay cheap: every worker process imports it, and the notebook launcher's start-up
time is part of what users feel. Public names are resolved from their home module on first access, and so
are the package's submodules (`nbaccel.utils`, `nbaccel.state`, ...), which Accelerate makes reachable as
attributes right after `import accelerate`.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from collections.abc import Callable, Mapping
from typing import Any


def submodule_names(package: str) -> set[str]:
    """Names of the modules and subpackages directly inside `package` (read from its folder; nothing imported)."""
    module = sys.modules[package]
    return {info.name for info in pkgutil.iter_modules(getattr(module, "__path__", []))}


def lazy_namespace(package: str, exports: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """Return `__getattr__` and `__dir__` for `package` resolving each name in `exports` from its module.

    `exports` maps a public name to the module (relative to `package`, e.g. ".state") that defines it. A name
    that is not exported but is a submodule of `package` is imported on first access, as `package.name`.
    """

    def __getattr__(name: str) -> Any:
        module_name = exports.get(name)
        if module_name is None:
            if name.startswith("__") or name not in submodule_names(package):
                raise AttributeError(f"module {package!r} has no attribute {name!r}")
            return importlib.import_module(f"{package}.{name}")  # the import binds it on the package too
        value = getattr(importlib.import_module(module_name, package), name)
        importlib.import_module(package).__dict__[name] = value  # cache: later lookups skip __getattr__
        return value

    def __dir__() -> list[str]:
        own = importlib.import_module(package).__dict__
        return sorted(set(exports) | set(own) | submodule_names(package))

    return __getattr__, __dir__
