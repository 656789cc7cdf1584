"""Live rank output without a kernel: the screen model of a worker stream, display ordering, the cell
renderer outside IPython, and a real 2-rank launch whose tqdm bars reach observers live (issue 16)."""

from __future__ import annotations

import re

import pytest

from nbaccel.launch.screen import MARK, DisplayOrder, Screen, resolve
from nbaccel.notebook.dashboard_model import DashboardModel
from nbaccel.notebook.live_output import CellOutput, label


def record() -> tuple[Screen, list]:
    events: list = []
    screen = Screen(lambda line: events.append(("line", line)), lambda rows: events.append(("live", rows)),
                    lambda mark: events.append(("mark", mark)))
    return screen, events


def test_plain_lines_pass_through_at_once_with_their_colours():
    screen, events = record()
    screen.feed(b"one\ntw")
    screen.feed(b"o\n\x1b[31mred\x1b[0m\n")
    assert events == [("line", "one"), ("line", "two"), ("line", "\x1b[31mred\x1b[0m")]


def test_a_carriage_return_bar_is_live_then_final_once():
    screen, events = record()
    for n in range(3):
        screen.feed(f"\r{n}/3 |{'#' * n}".encode())
    screen.feed(b"\r3/3 |###\n")
    assert events == [("live", ["0/3 |"]), ("live", ["1/3 |#"]), ("live", ["2/3 |##"]),
                      ("line", "3/3 |###"), ("live", [])]


def test_a_multi_line_redraw_with_the_cursor_hidden_commits_only_what_scrolled_away():
    screen, events = record()  # rich.live: hide the cursor, draw 2 rows, move up, redraw; print above it
    screen.feed(b"\x1b[?25l\r\x1b[2Ka 1\nb 1")
    screen.feed(b"\r\x1b[2K\x1b[1A\x1b[2Ka 2\nb 2")
    screen.feed(b"\r\x1b[2K\x1b[1A\x1b[2Kprinted\na 3\nb 3")
    screen.feed(b"\r\x1b[2K\x1b[1A\x1b[2Ka done\nb done\n\x1b[?25h")
    lines = [value for kind, value in events if kind == "line"]
    lives = [value for kind, value in events if kind == "live"]
    assert lines == ["printed", "a done", "b done"]
    assert lives == [["a 1", "b 1"], ["a 2", "b 2"], ["a 3", "b 3"], []]


def test_an_escape_sequence_cut_by_a_read_is_held_until_complete():
    screen, events = record()
    mark = MARK.format(7).encode()
    screen.feed(b"before\n" + mark[:4])
    screen.feed(mark[4:] + b"after\n\r50%\x1b[")
    screen.feed(b"K\n")
    assert events == [("line", "before"), ("mark", "7"), ("line", "after"), ("live", ["50%"]),
                      ("line", "50%"), ("live", [])]


def test_finish_delivers_a_last_line_without_newline_and_a_bar_in_its_last_state():
    screen, events = record()
    screen.feed(b"\r10%\r20%")
    screen.finish()
    assert events[-2:] == [("line", "20%"), ("live", [])]
    assert resolve("a\r  0%\r100%\nnext\n") == "100%\nnext\n"
    assert resolve("no control\n") == "no control\n"


def test_displays_wait_for_their_mark_in_the_stdout_stream():
    shown: list = []
    order = DisplayOrder(lambda rank, message: shown.append((rank, message["seq"])))
    order.arrived(0, {"kind": "display", "seq": 1})
    assert shown == []  # the text printed before it may still be in the pipe
    order.marked(0, "1")
    order.marked(1, "1")  # the mark came first this time
    order.arrived(1, {"kind": "display", "seq": 1})
    order.arrived(0, {"kind": "display", "seq": 3})
    order.arrived(0, {"kind": "display", "seq": 2})
    order.flush()  # the stream ended without the marks: shown in their order
    assert shown == [(0, 1), (1, 1), (0, 2), (0, 3)]


def test_outside_a_kernel_displays_print_their_text_with_the_rank(capsys):
    cell = CellOutput(kernel=False)
    cell.display(1, {"data": {"text/plain": "line a\nline b", "text/html": "<b>x</b>",
                              "application/vnd.jupyter.widget-view+json": {"model_id": "m"}}})
    cell.live(0, "stderr", ["50%"])
    cell.close()
    assert capsys.readouterr().out == "[rank 1] line a\n[rank 1] line b\n"
    assert cell.live_text() == ""


def test_labels_name_the_rank_in_text_and_html():
    data = label(3, {"text/plain": "value", "text/html": "<p>v</p>", "image/png": b"png"})
    assert data["text/plain"] == "[rank 3] value"
    assert "rank 3" in data["text/html"] and "<p>v</p>" in data["text/html"] and data["image/png"] == b"png"
    # a figure (plt.show(): image/png and text/plain only) gets an HTML form: the caption above the image
    figure = label(0, {"text/plain": "<Figure size 400x300 with 1 Axes>", "image/png": b"\x89PNG"})
    assert figure["text/html"].startswith("<div class='nbaccel-display' data-rank='0'>")
    assert ">rank 0</div><img src='data:image/png;base64,iVBORw==' alt='rank 0 image'>" in figure["text/html"]
    assert figure["image/png"] == b"\x89PNG" and figure["text/plain"].startswith("[rank 0] <Figure")
    assert label(1, {"image/jpeg": "/9j/4AAQ\n"})["text/html"].count("data:image/jpeg;base64,/9j/4AAQ'") == 1
    assert label(2, {"text/markdown": "**hi**"})["text/markdown"] == "<sub>rank 2</sub>\n\n**hi**"


