"""RankPool and %%ranks when a rank fails badly: it dies mid-cell, its peer is left computing or waiting in a
collective. The user must get one error, soon, that names the rank and what happened, and no process stays.

Each test starts its own pool (the suite fails a test that leaves a process running) and checks that the one
it replaced is gone.
"""

from __future__ import annotations

import pytest
from process_helpers import all_gone

from nbaccel.launch.pool import (
    CollectiveMismatchError,
    RankFailedError,
    RankPool,
    RankResults,
    RankStartError,
    rank_pool,
)

# a test that fails by waiting (the fault the file guards against) fails here, not at the suite's limit
pytestmark = pytest.mark.timeout(60)

SETUP = """
import os, signal, time
import torch
import torch.distributed as dist
rank = dist.get_rank()
"""
# rank 1 ends by SIGKILL (as the OOM killer or `kill -9` ends it) while rank 0 computes on, for far longer
# than any test may take
KILLED_WHILE_PEER_COMPUTES = """
if rank == 1:
    print("dying", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
print("computing", flush=True)
time.sleep(600)
"""
# rank 1 dies after both ranks met once; rank 0 then waits for it in a collective, whose gloo error
# ("Connection closed by peer") is the consequence, not the cause
KILLED_WHILE_PEER_WAITS = """
dist.all_reduce(torch.ones(1))
if rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)
dist.all_reduce(torch.ones(1))
"""


@pytest.fixture
def pool():
    with RankPool(2, timeout=20) as pool:
        yield pool


def _fresh(pool: RankPool) -> list[int]:
    """Define the cells' names on the ranks (a restart loses them); return the ranks' pids."""
    pool.exec(SETUP).raise_if_failed()
    return pool.pids


def _killed_while_peer_computes() -> None:
    import os
    import signal
    import time

    import torch.distributed as dist

    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(600)


def test_a_rank_that_dies_ends_the_call_without_waiting_for_the_others_to_finish(pool):
    """The pool restarts every rank after a rank died, so the others' work is lost anyway: the call gives them
    a short grace, then reports, instead of waiting for a computation of minutes (here ten) to end."""
    old = _fresh(pool)
    restarts = pool.restarts
    results = pool.exec(KILLED_WHILE_PEER_COMPUTES)
    assert results[1].error.exc_type == "RankDied" and "SIGKILL" in results[1].error.message
    assert results[1].stdout == "dying\n" and not results[1].group_broken
    stopped = results[0]
    assert stopped.error.exc_type == "RankStopped" and stopped.group_broken, stopped
    assert "rank 1 died (killed by SIGKILL" in stopped.error.message and "restarts every rank" in stopped.error.message
    assert stopped.stdout == "computing\n"  # what it printed before it was given up
    assert pool.restarts == restarts + 1 and all_gone(old)
    # run(): the dead rank heads the error, the rank given up on follows as its consequence
    old = pool.pids
    with pytest.raises(RankFailedError) as caught:
        pool.run(_killed_while_peer_computes)
    assert all_gone(old)
    head, also = str(caught.value).splitlines()[:2]
    assert head.startswith("ranks 1, 0 failed; first: rank 1: RankDied: the rank process ended (killed by SIGKILL"), head
    assert also.startswith("  also rank 0: RankStopped: stopped before it finished, because rank 1 died"), also
    assert pool.exec("1 + 1").values == [2, 2]


def test_a_ranks_cell_that_fails_names_the_rank_that_died_not_its_peer_s_gloo_error(pool):
    """%%ranks shows every rank's traceback, then raises: its one line must name the cause (rank 1 was killed),
    not rank 0's `Connection closed by peer`, which only follows from it."""
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output

    from nbaccel.notebook.magics import RankMagics

    _fresh(pool)
    shell = InteractiveShell.instance()
    try:
        magics = RankMagics(shell)
        magics.pool = pool
        with capture_output(), pytest.raises(RankFailedError) as caught:
            magics.ranks("", KILLED_WHILE_PEER_WAITS)
    finally:
        magics.pool = None  # the fixture's pool: the fixture stops it
        InteractiveShell.clear_instance()
    message = str(caught.value)
    assert message.startswith("ranks 0, 1 failed; first: rank 1: RankDied: the rank process ended (killed by "
                              "SIGKILL"), message
    assert message.endswith("(remote traceback above)") and "Connection closed" not in message, message
    assert pool.exec("1 + 1").values == [2, 2]


def _interrupt_once_every_rank_printed(partial: RankResults) -> None:
    """What the stop button does (the kernel's SIGINT), once every rank is in the cell's last statement."""
    if all(result.stdout for result in partial):
        raise KeyboardInterrupt


