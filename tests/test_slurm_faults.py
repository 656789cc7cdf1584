"""Faults of `hosts="slurm"` launches and RankPools, provoked for real on the one-node SLURM cluster of
tests/slurm_cluster.py (one per session): the job scancel'ed while rank 0 waits in a collective and rank 1
trains, a pool whose allocation was cancelled, a kernel whose SLURM_JOB_ID is stale or missing, and SLURM's
own words for a step it ended. Each kernel runs inside `salloc`, as a Jupyter kernel in an allocation does."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from process_helpers import all_gone, run_in_session

from nbaccel.launch import HostError
from nbaccel.launch.kernel.hosts import slurm_ended, slurm_hosts
from nbaccel.utils.other import get_free_port

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def slurm_env(slurm_cluster) -> dict[str, str]:
    """The environment of a client of the test cluster, outside any allocation."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("SLURM_")}
    env.pop("NBACCEL_SSH_CONFIG", None)
    return env | {"SLURM_CONF": str(slurm_cluster.conf)}


def processes_of_job(job: str) -> list[int]:
    """The processes that run in SLURM job `job` (agents, ranks: srun's steps give them SLURM_JOB_ID)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("SLURM_JOB_ID") == job and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc.pid)
        except psutil.Error:
            pass
    return found


def finished_job(env: dict[str, str], tmp_path: Path) -> str:
    """The id of a job of this cluster that has ended."""
    done = run_in_session(["salloc", "-N1", "-n1", "true"], env, tmp_path, timeout=60)
    return re.search(r"Granted job allocation (\d+)", done.stdout).group(1)


CANCELLED_KERNEL = """
import os, re, subprocess, sys, threading, time
from pathlib import Path
from nbaccel.launch import HostError
from nbaccel.launch.errors import LaunchError
from nbaccel.launch.kernel.launcher import notebook_launcher
from nbaccel.utils.atomic_files import write_text

folder = Path(sys.argv[1])
job = os.environ["SLURM_JOB_ID"]

def train(folder):
    import os, signal, time
    import torch, torch.distributed as dist
    from nbaccel import PartialState
    state = PartialState()

    def save_then_exit(signum, frame):  # SLURM's SIGTERM: KillWait's seconds to save before its SIGKILL
        print(f"rank {state.process_index} saves a checkpoint", flush=True)
        write_text(Path(folder, "checkpoint"), "saved", durable=False)
        raise SystemExit(0)

    write_text(Path(folder, f"pid-{state.process_index}"), str(os.getpid()), durable=False)
    if state.process_index == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never enters it: rank 0 waits in the collective
    signal.signal(signal.SIGTERM, save_then_exit)
    time.sleep(120)

def cancel_once_both_run():
    while len(list(folder.glob("pid-*"))) < 2:
        time.sleep(0.1)
    subprocess.run(["scancel", job], check=True)

threading.Thread(target=cancel_once_both_run, daemon=True).start()
try:
    notebook_launcher(train, (str(folder),), num_processes=2, hosts="slurm", dashboard=False)
except LaunchError as error:
    print("cancelled:", str(error).splitlines()[0], flush=True)
try:  # the same allocation again: it has ended
    notebook_launcher(train, (str(folder),), num_processes=2, hosts="slurm", dashboard=False)
except HostError as error:
    print("stale:", error, flush=True)
# a new allocation for the same kernel (salloc --no-shell: held until scancel)
env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}
granted = subprocess.run(["salloc", "--no-shell", "-N1", "-n1"], env=env, capture_output=True, text=True)
new = re.search(r"Granted job allocation (\\d+)", granted.stderr).group(1)
print("new job", new, flush=True)
try:
    os.environ.update(SLURM_JOB_ID=new, SLURM_JOBID=new)
    print("next:", notebook_launcher(lambda: os.environ["SLURM_JOB_ID"], num_processes=2, hosts="slurm",
                                     dashboard=False), flush=True)
finally:
    subprocess.run(["scancel", new])
