"""A correct program exits 0 promptly: the teardown after `end_training()` cannot deadlock, and a rank that
still hangs after its script ended is named and stopped within seconds instead of holding the launch forever.

The hang these tests guard against: a DDP model outliving `end_training()` (a local of the training function,
freed when it returns) used to drop the destroyed gloo group's last reference from its C++ reducer with the GIL
held, and gloo's destructor joined a worker thread that needed the GIL (utils/process_group_exit.py). The
launchers' exit watch covers whatever else may hang in a process's teardown: its bound is
NBACCEL_EXIT_HANG_GRACE (10 s by default, GRACE here); every test here ends in well under BOUND seconds or
fails by timeout.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from nbaccel.utils.constants import EXIT_HANG_GRACE_ENV

pytestmark = pytest.mark.timeout(180)
BOUND = 90.0  # seconds: far above the exit watch's grace, far below "forever"
GRACE = "3"  # the exit watch's grace for these tests (NBACCEL_EXIT_HANG_GRACE; 10 s by default)


def launch_script(tmp_path: Path, body: str, **env: str) -> subprocess.CompletedProcess:
    """Run `body` as a script on 2 gloo ranks under `nbaccel launch`; kill everything if it passes BOUND."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(body))
    proc = subprocess.Popen(
        [sys.executable, "-m", "nbaccel", "launch", "--num_processes", "2", "--cpu", str(script)],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        stdin=subprocess.DEVNULL, env={**os.environ, **env},
    )
    try:
        out, err = proc.communicate(timeout=BOUND)
    except subprocess.TimeoutExpired:
        for process in [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]:
            process.kill()  # torch elastic starts each rank in a session of its own
        out, err = proc.communicate()
        pytest.fail(f"nbaccel launch still running after {BOUND} s:\n{out}\n{err}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_the_group_outlives_the_ddp_models_that_use_it(tmp_path):
    """end_training() destroys the group while the prepared DDP model lives on: nbaccel holds the group until
    the model is gone, then drops it from Python (torch's holder releases the GIL there)."""
    result = launch_script(tmp_path, """
        import gc
        import torch
        import torch.distributed as dist
        from nbaccel import Accelerator
        from nbaccel.utils import process_group_exit

        def train():
            accelerator = Accelerator(cpu=True)
            model = accelerator.prepare(torch.nn.Linear(4, 4))
            model(torch.ones(2, 4)).sum().backward()
            accelerator.end_training()
            kept = [k.group for k in process_group_exit._kept]
            assert not dist.is_initialized()
            assert kept == [model.process_group], kept  # held while the model lives
            return model

        model = train()
        process_group_exit.release_unused_groups()
        assert len(process_group_exit._kept) == 1  # still used
        del model
        gc.collect()
        process_group_exit.release_unused_groups()
        assert process_group_exit._kept == []  # its last user gone: dropped from Python
        print("checked", flush=True)
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("checked") == 2


def test_a_model_freed_after_end_training_while_a_collective_is_queued_exits_zero(tmp_path):
    """The teardown order of Accelerate's examples, made as hard as it gets: rank 0's gloo worker still runs a
    collective (rank 1 joins it 2 s later) whose tensor only the queued work holds, when the training function
    returns and frees the DDP model after end_training()."""
    result = launch_script(tmp_path, """
        import time
        import torch
        import torch.distributed as dist
        from nbaccel import Accelerator

        def main():
            accelerator = Accelerator(cpu=True)
            model = accelerator.prepare(torch.nn.Linear(4, 4))
            model(torch.ones(2, 4)).sum().backward()
            if accelerator.process_index == 0:
                work = dist.all_reduce(torch.ones(1000), async_op=True)
                del work
            else:
                time.sleep(2)
                dist.all_reduce(torch.ones(1000))
            accelerator.end_training()
            print(f"rank {accelerator.process_index} done", flush=True)

        main()
    """)
    assert result.returncode == 0, result.stderr
    assert "did not exit" not in result.stderr
    assert sorted(line for line in result.stdout.splitlines() if line.endswith("done")) == [
        "rank 0 done", "rank 1 done"]


HANGS_IN_TEARDOWN = """
    import time
    import torch
    from nbaccel import Accelerator

    accelerator = Accelerator(cpu=True)
    total = accelerator.reduce(torch.tensor([accelerator.process_index + 1.0]), reduction="sum")
    print(f"rank {accelerator.process_index} total {total.item()}", flush=True)
    accelerator.end_training()


    class HangsWhenFreed:
        # freed with the module's globals, after every exit function ran. The sleep is bound now, a C function:
        # by then a module kept alive (torch imports dill when installed; dill holds __main__, threading holds
        # its own) has its names set to None
        def __del__(self, sleep=time.sleep):
            sleep(3600)


    if accelerator.process_index == 1:
        keep = HangsWhenFreed()
"""


def test_nbaccel_launch_names_and_stops_a_rank_stuck_after_its_script(tmp_path):
    result = launch_script(tmp_path, HANGS_IN_TEARDOWN, **{EXIT_HANG_GRACE_ENV: GRACE})
    assert result.returncode == 0, result.stderr  # every script completed
    assert f"rank(s) 1 finished the script but did not exit within {GRACE} s" in result.stderr
    assert "rank 0 total 3.0" in result.stdout and "rank 1 total 3.0" in result.stdout


def test_a_slow_exit_function_is_not_a_hang(tmp_path):
    """What the script registers with atexit (a tracker's upload) runs before the rank says it finished: a
    long one is the script's own time, not a teardown hang."""
    result = launch_script(tmp_path, """
        import atexit, time
        from nbaccel import PartialState

        state = PartialState()
        if state.process_index == 1:
            atexit.register(time.sleep, 5)  # longer than the exit watch's grace
        atexit.register(print, f"rank {state.process_index} exit function ran", flush=True)
    """, **{EXIT_HANG_GRACE_ENV: GRACE})
    assert result.returncode == 0, result.stderr
    assert "did not exit" not in result.stderr
    assert "rank 1 exit function ran" in result.stdout


def _returns_then_hangs_at_exit(x: int) -> int:
    import atexit
    import threading

    from nbaccel import PartialState

    state = PartialState()
    if state.process_index == 1:
        atexit.register(threading.Event().wait)  # the spawned process's interpreter exit never ends
    return x * 10 + state.process_index


def test_notebook_launcher_returns_results_of_ranks_stuck_after_returning(capfd, monkeypatch):
    from nbaccel import notebook_launcher

    monkeypatch.setenv(EXIT_HANG_GRACE_ENV, GRACE)

    results = notebook_launcher(_returns_then_hangs_at_exit, (4,), num_processes=2, start_method="spawn",
                                dashboard=False)
    assert results == [40, 41]
    err = capfd.readouterr().err
    assert f"rank(s) 1 returned a result but did not exit within {GRACE} s" in err


@pytest.mark.parametrize("value", ["0", "-2", "soon", "inf", "nan"])
def test_a_bad_exit_grace_says_what_to_give(monkeypatch, value):
    from nbaccel.launch.hang_report import exit_hang_grace

    monkeypatch.setenv(EXIT_HANG_GRACE_ENV, " 2.5 ")
    assert exit_hang_grace() == 2.5
    monkeypatch.setenv(EXIT_HANG_GRACE_ENV, value)
    with pytest.raises(ValueError, match=f"{EXIT_HANG_GRACE_ENV}={value!r}: give the seconds a finished rank may"):
        exit_hang_grace()


def test_a_bad_exit_grace_is_refused_before_any_rank_starts(tmp_path):
    result = launch_script(tmp_path, "print('ran', flush=True)", **{EXIT_HANG_GRACE_ENV: "soon"})
    assert result.returncode != 0 and "ran" not in result.stdout, result.stdout
    assert f"{EXIT_HANG_GRACE_ENV}='soon': give the seconds" in result.stderr, result.stderr


def test_a_bad_exit_grace_is_one_usage_line_for_every_command_that_launches(tmp_path):
    # `nbaccel test` runs its check script through the same settings as `nbaccel launch`
    for command in (["launch", "--num_processes", "2", "--cpu", "job.py"], ["test"]):
        (tmp_path / "job.py").write_text("print('ran', flush=True)\n")
        result = subprocess.run([sys.executable, "-m", "nbaccel", *command], cwd=tmp_path, capture_output=True,
                                text=True, timeout=BOUND, env={**os.environ, EXIT_HANG_GRACE_ENV: "soon"})
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        assert f"error: {EXIT_HANG_GRACE_ENV}='soon': give the seconds" in result.stderr, result.stderr
        assert "ran" not in result.stdout and "Running" not in result.stdout, result.stdout


def test_a_bad_exit_grace_is_refused_before_notebook_launcher_starts_a_rank(monkeypatch):
    from process_helpers import started_children

    from nbaccel import notebook_launcher

    monkeypatch.setenv(EXIT_HANG_GRACE_ENV, "-1")
    with pytest.raises(ValueError, match=f"{EXIT_HANG_GRACE_ENV}='-1': give the seconds"):
        notebook_launcher(print, ("ran",), num_processes=2, dashboard=False)
    assert not started_children(recursive=True)
