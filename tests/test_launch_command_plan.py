"""`nbaccel launch` as the third front door of one launch machine: it builds a LaunchPlan (mode script) and its
ranks are started by a registered backend (torchrun's agent underneath), watched and stopped by the supervisor."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from nbaccel.commands.launch import LaunchOptionError, resolve_settings, script_plan, worker_environment
from nbaccel.commands.main import build_parser
from nbaccel.launch.kernel.elastic import ElasticBackend
from nbaccel.launch.kernel.placements import select_backend
from nbaccel.launch.kernel.plan import Placement, Program
from nbaccel.launch.kernel.torchrun import TorchrunScript

pytestmark = pytest.mark.timeout(120)


def settings(tmp_path, *options: str):
    script = tmp_path / "job.py"
    script.write_text("")
    return resolve_settings(build_parser().parse_args(["launch", *options, str(script), "--x"]), None)


def test_the_plan_holds_every_input_of_the_launch(tmp_path):
    s = settings(tmp_path, "--cpu", "--num_processes", "4", "--num_machines", "2", "--machine_rank", "1",
                 "--main_process_ip", "10.0.0.7", "--main_process_port", "29600", "--max_restarts", "2",
                 "--rdzv_conf", "join_timeout=30,read_timeout=5", "--role", "trainer")
    plan = script_plan(s)
    assert plan.placement is Placement.ELASTIC and plan.program is Program.SCRIPT
    backend = select_backend(plan)  # placement elastic's one class, with its script part
    assert type(backend) is ElasticBackend and isinstance(backend.script, TorchrunScript)
    assert (plan.num_processes, plan.num_nodes, plan.node_rank, plan.world_size) == (2, 2, 1, 4)
    assert (plan.master_addr, plan.port, plan.device) == ("10.0.0.7", 29600, "cpu")
    assert plan.rendezvous.endpoint == "10.0.0.7:29600" and plan.rendezvous.max_restarts == 2
    assert dict(plan.rendezvous.conf) == {"join_timeout": "30", "read_timeout": "5"}
    assert plan.script.script.endswith("job.py") and plan.script.args == ("--x",) and plan.script.role == "trainer"
    assert dict(plan.environ) == worker_environment(s)  # every rank's environment, final before any start
    with pytest.raises(TypeError):
        plan.environ["X"] = "1"  # frozen


def test_one_machine_meets_on_the_loopback_store(tmp_path):
    plan = script_plan(settings(tmp_path, "--cpu", "--num_processes", "2"))
    assert plan.rendezvous.backend == "nbaccel-loopback" and plan.rendezvous.endpoint == "127.0.0.1:0"
    assert plan.master_addr == "127.0.0.1" and plan.port is None  # the store's port, opened by the backend


def test_a_rendezvous_option_that_is_not_key_value_is_refused(tmp_path):
    with pytest.raises(LaunchOptionError, match="--rdzv_conf: 'timeout' is not key=value"):
        script_plan(settings(tmp_path, "--cpu", "--rdzv_conf", "timeout"))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_every_rank_through_the_supervisor(tmp_path, sig):
    """The agent runs beside the supervisor: a signal to `nbaccel launch` stops every rank (and their
    children) and ends the launch with 128 + the signal, as torchrun does."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import os, subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        os.write(1, f"PIDS {os.getpid()} {child.pid}\\n".encode())  # one write: the two ranks share the pipe
        time.sleep(120)
    """))
    proc = subprocess.Popen([sys.executable, "-m", "nbaccel", "launch", "--num_processes", "2", "--cpu", str(script)],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)
    pids = [int(pid) for _ in range(2) for pid in proc.stdout.readline().split()[1:]]
    proc.send_signal(sig)
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 10
    left = pids
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    for pid in left:
        psutil.Process(pid).kill()
    assert not left, f"processes {left} outlived the stopped launch"
    assert proc.returncode == 128 + sig, err
    assert f"nbaccel launch: stopped by {signal.Signals(sig).name}; workers stopped" in err
    assert "child thread" not in err  # torch elastic's note about its thread is not the user's business


def test_a_stopped_rank_gets_torch_elastics_time_to_end_by_itself(tmp_path):
    """As under torchrun, a rank's SIGTERM handler (a checkpoint on preemption) may take its time
    (TORCH_ELASTIC_SHUTDOWN_TIMEOUT, 30 s by default) before the rank is killed."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import os, signal, sys, time
        def save(signum, frame):
            time.sleep(2.5)  # longer than a notebook launch's grace between SIGTERM and SIGKILL
            open(f"saved-{os.environ['RANK']}", "w").close()
            sys.exit(0)
        signal.signal(signal.SIGTERM, save)
        os.write(1, b"ready\\n")
        time.sleep(120)
    """))
    proc = subprocess.Popen([sys.executable, "-m", "nbaccel", "launch", "--num_processes", "2", "--cpu", str(script)],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)
    for _ in range(2):
        proc.stdout.readline()
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert sorted(p.name for p in tmp_path.glob("saved-*")) == ["saved-0", "saved-1"], err
