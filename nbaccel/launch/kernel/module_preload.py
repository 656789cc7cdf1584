"""The modules a fork launch's ranks import, imported in the kernel first so that the ranks inherit them."""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterable

from ..messages import PRELOADABLE_MODULES

_learned_imports: set[str] = set()  # PRELOADABLE_MODULES that ranks of this kernel's launches imported


def learn_rank_imports(names: Iterable[str]) -> None:
    """Remember which PRELOADABLE_MODULES a launch's rank imported (from its `result` message)."""
    _learned_imports.update(name for name in names if name in PRELOADABLE_MODULES)


def preload_worker_modules(start_method: str, *, launch: bool = False) -> None:
    """Under fork, import in the kernel what every rank imports before the user's code runs: the ranks
    inherit the loaded modules instead of each importing them again (`nbaccel.state` and what it pulls in
    cost 0.3-0.9 s per rank on a loaded 2-core machine; see docs/internals.md "Where the time goes").

    `launch`: a launch's ranks are new processes each time, so what they import they paid at every launch.
    Also `nbaccel.accelerator` (~50 ms), and the PRELOADABLE_MODULES an earlier launch's ranks imported:
    torch._dynamo, which every torch optimizer imports when the first one is built (2.3 s of CPU and 69 MiB
    here). Only once a launch showed it is needed: a launch that builds no optimizer never pays for it, and the
    kernel's import takes what the ranks' took at the same time. RankPool leaves these out: its ranks live
    on and pay them once, and its start stays fast.
    """
    if start_method != "fork":
        return
    from ... import state  # noqa: F401
    from ...utils import collective_trace  # noqa: F401
    from ..worker import parent_death, rank_display

    # what every forked rank would otherwise look up itself on its way to the function
    parent_death.load_prctl()
    rank_display.note_kernel_stream_handlers()

    if launch:
        from ... import accelerator  # noqa: F401

        for name in sorted(name for name in _learned_imports if name not in sys.modules):
            with contextlib.suppress(Exception):  # a broken module: the ranks import it or fail as before
                importlib.import_module(name)
