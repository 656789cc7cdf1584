"""`Dashboard`: the live per-rank view of a launch, fed with the launcher's channel messages.

The launcher calls `dashboard(message)` (or `.observe(message)`) from its supervising thread for every
message, the thread that also forwards the ranks' output: the model is updated there and nothing else. The
view is redrawn by the dashboard's own thread, at most `max_redraws_per_second` times, as soon as the
throttle allows after a change (so a burst's last change is drawn too); the chart libraries are imported on
another thread at the first metric (background_drawing.py). Where it draws is chosen by `mode`:

- "widget": ipywidgets in a notebook (widget_view.py); at `finish` the widget's output is replaced by the
  static summary (an HTML table, then a PNG chart in the output reserved below it), so a saved notebook
  holds no widget output (no "model not found" when reopened) and the run shows once;
- "terminal": a rich live table (console.py);
- "html": without the `notebook` extra (ipywidgets, bqplot) in a notebook: the summary table as HTML, redrawn
  in place (a display handle, no widget), then the static summary; the chart is a PNG only with matplotlib;
- "plain": log lines, throttled (console.py);
- "auto": widget inside an IPython kernel with ipywidgets and bqplot, html in a kernel without them, terminal
  on a TTY, plain otherwise.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from . import background_drawing
from .dashboard_model import DashboardModel

MODES = ("auto", "widget", "html", "terminal", "plain")
INSTALL_HINT = "pip install nbaccel[notebook]"
_FALLBACK_HTML = (
    "<div class='nbaccel-dashboard-fallback'><i>nbaccel live dashboard of a run that was still going when "
    "the notebook was saved (an ipywidgets view; it needs the running kernel).</i></div>"
)
_FALLBACK_TEXT = "nbaccel live dashboard (the run was still going when this was saved)"
ENDED_ERROR = ("this Dashboard already showed a run that ended, and keeps its summary: pass a new Dashboard(...) "
               "to each launch (or dashboard=True)")


class Throttle:
    """Allows an action at most once every `min_interval` seconds; `delay()` says how long until next."""

    def __init__(self, min_interval: float, clock: Callable[[], float] = time.monotonic):
        self.min_interval = min_interval
        self.clock = clock
        self._last: float | None = None

    def ready(self) -> bool:
        return self.delay() <= 0

    def delay(self) -> float:
        if self._last is None:
            return 0.0
        return self._last + self.min_interval - self.clock()

    def mark(self) -> None:
        self._last = self.clock()


def in_notebook_kernel() -> bool:
    """Whether this process is an IPython kernel (Jupyter, Colab, VS Code), not a terminal IPython."""
    if "IPython" not in sys.modules:
        return False
    from IPython import get_ipython

    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def _ipython_running() -> bool:
    """Whether an IPython shell runs in this process (a kernel, or terminal IPython): display() has a publisher."""
    if "IPython" not in sys.modules:
        return False
    from IPython import get_ipython

    return get_ipython() is not None


def widgets_installed() -> bool:
    """Whether the widget view can be drawn: ipywidgets and bqplot (the `notebook` extra) are installed (found,
    not imported: bqplot imports pandas, a second the launch need not wait for)."""
    return all(_importable(name) for name in ("ipywidgets", "bqplot"))


def _importable(name: str) -> bool:
    """Whether `import name` would find a module (None in sys.modules: a blocked import, not found)."""
    try:
        return importlib.util.find_spec(name) is not None
    except ValueError:  # a module object without a spec in sys.modules (a frontend's or a test's): imported
        return True


def resolve_mode(mode: str) -> str:
    """The concrete view for `mode` ("auto" -> widget / terminal / plain, see the module docstring)."""
    if mode not in MODES:
        raise ValueError(f"Dashboard mode must be one of {', '.join(MODES)}; got {mode!r}")
    if mode == "widget" and not widgets_installed():
        raise ImportError(f"Dashboard(mode='widget') needs ipywidgets and bqplot: {INSTALL_HINT} "
                          "(or mode='html' / 'auto', which need neither)")
    if mode in ("widget", "html") and not _ipython_running():
        raise ValueError(f"Dashboard(mode={mode!r}) draws into a notebook's output, and this is plain Python (no "
                         "IPython): use mode='auto' (or dashboard=True), 'terminal' or 'plain'")
    if mode != "auto":
        return mode
    if in_notebook_kernel():
        return "widget" if widgets_installed() else "html"
    isatty = getattr(sys.stdout, "isatty", None)
    return "terminal" if isatty is not None and isatty() else "plain"


class Dashboard:
    """Live per-rank status, memory, throughput and logged metrics of a launch.

    `Dashboard(num_processes, title=None, total_steps=None, mode="auto", metrics=None)`; `start()` shows it,
    `observe(message)` (or calling the instance) feeds it a channel message, `finish(results, failures)`
    leaves a static summary, `close()` ends it (idempotent; a started dashboard is finished first, with
    `close(results=..., failures=...)` as the launcher calls it). Other keyword
    arguments (the launcher passes `start_method`, `world_size`, `rendezvous`, `device`) are shown in the header.
    `metrics`: the names of the logged metrics to chart and tabulate, in that order (default: the first 16
    logged; a run that logs one value per parameter would bury `loss`).
    """

    # the view a mode gives here, or why it cannot be drawn here: the launcher asks before any rank starts
    resolve_mode = staticmethod(resolve_mode)

    def __init__(
        self,
        num_processes: int,
        *,
        title: str | None = None,
        total_steps: int | None = None,
        mode: str = "auto",
        max_redraws_per_second: float = 5.0,
        plain_interval: float = 10.0,
        metrics: Sequence[str] | None = None,
        **launch_info: Any,
    ):
        if not (isinstance(max_redraws_per_second, (int, float)) and max_redraws_per_second > 0):
            raise ValueError(f"max_redraws_per_second must be a positive number, got {max_redraws_per_second!r}")
        if isinstance(plain_interval, bool) or not (isinstance(plain_interval, (int, float)) and plain_interval >= 0):
            raise ValueError(f"plain_interval must be a number of seconds >= 0, got {plain_interval!r}")
        self.model = DashboardModel(num_processes, title=title, total_steps=total_steps, info=launch_info,
                                    metrics=metrics)
        self.mode = resolve_mode(mode)
        self.plain_interval = plain_interval
        self.redraws = 0
        self._throttle = Throttle(1.0 / max_redraws_per_second)
        self._lock = threading.RLock()  # the model and the view: updated and drawn one thread at a time
        self._changed = threading.Event()  # something to draw: the model changed, or the charts can be built
        self._ended = threading.Event()  # finished or closed: the drawing thread stops
        self._charts_arrived = False
        self._drawer: threading.Thread | None = None
        self._view: Any = None
        self._display_handle: Any = None
        self._chart_handle: Any = None
        self._drawn_version = -1
        self._started = self._finished = self._closed = False
        self._broken = False

    # --- lifecycle -------------------------------------------------------------------------------------

    @property
    def ended(self) -> bool:
        """Whether this dashboard's run is over (finished or closed): it shows one run, and stays as it ended."""
        return self._finished or self._closed

    def start(self) -> Dashboard:
        """Show the dashboard (displays the widget, starts the live table or the log lines); again while
        running: nothing. RuntimeError once it ended: a dashboard shows one run."""
        with self._lock:
            if self.ended:
                raise RuntimeError(ENDED_ERROR)
            if self._started:
                return self
            self._started = True
            self._guard(self._create_view)
            self._drawn_version = self.model.version  # the throttle starts with the first change: drawn at once
            self._drawer = threading.Thread(target=self._draw_changes, name="nbaccel-dashboard", daemon=True)
            self._drawer.start()
        return self

    def observe(self, message: dict[str, Any]) -> None:
        """Apply one channel message to the model; the dashboard's thread redraws (throttled). Never raises."""
        with self._lock:
            if not self.model.update(message) or not self._started or self._finished:
                return
        self._changed.set()

    __call__ = observe

    def finish(self, results: list | None = None, failures: dict | None = None) -> None:
        """The launch is over: mark final states and leave the static summary on display."""
        with self._lock:
            self._end(results, failures)
        self.close()

    def close(self, results: list | None = None, failures: dict | None = None) -> None:
        """End the live view; what is displayed stays. A started dashboard not finished yet is finished
        first (static summary) with the launch's `results` / `failures` when given; ranks that never
        reported their end then show as failed ("stopped before reporting its end", e.g. an interrupt)."""
        try:
            with self._lock:
                if not self._finished and (self._started or results is not None or failures is not None):
                    self._end(results, failures)
        finally:  # even when a second Ctrl-C lands in the summary's drawing: the live view still ends
            with self._lock:
                if not self._closed:
                    self._closed = True
                    self._ended.set()
                    self._changed.set()  # the drawing thread wakes up and sees the end
                    if self.mode in ("html", "terminal", "plain") and self._view is not None:
                        self._guard(self._view.close)
            drawer = self._drawer  # joined outside the lock: it may be waiting for it
            if drawer is not None and drawer is not threading.current_thread():
                drawer.join(timeout=5)
            background_drawing.thaw()

    def _end(self, results: list | None, failures: dict | None) -> None:
        """Final states and the static summary (under the lock)."""
        if self._finished:
            return
        if not self._started:
            self.start()
        self.model.finish(results, failures)
        self._finished = True
        self._ended.set()
        self._redraw()
        self._guard(self._finish_view)

    def __enter__(self) -> Dashboard:
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is not None and not self._finished:
            self.finish(failures={s.rank: exc for s in self.model.ranks if not s.done})
        else:
            self.finish()

    # --- drawing ---------------------------------------------------------------------------------------

    def _create_view(self) -> None:
        if self.mode == "widget":
            from IPython.display import display

            _enable_colab_widgets()
            # The live view's place, then the summary chart's right below it (empty until the run ends), reserved
            # here; the dashboard's thread builds the widgets there (`import ipywidgets` takes 0.05-0.2 s that the
            # ranks' first lines would wait for on this thread).
            self._display_handle = display({"text/html": _FALLBACK_HTML, "text/plain": _FALLBACK_TEXT}, raw=True,
                                           display_id=True)
            self._chart_handle = display({"text/plain": ""}, raw=True, display_id=True)
        elif self.mode == "html":
            from .render import HtmlView

            self._view = HtmlView(self.model)
        elif self.mode == "terminal":
            from .console import RichView

            self._view = RichView(self.model)
        else:
            from .console import PlainView

            self._view = PlainView(self.model, interval=self.plain_interval)

    def _show_widget_view(self) -> None:
        """On the dashboard's thread: build the widget view (outside the lock), draw it and show it in its place."""
        with background_drawing.forks_wait():  # imports ipywidgets the first time
            from .widget_view import WidgetView

            view = WidgetView(None, on_charts_loaded=self._charts_loaded)
        with self._lock:
            if self._finished or self._closed:  # a run shorter than the build: its summary is shown already
                view.close()
                return
            self._view = view
            self._redraw()
            self._display_handle.update(view.mimebundle(_FALLBACK_HTML, _FALLBACK_TEXT), raw=True)

    def _finish_view(self) -> None:
        if self.mode == "widget":
            from .render import chart_text, metrics_png, png_bundle, summary_html, summary_text

            self._display_handle.update({"text/html": summary_html(self.model), "text/plain": summary_text(self.model)},
                                        raw=True)
            png = metrics_png(self.model)
            if png is not None:
                self._chart_handle.update(png_bundle(png, chart_text(self.model)), raw=True)
            if self._view is not None:  # its output is gone: free the widgets (and keep them out of saved widget state)
                self._view.close()
        elif self._view is not None:
            self._view.finish(self.model)

    def _redraw(self) -> None:
        if self._view is not None and not self._broken:
            self._guard(lambda: self._view.render(self.model))
        self._drawn_version = self.model.version
        self._throttle.mark()
        self.redraws += 1

    def _draw_changes(self) -> None:
        """The dashboard's thread: redraw after each change, no sooner than the throttle allows, until the end."""
        if self.mode == "widget":
            self._guard(self._show_widget_view)
        while True:
            self._changed.wait()
            delay = self._throttle.delay()
            if self._ended.is_set() or (delay > 0 and self._ended.wait(delay)):
                return
            self._changed.clear()  # a change from now on sets it again: drawn by the next round
            with background_drawing.forks_wait():
                self._prepare_view()
                with self._lock:
                    if self._finished or self._closed:
                        return
                    if self._drawn_version != self.model.version or self._charts_arrived:
                        self._charts_arrived = False
                        self._redraw()
                    if getattr(self._view, "charts_pending", False):  # a metric's chart still to build
                        self._charts_loaded()

    def _prepare_view(self) -> None:
        """What the view builds without the model (the widget view's charts): outside the lock, so `observe`
        (the launch's thread) never waits for it."""
        prepare = getattr(self._view, "prepare", None)
        if prepare is not None and not self._broken:
            self._guard(prepare)

    def _charts_loaded(self) -> None:
        """The chart libraries are imported (background_drawing.py): build the charts at the next redraw."""
        self._charts_arrived = True
        self._changed.set()

    def _guard(self, action: Callable[[], Any]) -> None:
        """Run a drawing action; a failure disables drawing (with one warning) instead of breaking the launch."""
        try:
            action()
        except Exception as error:  # the dashboard must never take a training run down
            if not self._broken:
                self._broken = True
                warnings.warn(f"nbaccel dashboard stopped drawing: {type(error).__name__}: {error}",
                              RuntimeWarning, stacklevel=3)


def _enable_colab_widgets() -> None:
    """Colab renders only its built-in widgets unless asked: turn on its custom widget manager (bqplot)."""
    if "google.colab" not in sys.modules:
        return
    try:
        from google.colab import output

        output.enable_custom_widget_manager()
    except Exception:  # an older Colab without it: the charts will not show, the rest does
        pass
