"""Which hosts a several-machine launch runs on, and the command that starts the agent on each.

`hosts=["gpu-a", "gpu-b"]`: names as the user's OpenSSH client knows them (~/.ssh/config aliases, users,
ports, jump hosts, keys); nbaccel runs the system `ssh` and handles no password. `NBACCEL_SSH_CONFIG` names
another config file (`ssh -F`), `NBACCEL_SSH_OPTIONS` adds options (split as a shell would),
`NBACCEL_SSH_PYTHON` is the Python to run there (default: this kernel's `sys.executable`, the same path).
`hosts="slurm"`: the nodes of the SLURM allocation this kernel runs in (SLURM_JOB_NODELIST, expanded by
`scontrol show hostnames`); the agents start with `srun` instead of ssh.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..host_protocol import AGENT_MODULE
from ..rank_environment import source_checkout_root

SSH_CONFIG_ENV = "NBACCEL_SSH_CONFIG"
SSH_OPTIONS_ENV = "NBACCEL_SSH_OPTIONS"
SSH_PYTHON_ENV = "NBACCEL_SSH_PYTHON"
SLURM = "slurm"
RAY = "ray"
RAY_INSTALL = "pip install nbaccel[ray]"
CONNECT_TIMEOUT = 10  # seconds ssh may take to connect
# the job states (scontrol show job's JobState) of an allocation that has ended
_SLURM_ENDED = {"COMPLETED", "COMPLETING", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL",
                "DEADLINE", "OUT_OF_MEMORY"}
# what srun says when the allocation it is to start a step in has ended
_SRUN_JOB_GONE = ("has expired", "Invalid job id", "already completing or completed", "Job has already finished")
# what ssh says, and what nbaccel tells the user it means
_SSH_DIAGNOSES = (
    (("Host key verification failed", "REMOTE HOST IDENTIFICATION HAS CHANGED", "host key for"),
     "SSH refused the host key of {host!r}: it is not in your known_hosts or it changed. Connect once with "
     "`ssh {host}` to check and accept the key, then launch again."),
    (("Could not resolve hostname", "Connection refused", "timed out", "No route to host",
      "Network is unreachable", "Connection closed by", "Connection reset"),
     "host {host!r} is unreachable over SSH."),
    (("Permission denied",),
     "SSH could not log in to {host!r} without a password (nbaccel runs ssh in batch mode): set up a key "
     "(ssh-copy-id {host}) or an agent."),
    (("No module named",),
     "nbaccel (or a module it needs) is not importable by the Python on {host!r}: install the same versions "
     "there, or name the Python with NBACCEL_SSH_PYTHON."),
    (("No such file or directory", "not found"),
     "the Python to run on {host!r} was not found: install it at the same path as this kernel's, or name it "
     "with NBACCEL_SSH_PYTHON."),
)


class HostError(RuntimeError):
    """A host of a several-machine launch cannot take part; the message names the host. Nothing was started
    (or what was started on the other hosts has been stopped)."""

    def __init__(self, host: str, message: str) -> None:
        super().__init__(message)
        self.host = host


@dataclass(frozen=True)
class HostSet:
    """The resolved hosts and how their agents start ("ssh" or "srun")."""

    names: tuple[str, ...]
    via: str = "ssh"
    node_ids: tuple[str, ...] = ()  # "ray": Ray's id of each node
    gpus: int | None = None  # "ray": the GPUs of each node the ranks use (None: as this kernel sees them)
    ray: RayHosts | None = None  # "ray": what each rank reserves


def resolve_hosts(hosts: Any) -> HostSet:
    """`hosts` as given (a list of names, a comma-separated string, or "slurm") -> a HostSet; ValueError or
    HostError when it cannot be used."""
    if isinstance(hosts, str) and hosts.strip().lower() == SLURM:
        return HostSet(slurm_hosts(), via="srun")
    if isinstance(hosts, RayHosts) or (isinstance(hosts, str) and hosts.strip().lower() == RAY):
        return resolve_ray_hosts(hosts if isinstance(hosts, RayHosts) else RayHosts())
    if isinstance(hosts, str):
        hosts = [part for part in hosts.split(",")]
    if not isinstance(hosts, (list, tuple)) or not hosts:
        raise ValueError(f"hosts must be a non-empty list of host names (as your ssh knows them), 'slurm', "
                         f"'ray' or RayHosts(...), got {hosts!r}")
    names = []
    for host in hosts:
        if not isinstance(host, str) or not host.strip() or host.strip().startswith("-") or \
                re.search(r"\s", host.strip()):
            raise ValueError(f"hosts: {host!r} is not a host name (give names as `ssh NAME` accepts them)")
        names.append(host.strip())
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"hosts: {duplicates} appear more than once; num_processes is the number of ranks per "
                         "host, so name each host once")
    return HostSet(tuple(names))


def slurm_hosts() -> tuple[str, ...]:
    """The nodes of this SLURM allocation, in SLURM's order."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if not nodelist:
        raise HostError(SLURM, "hosts='slurm' needs a SLURM allocation, and SLURM_JOB_NODELIST is not set: start "
                        "Jupyter (or Python) inside `salloc` or an sbatch job, or name the hosts: hosts=['a', 'b'].")
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        raise HostError(SLURM, "hosts='slurm': SLURM_JOB_NODELIST is set but `scontrol` is not on PATH, so the node "
                        f"list {nodelist!r} cannot be expanded; load SLURM's tools (e.g. `module load slurm`).")
    check_allocation(scontrol, nodelist)
    done = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30)
    names = tuple(line.strip() for line in done.stdout.splitlines() if line.strip())
    if done.returncode != 0 or not names:
        raise HostError(SLURM, f"hosts='slurm': `scontrol show hostnames {nodelist}` failed: "
                        f"{(done.stderr or done.stdout).strip() or 'no hosts'}")
    return names


