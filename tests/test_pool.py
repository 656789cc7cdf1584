"""RankPool: persistent ranks (2 gloo processes), their results, hang reports, restarts and cleanup."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest
from process_helpers import all_gone, started_children

from nbaccel.launch.errors import WorkerFailure
from nbaccel.launch.hang_report import RankProgress, diagnose
from nbaccel.launch.pool import (
    CollectiveMismatchError,
    RankFailedError,
    RankPool,
    RankResult,
    RankResults,
    RankStartError,
    RankTimeoutError,
    results_equal,
)
from nbaccel.launch.pool.rank_view import render_html, render_text
from nbaccel.launch.private_dirs import make_store_dir

pytestmark = pytest.mark.timeout(120)

SETUP = """
import torch
import torch.distributed as dist
from nbaccel import PartialState
from nbaccel.utils.collective_trace import in_collective
state = PartialState()
x = torch.arange(3) + 10 * state.process_index
"""

TRACED_GATHER_ON_RANK_0 = """
if state.process_index == 0:
    out = torch.zeros(6, dtype=x.dtype); print("entering")
    with in_collective("gather", "all_gather_into_tensor", [x]):
        dist.all_gather_into_tensor(out, x)
"""




def test_exec_run_namespaces_output_errors_push_pull():
    with RankPool(2, timeout=20) as pool:
        assert pool.devices == ["cpu", "cpu"]
        results = pool.exec(SETUP + "print('hello', state.process_index)\nstate.num_processes, x")
        assert isinstance(results, RankResults) and [r.rank for r in results] == [0, 1]
        assert [r.stdout for r in results] == ["hello 0\n", "hello 1\n"]
        assert results[0].value[0] == 2 and results[1].value[1].tolist() == [10, 11, 12]
        # each rank keeps its own namespace between calls
        results = pool.exec("y = int(x[0]) + 1\ny")
        assert results.values == [1, 11]
        assert pool.exec("y * 2").values == [2, 22]
        # fd-level output (C extensions, subprocesses) and stderr
        results = pool.exec("import os, sys\nos.write(1, b'raw\\n')\nprint('err', file=sys.stderr)")
        assert [r.stdout for r in results] == ["raw\n", "raw\n"] and results[1].stderr == "err\n"
        assert results.values == [None, None] and results[0].text is None
        # a trailing semicolon hides the value, like IPython
        assert pool.exec("y;")[0].text is None
        # an error on one rank: the other rank's result is still there
        results = pool.exec("print('before')\n1 / 0 if state.process_index == 1 else 'fine'")
        assert results[0].ok and results[0].value == "fine"
        assert not results[1].ok and results[1].error.exc_type == "ZeroDivisionError"
        assert "<rank-cell-" in results[1].error.traceback and results[1].stdout == "before\n"
        assert "During handling" not in results[1].error.traceback
        assert "ZeroDivisionError" in repr(results[1]) and "rank 1" in render_text(results)
        with pytest.raises(RankFailedError, match="ZeroDivisionError"):
            results.raise_if_failed()
        # a syntax error is raised in the kernel, before any rank sees the cell
        with pytest.raises(SyntaxError):
            pool.exec("def (")
        # run(): a cloudpickled function, like notebook_launcher
        offset = 5
        assert pool.run(lambda a, b=0: a + b + offset, 1, b=2) == [8, 8]
        with pytest.raises(RankFailedError, match="rank 0 failed.*ValueError: no"):
            pool.run(_raise_on_rank_0)
        # a collective through nbaccel's trace, on all ranks, works
        results = pool.exec("out = torch.zeros(6, dtype=x.dtype)\n"
                            "with in_collective('gather', 'all_gather_into_tensor', [x]):\n"
                            "    dist.all_gather_into_tensor(out, x)\nout")
        assert [r.value.tolist() for r in results] == [[0, 1, 2, 10, 11, 12]] * 2
        assert "all ranks: tensor([ 0,  1,  2, 10, 11, 12])" in render_text(results)
        assert "(shape [6], int64, cpu)" in render_text(results)
        # end_training() in a cell leaves the pool's process group up (the pool owns it: FORK_LAUNCHED)
        results = pool.exec("from nbaccel import Accelerator\nAccelerator(cpu=True).end_training()\n"
                            "from nbaccel.utils import gather\ngather(x).tolist()")
        assert results.values == [[0, 1, 2, 10, 11, 12]] * 2
        # push / pull move a variable between the kernel and every rank
        pool.push("data", {"a": [1, 2]})
        assert pool.exec("data['a'].append(state.process_index)\ndata").values == [{"a": [1, 2, 0]},
                                                                               {"a": [1, 2, 1]}]
        assert pool.pull("data") == [{"a": [1, 2, 0]}, {"a": [1, 2, 1]}]
        pool.push("same", 3)
        assert results_equal(pool.pull("same")) and not results_equal(pool.pull("data"))
        with pytest.raises(RankFailedError, match="NameError"):
            pool.pull("not_defined_anywhere")
        # a long cell reports its progress (live views); a quick one does not
        seen = []
        results = pool.exec("import time\nfor i in range(4):\n    print('step', i, flush=True)\n    time.sleep(0.3)\n"
                            "'done'", on_progress=seen.append)
        assert results.values == ["done", "done"] and results[0].stdout.splitlines()[-1] == "step 3"
        assert seen and all(r.status == "running" for r in seen[0]) and "step" in seen[-1][0].stdout
        pool.exec("1", on_progress=seen.append)
        assert all(len(partial) == 2 for partial in seen) and seen[-1][0].status == "running"
        # a subset of the ranks
        results = pool.exec("z = 'only here'\nz", ranks=[1])
        assert [r.rank for r in results] == [1] and results.values == ["only here"]
        assert not pool.exec("'z' in dir()").values[0] and pool.exec("z", ranks=1).values == ["only here"]
        with pytest.raises(ValueError, match="ranks"):
            pool.exec("1", ranks=[2])
    assert not pool.running


def test_a_cell_run_again_runs_again_under_its_first_name():
    """The pool names a source it has seen with its first name and the ranks reuse its compiled code: the
    cell still runs every time, in the namespace as it is then, and its errors point at its lines."""
    with RankPool(2, timeout=20) as pool:
        pool.exec("n = 0")
        step = "n += 1\nn * 10"
        assert [pool.exec(step).values for _ in range(3)] == [[10, 10], [20, 20], [30, 30]]
        assert pool.exec("n = 100; n").values == [100, 100]  # a statement and its value on one line
        assert pool.exec(step).values == [1010, 1010]
        failing = "m = n\nraise KeyError(m)"
        first, second = pool.exec(failing)[0].error.traceback, pool.exec(failing)[0].error.traceback
        assert first == second and 'line 2' in first and "raise KeyError(m)" in first
        other = pool.exec("raise KeyError(0)")[0].error.traceback
        assert _cell_file(first).startswith("<rank-cell-") and _cell_file(other) != _cell_file(first)
        assert pool.exec("x = 1").values == [None, None]  # no trailing expression: nothing shown
        for _ in range(2):  # a syntax error is raised every time, never remembered as a good cell
            with pytest.raises(SyntaxError):
                pool.exec("def (")


def _cell_file(traceback: str) -> str:
    return next(part.split('"')[0] for part in traceback.split('File "')[1:] if part.startswith("<rank-cell-"))


def _raise_on_rank_0() -> int:
    import torch.distributed as dist

    if dist.get_rank() == 0:
        raise ValueError("no")
    return 1


def test_mismatch_timeout_and_raw_collective_are_reported_and_the_pool_recovers():
    with RankPool(2, timeout=4) as pool:
        pool.exec(SETUP)
        first_pids = pool.pids
        start = time.monotonic()
        with pytest.raises(CollectiveMismatchError) as caught:
            pool.exec(TRACED_GATHER_ON_RANK_0)
        assert time.monotonic() - start < 4 + 10
        message = str(caught.value)
        assert "rank 0 waits in gather(all_gather_into_tensor, shape [3], int64) at cell line 4 for" in message
        assert "rank 1 finished the cell" in message
        assert "restarted" in message and "lost" in message
        assert caught.value.restarted and pool.pids != first_pids and all_gone(first_pids)
        assert [r.status for r in caught.value.results] == ["waiting", "finished"]
        assert caught.value.results[0].stdout == "entering\n"  # what the stuck rank printed
        # usable afterwards, but the namespaces are new
        results = pool.exec("from nbaccel import PartialState\nPartialState().process_index")
        assert results.values == [0, 1]
        assert pool.exec("x")[0].error.exc_type == "NameError"

        # a raw torch.distributed call that only rank 0 makes is seen through its stack; the report shows the
        # user's frames under the cell's given name, torch's on request
        pool.exec(SETUP)
        with pytest.raises(CollectiveMismatchError, match=r"rank 0 waits in torch\.distributed\.all_reduce at "
                                                          r"cell line 3 for [\d.]+ s; rank 1 finished the cell") as caught:
            pool.exec("t = torch.ones(1)\nif state.process_index == 0:\n    dist.all_reduce(t)\n", name="Cell In[7]")
        message = str(caught.value)
        assert 'File "Cell In[7]", line 3, in <module>\n    dist.all_reduce(t)' in message
        assert "distributed_c10d" not in message and "NBACCEL_INTERNAL_FRAMES=1" in message
        assert 'File "Cell In[7]", line 3' in caught.value.full_stacks and "distributed_c10d" in caught.value.full_stacks

        # a rank that does not finish (nor enter the collective) within the timeout: RankTimeoutError
        pool.exec(SETUP)
        start = time.monotonic()
        with pytest.raises(RankTimeoutError) as caught:
            pool.exec(TRACED_GATHER_ON_RANK_0 + "else:\n    import time\n    time.sleep(60)\n")
        assert 3.5 < time.monotonic() - start < 4 + 10
        assert "rank 0 waits in gather(" in str(caught.value)
        assert "rank 1 is still running (cell line 8, not in a collective)" in str(caught.value)
        assert pool.exec("1 + 1").values == [2, 2]
        assert pool.restarts == 3


def test_a_rank_that_answers_no_status_query_does_not_stop_the_hang_checks():
    """Rank 1 is stopped (as a rank is whose one long C call holds the GIL: its status thread cannot answer)
    while rank 0 waits in a collective: the call ends at the timeout, with where each rank is, instead of
    waiting for an answer for ever."""
    with RankPool(2, timeout=3) as pool:
        pool.exec(SETUP)
        start = time.monotonic()
        with pytest.raises(RankTimeoutError) as caught:
            pool.exec("import os, signal\nif state.process_index == 1:\n    os.kill(os.getpid(), signal.SIGSTOP)\n"
                      "dist.all_reduce(x)\n")
        assert time.monotonic() - start < 3 + 10
        message = str(caught.value)
        assert "rank 0 waits in torch.distributed.all_reduce at cell line 4" in message, message
        assert "rank 1 is still running, where is unknown: it answers no status query" in message, message
        assert pool.exec("1 + 1").values == [2, 2]  # the stopped rank was replaced


def test_restart_and_shutdown_leave_no_process():
    pool = RankPool(2, timeout=10)
    pool.exec("a = 1")
    old = pool.pids
    # interrupting the kernel interrupts the ranks; they stay up, with their variables
    def interrupt_once_both_sleep(partial: RankResults) -> None:  # what the stop button does, at that moment
        if all("sleeping" in result.stdout for result in partial):
            raise KeyboardInterrupt

    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        pool.exec("import time\nprint('sleeping', flush=True)\ntime.sleep(30)", on_progress=interrupt_once_both_sleep)
    assert time.monotonic() - start < 10 and pool.pids == old and pool.restarts == 0
    assert pool.exec("a").values == [1, 1]
    pool.restart()
    assert all_gone(old) and pool.pids != old
    assert pool.exec("'a' in dir()").values == [False, False]
    pids = pool.pids
    pool.shutdown()
    pool.shutdown()  # twice is fine
    assert all_gone(pids, within=1.0)
    with pytest.raises(RuntimeError, match="shut down"):
        pool.exec("1")


def test_garbage_collection_stops_the_ranks():
    pool = RankPool(2, timeout=10)
    pids = pool.pids
    del pool
    gc.collect()
    assert all_gone(pids)


def _killed_in_a_collective() -> None:
    import signal

    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        time.sleep(0.5)  # rank 0 waits in the all-reduce meanwhile
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(1))


def test_a_rank_killed_in_a_collective_heads_the_error_not_its_peer_s_gloo_error():
    with RankPool(2, timeout=20) as pool:
        with pytest.raises(RankFailedError) as caught:
            pool.run(_killed_in_a_collective)
        assert pool.restarts == 1 and pool.run(int) == [0, 0]  # the broken group was replaced
    head, also = str(caught.value).splitlines()[:2]
    assert head.startswith("ranks 1, 0 failed; first: rank 1: RankDied: the rank process ended (killed by SIGKILL"), head
    assert also.startswith("  also rank 0: "), also  # gloo's error on the rank that waited: the consequence
    assert [result.group_broken for result in caught.value.results] == [True, False]


def _users_own_error() -> None:
    kept = "the user's frames keep their variables"  # noqa: F841  (read from the frame by the test)
    raise KeyError(kept)


def test_a_failed_call_s_traceback_does_not_keep_the_pool_alive():
    """IPython keeps the last error and its traceback (sys.last_value, sys.last_traceback): the frames of a
    failed call must not hold the pool, or `del pool` leaves its ranks running until the next error."""
    pool = RankPool(2, timeout=4)
    try:
        _users_own_error()
    except KeyError:  # a call made while the user handles an error of their own: it is the context
        with pytest.raises(RankFailedError) as failed:
            pool.run(_raise_on_rank_0)
    own = failed.value.__context__
    assert isinstance(own, KeyError)
    assert own.__traceback__.tb_next.tb_frame.f_locals == {"kept": "the user's frames keep their variables"}
    pool.exec(SETUP)
    with pytest.raises(CollectiveMismatchError) as hung:  # raised by the pool's own wait, not by a rank
        pool.exec(TRACED_GATHER_ON_RANK_0)
    pids = pool.pids
    del pool
    gc.collect()
    assert all_gone(pids), "the ranks outlived `del pool`: a kept traceback holds the pool"
    assert "rank 0" in str(failed.value) and "restarted" in str(hung.value)  # both kept, as IPython keeps them


def test_ranks_die_with_their_kernel(tmp_path, monkeypatch):
    """Even a SIGKILLed kernel leaves no rank behind; the next pool or launch removes its store folder."""
    script = tmp_path / "kernel.py"
    script.write_text(textwrap.dedent("""
        import os, signal
        from nbaccel.launch.pool import RankPool
        pool = RankPool(2, timeout=10)
        print(*pool.pids, pool._workers.session.store_dir, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=90,
                          env=dict(os.environ, TMPDIR=str(tmp_path)))
    *pids, store = proc.stdout.split()
    pids = [int(pid) for pid in pids]
    assert len(pids) == 2, proc.stderr
    assert all_gone(pids)
    assert os.path.isdir(store) and os.path.dirname(store) == str(tmp_path / f"nbaccel-{os.getuid()}")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    made = make_store_dir()
    assert not os.path.exists(store) and os.path.isdir(made)


