"""Examples from README.md and docs/*.md that once failed as written, run as a user runs them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import jupyter_client
import pytest
from kernel_input import execute, scripted, write_kernelspec

NBACCEL = Path(sys.executable).parent / "nbaccel"  # the console script, whose sys.path lacks the working folder
ROOT = Path(__file__).resolve().parent.parent


def block_starting(page: str, first_line: str, after: str = "") -> str:
    """The first fenced code block of a page of the repository (README.md, docs/...) whose first line is
    `first_line`, below the line `after` (a heading) when given."""
    lines = (ROOT / page).read_text().splitlines()
    lines = lines[lines.index(after) + 1:] if after else lines
    block = None
    for line in lines:
        if line.startswith("```"):
            if block is not None and block and block[0].strip() == first_line:
                return "\n".join(block) + "\n"
            block = None if block is not None else []
        elif block is not None:
            block.append(line)
    raise AssertionError(f"{page} has no code block starting with {first_line!r}")


def test_estimate_memory_imports_a_package_from_the_working_folder(tmp_path):
    # docs/big_models.md: `nbaccel estimate-memory my_package.models:make_model` run in the project's folder
    (tmp_path / "my_package").mkdir()
    (tmp_path / "my_package" / "__init__.py").write_text("")
    (tmp_path / "my_package" / "models.py").write_text(
        "import torch\n\ndef make_model():\n    return torch.nn.Linear(1000, 1000)\n")
    done = subprocess.run([str(NBACCEL), "estimate-memory", "my_package.models:make_model", "--dtypes", "float32"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "1,001,000" in done.stdout and "3.82 MB" in done.stdout  # parameters; float32 total size


README_QUICKSTART_AFTER_DILL = '''
import logging
# what `import torch.utils.data` does where dill is installed (HF datasets needs it): dill's logger gets
# logging's _StderrHandler, whose stream is a read-only property reading sys.stderr
dill_like = logging.getLogger("docs_test_dill_like")
dill_like.propagate = False
dill_like.addHandler(logging._StderrHandler())
from nbaccel import notebook_launcher

def train():
    import os
    logging.getLogger("docs_test_dill_like").warning("logged by rank %s", os.environ["RANK"])
    return int(os.environ["RANK"])

print("results:", notebook_launcher(train, num_processes=2, dashboard=False))
'''


@pytest.fixture
def kernel(tmp_path, monkeypatch):
    name = write_kernelspec(tmp_path / "jupyter")
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    manager = jupyter_client.KernelManager(kernel_name=name)
    manager.start_kernel(cwd=str(tmp_path))
    client = manager.client()
    client.start_channels()
    try:
        client.wait_for_ready(timeout=60)
        yield client
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


@pytest.mark.kernel
def test_a_launch_from_a_kernel_with_a_read_only_stderr_handler_runs(kernel):
    # The README quickstart in a kernel failed on every rank once datasets (so dill) was installed:
    # "AttributeError: property 'stream' of '_StderrHandler' object has no setter" while the rank rebound the
    # log handlers it inherited from the kernel. Such a handler follows sys.stderr by itself: left as it is.
    run = execute(kernel, README_QUICKSTART_AFTER_DILL, timeout=120)
    assert run.error is None, f"{run.error}\n{run.stdout}\n{run.stderr}"
    assert "results: [0, 1]" in run.stdout
    assert "[rank 1] logged by rank 1" in run.stderr


@pytest.mark.kernel
def test_the_persistent_ranks_and_post_mortem_examples_run_as_written(kernel):
    # README's "Persistent ranks in two cells", then docs/debugging.md's %%ranks cell and `%ranks debug`
    # (its cell once used a `dist` no rank had, and a comment after `%ranks debug` that the magic took for a rank)
    start = block_starting("README.md", "%load_ext nbaccel")
    assert execute(kernel, start).error is None
    run = execute(kernel, block_starting("README.md", "%%ranks"))
    assert run.error is None and "all ranks: tensor([ 0,  1,  2, 10, 11, 12])" in run.shown
    cell = block_starting("docs/debugging.md", "%%ranks", after="## Post-mortem")
    run = execute(kernel, cell)
    assert run.error["ename"] == "RankFailedError" and "ZeroDivisionError" in run.error["evalue"], run.error
    run = execute(kernel, block_starting("docs/debugging.md", "%ranks debug"), scripted("p scale", "q"))
    assert run.error is None, run.error
    assert run.prompts[0] == "[rank 1] (Pdb) " and "[rank 1] 14" in run.stdout
    assert execute(kernel, "%ranks stop").error is None
