"""HTML for the dashboard: the live per-rank table and the static end-of-run summary with SVG charts.

The summary is plain HTML with inline SVG, displayed as an ordinary output: it needs no widget state, so
it still renders when the notebook is saved and reopened, in nbviewer, on GitHub, or exported. The charts
are drawn by matplotlib's SVG backend on a bare `Figure` (no pyplot, so the user's own plotting state and
backend are left alone).
"""

from __future__ import annotations

import html
import io
import math

from .dashboard_model import (
    DashboardModel,
    device_memory_text,
    format_bytes,
    format_duration,
    format_rate,
    format_step,
    format_value,
    host_memory_text,
    status_text,
)

STATE_COLORS = {"starting": "#8a8a8a", "running": "#1f6feb", "finished": "#1a7f37", "failed": "#cf222e"}
_TABLE_STYLE = (
    "border-collapse:collapse;font-family:var(--jp-code-font-family,monospace);font-size:12px;"
)
_CELL = "padding:2px 8px;border-bottom:1px solid #ddd;text-align:left;white-space:nowrap"


def _cell(text: str, extra: str = "", tag: str = "td") -> str:
    return f'<{tag} style="{_CELL};{extra}">{html.escape(text)}</{tag}>'


def _state_cell(state) -> str:
    color = STATE_COLORS.get(state.state, "#000")
    return _cell(status_text(state), f"color:{color};font-weight:600;white-space:normal;max-width:28em")


def rank_table_html(model: DashboardModel) -> str:
    """The live per-rank table: device, status, host and device memory, step and rate, last output."""
    total = model.total
    heads = ["rank", "device", "status", "host memory", "device memory", "step", "steps/s", "last output"]
    rows = []
    for s in model.ranks:
        rows.append(
            f"<tr class='nbaccel-rank' data-rank='{s.rank}' data-state='{s.state}'>"
            + _cell(str(s.rank))
            + _cell(s.device or "–")
            + _state_cell(s)
            + _cell(host_memory_text(s))
            + _cell(device_memory_text(s))
            + _cell(format_step(s, total))
            + _cell(format_rate(s.steps_per_second))
            + _cell(s.last_output or "", "max-width:32em;overflow:hidden;text-overflow:ellipsis")
            + "</tr>"
        )
    head = "".join(_cell(h, "font-weight:600", "th") for h in heads)
    return f'<table class="nbaccel-ranks" style="{_TABLE_STYLE}"><tr>{head}</tr>{"".join(rows)}</table>'


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
    parts += [f"{html.escape(str(key))} {html.escape(str(value))}" for key, value in model.info.items()]
    if model.wall_time is not None:
        parts.append(f"wall time {format_duration(model.wall_time)}")
    return "<div class='nbaccel-header' style='font-family:sans-serif'>" + " · ".join(parts) + "</div>"


def metric_svg(model: DashboardModel, name: str, *, width: float = 4.0, height: float = 2.4) -> str:
    """An inline SVG line chart of metric `name`: the mean across ranks, and each rank thin behind it."""
    from matplotlib.backends.backend_svg import FigureCanvasSVG
    from matplotlib.figure import Figure

    series = model.metrics[name]
    figure = Figure(figsize=(width, height), dpi=72)
    FigureCanvasSVG(figure)
    axes = figure.add_subplot()
    ranks = sorted({r for values in series.points.values() for r in values})
    if len(ranks) > 1:
        for rank in ranks:
            xs = [x for x in sorted(series.points) if rank in series.points[x]]
            axes.plot(xs, [series.points[x][rank] for x in xs], linewidth=0.8, alpha=0.35,
                      label=f"rank {rank}")
    xs, means = series.mean_series(max_points=2000)
    axes.plot(xs, means, color="#1f6feb", linewidth=1.8, marker="o" if len(xs) < 30 else None,
              markersize=3, label="mean")
    axes.set_title(name, fontsize=10)
    axes.set_xlabel("step", fontsize=8)
    axes.tick_params(labelsize=7)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    buffer = io.StringIO()
    figure.savefig(buffer, format="svg")
    svg = buffer.getvalue()
    return svg[svg.index("<svg"):]  # drop the XML prolog and doctype: inline in HTML


def summary_html(model: DashboardModel, *, charts: bool = True) -> str:
    """The end-of-run summary: final status, wall time, steps, peak memory per rank, last metrics, charts."""
    summary = model.summary()
    heads = ["rank", "device", "status", "steps", "steps/s", "peak host memory", "peak device memory"]
    names = sorted(summary["metrics"])
    heads += names
    rows = []
    for s, info in zip(model.ranks, summary["ranks"]):
        cells = [
            _cell(str(s.rank)), _cell(s.device or "–"), _state_cell(s), _cell(format_step(s, model.total)),
            _cell(format_rate(s.steps_per_second)), _cell(format_bytes(s.rss_peak)),
            _cell(format_bytes(s.device_peak)),
        ]
        cells += [_cell(format_value(info["metrics"].get(name))) for name in names]
        rows.append(f"<tr class='nbaccel-rank' data-rank='{s.rank}' data-state='{s.state}'>{''.join(cells)}</tr>")
    if names and len(model.ranks) > 1:
        means = [summary["metrics"][name]["mean"] for name in names]
        rows.append(
            "<tr>" + _cell("mean", "font-weight:600") + _cell("") * 6
            + "".join(_cell(format_value(None if math.isnan(m) else m)) for m in means) + "</tr>"
        )
    table = (
        f'<table class="nbaccel-summary-ranks" style="{_TABLE_STYLE}"><tr>'
        + "".join(_cell(h, "font-weight:600", "th") for h in heads)
        + "</tr>" + "".join(rows) + "</table>"
    )
    chart_html = ""
    if charts and names:
        chart_html = "<div style='display:flex;flex-wrap:wrap;gap:8px'>" + "".join(
            f"<div class='nbaccel-chart'>{metric_svg(model, name)}</div>" for name in names
        ) + "</div>"
    title = html.escape(model.title)
    state = summary["state"]
    return (
        f"<div class='nbaccel-summary' data-state='{state}' style='margin:4px 0'>"
        f"<div style='font-family:sans-serif;margin-bottom:4px'><b>{title}</b> · summary · "
        f"<span style='color:{STATE_COLORS.get(state, '#000')};font-weight:600'>{state}</span>"
        f" · wall time {format_duration(summary['wall_time'])}</div>"
        f"{table}{chart_html}</div>"
    )


def summary_text(model: DashboardModel) -> str:
    """The summary as plain text lines (for text/plain outputs and logs)."""
    lines = [f"{model.title}: {model.overall_state}, wall time {format_duration(model.wall_time)}"]
    for s in model.ranks:
        metrics = " ".join(f"{k}={format_value(v)}" for k, v in sorted(s.metrics.items()))
        lines.append(
            f"  rank {s.rank} [{s.device or '?'}] {status_text(s)}; step {format_step(s, model.total)}; "
            f"peak host {format_bytes(s.rss_peak)}; peak device {format_bytes(s.device_peak)}"
            + (f"; {metrics}" if metrics else "")
        )
    return "\n".join(lines)
