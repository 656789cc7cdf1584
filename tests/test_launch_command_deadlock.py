"""`nbaccel launch` names ranks deadlocked in nbaccel collectives within seconds, and runs scripts as Python does.

Each script runs on 2 gloo ranks under `nbaccel launch`; the process group keeps its 600 s default timeout, so
a launch that ends in well under BOUND seconds was stopped by the collective watch
(nbaccel/launch/kernel/collective_watch.py). Before the watch these launches waited for that timeout, or
ended with gloo's "Connection reset by peer" blamed on the rank that waited.
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from nbaccel.commands.launch import resolve_settings, torchrun_arguments
from nbaccel.commands.main import build_parser
from nbaccel.launch.kernel.collective_watch import SOCKET_PARENTS
from nbaccel.launch.private_dirs import WATCH_PREFIX
from nbaccel.utils.constants import SCRIPT_ENTRY

pytestmark = pytest.mark.timeout(240)
ROOT = Path(__file__).resolve().parent.parent
BOUND = 40.0  # seconds: far below the process group's 600 s, far above the few the detection takes

PREAMBLE = """
    import os, sys, time
    import torch
    from nbaccel import PartialState
    from nbaccel.utils import broadcast, reduce

    state = PartialState()
    rank = state.process_index
    reduce(torch.ones(2))  # one collective both ranks go through
"""


def launch(tmp_path: Path, body: str, *options: str, processes: int = 2, preamble: str = PREAMBLE,
           env: dict[str, str] | None = None) -> tuple[int, str, str, float]:
    """Run `preamble` + `body` as tmp_path/job.py under `nbaccel launch`: (exit status, stdout, stderr, seconds)."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(preamble) + textwrap.dedent(body))
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "nbaccel", "launch", "--num_processes", str(processes), "--cpu", *options,
         str(script)],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        stdin=subprocess.DEVNULL, env=None if env is None else {**os.environ, **env},
    )
    (tmp_path / "launcher.pid").write_text(str(proc.pid))  # what this launch's own private folders are named by
    try:
        out, err = proc.communicate(timeout=BOUND)
    except subprocess.TimeoutExpired:
        for process in [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]:
            process.kill()  # the ranks too: torch elastic starts each in a session of its own
        out, err = proc.communicate()
        pytest.fail(f"nbaccel launch did not end within {BOUND} s\n{out}\n{err}")
    return proc.returncode, out, err, time.monotonic() - start


def own_watch_folders(tmp_path: Path) -> list[str]:
    """The collective-watch folders left by the launch `launch` ran last in tmp_path (named by its pid:
    nbaccel/launch/private_dirs.py), not those of other launches running on this machine."""
    pid = (tmp_path / "launcher.pid").read_text()
    parents = {tempfile.gettempdir(), *filter(None, SOCKET_PARENTS)}  # where a too deep one's socket goes
    return [path for parent in parents
            for path in glob.glob(os.path.join(parent, f"nbaccel-{os.getuid()}", f"{WATCH_PREFIX}{pid}-*"))]


def line_of(tmp_path: Path, text: str) -> str:
    """`<tmp_path>/job.py:N`: where `text` is in the script (what the report names)."""
    lines = (tmp_path / "job.py").read_text().splitlines()
    return f"{tmp_path / 'job.py'}:{next(i for i, line in enumerate(lines, 1) if text in line)}"


@pytest.mark.parametrize("restarts", ["0", "1"])
def test_different_operations_are_named_and_every_rank_stopped(tmp_path, restarts):
    """With restarts too: a deadlock is the program's, another attempt would replay it. Another launch's watch
    folder (here one of this live process) is left alone and does not fail the test."""
    from nbaccel.launch.private_dirs import make_user_dir

    other = make_user_dir(WATCH_PREFIX)
    try:
        code, out, err, _ = launch(tmp_path, """
            if rank == 0:
                reduce(torch.ones(3))
            else:
                broadcast(torch.ones(3))
            print("unreachable", flush=True)
        """, "--max_restarts", restarts)
        assert os.path.isdir(other)
    finally:
        os.rmdir(other)
    assert code == 1, err
    assert "unreachable" not in out
    assert "nbaccel launch: not every rank entered the same collective:" in err
    assert f"rank 0 waits in reduce(all_reduce, shape [3], float32) at {line_of(tmp_path, 'reduce(torch.ones(3))')}" in err
    assert f"rank 1 waits in broadcast(broadcast, shape [3], float32) at {line_of(tmp_path, 'broadcast(torch')}" in err
    assert "The operations differ: reduce (all_reduce) on rank 0, broadcast (broadcast) on rank 1." in err
    assert "stopped by SIGTERM" not in err and "death signal" not in err  # nobody sent a signal
    assert own_watch_folders(tmp_path) == []  # its socket is gone (other launches on the machine may have theirs)


