"""The dashboard outside a notebook: a rich live table on a terminal, plain log lines without one.

`RichView` redraws a `rich.live.Live` table in place (per-rank status, memory, step rate, last output,
logged metrics with a sparkline of their mean) and leaves its last frame on screen as the summary. Prints
from this process while it is live go above the table (rich redirects stdout/stderr). `PlainView` is for
logs and CI: a line when a rank changes state, a progress line per rank at most every `interval` seconds,
and a summary at the end.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

from ..launch.messages import RankState
from .dashboard_model import (
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
from .render import summary_text

_STYLES = {RankState.STARTING: "dim", RankState.RUNNING: "bold blue", RankState.FINISHED: "bold green",
           RankState.FAILED: "bold red"}
_SPARK = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], width: int = 30) -> str:
    """The last `width` values as a row of block characters scaled between their min and max."""
    values = values[-width:]
    if not values:
        return ""
    low, high = min(values), max(values)
    span = high - low
    if span <= 0:
        return _SPARK[3] * len(values)
    return "".join(_SPARK[min(len(_SPARK) - 1, int((v - low) / span * len(_SPARK)))] for v in values)


def rich_renderable(model: DashboardModel):
    """The dashboard as rich renderables: header, per-rank table, progress, metrics table."""
    from rich.console import Group
    from rich.progress_bar import ProgressBar
    from rich.table import Table
    from rich.text import Text

    state = model.overall_state
    header = Text.assemble(
        (model.title, "bold"), " · ", (state, _STYLES.get(state, "")),
        f" · {len(model.ranks)} processes · wall time {format_duration(model.wall_time)}",
    )
    table = Table(expand=False, show_edge=False, pad_edge=False)
    hosts = model.shows_hosts  # a launch on several hosts (hosts=): a host column
    columns = ("rank", *(("host",) if hosts else ()), "device", "status", "RAM now/peak",
               "device alloc/reserved/peak", "step", "steps/s", "last output")
    for column in columns:
        table.add_column(column, no_wrap=column != "last output", overflow="ellipsis",
                         max_width=40 if column == "last output" else None)
    for s in model.ranks:
        table.add_row(
            str(s.rank), *((s.host or "–",) if hosts else ()), s.device or "–",
            Text(status_text(s), style=_STYLES.get(s.state, "")),
            _compact(s.rss, s.rss_peak),
            _compact(s.device_allocated, s.device_reserved if s.device_reserved is not None else s.device_limit,
                     s.device_peak),
            format_step(s, model.total),
            format_rate(s.steps_per_second), s.last_output,
        )
    parts = [header, table]
    progress = model.progress
    if progress is not None:
        parts.append(Group(ProgressBar(total=1.0, completed=progress, width=50), Text(model.progress_text())))
    if model.metrics:
        metrics = Table(show_edge=False, pad_edge=False)
        ranks = sorted({r for series in model.metrics.values() for r in series.last_by_rank()})
        for column in ["metric", "mean", *[f"rank {r}" for r in ranks], "trend (mean)"]:
            metrics.add_column(column, no_wrap=True)
        for name in model.shown_metrics():
            series = model.metrics[name]
            last = series.last_by_rank()
            _, means = series.mean_series()
            mean = sum(last.values()) / len(last) if last else None
            metrics.add_row(name, format_value(mean), *[format_value(last.get(r)) for r in ranks],
                            sparkline(means))
        parts.append(metrics)
    return Group(*parts)


def _compact(*values: int | None) -> str:
    """'1.2G/2.0G': byte counts in a narrow terminal column; '–' when none is known, '–/2.0G' when only the
    first is not (a rank that ended before its first sample sends its peak alone)."""
    if all(v is None for v in values):
        return "–"
    first = "–" if values[0] is None else _short_bytes(values[0])
    return "/".join([first, *(_short_bytes(v) for v in values[1:] if v is not None)])


def _short_bytes(value: int) -> str:
    return format_bytes(value).replace(" ", "").replace("iB", "")


class RichView:
    """A live table redrawn in place on a terminal."""

    def __init__(self, model: DashboardModel, console=None):
        from rich.console import Console
        from rich.live import Live

        self.console = console or Console()
        self.live = Live(rich_renderable(model), console=self.console, auto_refresh=False, transient=False,
                         redirect_stdout=True, redirect_stderr=True)
        self.live.start(refresh=True)

    def render(self, model: DashboardModel) -> None:
        self.live.update(rich_renderable(model), refresh=True)

    def finish(self, model: DashboardModel) -> None:
        self.render(model)  # the last frame stays on screen: it is the summary
        self.close()

    def close(self) -> None:
        if self.live.is_started:
            self.live.stop()


class PlainView:
    """Log lines: state changes at once, per-rank progress at most every `interval` seconds."""

    def __init__(self, model: DashboardModel, stream: TextIO | None = None, *, interval: float = 10.0,
                 clock: Callable[[], float] = time.monotonic):
        self.stream = stream
        self.interval = interval
        self.clock = clock
        self._states: dict[int, str] = {}
        self._last_progress = clock()
        self.render(model)

    def _write(self, line: str) -> None:
        stream = self.stream or sys.stdout
        stream.write(line + "\n")
        stream.flush()

    def render(self, model: DashboardModel) -> None:
        for s in model.ranks:
            if self._states.get(s.rank) != s.state:
                self._states[s.rank] = s.state
                device = f" on {s.device}" if s.device else ""
                if s.host:
                    device = f" on {s.host}" + (f" ({s.device})" if s.device else "")
                self._write(f"[{model.title}] rank {s.rank}{device}: {status_text(s)}")
        now = self.clock()
        if now - self._last_progress >= self.interval:
            self._last_progress = now
            for s in model.ranks:
                if s.state == RankState.RUNNING:
                    self._write(self._progress_line(model, s))

    @staticmethod
    def _progress_line(model: DashboardModel, s) -> str:
        metrics = " ".join(f"{k}={format_value(s.metrics[k])}" for k in model.shown_metrics() if k in s.metrics)
        line = (f"[{model.title}] rank {s.rank}: step {format_step(s, model.total)} "
                f"({format_rate(s.steps_per_second)}), RAM {ram_text(s)}")
        if s.device_allocated is not None:
            line += f", device {device_memory_text(s)}"
        return line + (f", {metrics}" if metrics else "")

    def finish(self, model: DashboardModel) -> None:
        self.render(model)
        self._write(summary_text(model))

    def close(self) -> None:
        pass