def test_an_interrupt_says_what_it_did_to_each_rank(pool):
    """The stop button during a %%ranks cell or pool call: a KeyboardInterrupt whose one line (IPython shows
    `_render_traceback_`, not the frames of the pool's wait) says which ranks stopped and whether the ranks
    keep their variables, or which did not stop, so that every rank was restarted."""
    _fresh(pool)
    with pytest.raises(KeyboardInterrupt) as caught:
        pool.exec("print('sleeping', flush=True)\ntime.sleep(600)", on_progress=_interrupt_once_every_rank_printed)
    assert str(caught.value) == "interrupted: ranks 0, 1 stopped; the ranks keep their variables"
    assert caught.value._render_traceback_() == [f"KeyboardInterrupt: {caught.value}"]
    assert pool.exec("rank").values == [0, 1]
    # rank 0 does not stop (as a rank inside a gloo collective does not): it is restarted with the others
    old = pool.pids
    with pytest.raises(KeyboardInterrupt) as caught:
        pool.exec("if rank == 0:\n    signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
                  "print('sleeping', flush=True)\ntime.sleep(600)", on_progress=_interrupt_once_every_rank_printed)
    assert str(caught.value) == ("interrupted: rank 0 did not stop within 3 s (inside a collective, which cannot be "
                                 "interrupted, or going on after the KeyboardInterrupt); rank 1 stopped; every rank "
                                 "was restarted: the ranks' variables are lost, re-run the cells that define them"
                                 ), str(caught.value)
    assert all_gone(old) and pool.exec("'rank' in dir()").values == [False, False]


def _object_of_a_module_only_the_ranks_import(folder: str) -> object:
    import sys

    sys.path.insert(0, folder)  # on the rank only: the kernel cannot import the module
    import rank_only_module

    return rank_only_module.Thing()


def test_a_value_the_kernel_cannot_unpickle_is_an_error_of_run_and_pull_not_a_none(pool, tmp_path):
    (tmp_path / "rank_only_module.py").write_text("class Thing:\n    pass\n")
    with pytest.raises(RankFailedError) as caught:
        pool.run(_object_of_a_module_only_the_ranks_import, str(tmp_path))
    assert str(caught.value).startswith("ranks 0, 1 failed; first: rank 0: ModuleNotFoundError: the value of rank 0 "
                                        "cannot be unpickled in the kernel: No module named 'rank_only_module'")
    pool.exec("import rank_only_module\nthing = rank_only_module.Thing()")
    with pytest.raises(RankFailedError, match="the value of rank 1 cannot be unpickled in the kernel"):
        pool.pull("thing", ranks=[1])
    # a cell's value stays a result: the rank's description of it is shown, the problem is in its meta
    results = pool.exec("thing")
    assert results.failed == [] and results[0].text.startswith("<rank_only_module.Thing object")
    assert results[0].meta["value_error"] == "ModuleNotFoundError: No module named 'rank_only_module'"
    assert pool.run(int, "7") == [7, 7]


def _exits(code: int | None) -> None:
    import sys

    sys.exit(code) if code is not None else sys.exit()


def test_run_takes_sys_exit_0_as_notebook_launcher_does_and_a_cell_as_ipython_does(pool):
    """A function that ends with sys.exit() or sys.exit(0) succeeded under notebook_launcher (value None), so it
    does under `run`; another code fails the rank, which stays up. In a cell, as in IPython's, any SystemExit
    is the cell's error."""
    assert pool.run(_exits, 0) == [None, None] and pool.run(_exits, None) == [None, None]
    pids = pool.pids
    with pytest.raises(RankFailedError, match=r"first: rank 0: SystemExit: 3"):
        pool.run(_exits, 3)
    results = pool.exec("import sys\nsys.exit(0)")
    assert [result.error.exc_type for result in results] == ["SystemExit", "SystemExit"]
    assert pool.pids == pids and pool.restarts == 0


