"""A backend for launchers that start the worker processes themselves (torch elastic, torch_xla).

Their blocking call runs in a helper thread while the supervisor, in the caller's thread, reads the
channels and output pipes. The workers are found as the new child processes of this process, so stopping
them does not depend on the other launcher's internals.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

from ..channel import close_quietly
from ..errors import WorkerFailure
from .processes import kill_pids

JOIN_TIMEOUT = 5.0


class ThreadedBackend:
    """Run `target()` in a thread; `finished()` once it returned; `stop()` kills the workers it started."""

    fail_fast = False

    def __init__(self, target: Callable[[], Any], worker_ends: list[Any], name: str) -> None:
        self._target = target
        self._worker_ends = worker_ends  # kept open while workers may still be (re)started
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._before: set[int] = set()
        self.value: Any = None
        self.error: BaseException | None = None

    def start(self) -> None:
        self._before = set(_children())
        self._thread.start()

    def _run(self) -> None:
        try:
            self.value = self._target()
        except BaseException as exc:
            self.error = exc

    def wait_objects(self) -> list[Any]:
        return []

    def poll_exits(self) -> list[tuple[int, int]]:
        return []

    def finished(self) -> bool:
        if self._thread.is_alive():
            return False
        if self._worker_ends:  # no worker can start any more: let the pipes reach end of stream
            close_quietly(*self._worker_ends)
            self._worker_ends = []
        return True

    def before_stop(self) -> None:
        """Keep the other launcher from starting new workers (e.g. elastic restarts)."""

    def stop(self) -> None:
        self.before_stop()
        kill_pids(pid for pid in _children() if pid not in self._before)
        self._thread.join(JOIN_TIMEOUT)
        kill_pids(pid for pid in _children() if pid not in self._before)
        self.finished()

    def exit_failures(self) -> dict[int, WorkerFailure]:
        return {}


def _children() -> list[int]:
    try:
        import psutil

        return [child.pid for child in psutil.Process(os.getpid()).children(recursive=False)]
    except Exception:
        return []
