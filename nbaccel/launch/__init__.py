"""Launching a function on every process of the machine: notebook_launcher, debug_launcher, RankPool.

The names load on first use (`nbaccel.launch.LaunchError` imports torch: it is a torch ChildFailedError), so
a process that needs one piece of the package (a rank of `nbaccel launch` needs its channel) imports only
that piece. The elastic agent, cloudpickle and the notebook views load only when a launch needs them.
"""

from __future__ import annotations

from .._lazy import lazy_namespace
from ..utils import notices as _notices

_notices.install()  # the launcher's notices: logging records with a default handler (utils/notices.py)

_EXPORTS = {
    **dict.fromkeys(["LaunchError", "LaunchTimeout", "PortInUseError", "UnpicklableError", "WorkerFailure"],
                    ".errors"),
    **dict.fromkeys(["debug_launcher", "notebook_launcher"], ".kernel.launcher"),
    "HostError": ".kernel.hosts",  # a host of a several-machine launch cannot take part (checked before it starts)
    "RayHosts": ".kernel.hosts",  # hosts=RayHosts(...): which nodes of a Ray cluster, what each rank reserves
    # persistent ranks live in .pool (built on this package's modules)
    **dict.fromkeys(["RankPool", "CollectiveMismatchError", "RankTimeoutError", "RankFailedError", "RankPoolError"],
                    ".pool"),
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_namespace(__name__, _EXPORTS)
