"""HTML for the dashboard: the live per-rank table, and the end-of-run summary (an HTML table and a PNG chart).

The summary is what the live view turns into when the run ends: ordinary outputs that need no widget
state, so they still render when the notebook is saved and reopened (trusted or not), in VS Code, on
GitHub and in nbconvert's HTML. The charts are a PNG image (`image/png`), not inline SVG: an untrusted
notebook's HTML sanitizer removes inline SVG and leaves its metadata as a line of text. They are drawn by
matplotlib's Agg canvas on a bare `Figure` (no pyplot, so the user's own plotting state and backend are
left alone).
"""

from __future__ import annotations

import base64
import html
import io
import math

from ..launch.messages import RankState
from . import background_drawing
from .dashboard_model import (
    MAX_SHOWN_METRICS,
    DashboardModel,
    device_memory_text,
    format_bytes,
    format_duration,
    format_rate,
    format_step,
    format_value,
    ram_text,
    status_text,
)

STATE_COLORS = {RankState.STARTING: "#8a8a8a", RankState.RUNNING: "#1f6feb", RankState.FINISHED: "#1a7f37",
                RankState.FAILED: "#cf222e"}
_TABLE_STYLE = (
    "border-collapse:collapse;font-family:var(--jp-code-font-family,monospace);font-size:12px;"
)
_CELL = "padding:2px 8px;border-bottom:1px solid #ddd;text-align:left;white-space:nowrap"


def _cell(text: str, extra: str = "", tag: str = "td") -> str:
    return f'<{tag} style="{_CELL};{extra}">{html.escape(text)}</{tag}>'


def _state_cell(state) -> str:
    color = STATE_COLORS.get(state.state, "#000")
    return _cell(status_text(state), f"color:{color};font-weight:600;white-space:normal;max-width:28em")


def _host_cell(model: DashboardModel, s) -> str:
    """The host column's cell of rank row `s`: only for a launch on several hosts (hosts=)."""
    if not model.shows_hosts:
        return ""
    return f'<td class="nbaccel-host" style="{_CELL}">{html.escape(s.host or "–")}</td>'


def _host_head(model: DashboardModel) -> list[str]:
    return ["host"] if model.shows_hosts else []


def rank_table_html(model: DashboardModel) -> str:
    """The live per-rank table: (host,) device, status, RAM and device memory, step and rate, last output."""
    total = model.total
    heads = ["rank", *_host_head(model), "device", "status", "RAM", "device memory", "step", "steps/s",
             "last output"]
    rows = []
    for s in model.ranks:
        rows.append(
            f"<tr class='nbaccel-rank' data-rank='{s.rank}' data-state='{s.state}'>"
            + _cell(str(s.rank))
            + _host_cell(model, s)
            + _cell(s.device or "–")
            + _state_cell(s)
            + _cell(ram_text(s))
            + _cell(device_memory_text(s))
            + _cell(format_step(s, total))
            + _cell(format_rate(s.steps_per_second))
            + _last_output_cell(s.last_output or "")
            + "</tr>"
        )
    head = "".join(_cell(h, "font-weight:600", "th") for h in heads)
    return f'<table class="nbaccel-ranks" style="{_TABLE_STYLE}"><tr>{head}</tr>{"".join(rows)}</table>'


def _last_output_cell(text: str) -> str:
    """The rank's last line: its spacing kept (a progress bar's columns), cut with an ellipsis at the
    column's width; the whole line in the cell's tooltip."""
    return (f'<td class="nbaccel-last-output" title="{html.escape(text)}" style="{_CELL};white-space:pre;'
            f'max-width:36em;overflow:hidden;text-overflow:ellipsis">{html.escape(text)}</td>')


def metric_table_html(model: DashboardModel, name: str) -> str:
    """The latest value of metric `name` on each rank, and their mean."""
    series = model.metrics.get(name)
    if series is None:
        return ""
    last = series.last_by_rank()
    heads = ["", "mean"] + [f"rank {r}" for r in sorted(last)]
    mean = sum(last.values()) / len(last) if last else None
    values = [name, format_value(mean)] + [format_value(last[r]) for r in sorted(last)]
    return (
        f'<table class="nbaccel-metric" style="{_TABLE_STYLE}"><tr>'
        + "".join(_cell(h, "font-weight:600", "th") for h in heads)
        + "</tr><tr>"
        + "".join(_cell(v) for v in values)
        + "</tr></table>"
    )


