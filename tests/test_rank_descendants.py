"""Issue 32: every process a rank started is stopped with the launch, the rank dead or alive, through each
front door (notebook_launcher, RankPool, `nbaccel launch`); and a child holding a dead rank's output pipe
does not delay the error (it would wait out the supervisor's drain)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch  # noqa: F401  (imported here so forked workers inherit it)
from process_helpers import is_alive, live_children

from nbaccel.launch import LaunchError, notebook_launcher
from nbaccel.launch.kernel.supervisor import DRAIN
from nbaccel.launch.pool import RankPool

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parent.parent


def _child_then_killed(folder: str, with_child: bool) -> None:
    """Rank 1 starts `sleep 300` (its pid into `folder`) and SIGKILLs itself; rank 0 waits to be stopped."""
    if os.environ["RANK"] == "0":
        time.sleep(60)
        return
    if with_child:
        child = subprocess.Popen(["sleep", "300"])
        Path(folder, "child").write_text(str(child.pid))
    Path(folder, "killed").write_text(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


def _error_delay(folder: Path, with_child: bool) -> float:
    """Seconds from rank 1's SIGKILL to notebook_launcher's error."""
    with pytest.raises(LaunchError) as info:
        notebook_launcher(_child_then_killed, args=(str(folder), with_child), num_processes=2, dashboard=False,
                          timeout=120)
    delay = time.time() - float((folder / "killed").read_text())
    assert "rank 1" in str(info.value) and "SIGKILL" in str(info.value), str(info.value)
    return delay


def test_notebook_launcher_stops_the_child_of_a_killed_rank_at_once(tmp_path: Path) -> None:
    plain, child = tmp_path / "plain", tmp_path / "child"
    plain.mkdir()
    child.mkdir()
    delays = {"plain": _error_delay(plain, False)}
    delays["child"] = _error_delay(child, True)
    pid = int((child / "child").read_text())
    assert not is_alive(pid), "the sleep started by the killed rank outlived the launch"
    assert live_children() == []
    # the same failure without a child is the yardstick: a child holding the pipe would add the whole drain
    assert delays["child"] < delays["plain"] + 0.75 * DRAIN, delays


def _finishes_leaving_a_child(folder: str) -> int:
    child = subprocess.Popen(["sleep", "300"])
    Path(folder, f"child-{os.environ['RANK']}").write_text(str(child.pid))
    return child.pid


def test_notebook_launcher_stops_what_a_finished_rank_left_running(tmp_path: Path) -> None:
    start = time.monotonic()
    pids = notebook_launcher(_finishes_leaving_a_child, args=(str(tmp_path),), num_processes=2, dashboard=False,
                             timeout=120)
    took = time.monotonic() - start
    assert not any(is_alive(pid) for pid in pids), "a rank's child outlived the launch"
    assert live_children() == []
    assert took < 60  # generous: only a guard against waiting for the children to end by themselves


def test_rank_pool_stops_the_child_of_a_killed_rank(tmp_path: Path) -> None:
    source = textwrap.dedent(f"""
        import os, signal, subprocess
        from pathlib import Path
        if os.environ["RANK"] == "1":
            child = subprocess.Popen(["sleep", "300"])
            Path({str(tmp_path)!r}, "child").write_text(str(child.pid))
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    with RankPool(2, timeout=60) as pool:
        start = time.monotonic()
        results = pool.exec(source, ranks=[1])
        took = time.monotonic() - start
        died = [result for result in results if result.error is not None]
        assert len(died) == 1 and "SIGKILL" in died[0].error.message, results
        pid = int((tmp_path / "child").read_text())
        assert not is_alive(pid), "the sleep started by the dead rank outlived the call"
        assert took < 60  # generous: only a guard against waiting for the child
    assert live_children() == []


