"""`nbaccel launch` under the signals and faults a terminal, a batch system or a container runtime sends,
compared with `accelerate launch` on the same script (exit status, what the ranks got, what is left running)."""

from __future__ import annotations

import os
import pty
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from process_helpers import all_gone, environment_without, is_alive

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[1]

# Each rank writes down every stop signal it gets (its handler, which saves and exits, must run once) and says
# READY once its handlers are in place.
RECORDING = textwrap.dedent("""
    import os, signal, sys, time
    rank = os.environ["RANK"]
    def got(signum, frame):
        with open(f"got-{rank}", "a") as record:
            record.write(signal.Signals(signum).name + "\\n")
        time.sleep(0.5)  # a checkpoint's save: a second signal now would enter this handler again
        os.write(1, f"saved {rank}\\n".encode())
        sys.exit(0)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, got)
    os.write(1, f"READY {rank} {os.getpid()}\\n".encode())
    while True:
        time.sleep(0.05)
""")


def _environment(folder: Path) -> dict[str, str]:
    """Neither library's settings nor a config file from the test run; the folder's own temporary files."""
    (folder / "tmp").mkdir()
    return {**environment_without(), "HOME": str(folder), "NBACCEL_CONFIG_FILE": str(folder / "none.yaml"),
            "HF_HOME": str(folder / "hf"), "PYTHONPATH": str(ROOT), "TMPDIR": str(folder / "tmp")}


def _signalled_launch(lib: str, folder: Path, sig: int) -> tuple[int, str, dict[str, list[str]]]:
    """Run RECORDING on 2 ranks under `lib`'s launcher, send `sig` to the launcher once both ranks are ready;
    return its exit status, its output and the signals each rank got. No rank may be left running."""
    folder.mkdir()
    (folder / "job.py").write_text(RECORDING)
    launch = subprocess.Popen([sys.executable, "-m", f"{lib}.commands.launch", "--multi_gpu", "--num_processes",
                               "2", "job.py"], cwd=folder, env=_environment(folder), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL, start_new_session=True)
    pids, lines = [], []
    try:
        while len(pids) < 2:
            line = launch.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("READY"):
                pids.append(int(line.split()[2]))
        assert len(pids) == 2, "".join(lines)
        launch.send_signal(sig)
        out, _ = launch.communicate(timeout=60)
    finally:
        if launch.poll() is None:
            os.killpg(launch.pid, signal.SIGKILL)
            launch.communicate()
    left = [] if all_gone(pids) else [pid for pid in pids if is_alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"{lib}: ranks {left} outlived the stopped launch"
    got = {path.name: path.read_text().split() for path in sorted(folder.glob("got-*"))}
    return launch.returncode, "".join(lines) + out, got


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGQUIT], ids=lambda sig: sig.name)
def test_each_rank_gets_the_launchs_signal_once_as_under_accelerate(tmp_path, sig):
    """torchrun (under `accelerate launch`) passes the signal it got on to each rank's process group, once:
    Ctrl-C reaches the script as SIGINT (KeyboardInterrupt, its `except KeyboardInterrupt:` saves). nbaccel
    sent SIGTERM whatever it got, and sent it twice (to the rank and to its group), so a SIGTERM handler saving
    a checkpoint was entered again from inside the first save. The rank's last lines, written in its handler,
    reach the output (its line relay ignores SIGQUIT too). nbaccel's exit status is 128 + the signal and one
    line (Accelerate: 1, with torch's SignalException traceback; docs/compat.md)."""
    name = signal.Signals(sig).name
    theirs, their_out, their_got = _signalled_launch("accelerate", tmp_path / "accelerate", sig)
    ours, our_out, our_got = _signalled_launch("nbaccel", tmp_path / "nbaccel", sig)
    assert their_got == our_got == {"got-0": [name], "got-1": [name]}, (their_got, our_got, our_out)
    assert theirs == 1 and "SignalException: Process" in their_out, their_out
    assert ours == 128 + sig, our_out
    assert our_out.count("saved ") == their_out.count("saved ") == 2, our_out
    assert our_out.rstrip().endswith(f"nbaccel launch: stopped by {name}; workers stopped"), our_out


