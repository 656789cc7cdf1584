"""Rich output from the ranks in a real Jupyter kernel: live progress bars, display(), figures (issue 16).

The kernel is driven with jupyter_client directly so each iopub message is read with the time it arrived,
and the kernel's own log (its stderr) is kept: ipykernel writes "attempted to send message from fork"
there when a forked worker talks to its sockets.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

jupyter_client = pytest.importorskip("jupyter_client")
pytestmark = [pytest.mark.kernel, pytest.mark.slow, pytest.mark.timeout(300)]

FORK_WARNING = "attempted to send message from fork"
POSITION = re.compile(r"\[rank (\d)\].*?\b(\d+)/20\b")

SETUP = """
import os, time
import logging
logging.basicConfig()  # a handler bound to the kernel's stderr: the forked ranks inherit it
from tqdm.auto import tqdm  # imported in the kernel: the notebook (widget) class, inherited by forked ranks
from nbaccel import notebook_launcher

def loop(bar):
    for _ in bar(range(20)):
        time.sleep(0.3)  # 6 s
    print("END", os.environ["RANK"], time.time(), flush=True)
    logging.getLogger("train").warning("loop over")
"""
AUTO_NO_DASHBOARD = "notebook_launcher(loop, (tqdm,), num_processes=2, dashboard=False)"
PLAIN_WITH_DASHBOARD = """
import tqdm as tqdm_package
notebook_launcher(loop, (tqdm_package.tqdm,), num_processes=2)
"""
RICH = """
def rich_loop():
    from rich.progress import track
    for _ in track(range(20), description="rich"):
        time.sleep(0.3)
    print("END", os.environ["RANK"], time.time(), flush=True)
notebook_launcher(rich_loop, num_processes=2, dashboard=False)
"""
ACCELERATE = """
def with_accelerate():
    # what transformers' Trainer, PEFT and diffusers do: import the real Accelerate
    import accelerate
    import torch
    from accelerate.logging import get_logger
    from accelerate.utils import tqdm as accelerate_tqdm
    accelerator = accelerate.Accelerator()
    logging.getLogger().setLevel(logging.INFO)
    get_logger("accel").info(f"state {accelerator.distributed_type} {accelerator.num_processes}",
                             main_process_only=False)
    gathered = accelerator.gather(torch.tensor([accelerator.process_index])).tolist()
    for _ in accelerate_tqdm(range(20), main_process_only=False):
        time.sleep(0.3)
    print("END", os.environ["RANK"], time.time(), flush=True)
    return str(accelerator.distributed_type), accelerator.num_processes, gathered
print("accelerate:", notebook_launcher(with_accelerate, num_processes=2, dashboard=False))
"""
DISPLAYS = """
def show():
    import matplotlib.pyplot as plt
    import pandas as pd
    import ipywidgets
    from IPython.display import HTML, clear_output, display
    rank = int(os.environ["RANK"])
    print("text before", rank)
    display(HTML(f"<b>html of rank {rank}</b>"))
    display(pd.DataFrame({"rank": [rank], "value": [rank * 1.5]}))
    display(HTML("<i>cleared later</i>"))
    clear_output()
    if rank == 0:
        fig, ax = plt.subplots()
        ax.imshow([[3, 1], [0, 4]])
        ax.set_title("confusion matrix")
        plt.show()
    display(ipywidgets.IntSlider(value=7))
    print("text after", rank)
    return rank
print(notebook_launcher(show, num_processes=2, dashboard=False{extra}))
"""


@dataclass
class Cell:
    source: str
    messages: list[tuple[float, dict]] = field(default_factory=list)  # (arrival time.time(), iopub message)

    def of_type(self, *types: str) -> list[tuple[float, dict]]:
        return [(t, m) for t, m in self.messages if m["msg_type"] in types]

    def stream(self) -> str:
        return "".join(m["content"]["text"] for _, m in self.of_type("stream"))

    def error(self) -> str | None:
        errors = self.of_type("error")
        return "\n".join(errors[0][1]["content"]["traceback"]) if errors else None


def run_cells(sources: list[str], tmp_path: Path) -> tuple[list[Cell], str]:
    """Run `sources` in a fresh python3 kernel; the iopub messages of each cell and the kernel's log."""
    log_path = tmp_path / "kernel.log"
    cells = [Cell(source) for source in sources]
    with open(log_path, "w") as log:
        manager = jupyter_client.KernelManager(kernel_name="python3")
        manager.start_kernel(stdout=log, stderr=log, cwd=str(tmp_path))
        client = manager.client()
        client.start_channels()
        try:
            client.wait_for_ready(timeout=120)
            for cell in cells:
                msg_id = client.execute(cell.source)
                deadline = time.monotonic() + 150
                while time.monotonic() < deadline:
                    message = client.get_iopub_msg(timeout=150)
                    if message["parent_header"].get("msg_id") != msg_id:
                        continue
                    if message["msg_type"] == "status":
                        if message["content"]["execution_state"] == "idle":
                            break
                        continue
                    cell.messages.append((time.time(), message))
        finally:
            client.stop_channels()
            manager.shutdown_kernel(now=True)
    return cells, log_path.read_text()


