"""Destroy, at a normal interpreter exit, the process group that nbaccel created in this process.

A script that builds `PartialState` under `nbaccel launch` (or torchrun) and ends without calling
`destroy_process_group` leaves gloo's worker threads alive into interpreter finalization; now and then one
of them touches Python after the interpreter is gone and the process aborts ("terminate called without an
active exception", exit code -6), so a correct script is reported as failed. torch's documentation asks
every process to call `destroy_process_group()` before it exits; this module does it for the user from an
`atexit` hook (atexit handlers run while the interpreter is still whole). A group the user created
themselves is theirs to destroy, and a process leaving on an unhandled exception is left alone: a backend
such as NCCL could wait on peers that are still inside a collective.
"""

from __future__ import annotations

import atexit
import os
import sys

_registered_pid: int | None = None  # the process whose atexit list holds the hook (a fork inherits the list)


def destroy_process_group_at_exit() -> None:
    """Register (once per process) the exit hook for the default process group just created here."""
    global _registered_pid
    if _registered_pid == os.getpid():
        return
    _registered_pid = os.getpid()
    atexit.register(_destroy_at_exit, os.getpid())


def _destroy_at_exit(pid: int) -> None:
    if os.getpid() != pid:  # a forked child inherited the hook; its group (if any) is not this one's
        return
    if getattr(sys, "last_value", None) is not None or getattr(sys, "last_exc", None) is not None:
        return  # leaving on an unhandled exception: never wait on peers here
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the exit must go on; the group was about to vanish anyway
        pass
