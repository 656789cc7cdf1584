"""The dashboard without a display: model from channel messages, throttled redraws, summary, views."""

from __future__ import annotations

import gc
import io
import multiprocessing
import re
import threading
import time

import pytest
from dashboard_streams import T0, MiB, scripted_stream  # noqa: E402  (tests/ is on sys.path)
from ranks_helper import run_ranks

from nbaccel import telemetry
from nbaccel.notebook import Dashboard
from nbaccel.notebook.console import PlainView, rich_renderable, sparkline
from nbaccel.notebook.dashboard import Throttle, resolve_mode
from nbaccel.notebook.dashboard_model import DashboardModel, device_memory_text, format_bytes, format_step
from nbaccel.notebook.render import (
    metrics_png,
    png_bundle,
    rank_table_html,
    summary_html,
    summary_text,
    y_range,
)


def replay(messages: list[dict], num_processes: int = 2) -> DashboardModel:
    model = DashboardModel(num_processes, title="test")
    for message in messages:
        model.update(message)
    return model


def test_model_from_scripted_stream():
    model = replay(scripted_stream())
    assert [s.state for s in model.ranks] == ["finished", "finished"]
    assert [s.device for s in model.ranks] == ["cpu:0", "cpu:1"]
    rank1 = model.ranks[1]
    assert rank1.step == 10 and rank1.total == 10 and model.total == 10
    assert rank1.steps_per_second == pytest.approx(10.0)
    assert rank1.rss == 110 * MiB and rank1.rss_peak == 110 * MiB
    assert rank1.last_output == "rank 1 step 10"
    xs, means = model.metrics["loss"].mean_series()
    assert xs == [float(s) for s in range(1, 11)]
    assert means == pytest.approx([1.0 / s + 0.5 for s in range(1, 11)])
    assert model.metrics["loss"].last_by_rank() == pytest.approx({0: 0.1, 1: 1.1})
    assert model.progress == 1.0
    assert model.wall_time == pytest.approx(1.5)
    assert model.overall_state == "finished"


def test_model_failure_shows_exception_line():
    model = replay(scripted_stream(fail_rank=1))
    assert model.ranks[1].state == "failed"
    assert model.ranks[1].error == "ValueError: loss is nan"
    assert model.overall_state == "failed"
    model.finish(failures={1: "ignored: the status already said"})
    assert model.ranks[0].state == "finished"


def test_a_launch_failure_shows_its_one_line_and_a_restart_clears_the_earlier_error():
    from nbaccel.launch.errors import WorkerFailure

    model = replay(scripted_stream(fail_rank=1))
    # torch elastic restarts the ranks: the error shown was the earlier attempt's
    model.update(dict(kind="status", rank=1, time=T0 + 5, state="starting", device="cpu:1", restart=1))
    assert model.ranks[1].state == "starting" and model.ranks[1].error == ""
    # the launcher finishes the board with its failure records (not their dataclass repr)
    model.finish(failures={1: WorkerFailure(1, "ValueError", "boom", "Traceback (most recent call last):\n"),
                           0: WorkerFailure(0, None, "stopped while waiting in reduce(all_reduce)", exitcode=-15)})
    assert model.ranks[1].error == "ValueError: boom"
    assert model.ranks[0].error == "stopped while waiting in reduce(all_reduce) (exit code -15)"


def test_finish_marks_unfinished_ranks():
    model = replay(scripted_stream()[:20])  # cut mid-run
    assert {s.state for s in model.ranks} == {"running"}
    model.finish(failures={0: RuntimeError("boom\nmore")})
    assert model.ranks[0].state == "failed" and model.ranks[0].error == "RuntimeError: boom"
    assert model.ranks[1].state == "failed" and "another rank failed" in model.ranks[1].error
    clean = replay(scripted_stream()[:20])
    clean.finish(results=[1, 2])
    assert [s.state for s in clean.ranks] == ["finished", "finished"]