@pytest.mark.parametrize("value", ["nan", "inf", "1e10"])
def test_a_monitor_interval_that_is_no_number_of_seconds_is_refused_before_any_rank_starts(
        tmp_path, capsys, monkeypatch, value):
    """`--monitor_interval nan`, inf or 1e10 passed the check (`<= 0` is false for them): the ranks started,
    then torch's agent failed with a traceback (ValueError: Invalid value NaN; OverflowError: timestamp out of
    range), as under `accelerate launch`. Now it is a usage error, exit 2, before anything starts."""
    from nbaccel.commands.main import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "job.py").write_text("open('ran', 'w').close()\n")
    with pytest.raises(SystemExit) as exit_:
        main(["launch", "--cpu", f"--monitor_interval={value}", "job.py"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    assert "--monitor_interval must be a number of seconds > 0 (at most 9223372036), got " \
           f"{float(value)}" in err, err
    assert not (tmp_path / "ran").exists()


def test_a_closed_terminal_stops_the_ranks_and_what_they_started(tmp_path):
    """The launch runs on a terminal (a pty, its controlling terminal), which then closes: the launch gets SIGHUP
    and, as torchrun signals each rank's process group, the ranks' children get SIGHUP too, once each. Its last
    line then fails on the dead terminal (EIO), which made the launch end with a traceback and status 1 instead
    of 128 + SIGHUP."""
    (tmp_path / "job.py").write_text(textwrap.dedent("""
        import os, signal, subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", '''
        import os, signal, sys, time
        def got(signum, frame):
            open(f"child-{os.environ['RANK']}", "a").write(signal.Signals(signum).name + "\\\\n")
            sys.exit(0)
        signal.signal(signal.SIGHUP, got)
        signal.signal(signal.SIGTERM, got)
        open(f"ready-{os.environ['RANK']}", "w").close()
        time.sleep(120)
        '''])
        while not os.path.exists(f"ready-{os.environ['RANK']}"):
            time.sleep(0.02)
        print(f"READY {os.environ['RANK']} {child.pid}", flush=True)
        child.wait()
    """))
    command = [sys.executable, "-m", "nbaccel", "launch", "--cpu", "--num_processes", "2", "job.py"]
    environment = _environment(tmp_path)
    pid, terminal = pty.fork()  # the child leads a session whose controlling terminal is the pty
    if pid == 0:
        try:
            os.chdir(tmp_path)
            os.execve(sys.executable, command, environment)
        finally:
            os._exit(127)
    seen = b""
    try:
        while seen.count(b"READY") < 2:
            try:
                chunk = os.read(terminal, 4096)
            except OSError:  # the launch ended (EIO)
                break
            if not chunk:
                break
            seen += chunk
        children = [int(found) for found in re.findall(rb"READY \d+ (\d+)", seen)]
        assert len(children) == 2, seen.decode(errors="replace")
    finally:
        os.close(terminal)  # the terminal closes: the kernel sends SIGHUP to its session's leader
        _, status = os.waitpid(pid, 0)
    assert all_gone(children), "a rank's child outlived the stopped launch"
    assert os.waitstatus_to_exitcode(status) == 128 + signal.SIGHUP, seen.decode(errors="replace")
    got = {path.name: path.read_text().split() for path in sorted(tmp_path.glob("child-*"))}
    assert got == {"child-0": ["SIGHUP"], "child-1": ["SIGHUP"]}, got


# A process that counts the times it gets SIGRTMIN (a real-time signal: two sent are two received, where two
# SIGTERMs sent before the first is handled count as one), writes the count to COUNTS/NAME and exits. With
# "children" it first starts one child in its own process group and one in a session of its own (a leftover
# that left the group), which count the same way.
COUNTING = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    counts, name = sys.argv[1], sys.argv[2]
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGRTMIN})
    if sys.argv[3:] == ["children"]:
        for child, own_session in (("grouped", False), ("strayed", True)):
            subprocess.Popen([sys.executable, __file__, counts, child], start_new_session=own_session)
        while len(os.listdir(counts)) < 2:
            time.sleep(0.01)
    open(os.path.join(counts, name + ".ready"), "w").close()
    got = 0
    while signal.sigtimedwait({signal.SIGRTMIN}, 0.5 if got else 60) is not None:
        got += 1
    with open(os.path.join(counts, name + ".tmp"), "w") as file:
        file.write(str(got))
    os.rename(os.path.join(counts, name + ".tmp"), os.path.join(counts, name))