def test_the_dashboard_shows_a_live_bar_as_the_last_output():
    model = DashboardModel(2)
    model.update({"kind": "live", "rank": 1, "time": 1.0, "stream": "stderr", "lines": ["45%|####  | 9/20"]})
    assert model.ranks[1].last_output == "45%|####  | 9/20"


def _bar_loop(steps: int) -> int:
    import time

    from tqdm import tqdm

    for _ in tqdm(range(steps), mininterval=0.05):
        time.sleep(0.1)
    return steps


@pytest.mark.timeout(120)
def test_launched_tqdm_bars_reach_observers_live_and_end_in_their_final_state(capfd):
    from nbaccel import notebook_launcher

    messages: list[dict] = []
    assert notebook_launcher(_bar_loop, (12,), num_processes=2, dashboard=False,
                             observers=[messages.append]) == [12, 12]
    captured = capfd.readouterr()
    out, err = captured.out, captured.err
    for rank in (0, 1):
        live = [m for m in messages if m["kind"] == "live" and m["rank"] == rank and m["lines"]]
        positions = {int(found) for m in live for found in re.findall(r"\b(\d+)/12\b", m["lines"][-1])}
        assert len(positions & set(range(1, 12))) >= 3, live
        # the finished bar (tqdm writes it to stderr) is printed to stdout: shown as it was live, not as an error
        assert re.search(rf"^\[rank {rank}\] 100%.*12/12", out, re.M), out
        assert not re.search(rf"^\[rank {rank}\] 100%", err, re.M), err
    assert "\r" not in out + err


RANK_SIDE = r"""
import io, sys
from nbaccel.launch.worker import rank_display
sent = []
rank_display.install(sent.append, mark=False)
from tqdm.notebook import tqdm  # imported after install: the rank's copy draws text, no widget
buffer = io.StringIO()
for _ in tqdm(range(3), file=buffer, mininterval=0):
    pass
import comm
print("bar:", repr(buffer.getvalue().splitlines()[-1] if buffer.getvalue() else ""))
print("comm:", type(comm.create_comm()).__name__)
import rich.console
print("rich jupyter:", rich.console.Console().is_jupyter, "terminal:", rich.console.Console().is_terminal)
"""


def test_in_a_rank_tqdm_notebook_draws_text_widgets_get_silent_comms_and_rich_draws_as_a_terminal():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", RANK_SIDE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "3/3" in done.stdout.split("bar:")[1].splitlines()[0], done.stdout
    assert "comm: DummyComm" in done.stdout
    assert "rich jupyter: False terminal: True" in done.stdout


def test_clear_output_of_a_rank_clears_only_its_own_displays(monkeypatch):
    import IPython.display

    published: list = []
    monkeypatch.setattr(IPython.display, "publish_display_data",
                        lambda data, metadata=None, **kw: published.append((data, kw)))
    cell = CellOutput(kernel=True)
    cell.display(0, {"data": {"text/plain": "a"}})
    cell.display(0, {"data": {"text/plain": "b"}})
    cell.display(1, {"data": {"text/plain": "other rank"}})
    first, second = (kw["transient"]["display_id"] for _, kw in published[:2])
    cell.clear_output(0, wait=True)
    assert len(published) == 3  # wait=True: nothing cleared until rank 0 shows its next output
    cell.display(0, {"data": {"text/plain": "c"}})
    assert published[3] == ({"text/plain": "[rank 0] c"}, {"transient": {"display_id": first}, "update": True})
    assert published[4] == ({"text/plain": ""}, {"transient": {"display_id": second}, "update": True})
    cell.clear_output(0)
    assert published[5] == ({"text/plain": ""}, {"transient": {"display_id": first}, "update": True})
    assert len(published) == 6  # rank 1's output stays


def test_a_ranks_cell_shows_finished_bars_as_progress_and_other_stderr_as_errors():
    from nbaccel.launch.pool.rank_view import render_html, split_progress
    from nbaccel.launch.pool.results import RankResult

    stderr = "\r  0%|          | 0/10\r100%|##########| 10/10\nUserWarning: careful\n"
    assert split_progress(stderr) == ("\r  0%|          | 0/10\r100%|##########| 10/10\n", "UserWarning: careful\n")
    page = render_html([RankResult(0, stderr=stderr)])
    bar = page.index("100%|##########| 10/10")
    assert page.rfind("<pre class='nbaccel-progress'", 0, bar) > page.rfind("background:#fdd", 0, bar)
    assert "| 0/10" not in page  # its carriage-return history collapsed
    warning = page.index("UserWarning: careful")
    assert page.rfind("background:#fdd", 0, warning) > bar  # a real stderr line stays marked