def test_model_ignores_malformed_and_grows_for_unknown_ranks():
    model = DashboardModel(1)
    assert not model.update({"kind": "nope", "rank": 0})
    assert not model.update({"kind": "step"})  # no rank
    assert model.update({"kind": "metrics", "rank": 2, "time": T0, "values": {"acc": "x", "b": float("nan")}})
    assert len(model.ranks) == 3 and list(model.metrics) == ["b"]  # NaN: the rank's latest value, not charted
    assert model.metrics["b"].points == {}
    with pytest.raises(ValueError, match="num_processes"):
        DashboardModel(0)


def test_metric_without_step_uses_log_count_and_downsamples():
    model = DashboardModel(1)
    for i in range(1000):
        model.update({"kind": "metrics", "rank": 0, "time": T0 + i, "values": {"lr": float(i)}, "step": None})
    xs, ys = model.metrics["lr"].mean_series(max_points=100)
    assert len(xs) == 100 and xs[-1] == 1000.0 and ys[0] == pytest.approx(4.5)


def test_device_memory_peaks_only_grow():
    model = DashboardModel(1)
    for allocated, peak in ((5, 10), (3, None), (12, 11)):
        model.update({"kind": "memory", "rank": 0, "time": T0, "rss": 1, "rss_peak": 2,
                      "device_allocated": allocated * MiB, "device_reserved": 20 * MiB,
                      "device_peak": None if peak is None else peak * MiB})
    state = model.ranks[0]
    assert state.device_allocated == 12 * MiB and state.device_peak == 12 * MiB
    assert format_bytes(state.device_reserved) == "20.0 MiB"


def test_summary_html_and_text():
    model = replay(scripted_stream(fail_rank=1))
    model.finish()
    summary = model.summary()
    assert summary["state"] == "failed"
    assert summary["ranks"][0]["rss_peak"] == 110 * MiB
    assert summary["metrics"]["loss"]["mean"] == pytest.approx(0.6)
    page = summary_html(model)
    assert "<svg" not in page and "ValueError: loss is nan" in page  # the chart is a PNG output of its own
    png = metrics_png(model)
    assert png.startswith(b"\x89PNG") and png_bundle(png, "chart")["image/png"].isascii()
    assert metrics_png(replay([])) is None
    assert "data-state='finished'" in page and "data-state='failed'" in page
    assert "1.5 s" in page
    text = summary_text(model)
    assert "rank 1 [cpu:1] failed: ValueError: loss is nan" in text and "loss=0.1" in text


def test_throttle_counts_with_fake_clock():
    now = [0.0]
    throttle = Throttle(0.25, clock=lambda: now[0])
    assert throttle.ready()
    throttle.mark()
    now[0] = 0.2
    assert not throttle.ready() and throttle.delay() == pytest.approx(0.05)
    now[0] = 0.26
    assert throttle.ready()


def test_dashboard_redraws_are_throttled_with_a_trailing_redraw(capsys):
    dashboard = Dashboard(2, mode="plain", max_redraws_per_second=4)
    dashboard.start()
    started = time.monotonic()
    messages = scripted_stream()
    for _ in range(20):  # a burst: 20 x 90 messages as fast as possible
        for message in messages[:-2]:
            dashboard(message)
    burst = time.monotonic() - started
    assert dashboard.redraws <= 2 + 4 * burst + 1
    time.sleep(0.4)  # the trailing redraw draws the last state of the burst
    assert dashboard._drawn_version == dashboard.model.version
    dashboard.observe(messages[-2])
    dashboard.observe(messages[-1])
    dashboard.finish()
    out = capsys.readouterr().out
    assert "rank 0 on cpu:0: finished" in out and "rank 1 on cpu:1: finished" in out
    assert dashboard.model.finished and not dashboard._drawer.is_alive()  # the drawing thread ended with it