def check_allocation(scontrol: str, nodelist: str) -> None:
    """HostError unless this kernel's SLURM job (SLURM_JOB_ID) is running. Outside a job srun would queue a new
    job per host (forever, with a node drained), and in a job that has ended it fails host by host."""
    job = os.environ.get("SLURM_JOB_ID") or os.environ.get("SLURM_JOBID")
    if not job:
        raise HostError(SLURM, f"hosts='slurm' needs a SLURM allocation: SLURM_JOB_NODELIST is set ({nodelist!r}) "
                        "but SLURM_JOB_ID is not, and srun outside an allocation would queue a new job per host. "
                        "Start Jupyter (or Python) inside `salloc` or an sbatch job.")
    done = subprocess.run([scontrol, "show", "job", "-o", job], capture_output=True, text=True, timeout=30)
    found = re.search(r"\bJobState=(\S+)", done.stdout)
    if found is None and "Invalid job id" not in done.stderr:
        raise HostError(SLURM, f"hosts='slurm': `scontrol show job {job}` failed: "
                        f"{(done.stderr or done.stdout).strip() or 'no answer'}")
    state = found.group(1) if found else None
    if state == "RUNNING":
        return
    if state is None or state in _SLURM_ENDED:
        how = f"has ended ({state or 'SLURM no longer knows it'})"
    else:
        how = f"is not running ({state})"
    raise HostError(SLURM, f"hosts='slurm': this kernel's SLURM allocation (job {job}, SLURM_JOB_ID) {how}, so "
                    "srun cannot start anything in it. Start a new allocation (`salloc`, or an sbatch job) and "
                    "Jupyter in it, or set SLURM_JOB_ID and SLURM_JOB_NODELIST to a running allocation of yours.")


def slurm_ended(host: str, srun_said: str) -> str | None:
    """Why SLURM ended the job step of `host`'s agent, from what srun printed (slurmstepd's `*** STEP 5.0 ON
    node CANCELLED AT ... ***` line), or None when SLURM did not say it ended the step."""
    found = re.search(r"\*\*\* (STEP|JOB) (\S+) ON \S+ CANCELLED AT (\S+)(?: DUE TO ([^*]+?))? \*\*\*", srun_said)
    if found is None:
        return None
    what, ident, when, cause = found.groups()
    step = f"job step {ident}" if what == "STEP" else f"job {ident}"
    if cause == "TIME LIMIT":
        why = (f"SLURM ended {step} on {host!r} at {when}: the allocation reached its time limit (--time; ask for "
               "more, or save checkpoints and resume in a new allocation)")
    elif cause:
        why = f"SLURM ended {step} on {host!r} at {when} due to {cause.lower()}"
    else:
        why = f"SLURM cancelled {step} on {host!r} at {when} (scancel of the job or of the step, or the allocation " \
              "was revoked)"
    return f"{why}; the agent and its ranks ended with it"


@dataclass(frozen=True)
class RayHosts:
    """`hosts=RayHosts(...)`: which nodes of the Ray cluster, and what each rank reserves there.

    `nodes`: how many nodes (None: every alive node that has `resources`); `num_processes` ranks run on each,
    as with `hosts=[...]`. `gpus_per_rank`: 0 or 1 (None: 1 where every chosen node has GPUs, else 0).
    `cpus_per_rank`: logical CPUs each rank reserves. `resources`: custom resources each rank reserves (only
    nodes that have them are chosen). `address`: the cluster to attach to (None: the `ray.init()` already
    called, else RAY_ADDRESS, else "auto")."""

    nodes: int | None = None
    gpus_per_rank: int | None = None
    cpus_per_rank: float = 1
    resources: Mapping[str, float] = field(default_factory=dict)
    address: str | None = None