def test_bad_arguments_fail_before_any_process_starts():
    with pytest.raises(ValueError, match="num_processes"):
        RankPool(0)
    with pytest.raises(ValueError, match="timeout"):
        RankPool(2, timeout=-1)
    with pytest.raises(ValueError, match="mixed_precision"):
        RankPool(2, mixed_precision="fp9")
    with pytest.raises(ValueError, match="start_method"):
        RankPool(2, start_method="thread")
    assert not started_children()


def test_diagnose_rules():
    now = 100.0
    record = {"op": "gather", "call": "all_gather_into_tensor", "shapes": [[2]], "dtypes": ["float32"],
              "site": "cell line 4", "started": 90.0}
    waiting = RankProgress(0, "running", snapshot={"collective": record})
    done = RankProgress(1, "finished")
    diagnosis = diagnose([waiting, done], now, timeout=30, grace=2)
    assert diagnosis.kind == "mismatch"
    assert diagnosis.summary == ("rank 0 waits in gather(all_gather_into_tensor, shape [2], float32) at cell line 4 "
                                 "for 10.0 s; rank 1 finished the cell")
    both = [waiting, RankProgress(1, "running", snapshot={"collective": dict(record, started=99.5)})]
    assert diagnose(both, now, timeout=30, grace=2) is None  # the same collective: still meeting
    assert diagnose(both, now, timeout=10, grace=2).kind == "timeout"
    other = RankProgress(1, "running", snapshot={"collective": dict(record, op="broadcast", call="broadcast")})
    assert diagnose([waiting, other], now, timeout=30, grace=2).kind == "mismatch"
    idle = diagnose([waiting, RankProgress(1, "idle")], now, timeout=30, grace=2)  # %%ranks --ranks 0
    assert idle.kind == "mismatch" and idle.summary.endswith("rank 1 does not run this cell")
    failed = diagnose([waiting, RankProgress(1, "failed", "ValueError: bad")], now, timeout=30, grace=2)
    assert failed.summary.endswith("rank 1 failed the cell (ValueError: bad)")
    raw = RankProgress(1, "running", snapshot={"collective": None, "raw_call": "torch.distributed.barrier", "line": 3},
                    raw_since=95.0)
    assert diagnose([waiting, raw], now, timeout=30, grace=2).summary.endswith(
        "rank 1 waits in torch.distributed.barrier at cell line 3 for 5.0 s")
    busy = RankProgress(1, "running", snapshot={"collective": None, "line": 7})
    assert diagnose([waiting, busy], now, timeout=30, grace=2) is None  # rank 1 may still get there
    assert diagnose([RankProgress(0, "running", snapshot={"collective": dict(record, started=99.0)}), done], now,
                    timeout=30, grace=2) is None


