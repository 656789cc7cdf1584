"""Which hosts a several-machine launch runs on, and the command that starts the agent on each.

`hosts=["gpu-a", "gpu-b"]`: names as the user's OpenSSH client knows them (~/.ssh/config aliases, users,
ports, jump hosts, keys); nbaccel runs the system `ssh` and handles no password. `NBACCEL_SSH_CONFIG` names
another config file (`ssh -F`), `NBACCEL_SSH_OPTIONS` adds options (split as a shell would),
`NBACCEL_SSH_PYTHON` is the Python to run there (default: this kernel's `sys.executable`, the same path).
`hosts="slurm"`: the nodes of the SLURM allocation this kernel runs in (SLURM_JOB_NODELIST, expanded by
`scontrol show hostnames`); the agents start with `srun` instead of ssh.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..host_protocol import AGENT_MODULE
from ..rank_environment import source_checkout_root

SSH_CONFIG_ENV = "NBACCEL_SSH_CONFIG"
SSH_OPTIONS_ENV = "NBACCEL_SSH_OPTIONS"
SSH_PYTHON_ENV = "NBACCEL_SSH_PYTHON"
SLURM = "slurm"
CONNECT_TIMEOUT = 10  # seconds ssh may take to connect
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


def resolve_hosts(hosts: Any) -> HostSet:
    """`hosts` as given (a list of names, a comma-separated string, or "slurm") -> a HostSet; ValueError or
    HostError when it cannot be used."""
    if isinstance(hosts, str) and hosts.strip().lower() == SLURM:
        return HostSet(slurm_hosts(), via="srun")
    if isinstance(hosts, str):
        hosts = [part for part in hosts.split(",")]
    if not isinstance(hosts, (list, tuple)) or not hosts:
        raise ValueError(f"hosts must be a non-empty list of host names (as your ssh knows them) or 'slurm', "
                         f"got {hosts!r}")
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
    done = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30)
    names = tuple(line.strip() for line in done.stdout.splitlines() if line.strip())
    if done.returncode != 0 or not names:
        raise HostError(SLURM, f"hosts='slurm': `scontrol show hostnames {nodelist}` failed: "
                        f"{(done.stderr or done.stdout).strip() or 'no hosts'}")
    return names


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


def diagnose(host: str, stderr: str, exitcode: int | None) -> HostError:
    """The clear error for an agent that ended before it said hello."""
    said = stderr.strip()
    for needles, text in _SSH_DIAGNOSES:
        if any(needle in said for needle in needles):
            return HostError(host, text.format(host=host) + (f" ssh said: {said}" if said else ""))
    return HostError(host, f"the agent on {host!r} ended before it answered (exit code {exitcode}): "
                     f"{said or 'no output'}")


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
