"""A launched rank never outlives the process that launched it, even when that one is SIGKILLed; and what
the rank starts stays in the rank's own process group, which the launcher stops as one (kernel/process_trees.py).

Linux: `prctl(PR_SET_PDEATHSIG, SIGKILL)` makes the OS kill the rank the moment its parent dies (no thread,
no polling). Elsewhere (macOS) a daemon thread checks every half second whether the parent is gone (the
rank was handed to another parent) and kills the rank then.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import threading
import time
from typing import Any

PR_SET_PDEATHSIG = 1
WATCH_INTERVAL = 0.5  # seconds between checks where there is no parent-death signal


def die_with_parent() -> None:
    """Tie this process's life to its parent's: called first thing in every launched rank."""
    parent = os.getppid()
    if _set_death_signal():
        if os.getppid() != parent:  # it died between the two calls
            os._exit(1)
        return
    threading.Thread(target=_watch, args=(parent,), name="nbaccel-parent-watch", daemon=True).start()


def _set_death_signal() -> bool:
    prctl = load_prctl()
    try:
        return prctl is not None and prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except Exception:
        return False


@functools.cache
def load_prctl() -> Any:
    """libc's `prctl` (None off Linux), looked up once per process. The launcher calls it before it forks
    (kernel/module_preload.py): a forked rank then calls the inherited function instead of paying ctypes'
    library and symbol lookup (~0.5 ms in a fresh fork, on every rank's way to the user's function)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except Exception:
        return None


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(WATCH_INTERVAL)
    os.kill(os.getpid(), signal.SIGKILL)


def lead_own_group(registry: str | None = None) -> None:
    """Make this rank the leader of a process group of its own, called before it starts anything, and register
    the group in the launch's `registry` folder (RANK_GROUPS_ENV) when there is one.

    Every process the rank starts (a `subprocess.Popen`, a data loader worker, their children) joins the
    group and stays in it after the rank dies (re-parented to pid 1), so the launcher stops all of them with
    one `killpg(rank's pid)`, dead rank or alive (kernel/rank_groups.py); the registry is how the launcher, and
    its keeper process after the launcher's own death, know every group, also of ranks that another launcher
    (torch elastic) started and restarted. It also keeps a terminal's or Jupyter's SIGINT to the launcher's
    group from reaching the rank: the launcher stops it.
    """
    if hasattr(os, "setpgid"):
        try:
            os.setpgid(0, 0)
        except OSError:  # already a session leader (torch elastic's subprocesses): its group is its own
            pass
    register_group(registry)


def register_group(registry: str | None) -> None:
    """Put this process's group in the launch's folder of rank groups (an empty file named by the group's
    number), if this process leads it: never the launcher's own group (a rank that could not make one)."""
    if not registry or not hasattr(os, "getpgrp") or os.getpgrp() != os.getpid():
        return
    try:
        os.close(os.open(os.path.join(registry, str(os.getpid())), os.O_WRONLY | os.O_CREAT, 0o600))
    except OSError:  # the folder is gone (the launch ended) or not on this machine: nothing to register in
        pass