def test_different_shapes_are_named(tmp_path):
    code, out, err, _ = launch(tmp_path, """
        reduce(torch.ones(3 + rank))
    """)
    assert code == 1, err
    assert "The shapes differ: [3] on rank 0, [4] on rank 1." in err


def test_a_rank_that_finished_while_another_waits_is_named(tmp_path):
    code, out, err, _ = launch(tmp_path, """
        if rank == 0:
            reduce(torch.ones(3))
    """)
    assert code == 1, err
    assert "nbaccel launch: rank 0 failed (exit code 1)" in err  # gloo's error, as before
    assert "not every rank entered the same collective:" in err  # and why it happened
    assert re.search(r"rank 0 waits in reduce\(all_reduce, shape \[3\], float32\) at \S+job\.py:\d+ for [\d.]+ s; "
                     r"rank 1 finished the script", err), err


def test_a_raw_call_that_a_finished_rank_left_is_named(tmp_path):
    code, out, err, _ = launch(tmp_path, """
        import torch.distributed as dist

        if rank == 0:
            dist.all_reduce(torch.ones(3))
    """)
    assert code == 1, err
    assert "nbaccel launch: rank 0 failed (exit code 1)" in err  # gloo's error, as before
    assert re.search(rf"rank 0 waits in torch\.distributed\.all_reduce at {re.escape(line_of(tmp_path, 'dist.all_reduce('))} "
                     r"for [\d.]+ s; rank 1 finished the script", err), err


def test_a_rank_that_ends_before_partial_state_is_named(tmp_path):
    code, out, err, seconds = launch(tmp_path, """
        import os
        from nbaccel import PartialState

        if os.environ["RANK"] == "0":
            PartialState()
    """, preamble="")
    assert code == 1, err
    assert seconds < BOUND
    assert re.search(rf"rank 0 waits in PartialState\(init_process_group\) at {re.escape(line_of(tmp_path, 'PartialState()'))} "
                     r"for [\d.]+ s; rank 1 finished the script", err), err


def test_a_rank_that_is_only_late_is_waited_for(tmp_path):
    code, out, err, seconds = launch(tmp_path, """
        if rank == 1:
            time.sleep(4)  # longer than the watch's 2 s grace
        total = reduce(torch.ones(3), reduction="sum")
        print(f"rank {rank} total {total.tolist()}", flush=True)
    """)
    assert code == 0, err
    assert "rank 0 total [2.0, 2.0, 2.0]" in out and "rank 1 total [2.0, 2.0, 2.0]" in out
    assert "not every rank" not in err
    assert seconds > 4


def test_a_thread_the_script_leaves_running_may_still_meet_its_peer(tmp_path):
    """A rank's script has ended only when Python is done with its threads: rank 0's thread waits 4 s in a
    collective for rank 1's, after both scripts' main code returned."""
    code, out, err, _ = launch(tmp_path, """
        import threading

        def late():
            time.sleep(4 if rank == 1 else 0)
            print(f"rank {rank} late {reduce(torch.ones(2), reduction='sum').tolist()}", flush=True)

        threading.Thread(target=late).start()
        time.sleep(1)  # rank 0's thread is in its collective when the main code ends
    """)
    assert code == 0, err
    assert "rank 0 late [2.0, 2.0]" in out and "rank 1 late [2.0, 2.0]" in out


