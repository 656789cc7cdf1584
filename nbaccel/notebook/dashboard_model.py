"""The dashboard's state, updated from channel messages: no widgets, no terminal, no clock of its own.

Every view (ipywidgets, rich, plain lines, the static HTML summary) reads this model, so what a run looks
like is decided once and tested without a display. Message kinds and fields are those of
docs/internals.md ("The channel"); times come from the messages, so a recorded stream replays the same.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..launch.messages import LaunchState, MessageKind, RankState

STATES = (RankState.STARTING, RankState.RUNNING, RankState.FINISHED, RankState.FAILED)  # the ones shown
# What a rank that never reported its end shows, by how the launch ended (a `launch` message's state).
STOPPED_BY = {LaunchState.INTERRUPTED: "stopped: the launch was interrupted",
              LaunchState.TIMEOUT: "stopped: the launch timed out"}
NOT_REPORTED = "stopped before reporting its end"
RATE_WINDOW_S = 5.0  # steps per second: measured over the last few seconds of step reports
# The views chart and tabulate the first metrics logged, this many: a run that logs thousands of names (one per
# parameter) would otherwise take minutes to draw (matplotlib: about 0.1 s a chart) into tables no one can read.
MAX_SHOWN_METRICS = 16
# Points a metric keeps in the kernel: past it, neighbouring points are averaged in pairs. A loop that logs every
# iteration (tens of thousands a second) would otherwise grow the kernel's memory without end, and every redraw,
# which sorts and averages the whole series under the dashboard's lock, would take seconds.
MAX_SERIES_POINTS = 10_000
# Rows the table grows to for ranks beyond num_processes (a larger world): a message naming rank 10**9 (a custom
# channel's bug) would otherwise build a billion rows, the kernel's memory and time gone.
MAX_RANK_ROWS = 65_536


@dataclass
class RankRow:
    """What the dashboard knows of one rank (one row of the table)."""

    rank: int
    device: str = ""
    host: str = ""  # a launch on several hosts (hosts=): the host, as named there
    state: RankState = RankState.STARTING
    error: str | None = None
    rss: int | None = None
    rss_peak: int | None = None
    device_allocated: int | None = None
    device_reserved: int | None = None
    device_peak: int | None = None
    device_limit: int | None = None
    step: int = 0
    total: int | None = None  # the run's optimizer steps, when the training code reported them
    epoch: int | None = None  # where the data loader was at the latest step: epoch (from 0, as shown),
    batch: int | None = None  # batches of it done,
    batches: int | None = None  # and the epoch's batches
    steps_per_second: float | None = None
    last_output: str = ""
    busy: bool = False  # the rank printed, stepped or logged: past its set-up (imports, joining the group)
    metrics: dict[str, float] = field(default_factory=dict)
    first_seen: float | None = None
    last_seen: float | None = None
    _rate_window: deque = field(default_factory=lambda: deque(maxlen=256), repr=False)

    @property
    def done(self) -> bool:
        return self.state in (RankState.FINISHED, RankState.FAILED)


@dataclass
class MetricSeries:
    """One logged metric: for each x (the logged step, or the n-th log when no step was given) the value
    of every rank that logged it there."""

    name: str
    points: dict[float, dict[int, float]] = field(default_factory=dict)
    latest: dict[int, float] = field(default_factory=dict)  # each rank's last logged value, NaN and inf included
    _count: dict[int, int] = field(default_factory=dict, repr=False)

    def add(self, rank: int, value: float, step: int | None, logs: int = 1) -> None:
        """Record a logged value: charted when finite; a NaN or inf is only each rank's latest value (a loss
        gone NaN must show as such in the tables, not as its last finite value). `logs`: how many logs the
        value stands for (a rank averages a flood of them, telemetry.merge_logs), counted for a stepless x."""
        count = self._count.get(rank, 0) + logs
        self._count[rank] = count
        self.latest[rank] = value
        if math.isfinite(value):
            x = float(step) if step is not None else float(count)
            self.points.setdefault(x, {})[rank] = value
            if len(self.points) > MAX_SERIES_POINTS:
                self._halve()

    def _halve(self) -> None:
        """Average neighbouring points in pairs (at the later x), each rank's values with its own."""
        xs = sorted(self.points)
        merged: dict[float, dict[int, float]] = {}
        for first, second in zip(xs[0::2], xs[1::2]):
            a, b = self.points[first], self.points[second]
            merged[second] = {rank: (a[rank] + b[rank]) / 2 if rank in a and rank in b else a.get(rank, b.get(rank))
                              for rank in a.keys() | b.keys()}
        if len(xs) % 2:
            merged[xs[-1]] = self.points[xs[-1]]
        self.points = merged

    def mean_series(self, max_points: int | None = None) -> tuple[list[float], list[float]]:
        """(xs, mean across ranks at each x), x ascending; averaged down to `max_points` buckets if longer."""
        xs = sorted(self.points)
        means = [_mean(self.points[x].values()) for x in xs]
        if max_points is not None and len(xs) > max_points:
            xs, means = _downsample(xs, means, max_points)
        return xs, means

    def last_by_rank(self) -> dict[int, float]:
        """The latest value each rank logged, by rank."""
        return dict(sorted(self.latest.items()))


