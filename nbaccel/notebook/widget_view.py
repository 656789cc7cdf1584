"""The dashboard as ipywidgets: a per-rank table, a progress bar and a live line chart per logged metric.

Charts use bqplot. It is built on ipywidgets itself (its marks are widgets, so a redraw sends only the new
x/y arrays over the comm and the browser re-renders the line: no image round trip, no second widget
framework), it is maintained by the Jupyter community, ships its JupyterLab / Notebook 7 extension inside
the wheel, and loads from the widget CDN in VS Code and Colab. plotly's FigureWidget would need anywidget
and a much larger JavaScript bundle; ipympl re-renders PNG frames on the kernel side for every update.
At the end of the run the dashboard replaces this view's output with the static summary (render.py: HTML
and a PNG chart), which needs no widget state.

Kernel side only: workers never import this module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ipywidgets as widgets

from ..launch.messages import RankState
from . import background_drawing, render
from .dashboard_model import DashboardModel, MetricSeries

MAX_CHART_POINTS = 500  # the live chart averages longer series down to this many points
CHART_COLOR = "#1f6feb"


class _Chart:
    """The live chart of one metric: a bqplot line of the mean across ranks (bqplot imported by now)."""

    def __init__(self, name: str):
        import bqplot

        # Scales fitted to the data in `update` (no padding: bqplot's would put ticks at -1 and below 0).
        x_scale, y_scale = bqplot.LinearScale(allow_padding=False), bqplot.LinearScale(allow_padding=False)
        self.x_scale, self.y_scale = x_scale, y_scale
        self.x_axis = bqplot.Axis(scale=x_scale, label="step", tick_format="d")
        self.y_axis = bqplot.Axis(scale=y_scale, side="left", tick_format=".3~g")
        self.line = bqplot.Lines(
            x=[], y=[], scales={"x": x_scale, "y": y_scale}, colors=[CHART_COLOR], stroke_width=2,
            labels=[f"{name} (mean)"],
        )
        self.points = bqplot.Scatter(
            x=[], y=[], scales={"x": x_scale, "y": y_scale}, colors=[CHART_COLOR], default_size=12,
            tooltip=bqplot.Tooltip(fields=["x", "y"], labels=["step", f"mean {name}"], formats=["", ".4g"]),
        )
        self.figure = bqplot.Figure(
            marks=[self.line, self.points],
            axes=[self.x_axis, self.y_axis],
            title=name,
            fig_margin={"top": 44, "bottom": 36, "left": 56, "right": 20},
            layout=widgets.Layout(width="380px", height="240px"),
            animation_duration=0,
        )
        self.figure.add_class("nbaccel-chart")
        self.widgets = [x_scale, y_scale, self.line, self.points, self.points.tooltip, *self.figure.axes,
                        self.figure]

    def update(self, series: MetricSeries) -> None:
        xs, ys = series.mean_series(max_points=MAX_CHART_POINTS)
        if xs:
            low, high = render.y_range(ys)
            first, last = float(xs[0]), float(max(xs[-1], xs[0] + 1))
            with self.x_scale.hold_sync(), self.y_scale.hold_sync():
                self.x_scale.min, self.x_scale.max = first, last
                self.y_scale.min, self.y_scale.max = float(low), float(high)
            # round ticks (1, 20, 40 ... and 0, 0.25, 0.5 ...), not bqplot's even splits of the range
            self.x_axis.tick_values = render.nice_ticks(first, last, integer=True)
            self.y_axis.tick_values = render.nice_ticks(low, high)
        with self.line.hold_sync(), self.points.hold_sync():
            self.line.x, self.line.y = xs, ys
            # Hover markers only while the series is short enough for a marker per point to stay readable.
            self.points.x, self.points.y = (xs, ys) if len(xs) <= 100 else ([], [])


class _MetricPanel:
    """One metric: its chart above a table of each rank's last value. The table is drawn from the first
    value on; the chart is added once the chart libraries are imported (background_drawing.py)."""

    def __init__(self, name: str):
        self.name = name
        self.table = widgets.HTML()
        self.box = widgets.VBox([self.table])
        self.chart: _Chart | None = None

    @property
    def widgets(self) -> list[Any]:
        return [self.table, self.box, *(self.chart.widgets if self.chart else ())]

    def attach(self, chart: _Chart) -> None:
        self.chart = chart
        self.box.children = (chart.figure, self.table)

    def update(self, model: DashboardModel) -> None:
        self.table.value = render.metric_table_html(model, self.name)
        if self.chart is not None:
            self.chart.update(model.metrics[self.name])


class WidgetView:
    """The live dashboard widget tree; `render(model)` brings it up to date.

    `on_charts_loaded`: the chart libraries are imported in the background at the first metric and this is
    called when they are; `prepare()` then builds the charts (a few dozen ms of widget creation, done outside
    the dashboard's lock so the launch's thread never waits for it) and the next `render` shows them. None:
    the libraries are imported and the charts built in `render` itself."""

    def __init__(self, model: DashboardModel | None, on_charts_loaded: Callable[[], None] | None = None):
        self.on_charts_loaded = on_charts_loaded
        self.header = widgets.HTML()
        self.table = widgets.HTML()
        self.progress = widgets.FloatProgress(
            value=0.0, min=0.0, max=1.0, description="progress", bar_style="info",
            layout=widgets.Layout(width="420px", display="none"),
        )
        self.progress_text = widgets.Label(layout=widgets.Layout(display="none"))
        self.charts = widgets.Box(layout=widgets.Layout(flex_flow="row wrap"))
        self.panels: dict[str, _MetricPanel] = {}
        self._built: dict[str, _Chart] = {}  # charts `prepare` built, for `render` to show
        self._closed = False
        self.root = widgets.VBox(
            [self.header, self.table, widgets.HBox([self.progress, self.progress_text]), self.charts]
        )
        self.root.add_class("nbaccel-dashboard")
        if model is not None:  # None: the widgets only (the dashboard renders under its lock)
            self.render(model)

    def render(self, model: DashboardModel) -> None:
        self.header.value = render.header_html(model)
        self.table.value = render.rank_table_html(model)
        progress = model.progress
        if progress is not None:
            self.progress.layout.display = self.progress_text.layout.display = None
            self.progress.value = progress
            self.progress.bar_style = {RankState.FAILED: "danger", RankState.FINISHED: "success"}.get(model.overall_state, "info")
            self.progress_text.value = model.progress_text()
        for name in model.shown_metrics():
            if name not in self.panels:
                self.panels[name] = _MetricPanel(name)
                self.charts.children = tuple(panel.box for panel in self.panels.values())
            panel = self.panels[name]
            if panel.chart is None:
                chart = self._built.pop(name, None)
                if chart is None and self.on_charts_loaded is None and background_drawing.load_charts():
                    chart = _Chart(name)
                if chart is not None:
                    panel.attach(chart)
                elif not background_drawing.charts_loaded():
                    background_drawing.load_charts_in_background(self.on_charts_loaded)
            panel.update(model)

    @property
    def charts_pending(self) -> bool:
        """A metric shown without its chart although the libraries are loaded: `prepare` has work."""
        return background_drawing.charts_loaded() and any(p.chart is None for p in list(self.panels.values()))

    def prepare(self) -> None:
        """Build the charts of the metrics shown so far, once their libraries are imported (no model needed)."""
        if not background_drawing.charts_loaded():
            return
        for name, panel in list(self.panels.items()):
            if panel.chart is None and name not in self._built and not self._closed:
                chart = _Chart(name)
                if self._closed:  # the run ended meanwhile
                    _close_widgets(chart.widgets)
                else:
                    self._built[name] = chart

    def mimebundle(self, fallback_html: str, fallback_text: str) -> dict[str, Any]:
        """The widget's display data plus text/html and text/plain fallbacks for frontends without its
        widget state (instead of ipywidgets' `VBox(children=...)` repr)."""
        data = self.root._repr_mimebundle_()
        data = dict(data[0] if isinstance(data, tuple) else data)
        data["text/html"] = fallback_html
        data["text/plain"] = fallback_text
        return data

    def close(self) -> None:
        """Close every widget of the view (their models leave the kernel and the saved widget state)."""
        self._closed = True
        own = [self.header, self.table, self.progress, self.progress_text, self.charts, self.root,
               *self.root.children]
        for panel in self.panels.values():
            own += panel.widgets
        for chart in list(self._built.values()):
            own += chart.widgets
        _close_widgets(own)


def _close_widgets(own: list[Any]) -> None:
    for widget in own:
        for part in (getattr(widget, "layout", None), getattr(widget, "style", None)):
            if isinstance(part, widgets.Widget):
                part.close()
        widget.close()