def test_rank_pool_stop_ends_what_a_live_rank_started(tmp_path: Path) -> None:
    source = textwrap.dedent(f"""
        import os, subprocess
        from pathlib import Path
        child = subprocess.Popen(["sleep", "300"])
        Path({str(tmp_path)!r}, "child-" + os.environ["RANK"]).write_text(str(child.pid))
    """)
    with RankPool(2, timeout=60) as pool:
        pool.exec(source)
        pids = [int(path.read_text()) for path in tmp_path.glob("child-*")]
        assert len(pids) == 2 and all(is_alive(pid) for pid in pids)
    assert not any(is_alive(pid) for pid in pids), "a rank's child outlived the pool"
    assert live_children() == []


SCRIPT = """
import os, signal, subprocess, sys, time
from pathlib import Path
folder = Path(sys.argv[1])
if os.environ["RANK"] == "0":
    time.sleep(60)
elif sys.argv[2] in ("child", "detached"):  # detached: a session of its own, as a daemon starts
    child = subprocess.Popen(["sleep", "300"], start_new_session=sys.argv[2] == "detached")
    (folder / "child").write_text(str(child.pid))
if os.environ["RANK"] == "1":
    os.kill(os.getpid(), signal.SIGKILL)
"""


def _launch(script: Path, folder: Path, variant: str) -> tuple[float, subprocess.CompletedProcess, bool]:
    """Run the script under `nbaccel launch`: (seconds it took, the run, whether rank 1's child outlived it)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    start = time.monotonic()
    child = folder / "child"
    try:
        run = subprocess.run([sys.executable, "-m", "nbaccel", "launch", "--num_processes", "2", str(script),
                              str(folder), variant], capture_output=True, text=True, timeout=200, env=env,
                             cwd=folder)
    finally:  # the child is no child of this process: nothing else would end one left behind
        survived = child.exists() and is_alive(int(child.read_text()))
        if survived:
            os.kill(int(child.read_text()), signal.SIGKILL)
    return time.monotonic() - start, run, survived


def test_nbaccel_launch_stops_the_child_of_a_killed_rank(tmp_path: Path) -> None:
    script = tmp_path / "kill.py"
    script.write_text(SCRIPT)
    plain, run, _ = _launch(script, tmp_path, "plain")
    assert run.returncode == 1, run.stdout + run.stderr
    with_child, run, survived = _launch(script, tmp_path, "child")
    assert run.returncode == 1, run.stdout + run.stderr
    assert "rank 1 failed" in run.stderr and "SIGKILL" in run.stderr, run.stderr
    assert not survived, "the sleep started by the killed rank outlived nbaccel launch"
    assert live_children() == []
    # the child shares the launch's stdout: alive, it would hold `capture_output` open for its 300 s
    assert with_child < 3 * plain, (plain, with_child)


def _detached_child_then_killed(folder: str) -> None:
    """Rank 1 starts `sleep 300` in a session of its own (as a daemon, or a tool that detaches, starts one),
    records its pid and SIGKILLs itself; rank 0 waits to be stopped. Once rank 1 is dead the sleep is in no
    tree and no group of the launch: only its environment says whose it is."""
    if os.environ["RANK"] == "0":
        time.sleep(60)
        return
    child = subprocess.Popen(["sleep", "300"], start_new_session=True)
    Path(folder, "child").write_text(str(child.pid))
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_notebook_launcher_stops_a_detached_child_of_a_killed_rank(tmp_path: Path, start_method: str) -> None:
    try:
        with pytest.raises(LaunchError, match="SIGKILL"):
            notebook_launcher(_detached_child_then_killed, args=(str(tmp_path),), num_processes=2,
                              start_method=start_method, dashboard=False, timeout=120)
        alive = is_alive(int((tmp_path / "child").read_text()))
    finally:
        _kill_recorded(tmp_path / "child")
    assert not alive, "the sleep the killed rank started in a session of its own outlived the launch"
    assert live_children() == []


def test_nbaccel_launch_stops_a_detached_child_of_a_killed_rank(tmp_path: Path) -> None:
    script = tmp_path / "kill.py"
    script.write_text(SCRIPT)
    _, run, survived = _launch(script, tmp_path, "detached")
    assert run.returncode == 1, run.stdout + run.stderr
    assert not survived, "the sleep the killed rank started in a session of its own outlived nbaccel launch"


def test_rank_pool_stops_a_detached_child_of_a_killed_rank(tmp_path: Path) -> None:
    source = textwrap.dedent(f"""
        import os, signal, subprocess
        from pathlib import Path
        if os.environ["RANK"] == "1":
            child = subprocess.Popen(["sleep", "300"], start_new_session=True)
            Path({str(tmp_path)!r}, "child").write_text(str(child.pid))
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    try:
        with RankPool(2, timeout=60) as pool:
            results = pool.exec(source, ranks=[1])
            assert "SIGKILL" in results[0].error.message, results
        alive = is_alive(int((tmp_path / "child").read_text()))
    finally:
        _kill_recorded(tmp_path / "child")
    assert not alive, "the sleep the killed rank started in a session of its own outlived the pool"
    assert live_children() == []