"""


def test_scancel_during_a_collective_names_slurm_and_the_kernel_launches_again(slurm_env, tmp_path):
    """The job scancel'ed while rank 0 waits in an all_reduce and rank 1 sleeps: SLURM's SIGTERM reaches the
    ranks (rank 1's handler saves a checkpoint), then one LaunchError says SLURM cancelled the agent's step
    (before: "the agent on 'vm' ended (srun exit code 143): srun: Job step aborted: ..." and srun's other
    lines), nothing of the job left; the next launch in the ended allocation is a
    HostError saying so before srun runs (before: srun's "Slurm job N has expired", worded as an agent that
    ended); and the same kernel then launches in a new allocation."""
    script = tmp_path / "kernel.py"
    script.write_text(CANCELLED_KERNEL)
    folder = tmp_path / "pids"
    folder.mkdir()
    done = run_in_session(["salloc", "-N1", "-n1", sys.executable, str(script), str(folder)], slurm_env,
                          tmp_path, timeout=180)
    job = re.search(r"Granted job allocation (\d+)", done.stdout).group(1)
    cancelled = re.search(r"cancelled: (.*)", done.stdout)
    assert cancelled, done.stdout
    assert re.search(rf"HostLost: SLURM cancelled job step {job}\.\d+ on '[^']+' at \S+ \(scancel of the job or "
                     r"of the step, or the allocation was revoked\); the agent and its ranks ended with it$",
                     cancelled.group(1)), done.stdout
    assert re.search(rf"stale: hosts='slurm': this kernel's SLURM allocation \(job {job}, SLURM_JOB_ID\) has ended "
                     r"\((CANCELLED|COMPLETING)\), so srun cannot start anything in it\.", done.stdout), done.stdout
    new = re.search(r"new job (\d+)", done.stdout).group(1)
    assert f"next: ['{new}', '{new}']" in done.stdout, done.stdout
    # the SIGTERM reached the training rank, whose handler saved and said so (before: the agent died at once and
    # the ranks with it, SIGKILLed)
    assert (folder / "checkpoint").read_text() == "saved" and "rank 1] rank 1 saves a checkpoint" in done.stdout
    pids = [int(path.read_text()) for path in folder.glob("pid-*")]
    assert len(pids) == 2 and all_gone(pids, within=10), done.stdout
    assert all_gone(processes_of_job(job) + processes_of_job(new), within=10)


CHECKPOINT_SIGNAL_KERNEL = """
import os, signal, subprocess, sys, threading, time
from pathlib import Path
import psutil
from nbaccel.launch.kernel.launcher import notebook_launcher
from nbaccel.utils.atomic_files import write_text

folder = Path(sys.argv[1])
job = os.environ["SLURM_JOB_ID"]

def train(folder):
    import os, signal, time
    from pathlib import Path
    from nbaccel import PartialState
    state = PartialState()
    got = []
    signal.signal(signal.SIGUSR1, lambda signum, frame: got.append(signum))  # "save a checkpoint"
    write_text(Path(folder, f"pid-{state.process_index}"), str(os.getpid()), durable=False)
    while not Path(folder, "go").exists():
        if got:
            write_text(Path(folder, f"got-{state.process_index}"), "", durable=False)
        time.sleep(0.05)
    return len(got)

def keepers():
    found = []
    for proc in psutil.process_iter():
        try:
            if "group_keeper.sh" in " ".join(proc.cmdline()) and proc.parent().environ().get("SLURM_JOB_ID") == job:
                found.append(proc)
        except psutil.Error:
            pass
    return found

def signal_while_they_train():
    while len(list(folder.glob("pid-*"))) < 2:
        time.sleep(0.1)
    # as SLURM's proctrack/cgroup delivers it: to every process of the step, the ranks' groups' keeper too
    keeper = keepers()
    for proc in keeper + [child for proc in keeper for child in proc.children()]:
        proc.send_signal(signal.SIGUSR1)
    time.sleep(1.5)
    print("keeper alive:", bool(keeper) and all(proc.is_running() and proc.status() != "zombie" for proc in keeper),
          flush=True)
    subprocess.run(["scancel", "--signal=USR1", job], check=True)  # to the agent's step (proctrack/pgid here)
    while len(list(folder.glob("got-*"))) < 2:
        time.sleep(0.1)
    write_text(folder / "go", "", durable=False)

threading.Thread(target=signal_while_they_train, daemon=True).start()
print("results:", notebook_launcher(train, (str(folder),), num_processes=2, hosts="slurm", dashboard=False),
      flush=True)
"""


def test_a_checkpoint_signal_reaches_the_ranks_and_the_launch_goes_on(slurm_env, tmp_path):
    """`scancel --signal=USR1 JOB` (or sbatch/salloc --signal=USR1@T), which asks a job's programs for a
    checkpoint: each rank's handler runs once and the launch returns. Before, the signal reached the agent
    (srun's task) and killed it, and the ranks with it: 'HostLost: the agent on 'vm' ended (srun exit code
    138): srun: error: vm: task 0: User defined signal 1'. The ranks' groups' keeper ignores it too (before,
    USR1 ended it: under proctrack/cgroup SLURM signals every process of the step)."""
    script = tmp_path / "kernel.py"
    script.write_text(CHECKPOINT_SIGNAL_KERNEL)
    folder = tmp_path / "pids"
    folder.mkdir()
    done = run_in_session(["salloc", "-N1", "-n1", sys.executable, str(script), str(folder)], slurm_env,
                          tmp_path, timeout=120)
    assert "keeper alive: True" in done.stdout, done.stdout
    assert "results: [1, 1]" in done.stdout, done.stdout
    job = re.search(r"Granted job allocation (\d+)", done.stdout).group(1)
    assert all_gone(processes_of_job(job), within=10)


POOL_KERNEL = """
import os, subprocess, time
from nbaccel import RankPool
from nbaccel.launch import HostError
from nbaccel.launch.pool import RankPoolError

pool = RankPool(num_processes=2, hosts="slurm", timeout=30)
print("pool runs:", pool.exec("1 + 1").values, flush=True)
subprocess.run(["scancel", os.environ["SLURM_JOB_ID"]], check=True)
time.sleep(1)
try:
    pool.exec("1 + 1")
except (HostError, RankPoolError) as error:  # the loss seen in the call first, or only by the restart
    print("after scancel:", " ".join(str(error).split()), flush=True)
finally:
    pool.shutdown()
"""


def test_a_pool_whose_allocation_was_cancelled_says_it_ended(slurm_env, tmp_path):
    """A RankPool's job scancel'ed between cells: the next cell finds its ranks lost (before it starts, or
    during it: RankPoolError) and the restart cannot start in the ended allocation; the error says the
    allocation ended (before: "the agent on 'vm' ended before it answered (exit code 1): srun: error: Slurm
    job N has expired")."""
    script = tmp_path / "kernel.py"
    script.write_text(POOL_KERNEL)
    done = run_in_session(["salloc", "-N1", "-n1", sys.executable, str(script)], slurm_env, tmp_path, timeout=120)
    job = re.search(r"Granted job allocation (\d+)", done.stdout).group(1)
    assert "pool runs: [2, 2]" in done.stdout, done.stdout
    assert re.search(rf"after scancel: .*hosts='slurm': this kernel's SLURM allocation \(job {job}\) has ended, so "
                     "srun could not start the agent on", done.stdout), done.stdout
    assert all_gone(processes_of_job(job), within=10)


def test_no_or_a_stale_allocation_is_refused_before_srun(slurm_env, tmp_path, monkeypatch):
    """SLURM_JOB_NODELIST without SLURM_JOB_ID: srun would have queued a new job per host (one left pending
    for ever on a drained node, after the 60 s hello timeout); a job that has ended: its state. Both before
    anything starts."""
    for key in [key for key in os.environ if key.startswith("SLURM_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("SLURM_CONF", slurm_env["SLURM_CONF"])
    monkeypatch.setenv("SLURM_JOB_NODELIST", "vm")
    with pytest.raises(HostError, match=r"needs a SLURM allocation: SLURM_JOB_NODELIST is set \('vm'\) but "
                                        "SLURM_JOB_ID is not"):
        slurm_hosts()
    monkeypatch.setenv("SLURM_JOB_ID", finished_job(slurm_env, tmp_path))
    with pytest.raises(HostError, match=rf"allocation \(job {os.environ['SLURM_JOB_ID']}, SLURM_JOB_ID\) has "
                                        r"ended \(COMPLETED\)"):
        slurm_hosts()
    monkeypatch.setenv("SLURM_JOB_ID", "999999")
    with pytest.raises(HostError, match=r"\(job 999999, SLURM_JOB_ID\) has ended \(SLURM no longer knows it\)"):
        slurm_hosts()


def test_slurms_reasons_for_ending_a_step():
    """What slurmstepd prints through srun when it ends a step (slurm 22.05), as the launch's error says it.
    The time limit is not provoked here: SLURM counts it in minutes."""
    srun_said = ("srun: Job step aborted: Waiting up to 32 seconds for job step to finish.\n"
                 "slurmstepd-vm: error: *** STEP 5.0 ON vm CANCELLED AT 2026-12-01T10:59:13 DUE TO TIME LIMIT ***\n"
                 "srun: error: vm: task 0: Terminated")
    assert slurm_ended("vm", srun_said) == (
        "SLURM ended job step 5.0 on 'vm' at 2026-12-01T10:59:13: the allocation reached its time limit (--time; "
        "ask for more, or save checkpoints and resume in a new allocation); the agent and its ranks ended with it")
    assert "SLURM ended job 9 on 'n1' at T due to preemption;" in slurm_ended(
        "n1", "slurmstepd: error: *** JOB 9 ON n1 CANCELLED AT T DUE TO PREEMPTION ***")
    assert slurm_ended("vm", "srun: error: vm: task 0: Exited with exit code 1") is None


SCRIPT = """
from {package} import PartialState

state = PartialState(cpu=True)  # Accelerate's PartialState() ignores the CPU launch here (test_accelerate_ci_scripts)
print(f"rank {{state.process_index}} of {{state.num_processes}}", flush=True)
"""


def srun_launch(env: dict[str, str], tmp_path: Path, package: str, options: str) -> subprocess.CompletedProcess:
    """`srun -n2 bash -c '<package> launch OPTIONS script'` in a new two-task allocation of the one node: two
    "machines" of one launch, as an sbatch script with --ntasks-per-node=1 starts one per node."""
    script = tmp_path / f"{package}_script.py"
    script.write_text(SCRIPT.format(package=package))
    launcher = Path(sys.executable).with_name(package)
    command = f"{launcher} launch {options} --mixed_precision no --dynamo_backend no {script}"
    return run_in_session(["salloc", "-N1", "-n2", "srun", "-n2", "bash", "-c", command], env, tmp_path, timeout=120)


def test_nbaccel_launch_under_srun_as_accelerate_launch(slurm_env, slurm_cluster, tmp_path):
    """Two srun tasks, each a machine (--machine_rank $SLURM_PROCID, the static rendezvous on the first node)
    with one rank each: one world of two ranks under nbaccel launch as under accelerate launch."""
    for package in ("accelerate", "nbaccel"):
        options = (f"--multi_gpu --num_processes 2 --num_machines 2 --machine_rank $SLURM_PROCID "
                   f"--main_process_ip {slurm_cluster.node} --main_process_port {get_free_port()}")
        done = srun_launch(slurm_env, tmp_path, package, options)
        assert done.returncode == 0, done.stdout
        assert sorted(re.findall(r"rank \d of \d", done.stdout)) == ["rank 0 of 2", "rank 1 of 2"], done.stdout


def test_srun_tasks_without_machine_rank_are_refused_before_anything_starts(slurm_env, slurm_cluster, tmp_path):
    """`srun -n2 nbaccel launch --num_machines 2` without --machine_rank: each task was machine 0; one failed on
    the port the other's store held (a traceback) and the other waited for the missing machine until the
    allocation ended (Accelerate: the same). Now every task exits 2 with one line that says what to pass."""
    options = (f"--num_processes 2 --num_machines 2 --main_process_ip {slurm_cluster.node} "
               f"--main_process_port {get_free_port()}")
    done = srun_launch(slurm_env, tmp_path, "nbaccel", options)
    refusal = ("nbaccel launch: error: srun runs this command as 2 tasks (SLURM_STEP_NUM_TASKS), and without "
               "--machine_rank every one would be machine 0 of --num_machines 2: give each its own")
    assert done.stdout.count(refusal) == 2 and not re.search(r"rank \d of", done.stdout), done.stdout
    assert "Traceback" not in done.stdout, done.stdout