def header_html(model: DashboardModel) -> str:
    state = model.overall_state
    color = STATE_COLORS.get(state, "#000")
    parts = [f"<b>{html.escape(model.title)}</b>",
             f"<span style='color:{color};font-weight:600'>{state}</span>",
             f"{len(model.ranks)} process{'es' if len(model.ranks) != 1 else ''}"]
    parts += [f"{html.escape(str(key))} {html.escape(_info_text(value))}" for key, value in model.info.items()]
    if model.hidden_metrics:
        parts.append(html.escape(hidden_metrics_text(model)))
    if model.wall_time is not None:
        parts.append(f"wall time {format_duration(model.wall_time)}")
    return "<div class='nbaccel-header' style='font-family:sans-serif'>" + " · ".join(parts) + "</div>"


def _info_text(value) -> str:
    """A header field's value: a list (the hosts) as `a, b`."""
    return ", ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def metrics_png(model: DashboardModel, *, width: float = 4.0, height: float = 2.6, dpi: int = 100) -> bytes | None:
    """A PNG with one line chart per logged metric, side by side: the mean across ranks, each rank thin
    behind it (None when nothing was logged)."""
    names = model.shown_metrics()
    if not names:
        return None
    background_drawing.wait_for_background_import()  # a live view's import of the same modules may still run
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:  # without the `notebook` extra: the summary table has the last values, no chart
        return None

    columns = min(len(names), 3)
    rows = math.ceil(len(names) / columns)
    figure = Figure(figsize=(width * columns, height * rows), dpi=dpi)
    FigureCanvasAgg(figure)
    for index, name in enumerate(names):
        draw_metric(figure.add_subplot(rows, columns, index + 1), model, name)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


def draw_metric(axes, model: DashboardModel, name: str) -> None:
    """Metric `name` on matplotlib `axes`: whole-number step ticks, and a y axis that fits the values (a
    metric that is never negative does not get a negative axis)."""
    from matplotlib.ticker import MaxNLocator

    series = model.metrics[name]
    ranks = sorted({r for values in series.points.values() for r in values})
    if len(ranks) > 1:
        for rank in ranks:
            xs = [x for x in sorted(series.points) if rank in series.points[x]]
            axes.plot(xs, [series.points[x][rank] for x in xs], linewidth=0.8, alpha=0.35,
                      label=f"rank {rank}")
    axes.set_title(name, fontsize=10)
    xs, means = series.mean_series(max_points=2000)
    if not xs:  # only NaN or inf logged: nothing to plot
        axes.text(0.5, 0.5, "no finite value logged", ha="center", va="center", transform=axes.transAxes)
        return
    axes.plot(xs, means, color="#1f6feb", linewidth=1.8, marker="o" if len(xs) < 30 else None,
              markersize=3, label="mean")
    axes.set_xlabel("step", fontsize=8)
    axes.tick_params(labelsize=7)
    axes.xaxis.set_major_locator(MaxNLocator(nbins=6, integer=True))
    axes.yaxis.set_major_locator(MaxNLocator(nbins=5))
    axes.grid(alpha=0.3)
    low, high = y_range([v for values in series.points.values() for v in values.values()])
    axes.set_ylim(low, high)
    if len(ranks) > 1:
        axes.legend(fontsize=6, loc="best", frameon=False)


def y_range(values: list[float]) -> tuple[float, float]:
    """(bottom, top) of a y axis for `values`: their range plus 5 % each side, not below 0 for values that
    are all >= 0, and a visible band for a constant series."""
    low, high = min(values), max(values)
    span = high - low or abs(high) or 1.0
    bottom, top = low - 0.05 * span, high + 0.05 * span
    if low >= 0 > bottom:
        bottom = 0.0
    return bottom, top


def nice_ticks(low: float, high: float, *, integer: bool = False, count: int = 5) -> list[float]:
    """About `count` round tick values inside [low, high] (matplotlib's tick locator)."""
    from matplotlib.ticker import MaxNLocator

    ticks = MaxNLocator(nbins=count, integer=integer).tick_values(low, high)
    span = (high - low) or 1.0
    return [round(float(t), 12) for t in ticks if low - 1e-9 * span <= t <= high + 1e-9 * span]


