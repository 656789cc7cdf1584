"""notebook_launcher inside a real Jupyter kernel (ipykernel driven by nbclient), as a notebook user runs it."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

pytestmark = [pytest.mark.kernel, pytest.mark.slow]
ROOT = Path(__file__).resolve().parent.parent

SETUP = """
import os, time
import torch
from nbaccel import notebook_launcher, LaunchError
"""
CLOSURE = """
print("before launch")  # still in the kernel's buffer when the workers fork: must not appear twice
base = 40
def train(x):
    print(f"hello from rank {os.environ['RANK']}")
    return base + x + int(os.environ["RANK"])
results = notebook_launcher(train, (2,), num_processes=2, dashboard=False)
print("results", results)
"""
FAILING = """
def bad():
    if os.environ["RANK"] == "1":
        raise ValueError("bad rank")
    time.sleep(60)
notebook_launcher(bad, num_processes=2, dashboard=False)
"""
AGAIN = """print("again", notebook_launcher(lambda: 5, num_processes=2, dashboard=False))"""
SPAWN = """
class Cell:
    factor = 3
print("spawned", notebook_launcher(lambda: print("in spawn") or Cell.factor * int(os.environ["RANK"]),
                                   num_processes=2, dashboard=False, start_method="spawn"))
"""
SLOW = """
def slow(marker):
    if os.environ["RANK"] == "0":
        open(marker, "w").close()
    time.sleep(60)
notebook_launcher(slow, ({marker!r},), num_processes=2, dashboard=False)
"""
CHILDREN = """
import psutil
alive = [c for c in psutil.Process().children(recursive=True) if c.status() != psutil.STATUS_ZOMBIE]
print("children", len(alive))
print("now", time.time())
"""


@pytest.fixture
def kernel_name(tmp_path, monkeypatch) -> str:
    """A kernelspec running this venv's python with this checkout importable."""
    spec = tmp_path / "jupyter" / "kernels" / "nbaccel-test"
    spec.mkdir(parents=True)
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "nbaccel test", "language": "python", "env": env, "interrupt_mode": "signal",
    }))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    return "nbaccel-test"


def stream_text(cell, name: str = "stdout") -> str:
    return "".join(out.get("text", "") for out in cell.outputs if out.get("name") == name)


def error_of(cell):
    errors = [out for out in cell.outputs if out.output_type == "error"]
    return errors[0] if errors else None


def test_launches_from_a_real_kernel(kernel_name, tmp_path):
    marker = tmp_path / "started"
    cells = [SETUP, CLOSURE, FAILING, AGAIN, SLOW.format(marker=str(marker)), CHILDREN, AGAIN, SPAWN]
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(src) for src in cells])
    client = nbclient.NotebookClient(notebook, kernel_name=kernel_name, allow_errors=True, timeout=120,
                                     startup_timeout=120)
    interrupted_at: list[float] = []

    def interrupt_when_started() -> None:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline and not marker.exists():
            time.sleep(0.1)
        time.sleep(0.3)
        km = getattr(client, "km", None)
        if marker.exists() and km is not None:
            interrupted_at.append(time.time())
            # what Jupyter's "interrupt kernel" does: SIGINT to the kernel's process group
            os.killpg(os.getpgid(km.provisioner.process.pid), signal.SIGINT)

    watcher = threading.Thread(target=interrupt_when_started, daemon=True)
    watcher.start()
    client.execute(cwd=str(tmp_path))
    watcher.join(5)
    setup, closure, failing, again, slow, children, again2, spawn = notebook.cells

    assert error_of(setup) is None, error_of(setup)
    out = stream_text(closure) + stream_text(closure, "stderr")
    assert error_of(closure) is None, error_of(closure)
    assert out.count("[rank 0] hello from rank 0\n") == 1, out
    assert out.count("[rank 1] hello from rank 1\n") == 1, out
    assert "results [42, 43]" in out
    assert out.count("before launch") == 1, out

    error = error_of(failing)
    assert error is not None and error.ename == "LaunchError"
    assert "rank 1" in error.evalue and "ValueError: bad rank" in error.evalue
    assert "Traceback from rank 1" in error.evalue
    assert "  Cell In[3], line 3, in bad\n" in error.evalue, error.evalue  # the cell, as IPython names it
    # shown as its message, with rank 1's traceback in it; not the kernel's frames from the cell to the raise
    assert "\n".join(error.traceback) == f"LaunchError: {error.evalue}", error.traceback

    assert error_of(again) is None and "again [5, 5]" in stream_text(again)

    assert interrupted_at, "the launch never started, so it was not interrupted"
    error = error_of(slow)
    assert error is not None and error.ename == "KeyboardInterrupt", error
    assert "children 0" in stream_text(children), stream_text(children) + str(children.outputs)
    stopped_at = float(stream_text(children).split("now ")[1].split()[0])
    assert stopped_at - interrupted_at[0] < 3 + 2  # workers stopped within 3 s (+ slack for the next cell)
    assert "again [5, 5]" in stream_text(again2)
    assert error_of(spawn) is None, error_of(spawn)
    assert "spawned [0, 3]" in stream_text(spawn)
    assert stream_text(spawn).count("[rank 0] in spawn\n") == 1 and stream_text(spawn).count("[rank 1] in spawn\n") == 1
    assert not os.path.exists(tmp_path / "leftover")


def test_a_launch_returning_nothing_shows_no_out_line(kernel_name, tmp_path):
    """As with Accelerate's launchers (which return None): no `Out[n]:` under the cell; the value is still the
    list of the ranks' values, and a launch that returns values shows them."""
    cells = [SETUP + "notebook_launcher(lambda: None, num_processes=2, dashboard=False)",
             "results = _ = notebook_launcher(lambda: None, num_processes=2, dashboard=False)\n"
             "print(results == [None, None], isinstance(results, list), repr(results))",
             "notebook_launcher(lambda: 7, num_processes=2, dashboard=False)"]
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(src) for src in cells])
    nbclient.NotebookClient(notebook, kernel_name=kernel_name, timeout=120, startup_timeout=120).execute(
        cwd=str(tmp_path))
    nothing, value, seven = notebook.cells
    assert [out.output_type for out in nothing.outputs if out.output_type != "stream"] == [], nothing.outputs
    assert "True True [None, None]" in stream_text(value)
    results = [out for out in seven.outputs if out.output_type == "execute_result"]
    assert len(results) == 1 and results[0].data["text/plain"] == "[7, 7]", seven.outputs