def texts(cell: Cell) -> list[str]:
    """Every text the cell shows: stream text and the text/plain of displays and their updates."""
    found = [m["content"]["text"] for _, m in cell.of_type("stream")]
    for _, message in cell.of_type("display_data", "update_display_data", "execute_result"):
        found.append(str(message["content"]["data"].get("text/plain", "")))
    return found


def check_live_bars(cell: Cell) -> None:
    """Both ranks' bars showed a position strictly between 0 and 20 at least 1.5 s before their loop ended,
    the final 20/20 is there, and no text holds a carriage-return history."""
    assert cell.error() is None, cell.error()
    ends = {int(rank): float(when) for rank, when in re.findall(r"\[rank \d\] END (\d) ([0-9.]+)", cell.stream())}
    assert sorted(ends) == [0, 1], cell.stream()
    early: dict[int, list[int]] = {0: [], 1: []}
    for arrived, message in cell.of_type("display_data", "update_display_data"):
        for rank, position in POSITION.findall(str(message["content"]["data"].get("text/plain", ""))):
            if 0 < int(position) < 20 and arrived <= ends[int(rank)] - 1.5:
                early[int(rank)].append(int(position))
    assert early[0] and early[1], f"no live position 1.5 s before the end: {early}; {texts(cell)}"
    assert len(set(early[0])) >= 3, early  # it moved while the loop ran (updates every 0.2 s)
    for rank in (0, 1):
        assert re.search(rf"\[rank {rank}\].*20/20", cell.stream()), cell.stream()  # the final state stays
    for text in texts(cell):
        assert "\r" not in text, repr(text)


@pytest.fixture(scope="module")
def bars(tmp_path_factory):
    return run_cells([SETUP, AUTO_NO_DASHBOARD, PLAIN_WITH_DASHBOARD, RICH, ACCELERATE],
                     tmp_path_factory.mktemp("bars"))


def test_tqdm_auto_bars_are_live_without_the_dashboard(bars):
    cells, log = bars
    assert cells[0].error() is None, cells[0].error()
    check_live_bars(cells[1])
    assert "[rank 1] WARNING:train:loop over" in cells[1].stream()  # the kernel's log handler, per rank
    assert FORK_WARNING not in log, log[-3000:]


def test_plain_tqdm_bars_are_live_with_the_dashboard(bars):
    cells, log = bars
    check_live_bars(cells[2])
    # the dashboard reserves its place at the start and its thread puts the widget there (an update)
    widgets = [m for _, m in cells[2].of_type("display_data", "update_display_data")
               if "application/vnd.jupyter.widget-view+json" in m["content"]["data"]]
    assert widgets, "the dashboard was not shown"
    assert FORK_WARNING not in log, log[-3000:]


def test_rich_progress_bars_are_live(bars):
    cells, _ = bars
    cell = cells[3]
    assert cell.error() is None, cell.error()
    ends = {int(rank): float(when) for rank, when in re.findall(r"\[rank \d\] END (\d) ([0-9.]+)", cell.stream())}
    live = [(arrived, str(m["content"]["data"].get("text/plain", "")))
            for arrived, m in cell.of_type("display_data", "update_display_data")]
    for rank in (0, 1):
        early = [text for arrived, text in live
                 if arrived <= ends[rank] - 1.5 and re.search(rf"\[rank {rank}\] rich .* ([1-9]\d?)%", text)]
        assert early, live
        assert re.search(rf"\[rank {rank}\] rich .* 100%", cell.stream()), cell.stream()
    for text in texts(cell):
        assert "\r" not in text and "\x1b[" not in text, repr(text)


