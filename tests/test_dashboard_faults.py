"""The dashboard and the ranks' telemetry under what users do to them: odd logged values, very many metrics,
ranks that die or flood their output. A run must end with its own result or one clear error, and the dashboard in a
final state; the dashboard itself never raises into the training loop or the cell."""

from __future__ import annotations

import sys
import threading
import types
import warnings

import numpy as np
import pytest
import torch
from dashboard_streams import T0, scripted_stream  # tests/ is on sys.path

from nbaccel import telemetry
from nbaccel.notebook import Dashboard
from nbaccel.notebook.dashboard import resolve_mode, widgets_installed
from nbaccel.notebook.dashboard_model import (
    MAX_SERIES_POINTS,
    MAX_SHOWN_METRICS,
    DashboardModel,
    format_value,
)
from nbaccel.notebook.live_output import MAX_LIVE_ROW, CellOutput
from nbaccel.notebook.render import chart_text, metric_table_html, metrics_png, summary_html, summary_text


@pytest.fixture
def sent():
    """Telemetry attached to a list: the messages a launch's sink would carry to the kernel."""
    messages: list[dict] = []
    telemetry.attach(messages.append, 0)
    yield messages
    telemetry.detach()


def test_logging_what_a_tracker_accepts_never_fails_the_training_loop(sent):
    # Accelerate's log() with no tracker ignores these; with the dashboard attached, they raised in the loop
    # (meta and complex tensors, an int too large for a float) or warned (a tensor that requires grad).
    odd = {"meta": torch.tensor(1.0, device="meta"), "complex": torch.tensor(1 + 2j), "huge": 10**400,
           "text": "epoch done", "none": None, "nested": {"a": 1.0}, "vector": torch.ones(3), "flag": True,
           "np_flag": np.bool_(True)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        telemetry.log_metrics(odd, step=1)
        telemetry.log_metrics({"loss": torch.tensor(0.5, requires_grad=True)}, step=2)
    assert [message["values"] for message in sent] == [{"loss": 0.5}]


def test_numpy_numbers_and_one_element_arrays_are_charted(sent):
    telemetry.log_metrics({"f32": np.float32(0.5), "i64": np.int64(3), "scalar_array": np.array(0.25),
                           "one": np.array([2.0]), "t": torch.tensor([[4]])}, step=1)
    assert sent[-1]["values"] == {"f32": 0.5, "i64": 3.0, "scalar_array": 0.25, "one": 2.0, "t": 4.0}


def test_metric_names_that_are_not_strings_do_not_break_the_summary(sent):
    telemetry.log_metrics({1: 0.5, "loss": 1.0}, step=1)
    assert sent[-1]["values"] == {"1": 0.5, "loss": 1.0}
    model = DashboardModel(1)
    # a message from another sink (RankPool's observers, a custom channel) may still carry them
    model.update(dict(kind="metrics", rank=0, time=1.0, values={2: 1.0, "loss": 2.0}, step=1))
    model.finish(results=[None])
    assert "loss" in summary_html(model) and "2=1" in summary_text(model)
    assert metrics_png(model).startswith(b"\x89PNG")


def test_thousands_of_metric_names_are_summarized_not_drawn_one_by_one():
    # 300 names took 30 s of matplotlib at the end of the run (10,000: hours), under the dashboard's lock
    model = DashboardModel(2)
    for rank in range(2):
        model.update(dict(kind="metrics", rank=rank, time=1.0, step=1,
                          values={f"layer{i}.grad_norm": float(i) for i in range(10_000)}))
    model.finish(results=[None, None])
    shown = model.shown_metrics()
    assert len(shown) == MAX_SHOWN_METRICS and "layer0.grad_norm" in shown
    page, text = summary_html(model), summary_text(model)
    assert "10000 metrics logged" in page and "10000 metrics logged" in text
    assert page.count("layer") == MAX_SHOWN_METRICS and len(text) < 10_000
    assert chart_text(model).count("layer") == MAX_SHOWN_METRICS
    assert metrics_png(model, dpi=20).startswith(b"\x89PNG")


def test_chosen_metrics_are_shown_when_thousands_of_names_bury_the_loss():
    # One log call with a value per parameter, `loss` last: the first 16 names shown left `loss` out, and the
    # user had no way to ask for it.
    values = {**{f"layer{i}.grad_norm": float(i) for i in range(1_000)}, "loss": 0.25, "lr": 0.1}
    default = DashboardModel(1)
    default.update(dict(kind="metrics", rank=0, time=1.0, step=1, values=values))
    assert "loss" not in default.shown_metrics()
    assert "metrics=[...]" in summary_text(default)
    board = Dashboard(1, mode="plain", metrics=["loss", "lr", "never_logged"])
    board.model.update(dict(kind="metrics", rank=0, time=1.0, step=1, values=values))
    board.model.finish(results=[None])
    assert board.model.shown_metrics() == ["loss", "lr"]
    assert board.model.hidden_metrics == 1_000
    text = summary_text(board.model)
    assert "loss=0.25" in text and "layer0" not in text and "the chosen ones are shown (1000 left out)" in text
    assert chart_text(board.model).endswith("chart of loss, lr")
    for bad in ("loss", [], ["loss", 3], None.__class__):
        with pytest.raises(ValueError, match="metrics must be a list of the names to show"):
            Dashboard(1, mode="plain", metrics=bad)


@pytest.mark.parametrize("how, shown", [("interrupted", "stopped: the launch was interrupted"),
                                        ("timeout", "stopped: the launch timed out")])
def test_ranks_stopped_by_an_interrupt_or_a_timeout_say_so(capsys, how, shown):
    # The launcher sends the launch's end before it closes the dashboard; the ranks still running said only
    # "stopped before reporting its end", as if they had vanished.
    dashboard = Dashboard(2, mode="plain").start()
    for message in scripted_stream()[:-2]:  # both ranks running, neither finished
        dashboard(message)
    dashboard(dict(kind="launch", rank=None, time=T0 + 2, state=how))
    dashboard.close()
    assert [s.error for s in dashboard.model.ranks] == [shown, shown]
    assert capsys.readouterr().out.count(shown) >= 2


def test_a_new_launch_start_forgets_an_earlier_interrupt():
    model = DashboardModel(1)
    model.update(dict(kind="launch", rank=None, time=T0, state="interrupted"))
    model.update(dict(kind="launch", rank=None, time=T0 + 1, state="started"))
    model.update(dict(kind="status", rank=0, time=T0 + 1, state="running"))
    model.finish()
    assert model.ranks[0].error == "stopped before reporting its end"


def test_a_metric_gone_nan_shows_nan_not_its_last_finite_value():
    # Before, NaN and inf were dropped: the tables kept showing the loss of the step before it diverged, and a
    # metric that was never finite was not shown at all.
    model = DashboardModel(2)
    for rank in range(2):
        model.update(dict(kind="metrics", rank=rank, time=T0, values={"loss": 0.5, "grad": float("inf")}, step=1))
    model.update(dict(kind="metrics", rank=1, time=T0 + 1, values={"loss": float("nan")}, step=2))
    model.finish(results=[None, None])
    assert model.metrics["loss"].mean_series() == ([1.0], [0.5])  # the chart: finite values only
    assert format_value(model.ranks[1].metrics["loss"]) == "nan"
    table = metric_table_html(model, "loss")
    assert ">nan<" in table and ">0.5<" in table
    assert "loss=nan" in summary_text(model) and "grad=inf" in summary_text(model)
    assert model.shown_metrics() == ["grad", "loss"]
    assert metrics_png(model, dpi=20).startswith(b"\x89PNG")


def test_a_metric_logged_every_iteration_keeps_a_bounded_series():
    # 40,000 logs a second per rank (accelerator.log in a tight loop) grew the kernel's series without end, and
    # each redraw sorted and averaged all of it under the dashboard's lock (a million points: seconds).
    model = DashboardModel(2)
    for rank in range(2):
        history = [{"values": {"v": float(i)}, "step": None} for i in range(1, 3 * MAX_SERIES_POINTS)]
        model.update(dict(kind="metrics", rank=rank, time=T0, values={"v": 3.0 * MAX_SERIES_POINTS}, history=history))
    series = model.metrics["v"]
    assert MAX_SERIES_POINTS // 2 <= len(series.points) <= MAX_SERIES_POINTS
    xs, means = series.mean_series()
    assert xs[0] < 64 and xs[-1] == 3 * MAX_SERIES_POINTS  # the whole run, averaged in small buckets
    assert max(abs(x - mean) for x, mean in zip(xs, means)) <= 32  # v == x: a bucket's mean stays near its x
    assert means[-1] == pytest.approx(3.0 * MAX_SERIES_POINTS, rel=1e-3)
    assert series.last_by_rank() == {0: 3.0 * MAX_SERIES_POINTS, 1: 3.0 * MAX_SERIES_POINTS}


def test_the_view_is_chosen_whatever_sys_modules_holds_for_the_widget_libraries(monkeypatch):
    # A module object without a spec (put there by a frontend or a test) made find_spec raise ValueError: with
    # dashboard=True the launch failed, with "auto" it ran without a dashboard; None there blocks the import.
    monkeypatch.setitem(sys.modules, "bqplot", types.ModuleType("bqplot"))
    monkeypatch.setitem(sys.modules, "ipywidgets", types.ModuleType("ipywidgets"))
    assert widgets_installed()
    monkeypatch.setitem(sys.modules, "ipywidgets", None)
    assert not widgets_installed()
    with pytest.raises(ImportError, match="nbaccel\\[notebook\\]"):
        resolve_mode("widget")


def test_a_second_interrupt_while_the_summary_draws_still_ends_the_live_view(monkeypatch):
    # Ctrl-C twice: the second KeyboardInterrupt landed in close()'s summary drawing and skipped the rest of it,
    # leaving the view open (its rich Live, its widgets) and the kernel's heap frozen for the chart import.
    thawed = []
    monkeypatch.setattr("nbaccel.notebook.background_drawing.thaw", lambda: thawed.append(True))
    dashboard = Dashboard(2, mode="plain").start()
    closed = []
    monkeypatch.setattr(dashboard._view, "finish", lambda model: (_ for _ in ()).throw(KeyboardInterrupt))
    monkeypatch.setattr(dashboard._view, "close", lambda: closed.append(True))
    with pytest.raises(KeyboardInterrupt):
        dashboard.close()
    assert thawed and closed and not dashboard._drawer.is_alive()
    dashboard.close()  # idempotent afterwards


def test_a_megabyte_line_redrawn_with_carriage_returns_is_cut_in_the_live_area():
    cell = CellOutput(kernel=False)
    cell.live(0, "stdout", ["z" * 1_000_000 + " 7/10"])
    cell.live(1, "stderr", ["rank 1: 70%|███████   | 7/10"])
    text = cell.live_text()
    assert len(text) < 2 * MAX_LIVE_ROW
    assert text.splitlines()[0].endswith("z…") and text.splitlines()[1] == "[rank 1] rank 1: 70%|███████   | 7/10"


def test_malformed_messages_from_a_custom_channel_are_dropped_not_raised(capsys):
    # observe() is documented never to raise: these raised AttributeError/ValueError/TypeError (in a launch the
    # supervisor then removed the dashboard, which stopped updating), and rank 10**9 built a billion rows.
    dashboard = Dashboard(2, mode="plain").start()
    for message in [None, "text", {"kind": "memory", "rank": 0, "rss": "abc"},
                    {"kind": "metrics", "rank": 0, "values": [1, 2]}, {"kind": "live", "rank": 0, "lines": 5},
                    {"kind": "metrics", "rank": 0, "history": [{"values": 5}]},
                    {"kind": "status", "rank": 10**9, "state": "running"},
                    {"kind": "status", "rank": 1, "local_rank": 10**9, "state": "running"}]:
        dashboard(message)
    dashboard(dict(kind="step", rank=1, time=T0, step=3))
    dashboard.finish(results=[None, None], failures={10**9: "x"})
    assert len(dashboard.model.ranks) == 2 and dashboard.model.ranks[1].step == 3
    assert [s.state for s in dashboard.model.ranks] == ["finished", "finished"]


def _one() -> int:
    return 1


def test_a_dashboard_passed_to_a_second_launch_says_it_shows_one_run(capsys):
    # Before, the second launch ran with nothing shown: start() was a no-op and every message was ignored.
    from nbaccel import notebook_launcher

    dashboard = Dashboard(2, mode="plain")
    dashboard.finish(results=[1, 1])
    with pytest.raises(RuntimeError, match="pass a new Dashboard"):
        notebook_launcher(_one, num_processes=2, dashboard=dashboard)
    with pytest.raises(RuntimeError, match="already showed a run that ended"):
        dashboard.start()
    assert [s.state for s in dashboard.model.ranks] == ["finished", "finished"]


@pytest.mark.parametrize("interval", ["10", -1, None, True])
def test_a_bad_plain_interval_is_refused_when_the_dashboard_is_made(interval):
    # Before, it was taken and the first redraw failed: "nbaccel dashboard stopped drawing: TypeError ..."
    with pytest.raises(ValueError, match="plain_interval must be a number of seconds >= 0"):
        Dashboard(2, mode="plain", plain_interval=interval)


def test_a_numpy_step_is_charted_as_that_step(sent):
    # `for step in np.arange(n)`: the step was an np.int64, which the dashboard did not take for a step, so
    # the chart counted logs instead (x 1, 2, 3 for steps 10, 20, 30).
    for step in np.arange(10, 40, 10):
        telemetry.log_metrics({"loss": 1.0}, step=step)
    assert [message["step"] for message in sent] == [10, 20, 30]
    assert all(type(message["step"]) is int for message in sent)


def test_the_runs_length_as_a_whole_float_counts_and_a_wrong_one_is_refused(sent):
    # Before, report_total_steps(len(loader) * epochs / 2) sent 88.0, which the dashboard ignored (no run
    # progress, no step/total) without a word; 88.5 or "88" too.
    telemetry.report_total_steps(88.0)
    telemetry.report_total_steps(np.int64(90))
    assert [(m["kind"], m["total"], type(m["total"])) for m in sent] == [("total", 88, int), ("total", 90, int)]
    for wrong in (88.5, "88", 0, True, None):
        with pytest.raises(ValueError, match="positive whole number of optimizer steps"):
            telemetry.report_total_steps(wrong)


def test_a_flood_of_logs_is_averaged_on_the_rank_into_bounded_sends(sent):
    # 170,000 logs a second per rank made messages the kernel read slower than the rank wrote them: the launch's end
    # waited seconds, and the rank's memory grew with the backlog. A send now carries at most MAX_LOGS_PER_SEND.
    reporter = telemetry._current()
    reporter.sampler = telemetry._Sampler(1.0, reporter)  # not started: flushed below, once
    try:
        for n in range(1, 5001):
            telemetry.log_metrics({"v": float(n)})
        telemetry.log_metrics({"v": 5001.0, "w": 1.0}, step=None)
        reporter.sampler.flush()
    finally:
        reporter.sampler = None
    (message,) = sent
    entries = [*message.get("history", []), message]
    assert len(entries) <= telemetry.MAX_LOGS_PER_SEND
    assert sum(entry.get("logs", 1) for entry in entries) == 5001
    model = DashboardModel(1)
    model.update(dict(message, rank=0, time=T0))
    xs, means = model.metrics["v"].mean_series()
    assert xs[-1] == 5001.0 and means[-1] == pytest.approx(5001.0, abs=8)
    assert max(abs(x - mean) for x, mean in zip(xs, means)) <= 8  # v == n: each average sits at its logs' end


def test_the_launchers_sink_sends_a_run_of_logs_as_one_message():
    # notebook_launcher's sink sent one message per accelerator.log: a loop logging 170,000 a second per rank
    # kept the kernel busy handing them to the dashboard one by one, and the launch ended 5 s after the ranks.
    from multiprocessing import Pipe

    from nbaccel.launch.channel import WorkerSink

    kernel_end, worker_end = Pipe(duplex=False)
    received: list[dict] = []
    reader = threading.Thread(target=lambda: received.append(kernel_end.recv()), daemon=True)
    reader.start()  # reads while the flush writes: a batch larger than the pipe's buffer would block it
    sink = WorkerSink(worker_end, rank=1, interval=3600)  # its sender thread waits: flushed below, once
    try:
        for n in range(1, 3001):
            sink(dict(kind="metrics", rank=1, time=T0 + n, values={"v": float(n)}, step=None))
        sink(dict(kind="step", rank=1, time=T0 + 3001, step=1))
        sink(dict(kind="metrics", rank=1, time=T0 + 3002, values={"v": 0.5}, step=1))
        sink.flush()
        reader.join(timeout=30)
    finally:
        sink.close()
    (batch,) = received
    kinds = [message["kind"] for message in batch["messages"]]
    assert kinds == ["metrics", "step", "metrics"]
    first = batch["messages"][0]
    entries = [*first["history"], first]
    assert len(entries) <= telemetry.MAX_LOGS_PER_SEND and sum(e.get("logs", 1) for e in entries) == 3000
    assert first["rank"] == 1 and first["local_rank"] == 1 and first["time"] == T0 + 3000
    model = DashboardModel(2)
    for message in batch["messages"]:
        model.update(message)
    assert model.metrics["v"].last_by_rank() == {1: 0.5} and model.ranks[1].step == 1
    assert max(model.metrics["v"].points) == 3000.0  # the 3000 stepless logs still count as 3000


def test_logs_of_ranks_sharing_a_sink_are_not_merged_across_ranks():
    # torch_xla runs ranks as threads of one process, which may share a sink: a run of logs is one rank's
    batch = [dict(kind="metrics", rank=rank, local_rank=rank, time=T0 + n, values={"v": float(rank)}, step=n)
             for n, rank in enumerate([0, 0, 1, 1, 0])]
    merged = telemetry.coalesce_metrics(batch)
    assert [(m["rank"], len(m.get("history", ()))) for m in merged] == [(0, 1), (1, 1), (0, 0)]


@pytest.mark.parametrize("mode", ["widget", "html"])
def test_a_notebook_view_asked_for_in_plain_python_is_one_clear_error(monkeypatch, mode):
    # Before, notebook_launcher(..., dashboard="widget") in a script printed the display dicts as text, then
    # "RuntimeWarning: nbaccel dashboard stopped drawing: AttributeError: 'NoneType' object has no attribute 'update'".
    from IPython.core.interactiveshell import InteractiveShell

    monkeypatch.setattr(InteractiveShell, "_instance", None, raising=False)  # no shell: plain Python
    with pytest.raises(ValueError, match="this is plain Python .*'terminal' or 'plain'"):
        Dashboard(2, mode=mode)


def test_a_notebook_view_asked_for_in_plain_python_fails_before_any_rank_starts(tmp_path):
    """notebook_launcher checks the view first (observers.check_dashboard): no rank runs the function."""
    from nbaccel import notebook_launcher

    marker = tmp_path / "ran"
    with pytest.raises(ValueError, match="this is plain Python"):
        notebook_launcher(marker.touch, num_processes=2, dashboard="html")
    assert not marker.exists()
