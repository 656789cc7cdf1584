"""One process: the function runs in the kernel itself (as Accelerate does), still returning `[result]`.

Observers and the dashboard see the same status and telemetry messages as for a multi-process launch;
`mixed_precision` is set in the environment for the duration of the call; `timeout` uses SIGALRM (main
thread only).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ... import telemetry
from ..channel import Observer
from ..errors import LaunchTimeout
from .observers import make_dashboard


def run_in_process(function: Callable[..., Any], args: tuple, kwargs: dict, mixed_precision: str,
                   dashboard: Any, observers: Sequence[Observer], timeout: float | None,
                   env: dict[str, str] | None = None) -> list[Any]:
    """One process: call the function here (Accelerate does the same), reporting to observers if any.

    `env` (e.g. the gradient accumulation of the saved config) is set, like the precision, for the call only.
    """
    handle = make_dashboard(dashboard, 1, start_method="in-process")
    listeners = list(observers) + ([handle.observer] if handle else [])

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
        with _patched_env({"NBACCEL_MIXED_PRECISION": mixed_precision,
                           "ACCELERATE_MIXED_PRECISION": mixed_precision, **(env or {})}), _alarm(timeout):
            telemetry.emit("status", state="running", device="cpu", pid=os.getpid())
            results = [function(*args, **kwargs)]
        telemetry.emit("status", state="finished", device="cpu")
        return results
    except BaseException as exc:
        telemetry.emit("status", state="failed", device="cpu", error=f"{type(exc).__name__}: {exc}")
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