""")


def test_a_stop_signals_each_process_once(tmp_path):
    """kill_pids (how `nbaccel launch` stops torchrun's ranks) signalled each rank by pid and again through its
    process group, and each child in the group by pid and through the group: a SIGTERM handler saving a
    checkpoint ran twice, the second time inside the first. Now the rank, its child in its group and its child
    that left the group get the signal once each."""
    from nbaccel.launch.kernel.process_trees import kill_pids

    (tmp_path / "counting.py").write_text(COUNTING)
    counts = tmp_path / "counts"
    counts.mkdir()
    rank = subprocess.Popen([sys.executable, str(tmp_path / "counting.py"), str(counts), "rank", "children"],
                            start_new_session=True)  # as torch elastic starts a rank: leader of its own group
    try:
        while len(list(counts.glob("*.ready"))) < 3 and rank.poll() is None:
            time.sleep(0.02)
        kill_pids([rank.pid], grace=30, sig=signal.SIGRTMIN)
    finally:
        if rank.poll() is None:
            os.killpg(rank.pid, signal.SIGKILL)
        rank.wait()
    got = {name: (counts / name).read_text() for name in ("rank", "grouped", "strayed") if (counts / name).exists()}
    assert got == {"rank": "1", "grouped": "1", "strayed": "1"}, got


# Ctrl-C caught and let go (a rank in a C call that would see it late, or a loop that swallows
# KeyboardInterrupt): the rank goes on; SIGTERM ends it. Each signal is written down.
SWALLOWS_CTRL_C = textwrap.dedent("""
    import os, signal, sys, time
    rank = os.environ["RANK"]
    def got(signum, frame):
        with open(f"got-{rank}", "a") as record:
            record.write(signal.Signals(signum).name + "\\n")
        if signum == signal.SIGTERM:
            sys.exit(0)
    signal.signal(signal.SIGINT, got)
    signal.signal(signal.SIGTERM, got)
    os.write(1, f"READY {rank} {os.getpid()}\\n".encode())
    while True:
        time.sleep(0.05)
""")


def _ctrl_c_twice(lib: str, folder: Path) -> tuple[int, str, dict[str, list[str]]]:
    """Run SWALLOWS_CTRL_C on 2 ranks under `lib`'s launcher; SIGINT the launcher, and again once both ranks
    got the first. Returns its exit status, its output and the signals each rank got; no rank may be left."""
    folder.mkdir()
    (folder / "job.py").write_text(SWALLOWS_CTRL_C)
    launch = subprocess.Popen([sys.executable, "-m", f"{lib}.commands.launch", "--multi_gpu", "--num_processes",
                               "2", "job.py"], cwd=folder, env=_environment(folder), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL, start_new_session=True)
    pids: list[int] = []
    try:
        while len(pids) < 2 and (line := launch.stdout.readline()):
            if line.startswith("READY"):
                pids.append(int(line.split()[2]))
        assert len(pids) == 2, f"{lib}: the ranks did not start"
        launch.send_signal(signal.SIGINT)
        while len(list(folder.glob("got-*"))) < 2 and launch.poll() is None:
            time.sleep(0.02)
        launch.send_signal(signal.SIGINT)
        out, _ = launch.communicate(timeout=60)
    finally:
        if launch.poll() is None:
            os.killpg(launch.pid, signal.SIGKILL)
            launch.communicate()
    left = [] if all_gone(pids) else [pid for pid in pids if is_alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"{lib}: ranks {left} outlived the stopped launch"
    return launch.returncode, out, {path.name: path.read_text().split() for path in sorted(folder.glob("got-*"))}


def test_a_second_ctrl_c_sends_sigterm_as_under_accelerate(tmp_path):
    """torchrun passes the first Ctrl-C on (SIGINT) and, on a second one while the ranks are being stopped,
    sends SIGTERM: a rank that did not end on the first (in a C call, or a loop that swallows
    KeyboardInterrupt) ends now instead of after the 30 s grace. nbaccel passed SIGINT on again."""
    theirs, their_out, their_got = _ctrl_c_twice("accelerate", tmp_path / "accelerate")
    ours, our_out, our_got = _ctrl_c_twice("nbaccel", tmp_path / "nbaccel")
    expected = ["SIGINT", "SIGTERM"]
    assert their_got == our_got == {"got-0": expected, "got-1": expected}, (their_got, our_got, our_out)
    assert theirs == 1 and ours == 128 + signal.SIGINT, our_out
    assert our_out.rstrip().endswith("nbaccel launch: stopped by SIGINT; workers stopped"), our_out



def test_a_stop_cut_short_by_a_second_ctrl_c_still_waits_for_the_launchers_thread():
    """The window behind an `nbaccel launch` that ended by SIGABRT ("terminate called without an active
    exception") instead of 130, in 1 run of 15-30 of the test above on a busy machine: the second Ctrl-C cut
    the first stop short while torchrun's agent thread still ran; the stop after it only killed the ranks, and
    the process exited while that thread was inside a store call (torch elastic's exit barrier), which Python's
    exit turns into an abort. Every stop now waits for the thread, up to JOIN_TIMEOUT each."""
    from nbaccel.launch.kernel.threaded import ThreadedBackend

    release = threading.Event()
    backend = ThreadedBackend()
    backend._target = lambda: release.wait(30)  # the other launcher's blocking call, still going
    backend._thread.start()
    kills = []

    def kill(*_):  # the first stop's kill is where the second Ctrl-C lands (it waits for the ranks to end)
        kills.append(time.monotonic())
        if len(kills) == 1:
            raise KeyboardInterrupt

    backend._kill_started = kill
    with pytest.raises(KeyboardInterrupt):
        backend.stop()
    threading.Timer(0.5, release.set).start()  # the thread ends 0.5 s later, as the agent's does
    backend.stop()
    assert not backend._thread.is_alive()

def test_a_child_that_ignores_sigterm_is_stopped_unlike_under_accelerate(tmp_path):
    """A rank's child that ignores SIGTERM (a tool's subprocess, a server the script started) is SIGKILLed
    after the grace with its rank; under `accelerate launch` torchrun kills the ranks only and the child keeps
    running (a listed difference: docs/compat.md). The grace is torch's TORCH_ELASTIC_SHUTDOWN_TIMEOUT."""
    script = textwrap.dedent("""
        import os, signal, subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                                  "signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); "
                                  "time.sleep(120)"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        # (it holds none of the launch's output: a child left running would keep the test reading)
        child.stdout.readline()  # its SIGTERM is ignored from here on
        os.write(1, f"READY {os.environ['RANK']} {child.pid}\\n".encode())
        time.sleep(120)
    """)
    left = {}
    for lib in ("accelerate", "nbaccel"):
        folder = tmp_path / lib
        folder.mkdir()
        (folder / "job.py").write_text(script)
        env = {**_environment(folder), "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "2"}
        launch = subprocess.Popen([sys.executable, "-m", f"{lib}.commands.launch", "--multi_gpu", "--num_processes",
                                   "2", "job.py"], cwd=folder, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL,
                                  start_new_session=True)
        children: list[int] = []
        try:
            while len(children) < 2 and (line := launch.stdout.readline()):
                if line.startswith("READY"):
                    children.append(int(line.split()[2]))
            assert len(children) == 2, f"{lib}: the ranks did not start"
            launch.send_signal(signal.SIGTERM)
            launch.communicate(timeout=60)
        finally:
            if launch.poll() is None:
                os.killpg(launch.pid, signal.SIGKILL)
                launch.communicate()
        left[lib] = [] if all_gone(children, within=2) else [pid for pid in children if is_alive(pid)]
        for pid in left[lib]:
            os.kill(pid, signal.SIGKILL)
        assert launch.returncode == (1 if lib == "accelerate" else 128 + signal.SIGTERM), lib
    assert left["nbaccel"] == [] and len(left["accelerate"]) == 2, left
