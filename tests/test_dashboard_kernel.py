"""The dashboard in a real Jupyter kernel (nbclient): a widget view while it runs, replaced by a static
summary (an HTML table and a PNG chart) when the run ends: the saved notebook holds no widget output."""

from __future__ import annotations

import base64
import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

pytestmark = [pytest.mark.kernel, pytest.mark.slow]

TESTS = Path(__file__).resolve().parent
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


def run_notebook(*sources: str, timeout: int = 120) -> nbformat.NotebookNode:
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(source) for source in sources]
    NotebookClient(notebook, timeout=timeout, kernel_name="python3", allow_errors=False,
                   store_widget_state=True).execute()
    return notebook


def displays(cell) -> list[dict]:
    return [output["data"] for output in cell.outputs if output["output_type"] in ("display_data", "execute_result")]


def rank_states(page: str) -> list[str]:
    return re.findall(r"<tr class='nbaccel-rank' data-rank='\d+' data-state='(\w+)'", page)


def check_dashboard_outputs(cell) -> str:
    """The live view's output became the summary: one HTML table, then one PNG chart right below it, and no
    widget output left (it would read "model not found" in a reopened notebook); returns the summary."""
    data = displays(cell)
    assert not any(WIDGET_MIME in d for d in data), [list(d) for d in data]
    summaries = [i for i, d in enumerate(data) if "nbaccel-summary" in d.get("text/html", "")]
    assert len(summaries) == 1, [list(d) for d in data]
    index = summaries[0]
    assert "image/png" in data[index + 1] and "chart of loss" in data[index + 1]["text/plain"]
    assert base64.b64decode(data[index + 1]["image/png"]).startswith(b"\x89PNG")
    assert "<svg" not in data[index]["text/html"] and "VBox(" not in data[index]["text/plain"]
    return data[index]["text/html"]


def test_dashboard_in_a_kernel_shows_widget_then_static_summary():
    notebook = run_notebook(
        f"import sys, time\nsys.path.insert(0, {str(TESTS)!r})\n"
        "from dashboard_streams import scripted_stream\n"
        "from nbaccel import Dashboard\n"
        "dashboard = Dashboard(2, title='kernel test')\n"
        "dashboard.start()\n"
        "for message in scripted_stream():\n"
        "    dashboard(message)\n"
        "dashboard.finish(results=[None, None])\n"
        "print(dashboard.mode, dashboard.redraws)",
    )
    cell = notebook.cells[0]
    summary = check_dashboard_outputs(cell)
    assert rank_states(summary) == ["finished", "finished"]
    stdout = "".join(o.get("text", "") for o in cell.outputs if o["output_type"] == "stream")
    assert stdout.startswith("widget ")


def test_notebook_launcher_with_dashboard_in_a_kernel():
    notebook = run_notebook(
        "from nbaccel import notebook_launcher, telemetry\n"
        "def train(steps=30):\n"
        "    import time\n"
        "    from nbaccel import telemetry\n"
        "    telemetry.report_total_steps(steps)\n"
        "    for step in range(1, steps + 1):\n"
        "        time.sleep(0.01)\n"
        "        telemetry.report_step(step, steps)\n"
        "        telemetry.log_metrics({'loss': 1.0 / step}, step=step)\n"
        "    print('done')\n"
        "    return step\n"
        "results = notebook_launcher(train, num_processes=2)\n"
        "print(results)",
    )
    cell = notebook.cells[0]
    summary = check_dashboard_outputs(cell)
    assert rank_states(summary) == ["finished", "finished"]
    stdout = "".join(o.get("text", "") for o in cell.outputs if o["output_type"] == "stream")
    assert "[30, 30]" in stdout
