"""The notebook views a launch shows, handed to the launch machinery instead of imported by it.

The launch machinery sits below the views (docs/internals.md): it knows only this small interface. The
package root (`nbaccel/__init__.py`, the top of the import order) hands in the notebook package's views when
`nbaccel` is imported, so `notebook_launcher`, `RankPool` and the supervisor reach the dashboard and the
cell's output without an import of `nbaccel.notebook` in `nbaccel.launch`. Each view is loaded only when
first asked for (a launch with `dashboard=False` outside a notebook loads none).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Views:
    """Factories of the views (each imports its module when called; ImportError when it cannot be loaded)."""

    dashboard_type: Callable[[], Any]  # the Dashboard class: Dashboard(num_processes, **info, mode=...)
    cell_output: Callable[[], Any]  # where the ranks' live rows and display() go: the running cell
    in_kernel: Callable[[], bool]  # whether this process is a Jupyter kernel (ranks then send rich output)


_views: Views | None = None


def provide(views: Views | None) -> None:
    """Hand the views to the launch machinery (None: take them back)."""
    global _views
    _views = views


def views() -> Views:
    """The views handed in; ImportError when none were (the launch then runs without a dashboard)."""
    if _views is None:
        raise ImportError("no notebook views were handed to nbaccel.launch (nbaccel.launch.views.provide)")
    return _views