@functools.cache
def _ray_import() -> concurrent.futures.Future:
    """`import ray`, under way or done, in a thread of its own.

    The import takes seconds (Ray builds parsers as it loads). Interrupted halfway in the kernel's main thread
    it left a half-made `ray` behind: every later launch of the kernel failed with "partially initialized
    module 'ray'" until a restart. In a thread an interrupt stops only the launch's wait; the import finishes,
    and the next launch finds it done."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            import ray
        except BaseException as exc:  # handed to the waiting launch
            future.set_exception(exc)
        else:
            future.set_result(ray)

    threading.Thread(target=run, daemon=True, name="nbaccel-import-ray").start()
    return future


def import_ray() -> Any:
    """The ray module; the wait for its first import can be interrupted (`_ray_import`)."""
    try:
        _ray_import().result()
        import ray  # as sys.modules has it now
    except ImportError:
        _ray_import.cache_clear()  # Ray installed later, in the same kernel, is found
        raise ImportError(f"hosts='ray' needs Ray in this kernel and on the cluster: {RAY_INSTALL}") from None
    return ray


def attach(address: str | None) -> Any:
    """The ray module, connected to the cluster (the user's own `ray.init()` is kept)."""
    ray = import_ray()
    if ray.is_initialized():
        _refuse_local_mode(ray)
        return ray
    try:
        with warnings.catch_warnings():  # Ray's tip on num_gpus=0: the agents' actors want the GPUs hidden then
            warnings.filterwarnings("ignore", "Tip: In future versions of Ray", FutureWarning)
            ray.init(address=address or os.environ.get("RAY_ADDRESS") or "auto", logging_level="ERROR",
                     log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise HostError(RAY, f"hosts='ray': no Ray cluster to attach to ({exc}). Start one (`ray start --head` "
                        "and `ray start --address ...` on the other nodes), set RAY_ADDRESS, or call ray.init() "
                        "first.") from None
    return ray


def _refuse_local_mode(ray: Any) -> None:
    """The user's `ray.init(local_mode=True)` runs every actor inside the kernel's own process, one call at a
    time: the agents' actors could not run the ranks there (their stream calls would wait on each other). Said
    before anything starts, without touching the user's connection."""
    worker = getattr(getattr(ray, "_private", None), "worker", None)
    if worker is not None and getattr(worker.global_worker, "mode", None) == getattr(worker, "LOCAL_MODE", object()):
        raise HostError(RAY, "hosts='ray' cannot run under ray.init(local_mode=True), which runs every actor in "
                        "this process: call ray.shutdown(), then ray.init(address=...) without local_mode (or let "
                        "nbaccel attach: RAY_ADDRESS, else address='auto').")


def resolve_ray_hosts(spec: RayHosts) -> HostSet:
    """The alive nodes to run on (head first), named for the output and the dashboard; HostError if none fit."""
    _check_spec(spec)
    ray = attach(spec.address)
    alive = [node for node in ray.nodes() if node.get("Alive")]
    fit = [node for node in alive if all(node["Resources"].get(key, 0) > 0 for key in spec.resources)]
    fit.sort(key=lambda node: (not node.get("Resources", {}).get("node:__internal_head__"), node["NodeID"]))
    if not fit or (spec.nodes is not None and len(fit) < spec.nodes):
        want = f"{spec.nodes} node(s)" if spec.nodes else "a node"
        having = f" with {dict(spec.resources)}" if spec.resources else ""
        raise HostError(RAY, f"hosts='ray': the cluster has {len(alive)} alive node(s), {len(fit)}{having}; the "
                        f"launch needs {want}{having}. `ray status` shows the nodes.")
    chosen = fit[: spec.nodes] if spec.nodes else fit
    gpus = spec.gpus_per_rank
    if gpus is None:
        gpus = int(all(node["Resources"].get("GPU", 0) >= 1 for node in chosen))
    per_node = min(int(node["Resources"].get("GPU", 0)) for node in chosen) if gpus else 0
    return HostSet(tuple(_names(chosen)), via=RAY, node_ids=tuple(node["NodeID"] for node in chosen),
                   gpus=per_node, ray=dataclasses.replace(spec, gpus_per_rank=gpus))


def _check_spec(spec: RayHosts) -> None:
    if spec.nodes is not None and (isinstance(spec.nodes, bool) or not isinstance(spec.nodes, int) or spec.nodes < 1):
        raise ValueError(f"RayHosts(nodes=...) must be a positive number of nodes or None (every node), got "
                         f"{spec.nodes!r}")
    if spec.gpus_per_rank not in (None, 0, 1):
        raise ValueError(f"RayHosts(gpus_per_rank=...) must be 0, 1 or None, got {spec.gpus_per_rank!r}: a rank "
                         "drives one GPU (run more ranks for more GPUs)")
    if not isinstance(spec.cpus_per_rank, (int, float)) or spec.cpus_per_rank < 0:
        raise ValueError(f"RayHosts(cpus_per_rank=...) must be a number >= 0, got {spec.cpus_per_rank!r}")


def _names(nodes: list[dict]) -> list[str]:
    """Each node's name (NodeName, its address by default); with its id's start where names repeat (several
    nodes on one machine)."""
    names = [node.get("NodeName") or node.get("NodeManagerAddress") or node["NodeID"][:8] for node in nodes]
    return [f"{name}/{node['NodeID'][:6]}" if names.count(name) > 1 else name for name, node in zip(names, nodes)]


def agent_command(host: str, via: str = "ssh") -> list[str]:
    """The command that starts the agent on `host`; its stdin/stdout become the kernel's channel."""
    python = os.environ.get(SSH_PYTHON_ENV) or sys.executable
    remote = [python, "-m", AGENT_MODULE]
    root = source_checkout_root()
    if root is not None:  # nbaccel runs from a checkout here: the same path there (a shared filesystem)
        remote = ["env", f"PYTHONPATH={root}", *remote]
    if via == "srun":
        # --unbuffered: srun forwards the output line by line otherwise, and the channel is binary frames
        return ["srun", "--nodes=1", "--ntasks=1", "--overlap", "--unbuffered", f"--nodelist={host}",
                "--kill-on-bad-exit=1",
                *remote]
    command = ["ssh"]
    config = os.environ.get(SSH_CONFIG_ENV)
    if config:
        command += ["-F", config]
    command += shlex.split(os.environ.get(SSH_OPTIONS_ENV, ""))
    command += ["-T", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={CONNECT_TIMEOUT}",
                "-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=3", "--", host]
    return command + [shlex.join(remote)]


def diagnose(host: str, stderr: str, exitcode: int | None, via: str = "ssh") -> HostError:
    """The clear error for an agent that ended before it said hello."""
    said = stderr.strip()
    if via == "srun":
        return _srun_diagnosis(host, said, exitcode)
    for needles, text in _SSH_DIAGNOSES:
        if any(needle in said for needle in needles):
            return HostError(host, text.format(host=host) + (f" ssh said: {said}" if said else ""))
    return HostError(host, f"the agent on {host!r} ended before it answered (exit code {exitcode}): "
                     f"{said or 'no output'}")


def _srun_diagnosis(host: str, said: str, exitcode: int | None) -> HostError:
    """diagnose() for an agent srun started: SLURM's reasons first, then those of the agent's Python."""
    if any(needle in said for needle in _SRUN_JOB_GONE):
        job = os.environ.get("SLURM_JOB_ID") or os.environ.get("SLURM_JOBID") or "?"
        return HostError(host, f"hosts='slurm': this kernel's SLURM allocation (job {job}) has ended, so srun "
                         f"could not start the agent on {host!r}. Start a new allocation (`salloc`, or an sbatch "
                         f"job) and launch there. srun said: {said}")
    ended = slurm_ended(host, said)
    if ended is not None:
        return HostError(host, f"{ended}. srun said: {said}")
    for needles, text in _SSH_DIAGNOSES[-2:]:  # the agent's Python or nbaccel missing on the node
        if any(needle in said for needle in needles):
            return HostError(host, text.format(host=host) + f" srun said: {said}")
    return HostError(host, f"srun could not start the agent on {host!r} (exit code {exitcode}): {said or 'no output'}")


def check_versions(host: str, theirs: dict[str, str], ours: dict[str, str]) -> None:
    """HostError naming each version that differs: the function, cloudpickled here, would not load there."""
    differ = [f"{name} {theirs.get(name, '?')} there, {value} here" for name, value in ours.items()
              if theirs.get(name) != value]
    if differ:
        raise HostError(host, f"host {host!r} runs different versions: {'; '.join(differ)}. The function is "
                        "pickled in this kernel and must load there: install the same versions on every host.")


def check_modules(host: str, missing: Sequence[tuple[str, str]]) -> None:
    """HostError naming the modules the pickled function needs that `host` cannot import ((module, why) pairs
    from its agent): its ranks would fail to load the function."""
    if not missing:
        return
    names = ", ".join(repr(name) for name, _ in missing)
    why = "; ".join(reason for _, reason in missing)
    raise HostError(host, f"host {host!r} cannot import {names}, which the function needs ({why}). The function is "
                    "cloudpickled in this kernel, and what it takes from an importable module (a .py file next to "
                    f"the notebook, a package installed here) travels by name and is imported on each host: install "
                    f"that module on {host!r} or make it importable there (on the Python path of the agent's Python, "
                    "e.g. a shared folder), or define the function in the notebook (or call "
                    "cloudpickle.register_pickle_by_value(module) here) so that it travels by value.")


def describe(hosts: Sequence[str]) -> str:
    return ", ".join(hosts)