def test_debug_with_nothing_to_debug_says_why_in_one_line(pool):
    """`%ranks debug` when no rank failed is a misuse of the magic (IPython's one-line UsageError, not a
    traceback through the pool); after the ranks were restarted the failure's frames are gone, and it says so
    instead of opening a new rank that has nothing to show."""
    from IPython.core.error import UsageError
    from IPython.core.interactiveshell import InteractiveShell

    from nbaccel.notebook.magics import RankMagics

    shell = InteractiveShell.instance()
    magics = RankMagics(shell)
    magics.pool = pool
    try:
        with pytest.raises(UsageError, match=r"^no rank failed in the last cell or function call; name the rank: "
                                             r"%ranks debug 1$"):
            magics.ranks("debug")
        assert pool.exec("1 / 0 if __import__('os').environ['RANK'] == '1' else 0").failed[0].rank == 1
        assert pool.failed_ranks == [1]
        pool.exec("import os\nif os.environ['RANK'] == '1':\n    os._exit(3)\n")  # rank 1 dies: every rank restarts
        assert pool.failed_ranks == [] and pool.restarts == 1
        with pytest.raises(UsageError, match="the ranks were restarted after the last failure"):
            magics.ranks("debug")
        with pytest.raises(RuntimeError, match="the ranks were restarted after the last failure"):
            pool.debug()
    finally:
        magics.pool = None  # the fixture's pool: the fixture stops it
        InteractiveShell.clear_instance()


def test_a_wrong_rank_or_pool_argument_in_a_magic_is_one_line(pool):
    """`%%ranks --ranks 5` on two ranks and `%ranks start` with an argument RankPool refuses are misuses of the
    magic: IPython's one-line UsageError, as for a malformed argument, not a ValueError's traceback; and the
    ranks that run stay running (a typo must not cost their variables)."""
    from IPython.core.error import UsageError
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output

    from nbaccel.notebook.magics import RankMagics

    magics = RankMagics(InteractiveShell.instance())
    try:
        magics.pool = pool
        pool.exec("kept = 1")
        with pytest.raises(UsageError, match="Unknown mixed_precision mode: 'bogus'"):
            magics.ranks("start --mixed_precision bogus")
        assert magics.pool is pool and pool.exec("kept").values == [1, 1]
        with pytest.raises(UsageError, match=r"^--ranks 1,5: no rank 5; the ranks are 0\.\.1$"):
            magics.ranks("--ranks 1,5", "1")
        assert magics.ranks("--ranks 1", "41 + 1")[0].value == 42
        old = pool.pids
        with capture_output() as shown:  # arguments that pass: the running ranks are stopped, new ones start
            magics.ranks("start -n 1")
        assert shown.stdout.startswith("Stopped the 2 ranks that ran before.\nStarted 1 ranks"), shown.stdout
        assert not pool.running and all_gone(old) and magics.pool.exec("1").values == [1]
    finally:
        if magics.pool is not pool:
            magics.close()  # the pool the magic started
        InteractiveShell.clear_instance()


@pytest.mark.parametrize("fault", ["hang", "died", "interrupt"])
def test_a_restart_that_fails_names_the_first_cause_and_why_the_ranks_did_not_start(monkeypatch, fault):
    """After a hang, a dead rank or an interrupt a rank does not heed, the pool restarts every rank. When the new
    ranks cannot start (here: not within the time they are given, as on a machine too busy to start them), the
    one error says what went wrong first and why the ranks did not start again; the pool is then shut down, and
    nothing is left."""
    with RankPool(2, timeout=3) as pool:
        old = _fresh(pool)
        monkeypatch.setattr(rank_pool, "START_TIMEOUT", 0.001)  # the next start's limit
        if fault == "hang":
            with pytest.raises(CollectiveMismatchError) as caught:
                pool.exec("if rank == 0:\n    dist.all_reduce(torch.ones(1))\n")
            first = "not every rank entered the same collective"
            assert "rank 0 stayed inside a collective, which cannot be undone), but they did not start again: the " \
                   "RankPool is shut down, start a new one (or `%ranks start`)" in str(caught.value)
            assert not caught.value.restarted
        elif fault == "died":
            with pytest.raises(RankStartError) as caught:
                pool.exec("if rank == 1:\n    os._exit(3)\n")
            first = "the process group failed ("
            assert [result.status for result in caught.value.results] == ["finished", "failed"]
        else:
            with pytest.raises(KeyboardInterrupt) as caught:
                pool.exec("if rank == 0:\n    signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
                          "print('sleeping', flush=True)\ntime.sleep(600)",
                          on_progress=_interrupt_once_every_rank_printed)
            first = "interrupted: rank 0 did not stop within 3 s"
            assert caught.value._render_traceback_() == [f"KeyboardInterrupt: {caught.value}"]
        shown = str(caught.value)  # what IPython shows: the message only
        assert shown.startswith(first), shown
        assert "did not start again" in shown and "RankStartError: " in shown, shown
        assert isinstance(caught.value.__cause__, RankStartError)
        assert "did not start within 0.001 s" in str(caught.value.__cause__)
        assert not pool.running and all_gone(old)
        with pytest.raises(RuntimeError, match="the RankPool is shut down"):
            pool.exec("1")
