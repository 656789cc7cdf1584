"""%ranks / %%ranks in a real Jupyter kernel (ipykernel driven by nbclient), as a notebook user runs them."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
from process_helpers import all_gone

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
from notebook_outputs import joined_streams  # noqa: E402  (needs nbformat)

pytestmark = [pytest.mark.kernel, pytest.mark.slow, pytest.mark.timeout(180)]
ROOT = Path(__file__).resolve().parent.parent

CELLS = [
    "%load_ext nbaccel\n%ranks start -n 2 --timeout 5",
    "%%ranks\nimport torch\nimport torch.distributed as dist\nfrom nbaccel import PartialState\n"
    "from nbaccel.utils.collective_trace import in_collective\nstate = PartialState()\n"
    "print('hello from', state.process_index)\nx = torch.arange(3) + 10 * state.process_index\nx",
    # state kept across cells, and a collective across the ranks (traced as nbaccel's operations do)
    "%%ranks\nout = torch.zeros(6, dtype=x.dtype)\nwith in_collective('gather', 'all_gather_into_tensor', [x]):\n"
    "    dist.all_gather_into_tensor(out, x)\nout",
    # only rank 0 enters the collective
    "%%ranks\nif state.process_index == 0:\n    with in_collective('gather', 'all_gather_into_tensor', [x]):\n"
    "        dist.all_gather_into_tensor(out, x)",
    "%%ranks\nfrom nbaccel import PartialState\nPartialState().process_index",
    "%%ranks\n1 / 0 if PartialState().process_index == 1 else 'fine'",
    "value = 41\n%ranks push value",
    "%%ranks --ranks 1\nvalue += 1",
    "%ranks pull value\nassert value == [41, 42]\npulled = %ranks pull value\npulled",
    "%%ranks\nimport time\nfor i in range(3):\n    print('step', i, flush=True)\n    time.sleep(0.4)\n'done'",
    "%ranks status",
    "%ranks stop",
    "import psutil\nprint('children', len([c for c in psutil.Process().children(recursive=True)"
    " if c.status() != psutil.STATUS_ZOMBIE]))",
    # ranks left running when the kernel shuts down are stopped with it
    "%ranks start -n 2\nfrom nbaccel.notebook import magics\nprint('pids', *magics._magics.pool.pids)",
]


def _run(cells: list[str], tmp_path: Path) -> list[str]:
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in cells])
    client = nbclient.NotebookClient(notebook, timeout=90, allow_errors=True, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    assert [cell.execution_count for cell in notebook.cells] == list(range(1, len(cells) + 1))
    return [_text(cell) for cell in notebook.cells]




def _text(cell) -> str:
    parts = []
    for output in joined_streams(cell.get("outputs", [])):
        if output["output_type"] == "stream":
            parts.append(output["text"])
        elif output["output_type"] == "error":
            parts.append(f"{output['ename']}: {output['evalue']}\n" + "\n".join(output["traceback"]))
        else:
            parts.append(output.get("data", {}).get("text/plain", ""))
            parts.append(output.get("data", {}).get("text/html", ""))
    return "\n".join(parts)


def test_ranks_magics_in_a_kernel(tmp_path):
    out = _run(CELLS, tmp_path)
    assert "Started 2 ranks" in out[0]
    assert "[rank 0] hello from 0" in out[1] and "[rank 1] hello from 1" in out[1]
    assert "rank 1: tensor([10, 11, 12])  (shape [3], int64, cpu)" in out[1]
    assert "<b>rank 0</b>" in out[1]  # the HTML view: one column per rank
    assert "all ranks: tensor([ 0,  1,  2, 10, 11, 12])" in out[2]
    assert "CollectiveMismatchError" in out[3]
    assert re.search(r"^rank 0 waits in gather\(all_gather_into_tensor, shape \[3\], int64\) at cell line 3 "
                     r"for [\d.]+ s; rank 1 finished the cell", out[3], re.M)
    assert "restarted" in out[3]
    # the user's frames only, the cell named as JupyterLab numbers it ([4]), its lines counted from the
    # %%ranks line as the user sees them; torch's frames on request
    assert 'File "Cell In[4]", line 4, in <module>\n    dist.all_gather_into_tensor(out, x)' in out[3]
    assert "c10d_logger" not in out[3] and "distributed_c10d" not in out[3] and "rank-cell" not in out[3]
    assert "inside nbaccel and torch hidden" in out[3] and "NBACCEL_INTERNAL_FRAMES=1" in out[3]
    assert 'File "Cell In[6]", line 2, in <module>' in out[5]  # a rank's own traceback names its cell too
    assert "rank 0: 0" in out[4] and "rank 1: 1" in out[4]  # the next cell works (on new ranks)
    assert "RankFailedError: rank 1 failed; first: rank 1: ZeroDivisionError" in out[5] and "rank 0: 'fine'" in out[5]
    assert "Pushed value to 2 ranks" in out[6]
    assert "differs between ranks" in out[8] and "[41, 42]" in out[8]
    assert "[rank 1] step 2" in out[9] and "all ranks: 'done'" in out[9]  # the live view, updated in place
    assert "running..." not in out[9]
    assert "2 ranks running" in out[10]
    assert "Stopped 2 ranks" in out[11]
    assert "children 0" in out[12]
    pids = [int(pid) for pid in out[13].split("pids", 1)[1].split()]
    assert len(pids) == 2 and all_gone(pids), pids


@pytest.mark.skipif(importlib.util.find_spec("nbaccel.utils.operations") is None,
                    reason="nbaccel.utils.operations (gather, ...) is not in this tree yet")
def test_debug_collectives_notebook_runs_top_to_bottom(tmp_path):
    notebook = nbformat.read(ROOT / "notebooks" / "02_debug_collectives.ipynb", as_version=4)
    cells = [cell.source for cell in notebook.cells if cell.cell_type == "code"]
    out = "\n".join(_run(cells, tmp_path))
    assert "tensor([ 0,  1,  2, 10, 11, 12])" in out
    assert re.search(r"^rank 0 waits in gather", out, re.M) and "rank 1 finished" in out
    assert "Stopped 2 ranks" in out


def _kernel_cells(sources: list[str], tmp_path: Path) -> list[dict]:
    """Run `sources` in a fresh python3 kernel through jupyter_client: per cell, its iopub outputs and the
    payloads of its execute_reply (where `?` help goes: a pager request, which nbclient drops)."""
    import time

    import jupyter_client

    manager = jupyter_client.KernelManager(kernel_name="python3")
    manager.start_kernel(cwd=str(tmp_path))
    client = manager.client()
    client.start_channels()
    cells = []
    try:
        client.wait_for_ready(timeout=120)
        for source in sources:
            msg_id = client.execute(source)
            outputs, deadline = [], time.monotonic() + 120
            while time.monotonic() < deadline:
                message = client.get_iopub_msg(timeout=120)
                if message["parent_header"].get("msg_id") != msg_id:
                    continue
                if message["msg_type"] == "status" and message["content"]["execution_state"] == "idle":
                    break
                outputs.append(message)
            reply = client.get_shell_msg(timeout=60)
            while reply["parent_header"].get("msg_id") != msg_id:
                reply = client.get_shell_msg(timeout=60)
            text = "".join(m["content"].get("text", "") for m in outputs if m["msg_type"] == "stream")
            text += "".join(str(m["content"].get("data", {}).get("text/plain", "")) for m in outputs
                            if m["msg_type"] in ("display_data", "update_display_data", "execute_result"))
            errors = [m["content"] for m in outputs if m["msg_type"] == "error"]
            pages = "".join(p.get("data", {}).get("text/plain", "") for p in reply["content"].get("payload", [])
                            if p.get("source") == "page")
            cells.append({"text": text, "errors": errors, "page": pages, "outputs": outputs})
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    return cells


def test_del_pool_after_a_failed_call_stops_the_ranks_in_a_kernel(tmp_path):
    """IPython keeps the last error and its traceback (sys.last_traceback): `del pool` after a failed call
    still stops the ranks (rank_pool.py `_keeps_no_pool`)."""
    cells = _kernel_cells([
        "from nbaccel import RankPool\npool = RankPool(2, timeout=10)\npids = pool.pids\n"
        "def fails():\n    raise ValueError('on purpose')",
        "pool.run(fails)",
        "import gc, time, psutil\ndel pool\ngc.collect()\ndeadline = time.monotonic() + 10\n"
        "def alive():\n    return [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != 'zombie']\n"
        "while alive() and time.monotonic() < deadline:\n    time.sleep(0.1)\nprint('alive', alive())",
    ], tmp_path)
    assert [error["ename"] for error in cells[1]["errors"]] == ["RankFailedError"]
    assert "on purpose" in cells[1]["errors"][0]["evalue"]
    assert cells[2]["text"] == "alive []\n", cells[2]


def test_ranks_help_usage_errors_and_ipython_lines_in_a_kernel(tmp_path):
    """IPython's conventions: `%ranks?` and `%ranks start?` page the help built by magic_arguments, bad
    arguments are IPython's UsageError, and a %%ranks cell's `!cmd`, `%magic` and `x?` lines run on the ranks
    (transformed by the kernel's own transformer; each rank's get_ipython() works in its namespace)."""
    out = _kernel_cells([
        "%load_ext nbaccel",
        "%ranks?",
        "%ranks start?",
        "%ranks start --timeout -1",
        "%ranks bogus",
        "%ranks start -n 2 --timeout 20",
        "%%ranks\n!echo from-the-shell\n%time y = 7\nz = y * 2\nlen?\nz",
        "%%ranks\nfrom nbaccel import PartialState\nassert get_ipython().user_ns is globals()\n"
        "%ranks_unknown_magic_xyz",
        "%%ranks\n%%time\nw = z + 1\nprint('w is', w)",
        "%ranks stop",
    ], tmp_path)
    assert not any(cell["errors"] for cell in out[:3]), [cell["errors"] for cell in out[:3]]
    for subcommand in ("start", "status", "restart", "stop", "push", "pull", "--ranks", "--timeout"):
        assert subcommand in out[1]["page"], out[1]["page"]
    assert "%ranks start [-n NUM_PROCESSES]" in out[2]["page"] and "--spawn" in out[2]["page"], out[2]["page"]
    assert "pull" not in out[2]["page"]  # one subcommand's help only
    # IPython shows a UsageError as one stderr line, without a traceback
    assert re.search(r"^UsageError: argument --timeout: the timeout must be > 0", out[3]["text"], re.M), out[3]
    assert re.search(r"^UsageError: unknown subcommand 'bogus'", out[4]["text"], re.M), out[4]
    assert "Started 2 ranks" in out[5]["text"], out[5]
    cell = out[6]
    assert not cell["errors"], cell["errors"]
    assert "[rank 0] from-the-shell" in cell["text"] and "[rank 1] from-the-shell" in cell["text"], cell["text"]
    assert "Wall time" in cell["text"]  # %time ran on the ranks
    assert "Return the number of items" in cell["text"]  # len? paged on the ranks, shown as their output
    assert "all ranks: 14" in cell["text"], cell["text"]
    assert "UsageError" in str(out[7]) and "ranks_unknown_magic_xyz" in str(out[7])  # the rank's own IPython said it
    assert "[rank 0] w is 15" in out[8]["text"] and "Wall time" in out[8]["text"], out[8]
    assert "Stopped 2 ranks" in out[9]["text"]


def test_magic_usage_errors_say_what_is_allowed(capsys):
    from IPython.core.error import UsageError
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    try:
        shell.run_line_magic("load_ext", "nbaccel")
        with pytest.raises(UsageError, match="unknown subcommand 'bogus'"):
            shell.run_line_magic("ranks", "bogus")
        with pytest.raises(UsageError, match="no ranks are running"):
            shell.run_cell_magic("ranks", "", "1")
        with pytest.raises(UsageError, match="timeout must be > 0"):
            shell.run_line_magic("ranks", "start --timeout -1")
        with pytest.raises(UsageError, match="--ranks takes comma-separated"):
            shell.run_cell_magic("ranks", "--ranks a,b", "1")
        shell.run_line_magic("ranks", "status")
        assert "No ranks running" in capsys.readouterr().out
        shell.run_line_magic("unload_ext", "nbaccel")
    finally:
        InteractiveShell.clear_instance()