class DashboardModel:
    """Per-rank state, logged metrics and run progress, built from channel messages by `update`."""

    def __init__(self, num_processes: int, *, title: str | None = None, total_steps: int | None = None,
                 info: dict[str, Any] | None = None, metrics: Sequence[str] | None = None):
        if not isinstance(num_processes, int) or isinstance(num_processes, bool) or num_processes < 1:
            raise ValueError(f"num_processes must be a positive int, got {num_processes!r}")
        if total_steps is not None and (not isinstance(total_steps, int) or total_steps < 1):
            raise ValueError(f"total_steps must be a positive int or None, got {total_steps!r}")
        if metrics is not None and (isinstance(metrics, str) or not isinstance(metrics, Sequence) or not metrics
                                    or not all(isinstance(name, str) for name in metrics)):
            raise ValueError(f"metrics must be a list of the names to show, such as ['loss', 'lr'], got {metrics!r}")
        # the names the views draw, in this order, once logged; None: the first MAX_SHOWN_METRICS logged
        self.chosen_metrics = None if metrics is None else list(dict.fromkeys(metrics))
        self.title = title or "nbaccel"
        self.info = {key: value for key, value in (info or {}).items() if value is not None}
        self.total_steps = total_steps
        self.ranks = [RankRow(rank) for rank in range(num_processes)]
        # hosts=: rows are the global ranks of every host, each rank's host as the kernel stamps it on the rank's
        # messages (it started the rank there); a launch on this machine shows no host
        self.on_hosts = bool(self.info.get("hosts"))
        self.metrics: dict[str, MetricSeries] = {}
        self.start_time: float | None = None
        self.end_time: float | None = None
        self.finished = False
        self.stopped_by: str | None = None  # the launch's interrupt or timeout, from its `launch` end message
        self.version = 0  # bumped on every change: views redraw only when it moved

    # --- updates ---------------------------------------------------------------------------------------

    def update(self, message: dict[str, Any]) -> bool:
        """Apply one channel message; returns whether anything shown changed. Unknown kinds and malformed messages are ignored."""
        if not isinstance(message, dict):
            return False
        kind = message.get("kind")
        if kind == MessageKind.LAUNCH.value:  # the whole launch's start or end: no rank of its own
            self.stopped_by = STOPPED_BY.get(message.get("state"))  # a new start forgets an earlier interrupt
            return False
        handler = _HANDLERS.get(kind)
        rank = message.get("rank")
        if handler is None or not _row_index(rank):
            return False
        # Rows are this node's processes: a multi-node launch tags messages with the node-local rank too. A
        # launch on several hosts (the kernel names each rank's host on its messages) shows every host's ranks: by
        # global rank.
        self.on_hosts = self.on_hosts or bool(message.get("host"))
        local_rank = message.get("local_rank")
        by_local = _row_index(local_rank) and not self.on_hosts
        state = self._rank(local_rank if by_local else rank)
        if message.get("host"):  # stamped by the kernel on every message of a rank it started on a host
            state.host = str(message["host"])
        state.rank = rank
        now = message.get("time")
        if isinstance(now, (int, float)):
            if self.start_time is None or now < self.start_time:
                self.start_time = now
            state.first_seen = now if state.first_seen is None else min(state.first_seen, now)
            state.last_seen = now if state.last_seen is None else max(state.last_seen, now)
        try:
            handler(self, state, message)
        except (TypeError, ValueError, AttributeError, OverflowError):  # a malformed field: the message is dropped
            return False
        self.version += 1
        return True

    def finish(self, results: list | None = None, failures: dict | None = None, end_time: float | None = None):
        """The run is over: ranks named in `failures` ({rank: error}) failed, ranks with a result
        finished, and any rank still marked starting/running takes the outcome of the whole run."""
        failures = dict(failures or {})
        for rank, error in failures.items():
            if _row_index(rank):
                state = self._rank(rank)
                state.state, state.error = RankState.FAILED, _first_line(error) or state.error or "failed"
        for rank, _result in enumerate(results or []):
            if rank < len(self.ranks) and not self.ranks[rank].done:
                self.ranks[rank].state = RankState.FINISHED
        for state in self.ranks:
            if not state.done:
                # A launcher that raised for one rank stopped the others: they did not finish their work.
                # With neither results nor failures, a rank that never reported its end did not finish.
                if failures:
                    state.state, state.error = RankState.FAILED, state.error or "stopped after another rank failed"
                elif results is not None:
                    state.state = RankState.FINISHED
                else:
                    state.state, state.error = RankState.FAILED, state.error or self.stopped_by or NOT_REPORTED
        if end_time is not None:
            self.end_time = end_time
        else:  # the last message of the run (message times, so a replayed stream gives the same summary)
            self.end_time = max((s.last_seen for s in self.ranks if s.last_seen is not None), default=None)
        self.finished = True
        self.version += 1

    def _rank(self, rank: int) -> RankRow:
        while rank >= len(self.ranks):  # a rank beyond num_processes (e.g. a larger world): show it too
            self.ranks.append(RankRow(len(self.ranks)))
        return self.ranks[rank]

    def _on_status(self, state: RankRow, message: dict) -> None:
        new = message.get("state")
        if new in STATES:
            state.state = RankState(new)
        if new == RankState.STARTING:  # a restarted rank: the error shown was its earlier attempt's
            state.error = ""
            state.busy = False
        if message.get("device"):
            state.device = str(message["device"])
        if new == RankState.FAILED:
            state.error = _first_line(message.get("error")) or state.error or "failed"
        if new in (RankState.FINISHED, RankState.FAILED) and all(s.done for s in self.ranks):
            self.end_time = max(s.last_seen or 0 for s in self.ranks)

    def _on_output(self, state: RankRow, message: dict) -> None:
        text = str(message.get("text", "")).rstrip("\r\n")
        if text.strip():
            state.last_output = text[-500:]
        self._mark_running(state)

    def _on_live(self, state: RankRow, message: dict) -> None:
        """A rank's progress bar redrawn in place: its current state is the rank's last output."""
        rows = [str(row) for row in message.get("lines") or () if str(row).strip()]
        if rows:
            state.last_output = rows[-1][-500:]
            self._mark_running(state)

    def _on_metrics(self, state: RankRow, message: dict) -> None:
        # A sampler-batched message carries the earlier logs of its interval in `history`, oldest first.
        for entry in message.get("history") or ():
            if isinstance(entry, dict):
                self._add_metrics(state, entry.get("values") or {}, entry.get("step"), entry.get("logs"))
        self._add_metrics(state, message.get("values") or {}, message.get("step"), message.get("logs"))
        self._mark_running(state)

    def _add_metrics(self, state: RankRow, values: dict, step: Any, logs: Any = None) -> None:
        step = step if isinstance(step, int) and not isinstance(step, bool) else None
        logs = logs if isinstance(logs, int) and not isinstance(logs, bool) and logs > 0 else 1
        for name, value in values.items():
            try:
                value = float(value)
            except (TypeError, ValueError):
                continue
            name = str(name)  # views sort the names: 1 and "loss" would not compare
            self.metrics.setdefault(name, MetricSeries(name)).add(state.rank, value, step, logs)
            state.metrics[name] = value

    def _on_step(self, state: RankRow, message: dict) -> None:
        step = message.get("step")
        if isinstance(step, int):
            state.step = step
            now = message.get("time")
            if isinstance(now, (int, float)):
                window = state._rate_window
                window.append((now, step))
                while len(window) > 2 and now - window[0][0] > RATE_WINDOW_S:
                    window.popleft()
                (t0, s0), (t1, s1) = window[0], window[-1]
                if t1 > t0:
                    state.steps_per_second = (s1 - s0) / (t1 - t0)
        if isinstance(message.get("total"), int):
            state.total = message["total"]
        if isinstance(message.get("epoch"), int) and isinstance(message.get("batch"), int):
            state.epoch, state.batch = message["epoch"], message["batch"]
            batches = message.get("batches")
            state.batches = batches if isinstance(batches, int) and batches > 0 else None
        self._mark_running(state)

    def _on_total(self, state: RankRow, message: dict) -> None:
        if isinstance(message.get("total"), int):
            state.total = message["total"]

    def _on_memory(self, state: RankRow, message: dict) -> None:
        for key in ("rss", "device_allocated", "device_reserved", "device_limit"):
            if message.get(key) is not None:
                setattr(state, key, int(message[key]))
        # Peaks only grow: the max of what the worker says and what was seen.
        for peak_key, current_key in (("rss_peak", "rss"), ("device_peak", "device_allocated")):
            candidates = [v for v in (message.get(peak_key), message.get(current_key), getattr(state, peak_key))
                          if v is not None]
            if candidates:
                setattr(state, peak_key, int(max(candidates)))

    def _on_error(self, state: RankRow, message: dict) -> None:
        state.state = RankState.FAILED
        kind = message.get("exc_type") or message.get("type")
        text = message.get("message") or message.get("error") or kind
        if kind and message.get("message"):
            text = f"{kind}: {message['message']}"
        state.error = _first_line(text) or "failed"

    def _on_result(self, state: RankRow, message: dict) -> None:
        if not state.done:
            state.state = RankState.FINISHED

    @staticmethod
    def _mark_running(state: RankRow) -> None:
        state.busy = True
        if state.state == RankState.STARTING:
            state.state = RankState.RUNNING

    # --- what views read -------------------------------------------------------------------------------

    @property
    def total(self) -> int | None:
        """The run's number of optimizer steps: given to the dashboard, or reported by the training code
        (`telemetry.report_total_steps`); None when unknown (a data loader knows an epoch, not the run)."""
        if self.total_steps is not None:
            return self.total_steps
        totals = [s.total for s in self.ranks if s.total]
        return max(totals) if totals else None

    @property
    def progress(self) -> float | None:
        """Fraction done (0..1) of the slowest rank still running: of the run when its total is known, else
        of the current epoch of the data loader the ranks step in; None when neither is known."""
        if self.finished and all(s.state == RankState.FINISHED for s in self.ranks):
            return 1.0 if self.total or self._slowest_in_epoch() is not None else None
        total = self.total
        if total:
            steps = [s.step for s in self._active()]
            return max(0.0, min(1.0, min(steps) / total))
        slowest = self._slowest_in_epoch()
        return None if slowest is None else min(1.0, slowest.batch / slowest.batches)

    def progress_text(self) -> str:
        """The words beside the progress bar: `69% (61/88 steps)`, or `epoch 4: 68% (15/22 batches)`."""
        progress = self.progress
        if progress is None:
            return ""
        if self.total:
            return f"{round(progress * 100)}% ({min(s.step for s in self._active())}/{self.total} steps)"
        slowest = self._slowest_in_epoch()
        if slowest is None:
            return f"{round(progress * 100)}%"
        return f"epoch {slowest.epoch}: {round(progress * 100)}% ({slowest.batch}/{slowest.batches} batches)"

    def _active(self) -> list[RankRow]:
        return [s for s in self.ranks if s.state != RankState.FAILED] or list(self.ranks)

    def _slowest_in_epoch(self) -> RankRow | None:
        """The rank least far through the training data (latest epoch position), None if one has none."""
        ranks = self._active()
        if any(s.batches is None or s.epoch is None for s in ranks):
            return None
        return min(ranks, key=lambda s: (s.epoch, s.batch / s.batches))

    @property
    def wall_time(self) -> float | None:
        """Seconds from the first message to the end (or to the latest message while running)."""
        if self.start_time is None:
            return None
        end = self.end_time
        if end is None:
            end = max((s.last_seen for s in self.ranks if s.last_seen is not None), default=self.start_time)
        return max(0.0, end - self.start_time)

    @property
    def shows_hosts(self) -> bool:
        """Whether views show a host column: the launch was given hosts= (a launch on this machine: no)."""
        return self.on_hosts or any(s.host for s in self.ranks)

    @property
    def overall_state(self) -> RankState:
        states = {s.state for s in self.ranks}
        if RankState.FAILED in states:
            return RankState.FAILED
        if states == {RankState.FINISHED}:
            return RankState.FINISHED
        if RankState.RUNNING in states or RankState.FINISHED in states:
            return RankState.RUNNING
        return RankState.STARTING

    def shown_metrics(self) -> list[str]:
        """The names of the metrics the views draw: the chosen ones logged so far, in the order chosen; else the
        first MAX_SHOWN_METRICS logged, sorted."""
        if self.chosen_metrics is not None:
            return [name for name in self.chosen_metrics if name in self.metrics]
        return sorted(itertools.islice(self.metrics, MAX_SHOWN_METRICS))

    @property
    def hidden_metrics(self) -> int:
        """How many logged metrics the views leave out (not chosen, or beyond MAX_SHOWN_METRICS)."""
        if self.chosen_metrics is not None:
            return len(self.metrics) - len(self.shown_metrics())
        return max(0, len(self.metrics) - MAX_SHOWN_METRICS)

    def summary(self) -> dict[str, Any]:
        """The static end-of-run summary: final status, peak memory per rank, wall time, last metrics."""
        return {
            "title": self.title,
            "state": self.overall_state,
            "wall_time": self.wall_time,
            "total": self.total,
            "ranks": [
                {
                    "rank": s.rank, "host": s.host or None, "device": s.device, "state": s.state, "error": s.error, "step": s.step,
                    "steps_per_second": s.steps_per_second, "rss_peak": s.rss_peak,
                    "device_peak": s.device_peak, "metrics": dict(s.metrics),
                }
                for s in self.ranks
            ],
            "metrics": {
                name: {"mean": _mean(series.last_by_rank().values()), "by_rank": series.last_by_rank()}
                for name, series in self.metrics.items()
            },
        }