def _popen_then_killed_once(folder: str) -> int:
    """First attempt: rank 1 starts `sleep 300` (its pid into `folder`) and SIGKILLs itself, which makes torch
    elastic restart the ranks. The restarted ranks return their attempt number."""
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if attempt == 0 and os.environ["RANK"] == "1":
        child = subprocess.Popen(["sleep", "300"])
        Path(folder, "child").write_text(str(child.pid))
        os.kill(os.getpid(), signal.SIGKILL)
    if attempt == 0:
        time.sleep(60)  # stopped by the agent when rank 1 dies
    return attempt


def test_restarted_launch_stops_the_child_of_the_killed_rank(tmp_path: Path) -> None:
    start = time.monotonic()
    try:
        results = notebook_launcher(_popen_then_killed_once, args=(str(tmp_path),), num_processes=2,
                                    max_restarts=1, dashboard=False, timeout=120)
        took = time.monotonic() - start
        pid = int((tmp_path / "child").read_text())
        alive = is_alive(pid)
    finally:
        _kill_recorded(tmp_path / "child")
    assert results == [1, 1]
    assert not alive, "the sleep started by the killed rank outlived the restarted launch"
    assert live_children() == []
    assert took < 60, took  # generous: only a guard against waiting for the child


NO_PYTHON_SCRIPT = """#!/bin/sh
# rank 1 puts `sleep 300` in the background (detached: in a session of its own), records its pid, then
# SIGKILLs itself or exits 0
if [ "$RANK" = "1" ]; then
    if [ "$2" = "detached" ]; then setsid sleep 300 & else sleep 300 & fi  # setsid: a session of its own
    echo $! > "$1/child"
    if [ "$2" != "exit" ]; then kill -KILL $$; fi
fi
exit 0
"""


def _kill_recorded(path: Path) -> None:
    """A process the test recorded and that outlived the call: no child of this process, so end it here."""
    if path.exists() and is_alive(int(path.read_text())):
        os.kill(int(path.read_text()), signal.SIGKILL)


@pytest.mark.parametrize("ending", ["kill", "exit", "detached"])
def test_nbaccel_launch_no_python_stops_what_a_rank_left(tmp_path: Path, ending: str) -> None:
    """`nbaccel launch --no_python` runs an executable, not nbaccel's Python entry: what its rank leaves behind
    (killed, or after a normal exit 0) is stopped all the same."""
    script = tmp_path / "rank.sh"
    script.write_text(NO_PYTHON_SCRIPT)
    script.chmod(0o755)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    start = time.monotonic()
    try:
        run = subprocess.run([sys.executable, "-m", "nbaccel", "launch", "--num_processes", "2", "--no_python",
                              str(script), str(tmp_path), ending], capture_output=True, text=True, timeout=200,
                             env=env, cwd=tmp_path)
        took = time.monotonic() - start
        alive = is_alive(int((tmp_path / "child").read_text()))
    finally:
        _kill_recorded(tmp_path / "child")
    assert run.returncode == (0 if ending == "exit" else 1), run.stdout + run.stderr
    assert not alive, "the sleep started by the rank outlived nbaccel launch --no_python"
    # the sleep shares the launch's stdout: alive, it would hold `capture_output` open for its 300 s
    assert took < 100, took


