"""What a dashboard does off the thread that forwards the ranks' output: import the chart libraries, redraw.

The launch's supervising thread reads the ranks' pipes and hands every message to the dashboard; if it drew
there, a redraw (or worse, the first chart's `import bqplot`, which imports pandas: a second or more on a
busy machine) would hold the ranks' printed lines back. So the dashboard draws on a thread of its own
(dashboard.py), and the chart libraries are imported on another one the first time a metric is logged
(`load_charts_in_background`), while the tables keep redrawing. That import also freezes the kernel's heap
(gc.freeze) until the live view closes (`thaw`): a full collection it would trigger holds the GIL, and so the
forwarding thread, for a fraction of a second.

A fork taken while another thread is inside an import (or a redraw) would leave the child with module locks
held by a thread it does not have: its first import of that module (numpy, pandas) would wait forever. The
ranks fork before the dashboard starts, but later forks exist (`RankPool.restart`, torch elastic's restarts,
a second launch from another thread): every `os.fork` of this process therefore waits, through an at-fork
hook, until no such import or redraw is running (`forks_wait`).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import threading
import warnings
from collections.abc import Callable, Iterator

# What the live chart (bqplot, matplotlib's tick locator) and the end-of-run PNG (matplotlib's Agg canvas) import.
CHART_MODULES = ("bqplot", "matplotlib.ticker", "matplotlib.figure", "matplotlib.backends.backend_agg")

class _ForkGate:
    """Counts the background imports and redraws running (which do not wait for each other); a fork waits
    until none runs (but for its own thread's), and none starts until the fork is done."""

    def __init__(self) -> None:
        self.condition = threading.Condition()
        self.running: dict[int, int] = {}  # thread ident -> imports/redraws it is inside
        self.forking = 0

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        me = threading.get_ident()
        with self.condition:
            self.condition.wait_for(lambda: not self.forking or me in self.running)
            self.running[me] = self.running.get(me, 0) + 1
        try:
            yield
        finally:
            with self.condition:
                self.running[me] -= 1
                if not self.running[me]:
                    del self.running[me]
                self.condition.notify_all()

    def before_fork(self) -> None:
        me = threading.get_ident()
        with self.condition:
            self.condition.wait_for(lambda: not (self.running.keys() - {me}))
            self.forking += 1

    def after_fork_in_parent(self) -> None:
        with self.condition:
            self.forking -= 1
            self.condition.notify_all()


_gate = _ForkGate()


def _after_fork_in_child() -> None:
    global _gate
    _gate = _ForkGate()  # the child has one thread: nothing of the parent's runs there


os.register_at_fork(before=lambda: _gate.before_fork(), after_in_parent=lambda: _gate.after_fork_in_parent(),
                    after_in_child=_after_fork_in_child)


def forks_wait() -> contextlib.AbstractContextManager[None]:
    """While inside, an `os.fork` of this process from another thread (multiprocessing's fork too) waits until
    the block ends; blocks of several threads run side by side."""
    return _gate.held()


def import_chart_modules() -> None:
    """Import what the live chart and the end-of-run PNG need."""
    for name in CHART_MODULES:
        importlib.import_module(name)


class _Charts:
    """The chart libraries: imported once per process, on a thread of their own."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None
        self.waiting: list[Callable[[], None]] = []
        self.frozen = False  # the heap is in gc's permanent generation since the import (until `thaw`)
        self.thaw_when_done = False

    def start(self, on_loaded: Callable[[], None] | None) -> None:
        with self.lock:
            if self.done.is_set():
                return
            if on_loaded is not None and on_loaded not in self.waiting:
                self.waiting.append(on_loaded)
            if self.thread is None:
                self.thread = threading.Thread(target=self._import, name="nbaccel-chart-imports", daemon=True)
                self.thread.start()

    def thaw(self) -> None:
        """Give the frozen heap back to the collections (under `lock`)."""
        if self.frozen:
            self.frozen = False
            gc.unfreeze()

    def _import(self) -> None:
        # The import makes ~80k objects: enough to trigger full collections, which walk the whole kernel heap
        # (torch's, imported for the forked ranks) holding the GIL 0.2-0.6 s on a busy machine, the forwarding
        # thread's included. Frozen objects are skipped; `thaw` (the dashboard's close) gives them back.
        with self.lock:
            if gc.isenabled():
                gc.freeze()
                self.frozen = True
        try:
            with forks_wait():
                import_chart_modules()
        except Exception as error:  # the tables still draw; the chart is left out, said once
            self.error = error
            warnings.warn(f"nbaccel dashboard: the live chart cannot be drawn: {type(error).__name__}: {error}",
                          RuntimeWarning, stacklevel=1)
        with self.lock:
            self.done.set()
            waiting, self.waiting = self.waiting, []
            if self.thaw_when_done:
                self.thaw()
        for callback in waiting:
            try:
                callback()
            except Exception:  # a dashboard that ended meanwhile
                pass


_charts = _Charts()


def charts_loaded() -> bool:
    """Whether the chart libraries are imported (and imported without error)."""
    return _charts.done.is_set() and _charts.error is None


def load_charts_in_background(on_loaded: Callable[[], None] | None = None) -> None:
    """Start importing the chart libraries on a background thread (once per process); `on_loaded()` is called
    from that thread when they are (not when they already were: check `charts_loaded()` first)."""
    _charts.start(on_loaded)


def thaw() -> None:
    """After the live view that imported the chart libraries: the heap frozen for the import (gc.freeze)
    goes back to the collections (a full one may then run: the live view is over)."""
    with _charts.lock:
        if _charts.done.is_set():
            _charts.thaw()
        elif _charts.thread is not None:  # still importing: the import thread thaws when it is done
            _charts.thaw_when_done = True


def wait_for_background_import(timeout: float = 60.0) -> None:
    """Before importing matplotlib on another thread: wait (up to `timeout` s) for the background import of the
    chart libraries, when one was started. Two threads importing the same modules at once race: one of them
    can find `matplotlib.ticker` partially initialized (an ImportError "most likely due to a circular import"),
    which left a short run's summary without its chart on a busy machine."""
    if _charts.thread is not None:
        _charts.done.wait(timeout)


def load_charts(timeout: float | None = None) -> bool:
    """Import the chart libraries now (or wait for the background import); whether they are loaded."""
    _charts.start(None)
    _charts.done.wait(timeout)
    thaw()  # no live view to protect: the caller waited
    return charts_loaded()
