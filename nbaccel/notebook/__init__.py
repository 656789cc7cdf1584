"""Kernel-side views of a launch: the live `Dashboard`, the `config_widget`, and the IPython magics.

Names load on first use, so importing this package does not import ipywidgets, rich or matplotlib.
"""

from .._lazy import lazy_namespace

_EXPORTS = {
    "Dashboard": ".dashboard",
    "DashboardModel": ".dashboard_model",
    "config_widget": ".config_widget",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_namespace(__name__, _EXPORTS)