def test_hang_reports_show_the_users_frames_and_the_internals_on_request(monkeypatch):
    record = {"op": "gather", "call": "all_gather_single", "shapes": [[3]], "dtypes": ["int64"], "site": "cell line 2",
              "started": 90.0}
    user = '  File "Cell In[7]", line 2, in <module>\n    gather(x)\n'
    full = user + '  File "/x/nbaccel/utils/collectives.py", line 198, in _call_checked\n    fn(*args)\n'
    waiting = RankProgress(0, "running", snapshot={"collective": record, "stack": user, "full_stack": full,
                                                   "hidden_frames": 1})
    monkeypatch.delenv("NBACCEL_INTERNAL_FRAMES", raising=False)
    diagnosis = diagnose([waiting, RankProgress(1, "finished")], 100.0, timeout=30, grace=2)
    assert user.rstrip() in diagnosis.details and "_call_checked" not in diagnosis.details
    assert diagnosis.details.endswith("(1 frame inside nbaccel and torch hidden: the error's .full_stacks has them; "
                                      "set NBACCEL_INTERNAL_FRAMES=1 to show them here)")
    assert diagnosis.full_details == "rank 0, main thread (most recent call last):\n" + full.rstrip()
    monkeypatch.setenv("NBACCEL_INTERNAL_FRAMES", "1")
    shown = diagnose([waiting, RankProgress(1, "finished")], 100.0, timeout=30, grace=2)
    assert shown.details == shown.full_details and "_call_checked" in shown.details and "hidden" not in shown.details


