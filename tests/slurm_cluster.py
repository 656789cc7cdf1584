"""A real one-node SLURM cluster for the tests of `hosts="slurm"`: Debian's slurmctld and slurmd (package
slurm-wlm; .ci/run installs them) started in the foreground as the current user, on free ports of this
machine, with their state in a temporary folder and no authentication daemon (auth/none: the cluster is this
machine's, for the test session only). Clients find it through SLURM_CONF."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from nbaccel.utils.other import get_free_port

DAEMONS = ("/usr/sbin/slurmctld", "/usr/sbin/slurmd")
PLUGINS = Path("/usr/lib/x86_64-linux-gnu/slurm-wlm")


@dataclass(frozen=True)
class SlurmCluster:
    processes: tuple[subprocess.Popen, ...]
    conf: Path  # SLURM_CONF for the clients (salloc, srun, scontrol)
    node: str

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        for process in self.processes:
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def missing_reason() -> str | None:
    """Why no cluster can run here, or None."""
    for daemon in DAEMONS:
        if not os.path.exists(daemon):
            return f"{daemon} is not installed (apt-get install slurmctld slurmd slurm-client; .ci/run does it)"
    if shutil.which("salloc") is None:
        return "salloc is not installed (apt-get install slurm-client)"
    if os.geteuid() != 0:
        return "slurmd runs jobs as their users and must run as root; these tests do not"
    return None


def start_cluster(folder: Path, timeout: float = 30.0) -> SlurmCluster:
    """Write the configuration, start both daemons, wait until the node is idle; RuntimeError otherwise."""
    node = socket.gethostname()
    for sub in ("state", "spool"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    conf = folder / "slurm.conf"
    conf.write_text(
        f"ClusterName=nbaccel\nSlurmctldHost={node}(127.0.0.1)\nSlurmctldPort={get_free_port()}\n"
        f"SlurmdPort={get_free_port()}\nAuthType=auth/none\nCredType=cred/none\nSlurmUser=root\nSlurmdUser=root\n"
        f"StateSaveLocation={folder / 'state'}\nSlurmdSpoolDir={folder / 'spool'}\n"
        f"SlurmctldPidFile={folder / 'slurmctld.pid'}\nSlurmdPidFile={folder / 'slurmd.pid'}\n"
        f"SlurmctldLogFile={folder / 'slurmctld.log'}\nSlurmdLogFile={folder / 'slurmd.log'}\n"
        "ProctrackType=proctrack/pgid\nTaskPlugin=task/none\nSelectType=select/cons_tres\n"
        "SelectTypeParameters=CR_CPU\nJobAcctGatherType=jobacct_gather/none\n"
        "AccountingStorageType=accounting_storage/none\nMpiDefault=none\nSwitchType=switch/none\n"
        "ReturnToService=2\n"
        f"NodeName={node} NodeAddr=127.0.0.1 CPUs={os.cpu_count() or 1} State=UNKNOWN\n"
        "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES\n")
    env = dict(os.environ, SLURM_CONF=str(conf))
    processes = tuple(subprocess.Popen([daemon, "-D", "-f", str(conf)], env=env, stdin=subprocess.DEVNULL,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                      for daemon in DAEMONS)
    cluster = SlurmCluster(processes, conf, node)
    deadline = time.monotonic() + timeout
    while True:
        done = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True, timeout=timeout)
        if done.returncode == 0 and done.stdout.strip() == "idle":
            return cluster
        if any(p.poll() is not None for p in processes) or time.monotonic() > deadline:
            cluster.stop()
            logs = "; ".join(f"{name}: {(folder / name).read_text(errors='replace')[-800:]}"
                             for name in ("slurmctld.log", "slurmd.log") if (folder / name).exists())
            raise RuntimeError(f"the SLURM node did not become idle ({done.stdout.strip() or done.stderr.strip()}); "
                               f"{logs}")
        time.sleep(0.3)
