"""Destroy, at a normal interpreter exit, the process group that nbaccel created in this process.

A script that builds `PartialState` under `nbaccel launch` (or torchrun) and ends without calling
`destroy_process_group` leaves gloo's worker threads alive into interpreter finalization; now and then one
of them touches Python after the interpreter is gone and the process aborts ("terminate called without an
active exception", exit code -6), so a correct script is reported as failed. torch's documentation asks
every process to call `destroy_process_group()` before it exits; this module does it for the user from an
`atexit` hook (atexit handlers run while the interpreter is still whole). A group the user created
themselves is theirs to destroy, and a process leaving on an unhandled exception is left alone: a backend
such as NCCL could wait on peers that are still inside a collective.

It also keeps a destroyed group alive past the DDP wrappers that use it. A `DistributedDataParallel`
model's C++ reducer holds its process group; when `end_training()` destroys the group while the model
lives on (the usual order: the model is a local of the training function, freed when it returns), the
reducer later drops the group's last reference with the GIL held, and gloo's destructor joins worker
threads, one of which may need the GIL to release its last collective's tensors: the rank hangs in
`Reducer::~Reducer -> ProcessGroupGloo::~ProcessGroupGloo -> std::thread::join`. A reference dropped from
Python instead goes through torch's GIL-releasing holder, which cannot deadlock that way; so nbaccel holds
the group until every wrapper that used it is gone, then drops it from Python.

A group can also outlive `destroy_process_group` in cyclic garbage, which only a collection frees (e.g. a
user's object that refers to itself and holds the group, or pdb's objects, which refer to the frames they
stopped in). Garbage old enough waits for a full collection, which may first come at finalization, with
gloo's threads running as above. So a group still alive after its destroy gets one collection while the
interpreter is whole.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_registered_pid: int | None = None  # the process whose atexit list holds the hook (a fork inherits the list)


@dataclass
class _KeptGroup:
    """A destroyed process group, held from Python until the DDP wrappers that used it are gone."""

    group: Any
    users: list[weakref.ref]

    def in_use(self) -> bool:
        return any(user() is not None for user in self.users)


_group_users: weakref.WeakSet = weakref.WeakSet()  # DDP wrappers made by `Accelerator.prepare`
_before_end: list[Callable[[], None]] = []  # run first by end_process_groups (before_groups_end)
_kept: list[_KeptGroup] = []


def note_group_user(ddp_model: Any) -> None:
    """Remember a DDP wrapper (its reducer holds `ddp_model.process_group` in C++): see the module docstring."""
    _group_users.add(ddp_model)


def keep_group_past_its_users(group: Any) -> None:
    """Before `group` is destroyed: hold it from Python while a remembered DDP wrapper still uses it."""
    release_unused_groups()
    users = [weakref.ref(model) for model in list(_group_users) if getattr(model, "process_group", None) is group]
    if users:
        _kept.append(_KeptGroup(group, users))


def release_unused_groups() -> None:
    """Drop, from Python (torch's holder releases the GIL while gloo joins its threads), every kept group
    whose DDP wrappers are gone. A wrapper still alive keeps its group until the next call."""
    _kept[:] = [kept for kept in _kept if kept.in_use()]


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
    end_process_groups()


def before_groups_end(hook: Callable[[], None]) -> None:
    """Have `end_process_groups` call `hook` before it destroys anything: a thread that may hold the process's
    frames, and through their locals a group, must let go first, or the group's last reference could drop in
    that thread during finalization, where gloo's destructor aborts the process (launch/worker/raw_calls.py)."""
    _before_end.append(hook)


def end_process_groups() -> None:
    """At a process's end, with the interpreter still whole: destroy the default process group (if one is
    up), free a destroyed group that only cyclic garbage still holds, and give the threads of one still in
    use (a DDP wrapper's) the moment they need (see the module docstring). Never raises."""
    for hook in _before_end:
        try:
            hook()
        except Exception:  # noqa: BLE001 - the exit must go on
            pass
    ended = destroy_default_group()
    release_unused_groups()
    if any(group() is not None for group in ended):
        gc.collect()
        release_unused_groups()  # a DDP wrapper the collection freed left its group in `_kept`
    wait_for_gloo_workers_to_settle()
    release_unused_groups()


def destroy_default_group() -> list[weakref.ref]:
    """`destroy_process_group()` when a default group is up; weak references to the groups it ended (one
    still alive afterwards is held by something else). Never raises: the process is on its way out."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is None or not dist.is_available() or not dist.is_initialized():
            return []
        groups = [weakref.ref(group) for group in getattr(dist.distributed_c10d, "_pg_map", ())]
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the exit must go on; the group was about to vanish anyway
        return []
    return groups


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
