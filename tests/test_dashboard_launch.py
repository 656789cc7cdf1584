"""The dashboard wired to the launchers: a rich terminal view under a pty, mode strings, a RankPool."""

from __future__ import annotations

import os
import re
import select
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from process_helpers import started_children

ROOT = Path(__file__).resolve().parent.parent
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")

PTY_SCRIPT = textwrap.dedent('''
    import sys
    from nbaccel.launch import notebook_launcher
    from nbaccel.notebook import Dashboard

    def work():
        import os, time
        rank = os.environ["RANK"]
        for i in range(3):
            print(f"marker-{rank}-{i}", flush=True)
            time.sleep(0.2)
        return rank

    print("results", notebook_launcher(work, num_processes=2, dashboard=Dashboard(2, mode="terminal"),
                                       timeout=60))
''')


def run_in_pty(script: str, timeout: float = 90) -> str:
    """Run `python -c script` with a pseudo-terminal as stdin/stdout/stderr; return what it wrote."""
    pty = pytest.importorskip("pty")
    master, slave = pty.openpty()
    env = dict(os.environ, TERM="xterm", COLUMNS="140", LINES="40")
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=slave, stdout=slave, stderr=slave, env=env,
                            close_fds=True, cwd=ROOT)
    os.close(slave)
    chunks = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(master)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, b"".join(chunks).decode(errors="replace")
    return b"".join(chunks).decode(errors="replace")


def visible_lines(output: str) -> list[str]:
    """Each terminal line as last drawn: escape codes dropped, text after the last carriage return."""
    return [ANSI.sub("", line).rstrip("\r").split("\r")[-1] for line in output.split("\n")]


def test_worker_lines_go_above_the_rich_table_intact_and_once():
    output = run_in_pty(PTY_SCRIPT)
    lines = visible_lines(output)
    assert "┃" in output  # the rich table was drawn
    for rank in (0, 1):
        for i in range(3):
            expected = f"[rank {rank}] marker-{rank}-{i}"
            assert lines.count(expected) == 1, (expected, [line for line in lines if expected in line])
            assert sum(expected in line for line in lines) == 1
    assert "results ['0', '1']" in lines


def test_dashboard_mode_strings_build_that_view(monkeypatch, capsys):
    import nbaccel.notebook
    from nbaccel.launch import notebook_launcher

    built = []
    real = nbaccel.notebook.Dashboard

    def recording(num_processes, **options):
        board = real(num_processes, **options)
        built.append((num_processes, options.get("mode"), board.mode))
        return board

    monkeypatch.setattr(nbaccel.notebook, "Dashboard", recording)
    assert notebook_launcher(lambda: 5, num_processes=2, dashboard="plain", timeout=60) == [5, 5]
    assert built == [(2, "plain", "plain")]
    out = capsys.readouterr().out
    assert "rank 0" in out and "rank 1" in out and "finished" in out  # the plain view's lines
    assert notebook_launcher(lambda: 6, num_processes=1, dashboard="terminal", timeout=60) == [6]
    assert built[-1] == (1, "terminal", "terminal")


def test_ranks_that_end_before_their_first_memory_sample_show_their_peak(capsys, monkeypatch):
    """A launch shorter than the memory interval (1 s): each rank sends its peak host memory with its result
    (the kernel cannot sample a process that has already exited), so the summary shows it rather than '–';
    with NBACCEL_MEMORY_INTERVAL=0 (no memory reports) nothing is sent."""
    from nbaccel.launch import notebook_launcher

    seen = []
    assert notebook_launcher(lambda: 5, num_processes=2, dashboard=seen.append, timeout=60) == [5, 5]
    peaks = {m["rank"]: m["rss_peak"] for m in seen if m.get("kind") == "memory"}
    assert sorted(peaks) == [0, 1] and all(peak > 2**20 for peak in peaks.values()), seen
    notebook_launcher(lambda: 5, num_processes=2, dashboard="plain", timeout=60)
    assert "peak RAM –" not in capsys.readouterr().out
    monkeypatch.setenv("NBACCEL_MEMORY_INTERVAL", "0")
    seen.clear()
    notebook_launcher(lambda: 5, num_processes=2, dashboard=seen.append, timeout=60)
    assert [m for m in seen if m.get("kind") == "memory"] == []