_HANDLERS = {
    MessageKind.STATUS.value: DashboardModel._on_status,
    MessageKind.OUTPUT.value: DashboardModel._on_output,
    MessageKind.LIVE.value: DashboardModel._on_live,
    MessageKind.METRICS.value: DashboardModel._on_metrics,
    MessageKind.STEP.value: DashboardModel._on_step,
    MessageKind.TOTAL.value: DashboardModel._on_total,
    MessageKind.MEMORY.value: DashboardModel._on_memory,
    MessageKind.ERROR.value: DashboardModel._on_error,
    MessageKind.RESULT.value: DashboardModel._on_result,
}


def format_bytes(value: int | None) -> str:
    """1536 -> '1.5 KiB'; None -> '–'."""
    if value is None:
        return "–"
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


def format_rate(value: float | None) -> str:
    return "–" if value is None else f"{value:.1f}/s" if value < 100 else f"{value:.0f}/s"


def format_step(state: RankRow, total: int | None) -> str:
    """`61/88` when the run's steps are known, else `61 (epoch 3, batch 17/22)` from the data loader
    (`batch 17` for an unsized one)."""
    total = state.total or total
    if total:
        return f"{state.step}/{total}"
    if state.epoch is not None:
        of = f"/{state.batches}" if state.batches else ""
        return f"{state.step} (epoch {state.epoch}, batch {state.batch}{of})"
    return str(state.step)