def _wait_until(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_the_caller_never_draws_and_the_tables_go_on_while_the_chart_libraries_import(monkeypatch):
    """`observe` (the launch's forwarding thread) only updates the model: the widget view is built (in the place
    `start` reserved) and drawn by the dashboard's own thread, and the first metric's chart libraries are imported on another one while the
    tables keep being redrawn (here the import is held until the tables showed the last values), with the
    heap frozen (gc) until the view closes."""
    pytest.importorskip("bqplot")
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output

    from nbaccel.notebook import background_drawing
    from nbaccel.notebook.widget_view import WidgetView

    importing, release = threading.Event(), threading.Event()
    real_import = background_drawing.import_chart_modules

    def slow_import():
        importing.set()
        assert release.wait(30)
        real_import()

    drawn_on: set[str] = set()
    real_render = WidgetView.render

    def render(view, model):
        drawn_on.add(threading.current_thread().name)
        real_render(view, model)

    monkeypatch.setattr(background_drawing, "import_chart_modules", slow_import)
    monkeypatch.setattr(background_drawing, "_charts", background_drawing._Charts())  # not imported yet
    monkeypatch.setattr(WidgetView, "render", render)
    InteractiveShell.instance()  # display() needs a shell to publish through
    try:
        with capture_output() as captured:
            board = Dashboard(2, mode="widget", max_redraws_per_second=50).start()
            drawn_on.clear()  # start() draws the empty view here; from now on the dashboard's thread draws
            for message in scripted_stream()[:-2]:
                board.observe(message)
            assert importing.wait(10)
            assert _wait_until(lambda: board._drawn_version == board.model.version)
            panel = board._view.panels["loss"]
            assert panel.chart is None and "rank 1" in panel.table.value  # values shown, chart on its way
            assert gc.get_freeze_count() > 0  # collections skip the heap while the import runs
            assert board._view.table.value == rank_table_html(board.model)  # the rank table is up to date
            release.set()
            assert _wait_until(lambda: panel.chart is not None and len(panel.chart.line.x) == 10)
            assert drawn_on == {"nbaccel-dashboard"}
            board.finish([None, None])
    finally:
        release.set()
        InteractiveShell.clear_instance()
    # start() only reserved the view's place (and the summary chart's): the widget went there by an update
    place = captured.outputs[0].transient["display_id"]
    assert not any("widget-view" in kind for kind in captured.outputs[0].data)
    widget = [o for o in captured.outputs if "application/vnd.jupyter.widget-view+json" in o.data]
    assert widget and all(o.update and o.transient["display_id"] == place for o in widget)
    assert not board._drawer.is_alive()
    assert gc.get_freeze_count() == 0  # the heap went back to the collections when the view closed


def _enter_and_leave_the_gate() -> None:
    from nbaccel.notebook import background_drawing

    with background_drawing.forks_wait():  # in a child: would wait forever if it inherited the parent's hold
        pass


def test_a_fork_waits_for_a_chart_import_or_redraw_in_progress():
    """A process forked mid-import would inherit module locks held by a thread it does not have: while the
    dashboard imports or draws on its threads, `os.fork` (here multiprocessing's) waits; the child's gate is
    free; an import and a redraw run side by side."""
    from nbaccel.notebook import background_drawing

    holding, release, forked = threading.Event(), threading.Event(), threading.Event()

    def hold():
        with background_drawing.forks_wait():
            holding.set()
            release.wait(30)

    child = multiprocessing.get_context("fork").Process(target=_enter_and_leave_the_gate)
    holder = threading.Thread(target=hold)
    forker = threading.Thread(target=lambda: (child.start(), forked.set()))
    holder.start()
    try:
        assert holding.wait(10)
        side_by_side = threading.Thread(target=_enter_and_leave_the_gate)
        side_by_side.start()
        side_by_side.join(10)
        assert not side_by_side.is_alive()  # a redraw does not wait for an import (nor the other way)
        forker.start()
        assert not forked.wait(0.3)  # held back while the import/redraw runs
        release.set()
        assert forked.wait(10)
        child.join(10)
        assert child.exitcode == 0
    finally:
        release.set()
        holder.join(10)
        forker.join(10)
        if child.is_alive():
            child.kill()
            child.join()


def test_plain_view_throttles_progress_lines():
    now = [0.0]
    model = DashboardModel(2, title="t")
    stream = io.StringIO()
    view = PlainView(model, stream, interval=10, clock=lambda: now[0])
    for message in scripted_stream()[:-2]:
        model.update(message)
        now[0] += 0.05  # 86 messages: ~4.3 s, under the interval
        view.render(model)
    lines = stream.getvalue().splitlines()
    assert sum("running" in line for line in lines) == 2 and not any("step" in line for line in lines)
    now[0] = 20
    view.render(model)
    progress = stream.getvalue().splitlines()[len(lines):]
    assert len(progress) == 2 and "step 10/10 (10.0/s)" in progress[0] and "loss=0.1" in progress[0]


def test_rich_renderable_shows_ranks_and_metrics():
    from rich.console import Console

    model = replay(scripted_stream(fail_rank=0))
    console = Console(record=True, width=200, color_system=None)
    console.print(rich_renderable(model))
    text = console.export_text()
    assert "failed: ValueError: loss is nan" in text and "finished" in text
    assert "loss" in text and "10/10" in text and "100%" in text and "110.0M/110.0M" in text
    assert sparkline([3.0, 2.0, 1.0]) == "█▅▁"


def _epoch_stream(positions: dict[int, tuple[int, int, int, int]], total: int | None = None) -> list[dict]:
    """Step messages as the prepared optimizer sends them: {rank: (step, epoch, batch, batches)}."""
    messages = [dict(kind="status", rank=rank, time=T0, state="running", device="cpu") for rank in positions]
    if total is not None:
        messages.append(dict(kind="total", rank=0, time=T0, total=total))
    for rank, (step, epoch, batch, batches) in positions.items():
        messages.append(dict(kind="step", rank=rank, time=T0 + 1, step=step, total=None, epoch=epoch,
                             batch=batch, batches=batches))
    return messages


def test_progress_follows_the_training_loaders_epoch_when_the_run_length_is_unknown():
    # 4 epochs of 22 batches, an evaluation loader of 4 batches prepared last: the dashboard once read
    # "88/4" (the last prepared loader's length taken for the run's). Now: the epoch of the loader stepped in.
    model = replay(_epoch_stream({0: (61, 2, 17, 22), 1: (59, 2, 15, 22)}))
    assert model.total is None
    # epoch 2 as the user's loop counts it (from 0, as `for epoch in range(n)` and tqdm show it)
    assert format_step(model.ranks[0], model.total) == "61 (epoch 2, batch 17/22)"
    assert model.progress == pytest.approx(15 / 22)  # the slowest rank
    assert model.progress_text() == "epoch 2: 68% (15/22 batches)"
    behind = replay(_epoch_stream({0: (61, 2, 17, 22), 1: (66, 3, 0, 22)}))
    assert behind.progress_text() == "epoch 2: 77% (17/22 batches)"  # an epoch behind is slower
    assert "step 61 (epoch 2, batch 17/22)" in PlainView._progress_line(model, model.ranks[0])
    from rich.console import Console

    console = Console(record=True, width=200, color_system=None)
    console.print(rich_renderable(model))
    assert "epoch 2: 68% (15/22 batches)" in console.export_text()
    model.update(dict(kind="status", rank=0, time=T0 + 2, state="finished"))
    model.update(dict(kind="status", rank=1, time=T0 + 2, state="finished"))
    model.finish()
    assert model.progress == 1.0


def test_progress_counts_steps_when_the_run_length_is_reported():
    model = replay(_epoch_stream({0: (61, 2, 17, 22), 1: (59, 2, 15, 22)}, total=88))
    assert format_step(model.ranks[1], model.total) == "59/88"
    assert model.progress == pytest.approx(59 / 88)
    assert model.progress_text() == "67% (59/88 steps)"
    unknown = replay(_epoch_stream({0: (3, 0, 3, 22)}) + [dict(kind="step", rank=1, time=T0 + 1, step=2)])
    assert unknown.progress is None and unknown.progress_text() == ""  # rank 1 stepped outside a loader
    assert format_step(unknown.ranks[1], unknown.total) == "2"
    unsized = replay(_epoch_stream({0: (5, 1, 3, None)}), num_processes=1)
    assert format_step(unsized.ranks[0], None) == "5 (epoch 1, batch 3)" and unsized.progress is None


def test_widget_view_builds_table_progress_and_chart():
    pytest.importorskip("bqplot")
    from nbaccel.notebook.widget_view import WidgetView

    model = replay(scripted_stream())
    view = WidgetView(model)
    assert "finished" in view.table.value and "cpu:1" in view.table.value
    assert view.progress.value == 1.0 and view.progress.layout.display is None
    panel = view.panels["loss"]
    chart = panel.chart
    assert list(chart.line.x) == [float(s) for s in range(1, 11)] and len(chart.line.y) == 10
    assert "rank 1" in panel.table.value
    epochs = WidgetView(replay(_epoch_stream({0: (61, 2, 17, 22), 1: (59, 2, 15, 22)})))
    assert epochs.progress_text.value == "epoch 2: 68% (15/22 batches)" and epochs.progress.value == pytest.approx(15 / 22)
    assert "59 (epoch 2, batch 15/22)" in epochs.table.value
    bundle = view.mimebundle("<i>fallback</i>", "dashboard")
    assert "application/vnd.jupyter.widget-view+json" in bundle and bundle["text/html"] == "<i>fallback</i>"
    assert bundle["text/plain"] == "dashboard"  # not ipywidgets' "VBox(children=...)"
    # the live chart's axes fit the data: steps 1..10, a loss >= 0 gets no negative axis
    assert (chart.x_scale.min, chart.x_scale.max) == (1.0, 10.0) and chart.y_scale.min >= 0
    assert list(chart.x_axis.tick_values) == [2.0, 4.0, 6.0, 8.0, 10.0]  # round steps, none outside the data
    assert list(chart.y_axis.tick_values) == [0.6, 0.8, 1.0, 1.2, 1.4]  # the mean loss goes 1.5 -> 0.6
    view.close()
    assert view.root.comm is None and chart.line.comm is None


def test_chart_axes_fit_the_values():
    assert y_range([0.05, 2.3]) == (0.0, pytest.approx(2.3 + 0.05 * 2.25))  # never below 0 for values >= 0
    assert y_range([-1.0, 1.0]) == (pytest.approx(-1.1), pytest.approx(1.1))
    low, high = y_range([0.5, 0.5])
    assert low < 0.5 < high


def test_mode_resolution_and_bad_arguments(monkeypatch):
    assert resolve_mode("plain") == "plain"
    monkeypatch.setattr("sys.stdout", io.StringIO())  # no TTY, not a kernel
    assert resolve_mode("auto") == "plain"
    with pytest.raises(ValueError, match="mode must be one of"):
        Dashboard(2, mode="fancy")
    with pytest.raises(ValueError, match="num_processes"):
        Dashboard(-1)


def _record_worker(rank: int) -> list[dict]:
    """On a worker: the real telemetry reporter and sampler, the sink collecting messages."""
    import torch

    from nbaccel import telemetry as worker_telemetry

    messages: list[dict] = []
    worker_telemetry.attach(messages.append, rank)
    worker_telemetry.emit("status", state="running", device="cpu")
    worker_telemetry.start_sampler(0.05)
    worker_telemetry.report_total_steps(40)
    weight = torch.ones(8)
    for step in range(1, 41):
        loss = (torch.ones(4, 8) @ weight).pow(2).mean()
        weight -= 0.01 * weight  # a stand-in for an optimizer step (torch.optim's first use is slow)
        worker_telemetry.report_step(step)
        worker_telemetry.log_metrics({"loss": loss.detach(), "note": "text is dropped"}, step=step)
        time.sleep(0.005)
    worker_telemetry.stop_sampler()
    worker_telemetry.emit("status", state="finished", device="cpu")
    worker_telemetry.detach()
    return messages


def test_recorded_worker_stream_feeds_the_model():
    import torch  # noqa: F401  (imported once here: the forked ranks inherit it instead of importing it twice)

    streams = run_ranks(_record_worker, world_size=2, timeout=60)
    for messages in streams:
        kinds = [m["kind"] for m in messages]
        metrics = [m for m in messages if m["kind"] == "metrics"]
        assert 1 <= len(metrics) < 40  # batched by the sampler: latest values + the interval's history
        logged = [entry["step"] for m in metrics for entry in [*m.get("history", []), m]]
        assert logged == list(range(1, 41))
        assert 2 <= kinds.count("step") < 40  # steps are sampled, not sent one by one
        assert kinds.count("memory") >= 2
        assert [m for m in messages if m["kind"] == "step"][-1]["step"] == 40  # the sampler flushes the last
    model = replay(sorted(streams[0] + streams[1], key=lambda m: m["time"]))
    model.finish()
    for state in model.ranks:
        assert state.state == "finished" and state.step == 40 and state.total == 40
        assert state.rss > 10 * MiB and state.rss_peak >= state.rss
        assert state.steps_per_second and state.steps_per_second > 1
    assert sorted(model.metrics) == ["loss"] and len(model.metrics["loss"].points) == 40


def test_sampler_is_quiet_without_sink_and_rejects_bad_interval():
    assert not telemetry.is_attached()
    telemetry.start_sampler(0.01)
    time.sleep(0.05)
    telemetry.stop_sampler()
    with pytest.raises(ValueError, match="interval"):
        telemetry.start_sampler(0)
    sample = telemetry.memory_sample()
    assert sample["rss"] > 0 and sample["device_allocated"] is None


def test_rows_follow_local_rank_and_error_messages():
    model = DashboardModel(2)
    model.update({"kind": "status", "rank": 5, "local_rank": 1, "time": T0, "state": "running", "device": "cpu"})
    model.update({"kind": "error", "rank": 5, "local_rank": 1, "time": T0 + 1, "exc_type": "KeyError",
                  "message": "'x'\nsecond line", "traceback": "..."})
    assert len(model.ranks) == 2 and model.ranks[1].rank == 5
    assert model.ranks[1].state == "failed" and model.ranks[1].error == "KeyError: 'x'"


def _hosts_stream() -> list[dict]:
    """Two hosts with two ranks each, as their statuses reach the kernel: every rank's local rank is 0 or 1."""
    stream = []
    for rank in range(4):
        host, local = ("gpu-a", "gpu-b")[rank // 2], rank % 2
        stream += [
            {"kind": "status", "rank": rank, "local_rank": local, "time": T0 + rank, "state": "starting",
             "device": f"cuda:{local}", "host": host, "pid": 100 + rank},
            {"kind": "step", "rank": rank, "local_rank": local, "time": T0 + 5, "step": 3 + rank, "total": 10},
            {"kind": "status", "rank": rank, "local_rank": local, "time": T0 + 9, "state": "finished",
             "device": f"cuda:{local}", "host": host},
        ]
    return stream


def test_ranks_on_several_hosts_get_a_host_column_and_their_own_rows():
    model = replay(_hosts_stream(), num_processes=4)
    assert [(s.rank, s.host, s.device, s.step) for s in model.ranks] == [
        (0, "gpu-a", "cuda:0", 3), (1, "gpu-a", "cuda:1", 4), (2, "gpu-b", "cuda:0", 5), (3, "gpu-b", "cuda:1", 6)]
    assert model.shows_hosts and model.summary()["ranks"][2]["host"] == "gpu-b"
    model.finish(results=[0, 1, 2, 3])
    for html in (rank_table_html(model), summary_html(model)):
        assert ">host</th>" in html
        for rank, host, device in ((0, "gpu-a", "cuda:0"), (3, "gpu-b", "cuda:1")):
            row = html.split(f"data-rank='{rank}'")[1].split("</tr>")[0]
            # the host in its own column, right after the rank; the device column is the device alone
            assert re.findall(r">([^<]*)</td>", row)[:3] == [str(rank), host, device]
            assert '<td class="nbaccel-host"' in row and "@" not in row
    assert "rank 2 [gpu-b cuda:0] finished" in summary_text(model)
    lines = io.StringIO()
    PlainView(model, stream=lines)
    assert "rank 3 on gpu-b (cuda:1): finished" in lines.getvalue()
    from rich.console import Console

    console = Console(record=True, width=200, color_system=None)
    console.print(rich_renderable(model))
    rows = [[cell.strip() for cell in line.replace("┃", "│").split("│")] for line in
            console.export_text().splitlines()]
    assert ["rank", "host", "device"] in [row[:3] for row in rows] and ["2", "gpu-b", "cuda:0"] in [row[:3] for row in rows]


def test_the_launch_info_shows_the_host_column_and_the_kernel_stamped_host_fills_it():
    model = DashboardModel(4, info={"hosts": ["gpu-a", "gpu-b"], "world_size": 4})
    assert [s.host for s in model.ranks] == [""] * 4 and model.shows_hosts  # no guess before a rank reports
    # a rank's own messages carry its local rank on its host: the row is still its global rank; the host is the
    # one the kernel stamped on the message (it started the rank there)
    model.update({"kind": "step", "rank": 3, "local_rank": 1, "time": T0, "step": 7, "host": "gpu-b"})
    assert model.ranks[3].step == 7 and model.ranks[1].step == 0 and model.ranks[3].host == "gpu-b"
    assert "gpu-a, gpu-b" in summary_html(model)  # the header's hosts, as a list of names


def test_a_launch_on_this_machine_has_no_host_column():
    model = replay(scripted_stream())
    model.finish()
    assert not model.shows_hosts
    for html in (rank_table_html(model), summary_html(model)):
        assert ">host</th>" not in html and "nbaccel-host" not in html
    assert "rank 0 [cpu:0] finished" in summary_text(model)


def test_close_with_results_finishes_like_the_launcher_does(capsys):
    dashboard = Dashboard(2, mode="plain", start_method="fork", world_size=2, device="cpu")
    dashboard.start()
    for message in scripted_stream()[:20]:
        dashboard(message)
    dashboard.close(results=None, failures={1: "RuntimeError: worker 1 exited with code 1"})
    assert dashboard.model.finished and dashboard.model.ranks[1].error == "RuntimeError: worker 1 exited with code 1"
    assert dashboard.model.ranks[0].error == "stopped after another rank failed"
    dashboard.close()  # idempotent
    out = capsys.readouterr().out
    assert "nbaccel: failed" in out and "rank 1 [cpu:1] failed: RuntimeError" in out
    assert dashboard.model.info == {"start_method": "fork", "world_size": 2, "device": "cpu"}


def test_close_after_an_interrupt_still_leaves_a_summary(capsys):
    dashboard = Dashboard(2, mode="plain")
    dashboard.start()
    for message in scripted_stream()[:20]:
        dashboard(message)
    dashboard.close()  # what the launcher does after KeyboardInterrupt: no results, no failures
    assert dashboard.model.finished
    assert {s.error for s in dashboard.model.ranks} == {"stopped before reporting its end"}
    assert "rank 0 [cpu:0] failed: stopped before reporting its end" in capsys.readouterr().out


def test_memory_sample_reads_cuda_and_xla_counters_without_initializing(monkeypatch):
    """The field mapping, with stand-ins for the runtimes (no GPU or TPU here): CUDA counters are read only
    once CUDA is initialized; torch_xla's memory info maps to allocated / limit / peak."""
    import sys
    import types

    calls = []
    cuda = types.SimpleNamespace(
        is_initialized=lambda: bool(calls),
        current_device=lambda: 1,
        memory_allocated=lambda device: 10 * MiB,
        memory_reserved=lambda device: 16 * MiB,
        max_memory_allocated=lambda device: 12 * MiB,
    )
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    assert telemetry.memory_sample()["device_allocated"] is None  # not initialized: nothing read
    calls.append("init")
    sample = telemetry.memory_sample()
    assert (sample["device_allocated"], sample["device_reserved"], sample["device_peak"]) == (10 * MiB, 16 * MiB, 12 * MiB)

    calls.clear()
    runtime_started = []
    xla = types.SimpleNamespace(xla_device=lambda: "xla:0",
                                get_memory_info=lambda device: {"bytes_used": 3, "bytes_limit": 8, "peak_bytes_used": 5})
    monkeypatch.setitem(sys.modules, "torch_xla.core.xla_model", xla)
    monkeypatch.setitem(sys.modules, "torch_xla", types.SimpleNamespace(
        _XLAC=types.SimpleNamespace(_xla_runtime_is_initialized=lambda: bool(runtime_started))))
    assert telemetry.memory_sample()["device_allocated"] is None  # torch_xla imported, runtime not started
    runtime_started.append(True)
    sample = telemetry.memory_sample()
    assert (sample["device_allocated"], sample["device_limit"], sample["device_peak"]) == (3, 8, 5)
    model = DashboardModel(1)
    model.update({"kind": "memory", "rank": 0, "time": T0, **sample})
    assert device_memory_text(model.ranks[0]) == "3 B / 8 B (peak 5 B)"


def test_the_start_up_phase_is_shown_until_a_rank_prints_steps_or_logs():
    from nbaccel.notebook.dashboard_model import status_text

    model = DashboardModel(1)
    model.update(dict(kind="status", rank=0, time=T0, state="starting", device="cpu"))
    assert status_text(model.ranks[0]) == "starting: process, imports"
    model.update(dict(kind="status", rank=0, time=T0 + 1, state="running", device="cpu"))
    assert status_text(model.ranks[0]) == "running: setting up (imports, joining the group)"
    assert "setting up" in rank_table_html(model)
    model.update(dict(kind="step", rank=0, time=T0 + 2, step=1))
    assert status_text(model.ranks[0]) == "running"
    model.update(dict(kind="status", rank=0, time=T0 + 3, state="starting", device="cpu", restart=1))
    model.update(dict(kind="status", rank=0, time=T0 + 4, state="running", device="cpu"))
    assert "setting up" in status_text(model.ranks[0])  # a restarted rank sets up again


def test_without_the_notebook_extra_a_kernel_gets_live_html(monkeypatch):
    """No ipywidgets/bqplot in a kernel: mode auto is "html", one output redrawn through its display id, then
    the summary; "widget" asked for says which extra to install. (tests/test_lean_install.py: a real venv.)"""
    import importlib.util

    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output

    from nbaccel.notebook import dashboard as dashboard_module

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("ipywidgets", "bqplot") else real_find_spec(name, *a))
    monkeypatch.setattr(dashboard_module, "in_notebook_kernel", lambda: True)
    with pytest.raises(ImportError, match=r"pip install nbaccel\[notebook\]"):
        Dashboard(2, mode="widget")
    InteractiveShell.instance()  # display() needs a shell to publish through
    try:
        with capture_output() as captured:
            board = Dashboard(2, mode="auto", max_redraws_per_second=1000)
            assert board.mode == "html"
            board.start()
            board.observe({"kind": "status", "rank": 0, "state": "running", "time": 1.0})
            board.finish([None, None])
    finally:
        InteractiveShell.clear_instance()
    outputs = captured.outputs
    ids = {output.transient["display_id"] for output in outputs}
    assert len(ids) == 2 and not any("widget-view" in kind for o in outputs for kind in o.data)
    last = [o for o in outputs if "text/html" in o.data][-1]
    assert last.update and "class='nbaccel-summary' data-state='finished'" in last.data["text/html"]


def test_the_summary_chart_waits_for_the_live_views_import_of_matplotlib(monkeypatch):
    """The end-of-run PNG imports matplotlib on the cell's thread; a live view's background import of the same
    modules may still run on a busy machine, and two threads importing them at once race ("cannot import name
    ... from partially initialized module 'matplotlib.ticker'"): the summary came without its chart. The PNG
    waits for that import first (the import here is held until released, so the order is checked)."""
    import matplotlib.backends.backend_agg  # noqa: F401  (imported already: the PNG alone takes well under 0.5 s)

    from nbaccel.notebook import background_drawing

    metrics_png(replay(scripted_stream()))
    release, order = threading.Event(), []

    def held_import() -> None:
        release.wait(30)
        order.append("background import")

    monkeypatch.setattr(background_drawing, "_charts", background_drawing._Charts())
    monkeypatch.setattr(background_drawing, "import_chart_modules", held_import)
    background_drawing.load_charts_in_background()
    threading.Timer(0.5, release.set).start()
    png = metrics_png(replay(scripted_stream()))
    order.append("summary chart")
    assert order == ["background import", "summary chart"] and png.startswith(b"\x89PNG")
