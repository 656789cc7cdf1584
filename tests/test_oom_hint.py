"""A rank SIGKILLed (what the out-of-memory killer does) is reported with the "out of memory?" hint and the
rank's last memory sample, in the error the user sees."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch  # noqa: F401  (imported here so forked workers inherit it)
from process_helpers import live_children

from nbaccel.launch import LaunchError, notebook_launcher
from nbaccel.launch.errors import WorkerFailure

pytestmark = pytest.mark.timeout(180)
ROOT = Path(__file__).resolve().parent.parent
BLOCK_MIB = 200


def grow_then_get_killed() -> None:
    """Rank 1 fills BLOCK_MIB of memory, lets the memory sampler see it, and is SIGKILLed as by the OOM killer."""
    if os.environ["RANK"] == "1":
        block = bytearray(b"\x01") * (BLOCK_MIB << 20)  # written, so resident
        time.sleep(2)  # 20 samples at NBACCEL_MEMORY_INTERVAL=0.1
        os.kill(os.getpid(), signal.SIGKILL)
        del block
    time.sleep(60)


def test_a_sigkilled_rank_gets_the_oom_hint_with_its_last_memory_sample(monkeypatch):
    monkeypatch.setenv("NBACCEL_MEMORY_INTERVAL", "0.1")
    with pytest.raises(LaunchError) as info:
        notebook_launcher(grow_then_get_killed, num_processes=2, timeout=120)
    failure = info.value.failures[1]
    assert failure.signal == "SIGKILL" and failure.last_rss is not None and failure.last_rss >= BLOCK_MIB << 20
    message = str(info.value)
    assert "rank 1: killed by SIGKILL (exit code -9; out of memory? the OOM killer sends SIGKILL; " \
           "its last memory sample: " in message, message
    shown = float(re.search(r"last memory sample: ([\d.]+) MiB resident", message).group(1))
    assert shown >= BLOCK_MIB
    assert live_children() == []


def test_the_hint_without_a_sample_and_other_signals_without_it():
    assert str(WorkerFailure(1, None, "", "", -9, "SIGKILL")) == (
        "killed by SIGKILL (exit code -9; out of memory? the OOM killer sends SIGKILL)")
    assert str(WorkerFailure(1, None, "", "", -9, "SIGKILL", last_rss=3 << 30)).endswith(
        "its last memory sample: 3072.0 MiB resident)")
    assert str(WorkerFailure(1, None, "", "", -15, "SIGTERM")) == "killed by SIGTERM (exit code -15)"
    assert str(WorkerFailure(1, None, "finished without returning a result")) == "finished without returning a result"


def test_an_exit_code_is_said_once():
    """A plain exit said its code twice: `rank 3 on gpu-b: exited with code 3 (exit code 3)`."""
    assert WorkerFailure(3, None, "exited with code 3", "", 3, host="gpu-b").summary() == (
        "rank 3 on gpu-b: exited with code 3")
    assert str(WorkerFailure(3, None, "", "", 3)) == "exited with code 3"
    assert str(WorkerFailure(0, None, "exited without returning a result", "", 0)) == (
        "exited without returning a result (exit code 0)")


def test_nbaccel_launch_names_sigkill_with_the_hint(tmp_path):
    script = tmp_path / "killed.py"
    script.write_text(textwrap.dedent("""
        import os, signal, time
        if os.environ["RANK"] == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    """))
    done = subprocess.run([sys.executable, "-m", "nbaccel", "launch", "--cpu", "--num_processes", "2", str(script)],
                          cwd=ROOT, capture_output=True, text=True, timeout=150, stdin=subprocess.DEVNULL)
    assert done.returncode == 1
    assert "nbaccel launch: rank 1 failed (signal 9, SIGKILL: out of memory? the OOM killer sends SIGKILL)" \
        in done.stderr, done.stderr[-3000:]
