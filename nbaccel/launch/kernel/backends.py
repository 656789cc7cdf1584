"""The backends, chosen by the plan's mode. Each says what it supports as class attributes, which the launcher
reads instead of asking for the mode:

- `inherits_objects`: under fork the ranks inherit the function and its arguments (no pickling) - not
  torch_xla's spawn, whose process pool pickles what it runs even when it forks;
- `preloads_modules`: the ranks fork from this process (elastic: from its agent thread), so the modules they
  will import are imported here first (processes.preload_worker_modules) and gc is frozen around the forks
  when `freezes_gc`;
- `private_store`: the ranks' process group meets in a FileStore in an owner-only folder of the launch;
- `result_folder`: large tensors of the results come back through the launch's /dev/shm folder;
- `rank_groups`: the ranks run on this machine and register the process groups they lead in the launch's
  folder (rank_groups.py), which the launch stops when it ends (and its keeper if the kernel dies first).

Each backend module is imported when a plan needs it (torch elastic's and torch_xla's are heavy).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .plan import Mode

if TYPE_CHECKING:
    from .plan import LaunchPlan
    from .supervisor import Backend


def _local() -> type:
    from .local import LocalBackend

    return LocalBackend


def _elastic() -> type:
    from .elastic import ElasticBackend

    return ElasticBackend


def _xla() -> type:
    from .xla import XlaBackend

    return XlaBackend


def _torchrun() -> type:
    from .torchrun import TorchrunBackend

    return TorchrunBackend


def _persistent() -> type:
    from .persistent import PersistentBackend

    return PersistentBackend


def _ssh() -> type:
    from .ssh_backend import SshBackend

    return SshBackend


def _ssh_persistent() -> type:
    from .ssh_pool_backend import SshPoolBackend

    return SshPoolBackend


def _ray() -> type:
    from .ray_backend import RayBackend

    return RayBackend


def _ray_persistent() -> type:
    from .ray_backend import RayPoolBackend

    return RayPoolBackend


BACKENDS: dict[Mode, Callable[[], type]] = {Mode.LOCAL: _local, Mode.ELASTIC: _elastic, Mode.XLA: _xla,
                                            Mode.PERSISTENT: _persistent, Mode.SCRIPT: _torchrun, Mode.SSH: _ssh,
                                            Mode.SSH_PERSISTENT: _ssh_persistent, Mode.RAY: _ray,
                                            Mode.RAY_PERSISTENT: _ray_persistent}
"""Mode -> the backend class (loaded on first use). Mode.IN_PROCESS has none: the function runs right here."""


def backend_type(plan: LaunchPlan) -> Any:
    """The backend class of the plan's mode."""
    try:
        return BACKENDS[plan.mode]()
    except KeyError:
        raise ValueError(f"no backend starts processes for mode {plan.mode.value!r}") from None


def select_backend(plan: LaunchPlan) -> Backend:
    """A new backend that starts and owns the plan's workers."""
    return backend_type(plan)()