def hidden_metrics_text(model: DashboardModel) -> str:
    """What the views say of the metrics they leave out (see MAX_SHOWN_METRICS), and how to choose others."""
    if model.chosen_metrics is not None:
        return f"{len(model.metrics)} metrics logged: the chosen ones are shown ({model.hidden_metrics} left out)"
    return (f"{len(model.metrics)} metrics logged: only the first {MAX_SHOWN_METRICS} are shown "
            f"({model.hidden_metrics} left out; Dashboard(..., metrics=[...]) chooses them)")


def chart_text(model: DashboardModel) -> str:
    """The text form of the end-of-run chart: which metrics it draws."""
    return f"{model.title}: chart of {', '.join(model.shown_metrics())}"


def png_bundle(png: bytes, text: str) -> dict[str, str]:
    """Display data of a PNG image (base64, as Jupyter stores it) with its text form."""
    return {"image/png": base64.b64encode(png).decode("ascii"), "text/plain": text}


def summary_html(model: DashboardModel) -> str:
    """The end-of-run summary table: final status, wall time, steps, peak memory per rank, last metrics (the
    charts are a PNG output of their own: `metrics_png`)."""
    summary = model.summary()
    heads = ["rank", *_host_head(model), "device", "status", "steps", "steps/s", "peak RAM",
             "peak device memory"]
    names = model.shown_metrics()
    heads += names
    rows = []
    for s, info in zip(model.ranks, summary["ranks"]):
        cells = [
            _cell(str(s.rank)), _host_cell(model, s), _cell(s.device or "–"), _state_cell(s),
            _cell(format_step(s, model.total)),
            _cell(format_rate(s.steps_per_second)), _cell(format_bytes(s.rss_peak)),
            _cell(format_bytes(s.device_peak)),
        ]
        cells += [_cell(format_value(info["metrics"].get(name))) for name in names]
        rows.append(f"<tr class='nbaccel-rank' data-rank='{s.rank}' data-state='{s.state}'>{''.join(cells)}</tr>")
    if names and len(model.ranks) > 1:
        means = [summary["metrics"][name]["mean"] for name in names]
        rows.append(
            "<tr>" + _cell("mean", "font-weight:600") + _cell("") * (len(heads) - len(names) - 1)
            + "".join(_cell(format_value(m)) for m in means) + "</tr>"  # NaN: a rank's metric went NaN
        )
    table = (
        f'<table class="nbaccel-summary-ranks" style="{_TABLE_STYLE}"><tr>'
        + "".join(_cell(h, "font-weight:600", "th") for h in heads)
        + "</tr>" + "".join(rows) + "</table>"
    )
    return (f"<div class='nbaccel-summary' data-state='{summary['state']}' style='margin:4px 0'>"
            f"{header_html(model)}{table}</div>")


def summary_text(model: DashboardModel) -> str:
    """The summary as plain text lines (for text/plain outputs and logs)."""
    lines = [f"{model.title}: {model.overall_state}, wall time {format_duration(model.wall_time)}"]
    if model.hidden_metrics:
        lines[0] += f"; {hidden_metrics_text(model)}"
    names = model.shown_metrics()
    for s in model.ranks:
        metrics = " ".join(f"{k}={format_value(s.metrics[k])}" for k in names if k in s.metrics)
        where = f"{s.host} " if s.host else ""
        lines.append(
            f"  rank {s.rank} [{where}{s.device or '?'}] {status_text(s)}; step {format_step(s, model.total)}; "
            f"peak RAM {format_bytes(s.rss_peak)}; peak device {format_bytes(s.device_peak)}"
            + (f"; {metrics}" if metrics else "")
        )
    return "\n".join(lines)


class HtmlView:
    """The dashboard in a notebook without ipywidgets: the summary table as one HTML output, redrawn in place
    through a display handle (`update_display_data`, which every frontend and nbclient apply), so the saved
    notebook holds its last frame; `finish` leaves the summary and, with matplotlib, the chart below it."""

    def __init__(self, model: DashboardModel):
        from IPython.display import display

        self._handle = display(self._bundle(model), raw=True, display_id=True)
        self._chart = display({"text/plain": ""}, raw=True, display_id=True)

    @staticmethod
    def _bundle(model: DashboardModel) -> dict[str, str]:
        return {"text/html": summary_html(model), "text/plain": summary_text(model)}

    def render(self, model: DashboardModel) -> None:
        self._handle.update(self._bundle(model), raw=True)

    def finish(self, model: DashboardModel) -> None:
        self.render(model)
        png = metrics_png(model)
        if png is not None:
            self._chart.update(png_bundle(png, chart_text(model)), raw=True)

    def close(self) -> None:
        pass
