"""A restartable launch and `nbaccel launch` leave no torch elastic log folder behind (torchrun leaves a
/tmp/torchelastic_* folder per run). Each test gives its launch a temp folder of its own (TMPDIR), so other
launches running on the machine do not count."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch  # noqa: F401  (imported here so forked workers inherit it)

from nbaccel.launch import LaunchError, notebook_launcher

pytestmark = pytest.mark.timeout(240)
ROOT = Path(__file__).resolve().parent.parent


def left_in(folder: Path) -> list[str]:
    """torch elastic's folders in `folder`: its own default ones and nbaccel's per-launch ones."""
    found = [p.name for p in folder.glob("torchelastic_*")]
    return found + [str(p.relative_to(folder)) for p in folder.glob(f"nbaccel-{os.getuid()}/elastic-*")]


def error_file_folder(fail: bool = False) -> str:
    """Where torch elastic told this rank to write its error file (inside the launch's log folder)."""
    path = os.environ["TORCHELASTIC_ERROR_FILE"]
    assert os.path.isdir(os.path.dirname(os.path.dirname(path)))  # the attempt folder exists while ranks run
    if fail and os.environ["RANK"] == "1":
        raise ValueError("rank one fails")
    return path


@pytest.fixture
def own_tmp(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))  # forked ranks and torch's mkdtemp use it too
    monkeypatch.setenv("TMPDIR", str(folder))
    return folder


@pytest.mark.parametrize("fail", [False, True], ids=["finished", "failed"])
def test_a_restartable_launch_leaves_no_elastic_folder(own_tmp, fail):
    if fail:
        with pytest.raises(LaunchError, match="rank one fails"):
            notebook_launcher(error_file_folder, (True,), num_processes=2, max_restarts=1, timeout=120)
    else:
        paths = notebook_launcher(error_file_folder, num_processes=2, max_restarts=1, timeout=120)
        assert all(p.startswith(str(own_tmp / f"nbaccel-{os.getuid()}" / "elastic-")) for p in paths), paths
        assert not any(os.path.exists(os.path.dirname(p)) for p in paths)
    assert left_in(own_tmp) == []


def run_launch(own_tmp: Path, tmp_path: Path, *options: str) -> subprocess.CompletedProcess:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import os
        print("error file:", os.environ["TORCHELASTIC_ERROR_FILE"], flush=True)
    """))
    return subprocess.run([sys.executable, "-m", "nbaccel", "launch", "--cpu", "--num_processes", "2", *options,
                           str(script)], cwd=ROOT, capture_output=True, text=True, timeout=180,
                          stdin=subprocess.DEVNULL, env={**os.environ, "TMPDIR": str(own_tmp)})


def test_nbaccel_launch_leaves_no_elastic_folder_but_keeps_a_given_log_dir(own_tmp, tmp_path):
    done = run_launch(own_tmp, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "no deadlock detection" not in done.stderr  # the ranks' lines went through their relays, whole
    paths = [line.split(": ", 1)[1] for line in done.stdout.splitlines() if line.startswith("error file: ")]
    assert len(paths) == 2 and all(p.startswith(str(own_tmp)) for p in paths), done.stdout
    assert left_in(own_tmp) == []

    logs = tmp_path / "logs"
    done = run_launch(own_tmp, tmp_path, "--log_dir", str(logs))
    assert done.returncode == 0, done.stderr[-3000:]
    assert list(logs.glob("*/attempt_0")), "the user's own --log_dir is theirs to keep"
    assert left_in(own_tmp) == []
