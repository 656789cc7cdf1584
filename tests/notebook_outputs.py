"""Reading an executed notebook's outputs, and the checks of notebook 01 that the binder test reuses."""

from __future__ import annotations

import re
from dataclasses import dataclass

import nbformat

ANSI = re.compile(r"\x1b\[[0-9;]*m")


@dataclass
class Cell:
    source: str
    text: str  # stream text, text/plain of results and displays, and error tracebacks, joined
    mimetypes: set[str]
    error: str | None  # "Name: message" of an error output
    html: str = ""  # the text/html of results and displays, joined


@dataclass
class Executed:
    cells: list[Cell]
    seconds: float = 0.0

    def cell(self, marker: str) -> Cell:
        """The code cell whose source contains `marker` (exactly one must)."""
        found = [cell for cell in self.cells if marker in cell.source]
        assert len(found) == 1, f"{len(found)} cells contain {marker!r}"
        return found[0]


def joined_streams(outputs: list) -> list:
    """`outputs` with adjacent pieces of one stream joined, as a notebook shows them: ipykernel flushes
    stdout on a timer, so one print can arrive as two stream outputs."""
    joined = []
    for output in outputs:
        previous = joined[-1] if joined else None
        if (output["output_type"] == "stream" and previous is not None and previous["output_type"] == "stream"
                and previous["name"] == output["name"]):
            joined[-1] = nbformat.v4.new_output("stream", name=output["name"], text=previous["text"] + output["text"])
        else:
            joined.append(output)
    return joined


def read_outputs(nb: nbformat.NotebookNode, seconds: float = 0.0) -> Executed:
    """The code cells of an executed notebook with their outputs as text."""
    cells = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        parts, html, mimetypes, error = [], [], set(), None
        for output in joined_streams(cell.get("outputs", [])):
            if output.output_type == "stream":
                parts.append(output.text)
            elif output.output_type in ("execute_result", "display_data"):
                mimetypes.update(output.data)
                parts.append(output.data.get("text/plain", ""))
                html.append(output.data.get("text/html", ""))
            elif output.output_type == "error":
                error = f"{output.ename}: {output.evalue}"
                parts.append(ANSI.sub("", "\n".join(output.traceback)))
        cells.append(Cell(cell.source, "\n".join(parts), mimetypes, error, "\n".join(html)))
    return Executed(cells, seconds)


def check_quickstart(run: Executed) -> float:
    """Notebook 01 on a machine without a GPU: 2 CPU ranks trained, agreed, plotted. Returns the accuracy."""
    launch = run.cell("notebook_launcher(train")
    ranks = re.findall(r"rank (\d+) on (\w+): final accuracy ([0-9.]+)", launch.text)
    assert [rank for rank, _, _ in ranks] == ["0", "1"], launch.text  # no GPU here: 2 CPU processes
    assert {device for _, device, _ in ranks} == {"cpu"}
    assert len({accuracy for _, _, accuracy in ranks}) == 1, "gather_for_metrics: every rank sees every image"
    # The per-epoch lines come from rank 0 only (accelerator.print), through the launcher's output relay.
    epochs = re.findall(r"\[rank 0\] epoch (\d+): accuracy ([0-9.]+) on 397 test images", launch.text)
    assert [int(epoch) for epoch, _ in epochs] == list(range(8)), launch.text
    assert "[rank 1] epoch" not in launch.text
    # the live dashboard became its summary: a table and a PNG chart of the loss, no widget left in the file
    assert "application/vnd.jupyter.widget-view+json" not in launch.mimetypes, "a dead widget box when reopened"
    assert "class='nbaccel-summary' data-state='finished'" in launch.html and "<svg" not in launch.html
    assert "image/png" in launch.mimetypes and "chart of loss" in launch.text
    plot = run.cell("plt.subplots")
    assert "image/png" in plot.mimetypes
    found = re.search(r"final accuracy: ([0-9.]+)", plot.text)
    assert found, plot.text
    accuracy = float(found.group(1))
    assert accuracy > 0.85, plot.text
    assert abs(accuracy - float(ranks[0][2])) < 1e-3
    return accuracy