def test_real_accelerate_inside_the_launcher_sees_the_ranks_and_its_bars_are_live(bars):
    cells, log = bars
    cell = cells[4]
    check_live_bars(cell)
    out = cell.stream()
    assert "accelerate: [('DistributedType.MULTI_CPU', 2, [0, 1]), ('DistributedType.MULTI_CPU', 2, [0, 1])]" in out
    for rank in (0, 1):  # Accelerate's logger (MultiProcessAdapter) through the kernel's log handler
        assert f"[rank {rank}] INFO:accel:[RANK {rank}] state DistributedType.MULTI_CPU 2" in out, out
    assert FORK_WARNING not in log, log[-3000:]


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_display_and_figures_reach_the_cell(start_method, tmp_path):
    extra = "" if start_method == "fork" else ", start_method='spawn'"
    cells, log = run_cells([SETUP, DISPLAYS.replace("{extra}", extra)], tmp_path)
    cell = cells[1]
    assert cell.error() is None, cell.error()
    assert "[0, 1]" in cell.stream()
    outputs = [m for _, m in cell.of_type("display_data", "update_display_data")]

    def rank_of(message: dict) -> int | None:
        return message["content"].get("metadata", {}).get("nbaccel", {}).get("rank")

    figures = [m for m in outputs if "image/png" in m["content"]["data"]]
    assert len(figures) == 1 and rank_of(figures[0]) == 0, [sorted(m["content"]["data"]) for m in outputs]
    for rank in (0, 1):
        html = [m for m in outputs if f"<b>html of rank {rank}</b>" in m["content"]["data"].get("text/html", "")]
        assert len(html) == 1 and rank_of(html[0]) == rank
        tables = [m for m in outputs if rank_of(m) == rank and "<table" in m["content"]["data"].get("text/html", "")]
        assert tables, "a pandas table as HTML"
        sliders = [m for m in outputs if rank_of(m) == rank and "IntSlider(value=7)" in
                   m["content"]["data"].get("text/plain", "")]
        assert sliders and all("application/vnd.jupyter.widget-view+json" not in m["content"]["data"] for m in sliders)
    # clear_output from a rank cleared that rank's displays: each shown output was replaced by an empty one
    cleared = [m for m in cell.of_type("update_display_data") if m[1]["content"]["data"] == {"text/plain": ""}]
    assert len(cleared) == 6, [m[1]["content"] for m in cell.of_type("update_display_data")]
    # in order with the rank's text: "text before", then its displays, then "text after"
    for rank in (0, 1):
        order = []
        for _, message in cell.messages:
            content = message["content"]
            if message["msg_type"] == "stream":
                order += [line for line in content["text"].splitlines() if line.startswith(f"[rank {rank}] text")]
            elif message["msg_type"] == "display_data" and rank_of(message) == rank:
                order.append("display")
        assert order[0] == f"[rank {rank}] text before {rank}" and order[-1] == f"[rank {rank}] text after {rank}", order
        assert order.count("display") == (5 if rank == 0 else 4), order
    assert FORK_WARNING not in log, log[-3000:]


RANKS_CELLS = [
    "%load_ext nbaccel\n%ranks start -n 2",
    "%%ranks\nimport time\nfrom tqdm.auto import tqdm\nfrom IPython.display import HTML, display\n"
    "for _ in tqdm(range(20)):\n    time.sleep(0.3)\nimport os\nprint('END', os.environ['RANK'], time.time())\n"
    "display(HTML('<u>rank display</u>'))\n'ok'",
    "%ranks stop",
]


def test_ranks_cell_shows_live_bars_and_displays(tmp_path):
    cells, log = run_cells(RANKS_CELLS, tmp_path)
    cell = cells[1]
    assert cell.error() is None, cell.error()
    views = [(arrived, str(m["content"]["data"].get("text/plain", "")))
             for arrived, m in cell.of_type("display_data", "update_display_data")]
    final = views[-1][1]
    ends = {int(rank): float(when) for rank, when in re.findall(r"\[rank \d\] END (\d) ([0-9.]+)", final)}
    assert sorted(ends) == [0, 1], final
    for rank in (0, 1):
        early = [text for arrived, text in views if arrived <= ends[rank] - 1.5 and
                 any(0 < int(position) < 20 for r, position in POSITION.findall(text) if int(r) == rank)]
        assert early, views
        assert re.search(rf"\[rank {rank}\] 100%.*20/20", final), final
    shown = [m for _, m in cell.of_type("display_data") if "<u>rank display</u>" in m["content"]["data"].get("text/html", "")]
    assert len(shown) == 2
    for text in texts(cell):
        assert "\r" not in text, repr(text)
    assert FORK_WARNING not in log, log[-3000:]