def test_the_terminal_column_shows_a_peak_known_alone():
    from nbaccel.notebook.console import _compact

    assert _compact(None, 3 * 2**20) == "–/3.0M"
    assert _compact(None, None, None) == "–"
    assert _compact(2**20, None, 3 * 2**20) == "1.0M/3.0M"


def _fails_on_rank_1():
    from nbaccel import PartialState

    if PartialState().process_index == 1:
        raise ValueError("boom")


def test_the_summary_names_a_failed_ranks_error_in_one_line(capsys):
    from nbaccel.launch import LaunchError, notebook_launcher

    with pytest.raises(LaunchError, match="rank 1: ValueError: boom"):
        notebook_launcher(_fails_on_rank_1, num_processes=2, dashboard="plain", timeout=60)
    out = capsys.readouterr().out
    assert "rank 1 [cpu] failed: ValueError: boom;" in out, out
    assert "WorkerFailure(" not in out, out


@pytest.mark.parametrize("value", ["Plain", "bogus", 3])
def test_unknown_dashboard_value_is_refused_before_starting(value):

    from nbaccel.launch import notebook_launcher

    with pytest.raises(TypeError, match=r"dashboard=.*'widget', 'html', 'terminal', 'plain'"):
        notebook_launcher(lambda: 1, num_processes=2, dashboard=value)
    assert started_children() == []


POOL_CELL = textwrap.dedent('''
    import nbaccel.telemetry as telemetry
    from nbaccel import PartialState
    for step in range(1, 4):
        telemetry.report_step(step, 3)
        telemetry.log_metrics({"loss": 1.0 / step}, step=step)
    PartialState().wait_for_everyone()
    print("cell done", PartialState().process_index)
''')


def test_rank_pool_sends_its_ranks_messages_to_attached_observers(capsys):
    from nbaccel.launch.pool import RankPool
    from nbaccel.notebook import Dashboard

    seen: list[dict] = []
    board = Dashboard(2, mode="plain", plain_interval=3600).start()
    with RankPool(2, observers=[seen.append]) as pool:
        assert [m["state"] for m in seen if m["kind"] == "status"] == ["running", "running"]  # attached at start
        seen.clear()
        pool.attach(board)
        results = pool.exec(POOL_CELL)
        assert all(r.error is None for r in results)
        deadline = time.monotonic() + 10  # telemetry arrives on the reader thread, within ~50 ms
        while time.monotonic() < deadline and sum(m["kind"] == "step" for m in seen) < 6:
            time.sleep(0.05)
        by_kind = {}
        for message in seen:
            by_kind.setdefault(message["kind"], []).append(message)
        assert {(m["rank"], m["step"]) for m in by_kind["step"]} == {(r, s) for r in (0, 1) for s in (1, 2, 3)}
        assert {m["rank"] for m in by_kind["metrics"]} == {0, 1}
        assert any(m.get("op") == "wait_for_everyone" for m in by_kind["collective"])
        outputs = [(m["rank"], m["stream"], m["text"]) for m in by_kind["output"]]
        assert outputs.count((0, "stdout", "cell done 0")) == 1 and outputs.count((1, "stdout", "cell done 1")) == 1
        states = [(m["rank"], m["state"]) for m in by_kind["status"]]
        assert states[-2:] == [(0, "finished"), (1, "finished")] and (0, "running") in states
        assert [s.step for s in board.model.ranks] == [3, 3]  # the dashboard saw it too
        pool.exec("raise ValueError('boom')", ranks=[1])
        assert seen[-1]["state"] == "failed" and seen[-1]["error"] == "ValueError: boom"

        pool.detach(seen.append)
        pool.detach(board)
        count = len(seen)
        pool.exec(POOL_CELL)
        time.sleep(0.2)
        assert len(seen) == count and pool.observers == []
    board.close()
    assert "rank 0" in capsys.readouterr().out


def test_rank_pool_observer_argument_is_checked():
    from nbaccel.launch.pool import RankPool

    with pytest.raises(TypeError, match="not an observer"):
        RankPool(2, observers=[42])

    assert started_children() == []