def format_duration(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def format_value(value: float | None) -> str:
    return "–" if value is None else f"{value:.4g}"


def device_memory_text(state: RankRow) -> str:
    """'1.2 GiB / 2.0 GiB (peak 1.5 GiB)': allocated / reserved (or the XLA limit), and the peak."""
    if state.device_allocated is None:
        return "–"
    text = format_bytes(state.device_allocated)
    second = state.device_reserved if state.device_reserved is not None else state.device_limit
    if second is not None:
        text += f" / {format_bytes(second)}"
    if state.device_peak is not None:
        text += f" (peak {format_bytes(state.device_peak)})"
    return text


def ram_text(state: RankRow) -> str:
    """The rank's RAM (resident memory), current and peak."""
    if state.rss is None:
        return "–"
    peak = f" (peak {format_bytes(state.rss_peak)})" if state.rss_peak is not None else ""
    return format_bytes(state.rss) + peak


STARTING_TEXT = "starting: process, imports"  # before the launched function runs
SETTING_UP_TEXT = "running: setting up (imports, joining the group)"  # in it, before its first output or step


def status_text(state: RankRow) -> str:
    """The status column: the state, a failed rank's error, and which part of its start-up a rank is in."""
    if state.state == RankState.FAILED and state.error:
        return f"failed: {state.error}"
    if state.state == RankState.STARTING:
        return STARTING_TEXT
    if state.state == RankState.RUNNING and not state.busy:
        return SETTING_UP_TEXT
    return str(state.state)


def _row_index(rank: Any) -> bool:
    """Whether `rank` can name a row of the table (an int from 0 to MAX_RANK_ROWS - 1)."""
    return isinstance(rank, int) and not isinstance(rank, bool) and 0 <= rank < MAX_RANK_ROWS


def _first_line(error: Any) -> str | None:
    """The line that says what went wrong: an exception's `Type: message`, a traceback's last line, or
    the first line of a message."""
    if error is None:
        return None
    if isinstance(error, BaseException):
        error = f"{type(error).__name__}: {error}"
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    if not lines:
        return None
    if lines[0].startswith("Traceback (most recent call last)"):
        unindented = [line for line in lines[1:] if not line[:1].isspace()]
        return (unindented[0] if unindented else lines[-1]).strip()[:300]
    return lines[0].strip()[:300]


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def _downsample(xs: list[float], ys: list[float], buckets: int) -> tuple[list[float], list[float]]:
    size = len(xs) / buckets
    out_x, out_y = [], []
    for index in range(buckets):
        lo, hi = int(index * size), max(int((index + 1) * size), int(index * size) + 1)
        out_x.append(xs[hi - 1])
        out_y.append(sum(ys[lo:hi]) / (hi - lo))
    return out_x, out_y
