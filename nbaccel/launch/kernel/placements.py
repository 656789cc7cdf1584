"""Where ranks run: one backend class per placement, chosen from `PLACEMENTS` by `LaunchPlan.placement`.

A plan says where its ranks run (`Placement`: local processes, torch elastic, torch_xla, SSH hosts, a SLURM
allocation; in this process needs no backend) apart from what they run (`Program`: a function, RankPool's
persistent rank loop, a script). One class per placement serves every program it lists in `programs`; the
`LaunchSession` (launch_session.py) prepares for it what its capability attributes ask, the same for a
launch, a pool and a script:

- `inherits_objects`: under fork the ranks inherit the function and its arguments (no pickling) - not
  torch_xla's spawn, whose process pool pickles what it runs even when it forks;
- `preloads_modules`: the ranks fork from this process (elastic: from its agent thread), so the modules they
  will import are imported here first (module_preload.py) and gc is frozen around the forks when `freezes_gc`;
- `private_store`: the ranks' process group meets in a FileStore in an owner-only folder of the launch;
- `result_folder`: large tensors of a function's results come back through the launch's /dev/shm folder;
- `rank_groups`: the ranks run on this machine and register the process groups they lead in the launch's
  folder (rank_groups.py), which the launch stops when it ends (and its keeper if the kernel dies first);
- `fail_fast`, `workers_may_not_start`: how the supervisor treats the first failure and missing ranks.

`start(plan, payload)` returns one `StartedRank` per rank it supervises (a function's payload; None for a pool
or a script); both types live in placement_base.py. Adding a placement: a `Placement` member (plan.py), one
subclass of `Backend` in a module of its own, one entry in `PLACEMENTS` below (docs/internals.md, "Adding a
placement"). Each class is imported when a plan needs it (torch elastic's and torch_xla's are heavy).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from .placement_base import Backend, StartedRank
from .plan import Placement

if TYPE_CHECKING:
    from .plan import LaunchPlan

__all__ = ["PLACEMENTS", "Backend", "StartedRank", "backend_type", "select_backend"]


def _local() -> type[Backend]:
    from .local import LocalBackend

    return LocalBackend


def _elastic() -> type[Backend]:
    from .elastic import ElasticBackend

    return ElasticBackend


def _xla() -> type[Backend]:
    from .xla_backend import XlaBackend

    return XlaBackend


def _ssh() -> type[Backend]:
    from .ssh_backend import SshBackend

    return SshBackend


def _slurm() -> type[Backend]:
    from .ssh_backend import SlurmBackend

    return SlurmBackend


def _ray() -> type[Backend]:
    from .ray_backend import RayBackend

    return RayBackend


PLACEMENTS: dict[Placement, Callable[[], type[Backend]]] = {
    Placement.LOCAL: _local, Placement.ELASTIC: _elastic, Placement.XLA: _xla, Placement.SSH: _ssh,
    Placement.SLURM: _slurm, Placement.RAY: _ray,
}
"""Placement -> its backend class (loaded on first use). Placement.IN_PROCESS has none: the function runs here."""


def backend_type(plan: LaunchPlan) -> type[Backend]:
    """The backend class of the plan's placement; ValueError when it cannot run the plan's program."""
    try:
        backend = PLACEMENTS[plan.placement]()
    except KeyError:
        raise ValueError(f"no backend starts processes for placement {plan.placement.value!r}") from None
    if plan.program not in backend.programs:
        runs = ", ".join(sorted(program.value for program in backend.programs))
        raise ValueError(f"placement {plan.placement.value!r} runs {runs}, not a {plan.program.value}")
    return backend


def select_backend(plan: LaunchPlan) -> Backend:
    """A new backend that starts and owns the plan's ranks."""
    return backend_type(plan).for_plan(plan)