def test_a_given_cell_name_names_the_cell_and_a_new_name_recompiles_it():
    with RankPool(2, timeout=20) as pool:
        failing = "y = 1\nraise KeyError(y)"
        assert 'File "Cell In[3]", line 2, in <module>' in pool.exec(failing, name="Cell In[3]")[0].error.traceback
        assert 'File "Cell In[4]", line 2, in <module>' in pool.exec(failing, name="Cell In[4]")[0].error.traceback
        assert _cell_file(pool.exec(failing)[0].error.traceback).startswith("<rank-cell-")
        assert pool.exec("y = 5\ny", name="Cell In[4]").values == [5, 5]  # same name, new source: run as it is
        with pytest.raises(ValueError, match="name must be a non-empty str"):
            pool.exec("1", name="")


def test_rank_view_shows_equal_values_once_and_columns():
    same = RankResults([RankResult(0, text="tensor([1])", meta={"type": "tensor", "shape": [1], "dtype": "int64",
                                                                "device": "cpu"}),
                        RankResult(1, text="tensor([1])", meta={"type": "tensor", "shape": [1], "dtype": "int64",
                                                                "device": "cpu"})])
    assert render_text(same) == "all ranks: tensor([1])  (shape [1], int64, cpu)"
    different = RankResults([RankResult(0, stdout="a\n", text="1"),
                             RankResult(1, text=None, status="failed",
                                        error=WorkerFailure(1, "ValueError", "bad", "Traceback...\nValueError: bad"))])
    text = render_text(different)
    assert "[rank 0] a" in text and "[rank 1] ValueError: bad" in text and "rank 0: 1" in text
    many = RankResults([RankResult(0, stdout="".join(f"line {i}\n" for i in range(500)))])
    assert "300 earlier lines" in render_text(many) and "[rank 0] line 499" in render_text(many)
    assert "line 299\n" not in render_text(many) + "\n" and "line 300" in render_html(many)
    dots = RankResults([RankResult(0, stdout="." * 1_000_000)])  # one line that grew: cut to its end too
    assert len(render_html(dots)) < 40_000 and len(render_text(dots)) < 40_000
    assert "968000 earlier characters" in render_text(dots)
    html = render_html(different)
    assert html.count("<b>rank ") == 2 and "ValueError: bad" in html and "all ranks" not in html


def test_a_rank_that_cannot_start_raises_with_its_traceback(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "nbaccel-no-such-if0")  # gloo cannot create the process group
    with pytest.raises(RankStartError, match="failed to start") as caught:
        RankPool(2, timeout=5)
    assert "Traceback" in str(caught.value)
