"""One process: the function runs in the kernel itself (as Accelerate does), still returning `[result]`.

Not a `Backend`: there is no process to start, watch or stop, so the supervisor is not involved; the plan's
mode `IN_PROCESS` sends the launch here instead.

Observers and the dashboard see the same status and telemetry messages as for a multi-process launch;
`mixed_precision` is set in the environment for the duration of the call; `timeout` uses SIGALRM (main
thread only).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

from ... import telemetry
from ..errors import LaunchTimeout
from ..messages import RankState, Status
from .observers import Reporting, make_dashboard
from .plan import LaunchPlan, LaunchRequest

# Variables of the plan set in the kernel for the call (the others, e.g. USE_CPU or OMP_NUM_THREADS, would not
# take effect in a process that already runs, or would change how the kernel's own PartialState sees it)
_IN_PROCESS_PREFIXES = ("NBACCEL_", "ACCELERATE_", "FSDP_")
_NOT_IN_PROCESS = ("NBACCEL_USE_CPU", "ACCELERATE_USE_CPU")


def in_process_environment(plan: LaunchPlan) -> dict[str, str]:
    """The plan's variables set for the duration of an in-process call (precision, accumulation, ...)."""
    return {key: value for key, value in plan.environ.items()
            if key.startswith(_IN_PROCESS_PREFIXES) and key not in _NOT_IN_PROCESS}


def run_in_process(plan: LaunchPlan, request: LaunchRequest, reporting: Reporting) -> list[Any]:
    """One process: call the function here (Accelerate does the same), reporting to observers if any.

    The plan's variables (precision, the saved config's gradient accumulation, ...) are set for the call only.
    """
    handle = make_dashboard(reporting.dashboard, 1, start_method="in-process")
    listeners = list(reporting.observers) + ([handle.observer] if handle else [])

    def sink(message: dict) -> None:
        message.setdefault("local_rank", 0)
        for listener in listeners:
            listener(message)

    results: list[Any] | None = None
    failures: dict | None = None
    if handle:
        handle.start()
    attached = bool(listeners) and not telemetry.is_attached()
    if attached:
        telemetry.attach(sink, 0)
    try:
        with _patched_env(in_process_environment(plan)), _alarm(plan.timeout):
            telemetry.emit(Status.kind.value, **Status(0, RankState.RUNNING, device="cpu", pid=os.getpid()).fields())
            results = [request.function(*request.args, **request.kwargs)]
        telemetry.emit(Status.kind.value, **Status(0, RankState.FINISHED, device="cpu").fields())
        return results
    except BaseException as exc:
        failed = Status(0, RankState.FAILED, device="cpu", error=f"{type(exc).__name__}: {exc}")
        telemetry.emit(Status.kind.value, **failed.fields())
        failures = {0: exc}
        raise
    finally:
        if attached:
            telemetry.detach()
        if handle:
            handle.close(results=results, failures=failures)


@contextlib.contextmanager
def _patched_env(values: dict[str, str]) -> Iterator[None]:
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def _alarm(timeout: float | None) -> Iterator[None]:
    """Bound an in-process run with SIGALRM (only possible from the main thread)."""
    if timeout is None or threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise LaunchTimeout(f"the function did not finish within timeout={timeout} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