def test_threads_the_script_leaves_running_are_still_watched(tmp_path):
    """After both scripts' main code returned, their threads enter collectives that cannot meet."""
    code, out, err, _ = launch(tmp_path, """
        import threading

        threading.Thread(target=lambda: reduce(torch.ones(3)) if rank == 0 else broadcast(torch.ones(3))).start()
    """)
    assert code == 1, err
    assert "The operations differ: reduce (all_reduce) on rank 0, broadcast (broadcast) on rank 1." in err


def test_a_rank_that_fails_on_its_own_is_restarted_not_called_a_deadlock(tmp_path):
    """Rank 0 waits in a collective longer than the grace while rank 1 fails outside any: torch elastic's
    restart handles that failure; the watch stays out of it."""
    code, out, err, _ = launch(tmp_path, """
        attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        if rank == 1 and attempt == 0:
            time.sleep(4)
            raise ValueError("rank 1 fails on its own")
        reduce(torch.ones(3))
        print(f"rank {rank} attempt {attempt} done", flush=True)
    """, "--max_restarts", "1")
    assert code == 0, err
    assert "rank 0 attempt 1 done" in out and "rank 1 attempt 1 done" in out
    assert "ValueError: rank 1 fails on its own" in err and "not every rank" not in err


def test_ranks_die_with_a_sigkilled_launch(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import os, time
        os.write(1, f"PID {os.getpid()}\\n".encode())  # one write: the two ranks share the pipe
        time.sleep(120)
    """))
    proc = subprocess.Popen([sys.executable, "-m", "nbaccel", "launch", "--num_processes", "2", "--cpu", str(script)],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            stdin=subprocess.DEVNULL)
    pids = [int(proc.stdout.readline().split()[1]) for _ in range(2)]
    proc.kill()
    proc.wait()
    proc.stdout.close()  # (a rank that outlived the launch would hold the pipe open)
    deadline = time.monotonic() + 10
    left = pids
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    for pid in left:  # no longer this test's children: the process fixture would not see them
        psutil.Process(pid).kill()
    assert not left, f"ranks {left} outlived their SIGKILLed launch"


def test_the_script_runs_as_python_runs_it(tmp_path):
    """sys.argv, __file__, __name__, sys.path[0] as under `python job.py`, and an uncaught exception's traceback
    starts in the script (no frames of nbaccel's entry); an exit status passes through."""
    (tmp_path / "helper.py").write_text("VALUE = 7\n")
    code, out, err, _ = launch(tmp_path, """
        import os, helper, __main__
        print(f"ARGV {sys.argv} FILE {__file__} NAME {__name__} PATH0 {sys.path[0]} MAIN {__main__.__file__} "
              f"VALUE {helper.VALUE}", flush=True)
        if rank == 0:
            raise ValueError("from the script")
        sys.exit(3)
    """, processes=1)
    script = tmp_path / "job.py"
    assert f"ARGV ['{script}'] FILE {script} NAME __main__ PATH0 {tmp_path} MAIN {script} VALUE 7" in out
    assert code == 1
    traceback = err[err.index("Traceback"):]
    assert f'File "{script}", line' in traceback and "ValueError: from the script" in traceback
    assert "script_entry" not in traceback and "runpy" not in traceback


def test_the_watch_is_one_more_torchrun_option(tmp_path):
    parser = build_parser()
    job = tmp_path / "job.py"
    job.write_text("")

    def argv(*args: str, watched: bool = True) -> list[str]:
        return torchrun_arguments(resolve_settings(parser.parse_args(["launch", *args]), None), watched=watched)

    assert argv(str(job), "--x")[-4:] == ["--module", SCRIPT_ENTRY, str(job), "--x"]
    assert argv("-m", "json.tool", "--x")[-5:] == ["--module", SCRIPT_ENTRY, "--module", "json.tool", "--x"]
    assert argv("--no_python", "hostname")[-2:] == ["--no-python", "hostname"]  # no Python: not watched
    assert argv(str(job), "--x", watched=False)[-2:] == [str(job), "--x"]


def test_a_temporary_folder_too_deep_for_a_socket_still_finds_the_deadlock(tmp_path):
    """A Unix socket's path has 104-108 bytes at most. A TMPDIR too deep for one (here 150 bytes; a test's
    tmp_path on CI was enough) once cost the launch its watch: no deadlock detection, no line relay (two ranks'
    lines mixed), no prompts. The watch's socket now goes to a short folder, and goes with the launch."""
    deep = tmp_path / ("d" * 150)
    deep.mkdir()
    code, out, err, seconds = launch(tmp_path, """
        if rank == 0:
            reduce(torch.ones(3))
        else:
            broadcast(torch.ones(3))
    """, env={"TMPDIR": str(deep)})
    assert "no deadlock detection" not in err
    assert code == 1 and seconds < BOUND, err
    assert "The operations differ: reduce (all_reduce) on rank 0, broadcast (broadcast) on rank 1." in err
    assert own_watch_folders(tmp_path) == []


def test_a_launch_without_a_socket_runs_unwatched_and_says_so(tmp_path, monkeypatch):
    """Where no folder is short enough for a socket's path, the launch loses its deadlock detection, prompts and
    line relay (with a warning that names all three), not its run, and leaves nothing behind."""
    from nbaccel.launch.kernel import collective_watch
    from nbaccel.launch.kernel.torchrun import TorchrunScript

    deep = tmp_path / ("d" * 120)
    deep.mkdir()
    monkeypatch.setattr(collective_watch, "SOCKET_PARENTS", (str(deep),))  # the only place, too deep
    backend = TorchrunScript()
    with pytest.warns(UserWarning, match="no deadlock detection in this launch") as caught:
        assert backend._start_watch(exit_grace=10.0) is None
    assert "input(), breakpoint() and printed lines go straight to the terminal" in str(caught[0].message)
    backend.close()
    assert list(deep.glob(f"*/{WATCH_PREFIX}*")) == []


def test_a_rank_stopped_in_its_teardown_still_finished():
    """Rank 1 finished its script; rank 0's collective then failed (its peer was gone), and torch elastic
    stopped rank 1 while it was still exiting ("signal 15"). The report still says rank 1 finished: rank 0
    waited for a rank that would never come. (Rank 1 is stopped in its teardown in about 1 launch of 7 here.)"""
    from multiprocessing.connection import Client

    from nbaccel.launch.kernel.collective_watch import CollectiveWatch

    def enter(op: str) -> dict:
        return {"kind": "collective", "event": "enter", "op": op, "call": "all_reduce", "shapes": [[3]],
                "dtypes": ["float32"], "site": "job.py:9", "started": time.time()}

    watch = CollectiveWatch(on_deadlock=lambda diagnosis: None)
    ranks = [Client(watch.address, family="AF_UNIX") for _ in range(2)]
    for rank, conn in enumerate(ranks):
        conn.send({"kind": "status", "state": "running", "rank": rank, "restart": 0})
        conn.send({**enter("reduce"), "rank": rank})
        conn.send({"kind": "collective", "event": "exit", "op": "reduce", "rank": rank})
    ranks[1].send({"kind": "status", "state": "finished", "rank": 1})
    ranks[0].send({**enter("reduce"), "rank": 0})
    ranks[0].send({"kind": "collective", "event": "error", "op": "reduce", "rank": 0})
    ranks[0].send({"kind": "status", "state": "failed", "rank": 0, "error": "RuntimeError: Connection reset"})
    for conn in ranks:
        conn.close()
    watch.close()
    diagnosis = watch.after_failure({0: "exit code 1", 1: "signal 15"})
    assert diagnosis is not None and "rank 1 finished the script" in diagnosis.summary, diagnosis


def test_raw_torch_distributed_calls_are_named(tmp_path):
    """The script's own torch.distributed calls, which nbaccel does not trace, are sampled where they block
    (launch/worker/raw_calls.py)."""
    code, out, err, elapsed = launch(tmp_path, """
        import torch.distributed as dist
        t = torch.ones(3)
        if rank == 0:
            dist.all_reduce(t)
        else:
            dist.broadcast(t, src=1)
        print("unreachable", flush=True)
    """)
    assert code == 1, err
    assert "unreachable" not in out
    assert "nbaccel launch: not every rank entered the same collective:" in err
    assert f"rank 0 waits in torch.distributed.all_reduce at {line_of(tmp_path, 'dist.all_reduce(t)')}" in err
    assert f"rank 1 waits in torch.distributed.broadcast at {line_of(tmp_path, 'dist.broadcast(t')}" in err
