"""Kernel-side subscribers to launch messages, and the one adapter that plugs in the dashboard."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..channel import Observer
from ..views import views

VIEW_MODES = ("widget", "html", "terminal", "plain")  # `dashboard=` strings naming a view of nbaccel.notebook.Dashboard


@dataclass(frozen=True)
class Reporting:
    """Who hears about a launch: the `dashboard=` value and the observers (the timeout is the plan's)."""

    dashboard: Any = "auto"
    observers: Sequence[Observer] = ()


class DashboardHandle:
    """Wraps a dashboard object: `.observer` for messages, `start()` and `close(results, failures)`."""

    def __init__(self, dashboard: Any) -> None:
        self.dashboard = dashboard
        observe = getattr(dashboard, "observe", None)
        self.observer: Observer = observe if callable(observe) else dashboard

    def start(self) -> None:
        start = getattr(self.dashboard, "start", None)
        if callable(start):
            start()

    def close(self, results: list | None = None, failures: dict | None = None) -> None:
        close = getattr(self.dashboard, "close", None)
        if not callable(close):
            return
        try:
            close(results=results, failures=failures)
        except TypeError:
            close()


def check_dashboard(dashboard: Any) -> None:
    """Reject a `dashboard=` value `make_dashboard` cannot use (TypeError; a Dashboard whose run ended:
    RuntimeError; a view this process cannot draw, such as "widget" in plain Python: the Dashboard's own
    ValueError or ImportError), before any process starts."""
    if getattr(dashboard, "ended", False) is True:  # a Dashboard shows one run: say so before ranks start
        raise RuntimeError("dashboard=: this Dashboard already showed a run that ended, and keeps its summary: "
                           "pass a new Dashboard(...) to each launch (or dashboard=True)")
    if dashboard is None or isinstance(dashboard, bool) or callable(dashboard):
        return
    if callable(getattr(dashboard, "observe", None)):
        return
    if isinstance(dashboard, str) and dashboard in VIEW_MODES:
        try:
            resolve = views().dashboard_type().resolve_mode
        except (ImportError, AttributeError):  # no notebook views: make_dashboard says so
            return
        resolve(dashboard)
        return
    if dashboard == "auto":
        return
    raise TypeError(
        f"dashboard={dashboard!r}: pass 'auto', True, False, one of the views {', '.join(map(repr, VIEW_MODES))}, "
        "or an object with .observe(message) / a callable"
    )


def make_dashboard(dashboard: Any, num_processes: int, **info: Any) -> DashboardHandle | None:
    """The dashboard for a launch: False/None -> none; "auto"/True -> `nbaccel.notebook.Dashboard` when it
    can be imported (True insists); "widget"/"terminal"/"plain" -> `Dashboard(num_processes, mode=...)`
    (errors raised, as with True); an object with `.observe` or a callable -> used as is.

    `dashboard=False` never imports the notebook package.
    """
    if dashboard is False or dashboard is None:
        return None
    if dashboard is True or dashboard == "auto":
        try:
            Dashboard = views().dashboard_type()
        except ImportError:
            if dashboard is True:
                raise
            return None
        try:
            return DashboardHandle(_construct(Dashboard, num_processes, info))
        except Exception as exc:
            if dashboard is True:
                raise
            warnings.warn(f"nbaccel: the dashboard could not start ({exc!r}); launching without it",
                          stacklevel=3)
            return None
    if isinstance(dashboard, str) and dashboard in VIEW_MODES:
        Dashboard = views().dashboard_type()
        return DashboardHandle(_construct(Dashboard, num_processes, info, mode=dashboard))
    check_dashboard(dashboard)
    return DashboardHandle(dashboard)


def _construct(factory: Callable[..., Any], num_processes: int, info: dict[str, Any], **options: Any) -> Any:
    try:
        return factory(num_processes, **info, **options)
    except TypeError:
        return factory(num_processes, **options)