KERNEL = """
import os, subprocess, sys, time
from pathlib import Path
import torch  # noqa: F401
from nbaccel import notebook_launcher

def rank(folder):
    child = subprocess.Popen(["sleep", "300"], start_new_session=sys.argv[3] == "detached")
    Path(folder, "pids-" + os.environ["RANK"]).write_text(f"{os.getpid()} {child.pid}")
    time.sleep(300)

if sys.argv[2] == "pool":  # persistent ranks (RankPool, %ranks) in the middle of a call
    from nbaccel import RankPool

    with RankPool(num_processes=2) as pool:
        pool.run(rank, sys.argv[1])
else:
    notebook_launcher(rank, args=(sys.argv[1],), num_processes=2, dashboard=False, max_restarts=int(sys.argv[2]))
"""


@pytest.mark.parametrize("max_restarts, child, reaped", [(0, "child", True), (1, "child", True), ("pool", "child", True),
                                                   (0, "detached", True), ("pool", "child", False)],
                         ids=["launch", "restarts", "pool", "detached-child", "pool-unreaped-kernel"])
def test_a_killed_kernel_leaves_no_rank_and_no_rank_child(tmp_path: Path, max_restarts: int | str, child: str,
                                                          reaped: bool) -> None:
    """SIGKILL of the process that called notebook_launcher, or that holds a RankPool in the middle of a call (a
    kernel the OOM killer or a timeout ends): its ranks and what they started end within seconds, though
    nothing of the kernel could stop them; also a child in a session of its own (`detached`), and while the
    dead kernel waits to be reaped by its parent (a zombie still answers `kill -0`)."""
    script = tmp_path / "kernel.py"
    script.write_text(KERNEL)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    kernel = subprocess.Popen([sys.executable, str(script), str(tmp_path), str(max_restarts), child], env=env,
                              cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    recorded = [tmp_path / "pids-0", tmp_path / "pids-1"]
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not all(path.exists() and len(path.read_text().split()) == 2 for path in recorded):
            assert time.monotonic() < deadline and kernel.poll() is None, "the ranks did not start"
            time.sleep(0.1)
        pids = [int(pid) for path in recorded for pid in path.read_text().split()]
        assert all(is_alive(pid) for pid in pids)
        kernel.kill()
        if reaped:  # else a zombie until `finally`
            kernel.wait()
        killed = time.monotonic()
        while any(is_alive(pid) for pid in pids) and time.monotonic() < killed + 20:
            time.sleep(0.1)
        left = [pid for pid in pids if is_alive(pid)]
    finally:
        if kernel.poll() is None:
            kernel.kill()
            kernel.wait()
        for pid in pids:
            if is_alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert left == [], f"still running 20 s after the kernel's SIGKILL: {left} (ranks and their sleeps {pids})"


SWEPT_KERNEL = """
import os, subprocess, sys, time
from nbaccel.launch.kernel.rank_groups import RankGroups

groups = RankGroups()
leftover = subprocess.Popen(["sleep", "300"], start_new_session=True)  # what a rank left: a group of its own
os.close(os.open(os.path.join(groups.folder, str(leftover.pid)), os.O_WRONLY | os.O_CREAT, 0o600))
print(leftover.pid, groups.folder, flush=True)
time.sleep(300)
"""


def test_a_dead_kernels_groups_are_left_to_its_keeper_by_another_launch(tmp_path: Path) -> None:
    """Another launch that starts right after a kernel's SIGKILL sweeps the dead kernel's folders
    (private_dirs.py): the folder of rank groups stays until its keeper, which looks for the kernel once a
    second, has read it and stopped what it lists. (Swept, the keeper found no folder and a rank's leftover ran
    on: one run in five of the killed-kernel test failed while other tests launched on the machine.)"""
    from nbaccel.launch.kernel.rank_groups import RankGroups

    script = tmp_path / "kernel.py"
    script.write_text(SWEPT_KERNEL)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    kernel = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, text=True)
    leftover = 0
    try:
        pid, folder = kernel.stdout.readline().split()
        leftover = int(pid)
        kernel.kill()
        kernel.wait()
        other = RankGroups()  # the next launch: its folder sweeps those of dead kernels
        other.close()
        deadline = time.monotonic() + 20
        while (is_alive(leftover) or Path(folder).exists()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not is_alive(leftover), "the dead kernel's rank group was not stopped: its folder was swept"
        assert not Path(folder).exists()  # the keeper removed it after stopping the group
    finally:
        if kernel.poll() is None:
            kernel.kill()
            kernel.wait()
        if leftover and is_alive(leftover):
            os.kill(leftover, signal.SIGKILL)


def _keeper_named() -> list[str]:
    from nbaccel.launch.private_dirs import KEEPER_PREFIX

    return [name for name in os.listdir(os.environ["NBACCEL_RANK_GROUPS"]) if name.startswith(KEEPER_PREFIX)]


@pytest.mark.parametrize("options", [{}, {"start_method": "spawn"}, {"max_restarts": 1}],
                         ids=["fork", "spawn", "elastic"])
def test_the_launch_s_keeper_runs_before_a_rank_runs_its_function(options: dict) -> None:
    """A launch's keeper starts before its ranks (kernel/rank_groups.py `spawn_keeper`): each rank, forked,
    spawned or started by torch elastic's agent, sees it named in its group folder when its function runs."""
    for _ in range(2):  # the second launch: the fork thread and the modules are warm, the forks fastest
        named = notebook_launcher(_keeper_named, num_processes=2, dashboard=False, **options)
        assert all(len(names) == 1 and names[0] != "keeper-none" for names in named), named


def _files_once_the_script_runs(pid: int) -> dict[int, str]:
    """The files `pid` holds once its shell reads the keeper's script. Not as soon as it runs /bin/sh: the
    dynamic loader then still holds the C library open for a moment (seen once in CI as fd 3)."""
    from nbaccel.launch.kernel.rank_groups import KEEPER

    deadline = time.monotonic() + 10
    while True:
        files = {}
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(FileNotFoundError):
                files[int(fd)] = os.readlink(f"/proc/{pid}/fd/{fd}")
        if KEEPER in files.values() or time.monotonic() > deadline:
            return files
        time.sleep(0.01)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="lists a process's files in /proc")
def test_the_keeper_holds_no_file_of_the_kernel_but_dev_null() -> None:
    """The keeper (os.posix_spawn, rank_groups.py `spawn_keeper`) outlives a killed kernel by a second or two:
    a pipe it inherited (here one the kernel's own parent could have passed down) would hold off whoever waits
    for that pipe's end. It holds /dev/null on 0-2 and its script, nothing else."""
    from nbaccel.launch.kernel.rank_groups import KEEPER, RankGroups

    read_end, write_end = os.pipe()
    os.set_inheritable(write_end, True)
    groups = RankGroups()
    try:
        keeper = groups._keeper
        assert keeper is not None
        files = _files_once_the_script_runs(keeper)
        assert all(files[fd] == os.devnull for fd in (0, 1, 2)), files
        assert set(files.values()) <= {os.devnull, KEEPER}, files
    finally:
        groups.close()
        os.close(read_end)
        os.close(write_end)
    assert not is_alive(keeper)
