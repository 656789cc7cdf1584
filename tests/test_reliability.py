"""Faults provoked on purpose (issue 15): a correct script exits 0; an exception whose __str__ raises is
still reported with its type and traceback."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch  # noqa: F401  (imported here so forked workers inherit it instead of importing it again)
from process_helpers import live_children
from torch.distributed import TCPStore

from nbaccel.launch import LaunchError, notebook_launcher
from nbaccel.launch.pool import RankFailedError, RankPool
from nbaccel.utils.atomic_files import write_text
from nbaccel.utils.exception_report import report_exception, safe_message

ROOT = Path(__file__).resolve().parent.parent

OK_SCRIPT = """
import torch
from nbaccel import PartialState

state = PartialState()
total = torch.ones(1)
torch.distributed.all_reduce(total)
assert total.item() == state.num_processes
# held past destroy_process_group, as a DDP model holds its group in a training script: gloo's worker threads
# then live until the interpreter finalizes, and the exit hook lets them settle first
group = torch.distributed.group.WORLD
"""


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


# ------------------------------------------------------------------ 1. a correct script exits 0
def test_script_under_nbaccel_launch_leaves_no_process_group_at_exit(tmp_path: Path) -> None:
    """The script never destroys its group; by the time the interpreter finalizes, nbaccel has (an atexit hook
    registered before PartialState runs after nbaccel's, and looks). On main the group was still up: gloo's
    threads then ran into finalization, which aborts the process now and then (exit -6)."""
    script = tmp_path / "ok.py"
    script.write_text(textwrap.dedent("""
        import atexit, os, sys
        import torch.distributed as dist

        def look():
            print(f"rank {os.environ['RANK']} group at exit: {dist.is_initialized()}", flush=True)

        atexit.register(look)  # registered first: runs last
    """) + OK_SCRIPT)
    run = subprocess.run([sys.executable, "-m", "nbaccel", "launch", "--num_processes", "2", str(script)],
                         capture_output=True, text=True, timeout=150, env=_env(), cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    for rank in (0, 1):
        assert f"rank {rank} group at exit: False" in run.stdout, run.stdout + run.stderr


def _gloo_threads() -> int:
    """How many of this process's threads are gloo's worker threads, read as the exit's settle wait reads them."""
    from nbaccel.utils.process_group_exit import GLOO_WORKER_THREAD, _thread_states

    return len(_thread_states("/proc/self/task", GLOO_WORKER_THREAD))


def _gloo_threads_after_collectives_and_destroy() -> int:
    import torch.distributed as dist

    from nbaccel import PartialState
    from nbaccel.utils import broadcast, gather, pad_across_processes, reduce

    state = PartialState()
    gather(torch.ones(2)), reduce(torch.ones(2)), broadcast(torch.ones(2))
    pad_across_processes(torch.ones(state.process_index + 1))
    state.wait_for_everyone()
    dist.destroy_process_group()
    return _gloo_threads()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the threads' names from /proc")
def test_destroy_process_group_ends_gloo_threads_after_nbaccels_collectives() -> None:
    """nbaccel's collectives kept a reference to the default group (a backend-name cache), so
    `destroy_process_group` left gloo's worker threads running into interpreter finalization, where one that
    released its last collective late aborted the process (-6): 6 of 40 runs of `nbaccel test`'s script under
    load. The group must end when torch's documented teardown says so."""
    assert notebook_launcher(_gloo_threads_after_collectives_and_destroy, num_processes=2, dashboard=False) == [0, 0]


class _Holder:
    """Refers to itself: once dropped, cyclic garbage that only a collection frees."""


def _gloo_threads_at_exit_with_the_group_in_cyclic_garbage(report: str) -> int:
    """The group held past the function by cyclic garbage old enough that only a full collection frees it;
    an exit hook registered before PartialState's (so it runs after it) writes how many gloo threads are left
    for finalization.

    (A DDP model is no way to hold it here: torch's DDP leaves references to the group's Python object that
    nothing frees, so after a DDP model the group always outlives its destroy; docs/launcher.md.)"""
    import atexit
    import gc

    import torch.distributed as dist

    from nbaccel import PartialState

    def look() -> None:  # written whole: the test polls for the name, then reads
        write_text(f"{report}.{os.environ['RANK']}", str(_gloo_threads()), durable=False)

    atexit.register(look)
    PartialState()
    holder = _Holder()
    holder.group, holder.me = dist.group.WORLD, holder
    gc.collect()  # the holder survives a collection: it is now in the oldest generation
    total = torch.ones(1)
    dist.all_reduce(total)
    return int(total.item())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the threads' names from /proc")
def test_a_spawned_rank_frees_a_group_held_by_cyclic_garbage_before_finalization(tmp_path: Path) -> None:
    """A spawned rank ends through the interpreter's exit. A group that only cyclic garbage still holds
    outlived `destroy_process_group`, so gloo's threads ran into finalization (where one of them now and then
    aborts the process, -6); nbaccel's teardown now collects it while the interpreter is whole."""
    report = str(tmp_path / "threads")
    assert notebook_launcher(_gloo_threads_at_exit_with_the_group_in_cyclic_garbage, (report,), num_processes=2,
                             dashboard=False, start_method="spawn") == [2, 2]
    deadline = time.monotonic() + 30  # the launch returns with the results, before the ranks' exit hooks ran
    while not all(Path(f"{report}.{rank}").exists() for rank in (0, 1)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [Path(f"{report}.{rank}").read_text() for rank in (0, 1)] == ["0", "0"]


# ~8 s quiet, ~17 s in the suite on 2 cores (8 runs took 35 s there, 16 runs 63-79 s): the deterministic test
# above is the guard; NBACCEL_EXIT_RUNS=50 for the stress this test began as
RUNS = 4


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_many_runs_of_a_correct_two_rank_script_all_exit_zero(tmp_path: Path) -> None:
    """RUNS runs of a 2-rank script that builds PartialState, all-reduces once and ends without destroying
    the group (which it still holds, as a DDP model would): 0 non-zero exits (on main about 1 run in 20 aborted
    with -6 here, up to 6 in 40 under load: 4 runs miss a rate of 1 in 20 81% of the time, so the
    deterministic check above is the one that always fails on it; this one shows the exit codes themselves).

    Each rank is a fresh interpreter with the environment `nbaccel launch` gives it (RANK, WORLD_SIZE,
    MASTER_ADDR/PORT, the agent's store): the abort happens at interpreter finalization, which forked workers
    never reach (they leave with os._exit) and which a fork of a warm parent did not reproduce (0 in 110). One
    `nbaccel launch` per run costs ~8 s here (a third interpreter, the torchrun agent); this form is the same
    processes without the agent, 2 runs at a time (~1.6 s per run on a quiet 2-core machine). The test holds
    each run's store, as torchrun's agent does (TORCHELASTIC_USE_AGENT_STORE): a port picked free for rank 0 to
    bind a second later was once taken by then, in a suite run (EADDRINUSE)."""
    script = tmp_path / "ok.py"
    script.write_text(OK_SCRIPT)
    env = _env()
    env.update(WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1",
               TORCHELASTIC_USE_AGENT_STORE="True")
    failures: list[str] = []
    runs, at_once = int(os.environ.get("NBACCEL_EXIT_RUNS", RUNS)), 2
    for first in range(0, runs, at_once):
        started = []
        stores = [TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
                  for _ in range(first, min(runs, first + at_once))]
        for store in stores:
            for rank in (0, 1):
                rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), MASTER_PORT=str(store.port))
                started.append(subprocess.Popen([sys.executable, str(script)], env=rank_env, cwd=tmp_path,
                                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        for process in started:
            try:
                out, _ = process.communicate(timeout=180)
            except subprocess.TimeoutExpired:  # a hang: say where it was, leave nothing running
                where = _where_stuck(process.pid)
                for other in started:
                    other.kill()
                    other.communicate()
                pytest.fail(f"a rank still ran after 180 s (run {first // at_once}):\n{where}\n"
                            f"ranks that failed before it: {failures}")
            if process.returncode != 0:
                failures.append(f"exit {process.returncode}: {out[-500:]}")
    assert failures == [], f"{len(failures)} of {2 * runs} ranks failed:\n" + "\n".join(failures)


# -------------------------------------------------- 4. an exception whose __str__ raises keeps its type
class UnprintableError(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no text for you")


def raise_unprintable() -> None:
    if os.environ.get("RANK", "0") == "1":
        raise UnprintableError("hidden")
    time.sleep(60)


def test_report_of_an_exception_whose_str_raises() -> None:
    try:
        raise_unprintable_here()
    except UnprintableError as exc:
        report = report_exception(exc)
    assert report.exc_type == "UnprintableError"
    assert "str()" in report.message and "RuntimeError" in report.message
    assert "raise_unprintable_here" in report.traceback and "UnprintableError" in report.traceback
    assert safe_message(ValueError("fine")) == "fine"


def raise_unprintable_here() -> None:
    raise UnprintableError("hidden")


def test_notebook_launcher_reports_type_and_traceback_when_str_raises() -> None:
    """On main the worker's own `str(exc)` raised while reporting: the kernel only saw "exited with code 1"."""
    with pytest.raises(LaunchError) as info:
        notebook_launcher(raise_unprintable, num_processes=2, dashboard=False, timeout=60)
    record = info.value.failures[1]
    assert record.exc_type == "UnprintableError", str(info.value)
    assert "raise_unprintable" in record.traceback and "UnprintableError" in record.traceback
    assert "rank 1: UnprintableError" in str(info.value)
    assert live_children() == []


def test_rank_pool_reports_type_and_traceback_when_str_raises() -> None:
    """On main the rank's reply never came (the rank's command loop died on `str(exc)`)."""
    with RankPool(2, timeout=30) as pool:
        pool.exec("class UnprintableError(Exception):\n    def __str__(self):\n        raise RuntimeError('no')\n")
        results = pool.exec("raise UnprintableError('hidden')")
        for result in results:
            assert not result.ok and result.error.exc_type == "UnprintableError"
            assert "<rank-cell-" in result.error.traceback
        with pytest.raises(RankFailedError, match="UnprintableError"):
            results.raise_if_failed()
        assert pool.exec("1 + 1").values == [2, 2]  # the ranks go on


def test_nbaccel_launch_shows_type_and_traceback_when_str_raises(tmp_path: Path) -> None:
    """Under `nbaccel launch` the script's uncaught exception is printed by Python itself, which copes with a
    raising __str__ (this passed on main too; it guards the launch path against a wrapper that would not)."""
    script = tmp_path / "bad.py"
    script.write_text(textwrap.dedent("""
        class UnprintableError(Exception):
            def __str__(self):
                raise RuntimeError("no")

        def main():
            raise UnprintableError("hidden")

        main()
    """))
    run = subprocess.run([sys.executable, "-m", "nbaccel", "launch", "--num_processes", "2", str(script)],
                         capture_output=True, text=True, timeout=150, env=_env(), cwd=tmp_path)
    assert run.returncode == 1
    assert "UnprintableError" in run.stderr and "in main" in run.stderr, run.stderr


def _where_stuck(pid: int) -> str:
    """A hung rank's threads (name, scheduler state) and, where py-spy is installed, their stacks."""
    lines = []
    for tid in sorted(os.listdir(f"/proc/{pid}/task")):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        lines.append(f"thread {tid} {stat[stat.index('('):stat.rindex(')') + 1]} {stat[stat.rindex(')') + 2]}")
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if Path(spy).exists():
        dump = subprocess.run([spy, "dump", "--native", "--pid", str(pid)], capture_output=True, text=True,
                              timeout=60)
        lines.append(dump.stdout + dump.stderr)
    return "\n".join(lines)
