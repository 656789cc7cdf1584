"""nbaccel installed as a user without the `notebook` extra has it: a fresh virtual environment (no system site
packages), the wheel built from this checkout, torch at CI's pin, and ipykernel (Jupyter, but not the extra).

Made once per test session (pip's wheel cache is the main venv's, so nothing is downloaded twice). In it, with
PYTHONPATH cleared so only the installed nbaccel is found: the notebook packages are absent, `nbaccel launch`
runs 2 ranks, the plain dashboard draws and the widget view refuses with the extra's name; in a real kernel of
that environment `notebook_launcher` shows its dashboard as live HTML (no widget) and `config_widget()` says
what to install.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK_EXTRA = ("ipywidgets", "bqplot", "matplotlib")


def _env(venv: Path) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(venv),
               PIP_DISABLE_PIP_VERSION_CHECK="1")
    return env


def _run(command: list, env: dict[str, str], cwd: Path, timeout: int = 300) -> str:
    done = subprocess.run([str(part) for part in command], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"{command} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return done.stdout + done.stderr


@pytest.fixture(scope="session")
def lean_venv(tmp_path_factory) -> Path:
    """The venv: `pip install <checkout> ipykernel` with constraints.txt, no extra."""
    folder = tmp_path_factory.mktemp("lean")
    venv = folder / "venv"
    env = _env(venv)
    _run([sys.executable, "-m", "venv", venv], env, folder)
    # --no-compile: byte code is written on import instead of up front (torch alone is thousands of files)
    _run([venv / "bin" / "python", "-m", "pip", "install", "-q", "--no-compile", "-c", ROOT / "constraints.txt",
          ROOT, "ipykernel"], env, folder, timeout=800)
    return venv


def test_core_install_launches_without_the_notebook_extra(lean_venv, tmp_path):
    python = lean_venv / "bin" / "python"
    env = _env(lean_venv)
    probe = textwrap.dedent('''
        import importlib.util, json, nbaccel
        from nbaccel.notebook import Dashboard
        from nbaccel.notebook.render import metrics_png
        missing = [name for name in %r if importlib.util.find_spec(name) is None]
        try:
            Dashboard(2, mode="widget")
            refused = ""
        except ImportError as error:
            refused = str(error)
        try:
            nbaccel.config_widget()
            widget = ""
        except ImportError as error:
            widget = str(error)
        board = Dashboard(2, mode="auto")
        board.start()
        board.observe({"kind": "metrics", "rank": 0, "values": {"loss": 0.5}, "step": 1})
        import importlib.metadata
        assert importlib.metadata.version("nbaccel") == nbaccel.__version__  # one version source (hatch reads it)
        print(json.dumps({"file": nbaccel.__file__, "missing": missing, "refused": refused, "widget": widget,
                          "mode": board.mode, "png": metrics_png(board.model)}))
        board.finish([None, None])
    ''') % (NOTEBOOK_EXTRA,)
    out = _run([python, "-c", probe], env, tmp_path)
    report = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    assert Path(report["file"]).is_relative_to(lean_venv), report["file"]
    assert report["missing"] == list(NOTEBOOK_EXTRA)
    assert "pip install nbaccel[notebook]" in report["refused"]
    assert "pip install nbaccel[notebook]" in report["widget"]
    assert report["mode"] == "plain" and report["png"] is None
    assert "rank 1" in out and "finished" in out  # the plain view's lines and summary

    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent('''
        import torch, torch.distributed as dist
        from nbaccel import Accelerator
        accelerator = Accelerator(cpu=True)
        total = accelerator.reduce(torch.tensor([accelerator.process_index + 1.0]), reduction="sum")
        print(f"rank {accelerator.process_index} of {accelerator.num_processes}: total {total.item()}")
    '''))
    out = _run([lean_venv / "bin" / "nbaccel", "launch", "--num_processes", "2", "--cpu", script], env, tmp_path)
    assert "rank 0 of 2: total 3.0" in out and "rank 1 of 2: total 3.0" in out, out


def test_notebook_without_the_extra_shows_html(lean_venv, tmp_path, monkeypatch):
    """A kernel of the lean venv (ipykernel, no ipywidgets): the dashboard is live HTML, never a widget."""
    spec = tmp_path / "jupyter" / "kernels" / "lean"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [str(lean_venv / "bin" / "python"), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "lean", "language": "python", "env": {"PYTHONPATH": ""}}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    cells = [
        "from nbaccel import notebook_launcher, Accelerator\n"
        "def train():\n    accelerator = Accelerator(cpu=True)\n    accelerator.log({'loss': 1.0}, step=1)\n"
        "notebook_launcher(train, num_processes=2)",
        "import nbaccel\ntry:\n    nbaccel.config_widget()\nexcept ImportError as error:\n    print('refused:', error)",
    ]
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in cells])
    nbclient.NotebookClient(notebook, timeout=240, kernel_name="lean",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = notebook.cells[0].outputs
    kinds = {kind for output in outputs for kind in output.get("data", {})}
    assert "application/vnd.jupyter.widget-view+json" not in kinds, outputs
    summaries = [output["data"]["text/html"] for output in outputs if "nbaccel-summary" in output.get("data", {}).get("text/html", "")]
    assert len(summaries) == 1 and "data-state='finished'" in summaries[0], outputs
    assert "refused: config_widget() needs ipywidgets: pip install nbaccel[notebook]" in notebook.cells[1].outputs[0]["text"]
