"""Fork ranks from one long-lived kernel thread that never runs torch ops, so they can use OpenMP threads.

GNU OpenMP (torch's CPU thread pool) keeps its pool in the thread that ran a parallel region. A child forked
from that thread inherits the pool's bookkeeping but not its threads, and its first multi-threaded op waits
forever for them: a kernel that built its dataset with torch, then launched ranks with more than one thread
each, hung. A child forked from a thread that never ran a parallel region starts with no pool and builds its
own. The thread is a daemon that lives as long as the kernel, so PR_SET_PDEATHSIG, which fires when the
thread that forked exits, still fires only when the kernel dies.

Not a ThreadPoolExecutor: its worker is joined at interpreter exit, before atexit handlers run, so the
parent-death signal would kill RankPool's ranks before their graceful stop; and a forked child would see
the parent's worker as its own.

torch keeps grad mode and the default device per thread; the caller's are set in the fork thread around
each fork, so a rank starts with them as it would when forked from the caller (Accelerate forks from there).
"""

from __future__ import annotations

import os
import queue
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from .interrupts import interrupts_held
from .process_trees import stop_processes

_lock = threading.Lock()
_jobs: queue.SimpleQueue | None = None
_jobs_pid: int | None = None  # a child forked from here has the queue but not the thread


def start_process(process: Any, start_method: str) -> None:
    """Start `process` (a multiprocessing.Process); under fork, from the fork thread.

    Interrupted while waiting, it lets the fork finish, stops the new process, then raises: no rank is left
    that the caller does not know of.
    """
    if start_method != "fork":
        try:
            # held: a KeyboardInterrupt inside spawn's start left a child its caller never knew of, reading its
            # start data from a pipe only the traceback kept open (and the resource tracker's stop waited for it)
            with interrupts_held():
                process.start()
        except BaseException:
            if getattr(process, "_popen", None) is not None:
                stop_processes([process])
            raise
        return
    carried = _thread_settings()
    done: Future = Future()
    _fork_thread_jobs().put((lambda: _with_settings(carried, process.start), done))
    try:
        error = done.exception()
    except BaseException:
        _wait_quietly(done)
        stop_processes([process])
        raise
    if error is not None:
        raise error


def run_forks(forks: Callable[[], None]) -> None:
    """Run `forks` (which forks ranks, e.g. every rank of a launch, one after the other) in the fork thread, in
    one hand-off: the caller's thread waits once instead of once per rank (~0.1-0.3 ms each on 2 cores).

    Interrupted while waiting, it lets `forks` finish, then raises: the caller stops what `forks` started (it
    records every process it started where the caller sees it)."""
    carried = _thread_settings()
    done: Future = Future()
    _fork_thread_jobs().put((lambda: _with_settings(carried, forks), done))
    try:
        error = done.exception()
    except BaseException:
        _wait_quietly(done)
        raise
    if error is not None:
        raise error


def _fork_thread_jobs() -> queue.SimpleQueue:
    global _jobs, _jobs_pid
    with _lock:
        if _jobs is None or _jobs_pid != os.getpid():
            _jobs, _jobs_pid = queue.SimpleQueue(), os.getpid()
            threading.Thread(target=_serve, args=(_jobs,), name="nbaccel-fork", daemon=True).start()
        return _jobs


def _serve(jobs: queue.SimpleQueue) -> None:
    while True:
        job, done = jobs.get()
        try:
            done.set_result(job())
        except BaseException as exc:  # handed to the caller, who raises it
            done.set_exception(exc)


def _wait_quietly(done: Future) -> None:
    while True:
        try:
            done.exception()
            return
        except BaseException:  # interrupted again: the fork itself takes milliseconds
            continue


def _thread_settings() -> tuple[bool, Any] | None:
    """The caller's torch grad mode and default device (None when torch is not imported)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    # the context's own attribute: torch.get_default_device() may create a tensor (and initialize CUDA)
    context = getattr(getattr(torch, "_GLOBAL_DEVICE_CONTEXT", None), "device_context", None)
    return torch.is_grad_enabled(), getattr(context, "device", None)


def _with_settings(settings: tuple[bool, Any] | None, fork: Callable[[], None]) -> None:
    if settings is None:
        fork()
        return
    torch = sys.modules["torch"]
    grad_enabled, device = settings
    with torch.set_grad_enabled(grad_enabled):
        if device is None:
            fork()
            return
        torch.set_default_device(device)
        try:
            fork()
        finally:
            torch.set_default_device(None)
