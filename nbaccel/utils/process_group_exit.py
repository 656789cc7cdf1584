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
import time

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
    wait_for_gloo_workers_to_settle()


GLOO_WORKER_THREAD = "pt_gloo_runloop"  # the name torch gives ProcessGroupGloo's worker threads


def wait_for_gloo_workers_to_settle(timeout: float = 0.25) -> None:
    """Give gloo's worker threads, when a group outlives `destroy_process_group` (a DDP model still holds
    it), the moment they need to release their last collective before the interpreter finalizes.

    A worker thread drops its finished collective (and with it the tensors, whose Python objects need the
    GIL) just after the rank's `wait()` returns. On a loaded machine it can be descheduled in between; if
    the interpreter is finalizing when it wakes, it cannot take the GIL and the process aborts. This waits,
    at most `timeout` seconds and only on Linux while such threads exist, until none of them has been
    runnable over three polls (the GIL is free during each sleep, so one waiting for it gets it)."""
    tasks = "/proc/self/task"
    if not os.path.isdir(tasks):
        return
    deadline = time.monotonic() + timeout
    quiet = 0
    while quiet < 3 and time.monotonic() < deadline:
        states = _thread_states(tasks, GLOO_WORKER_THREAD)
        if not states:
            return
        quiet = 0 if "R" in states else quiet + 1
        time.sleep(0.002)


def _thread_states(tasks: str, name: str) -> list[str]:
    """The scheduler states (R, S, D, ...) of this process's threads called `name`."""
    states = []
    for tid in os.listdir(tasks):
        try:
            with open(f"{tasks}/{tid}/stat") as stat:
                fields = stat.read()
        except OSError:  # the thread ended meanwhile
            continue
        comm = fields[fields.index("(") + 1:fields.rindex(")")]
        if comm == name:
            states.append(fields[fields.rindex(")") + 2])
    return states
