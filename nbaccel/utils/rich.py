"""`accelerate.utils.rich`: importing it turns on rich's tracebacks for uncaught exceptions in this process
(rich is one of nbaccel's dependencies, so unlike Accelerate it needs no opt-in variable)."""

from __future__ import annotations

try:
    from rich.traceback import install
except ImportError as error:  # pragma: no cover - rich is a dependency
    raise ImportError("nbaccel.utils.rich needs rich: pip install rich") from error

install(show_locals=False)

__all__: list[str] = []
