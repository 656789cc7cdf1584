"""A rank's breakpoint()/input() on other hosts (hosts=[...]): the prompt and its answer travel over the host
agent's channel (a real sshd on 127.0.0.1, tests/ssh_server.py). The kernel's input() is the user here:
`builtins.input` answers as a person would type, and records what it was asked."""

from __future__ import annotations

import builtins
import os
import re
import sys

import cloudpickle
import pytest
from ssh_server import HOSTS

from nbaccel.launch.kernel.launcher import notebook_launcher
from nbaccel.launch.pool import RankPool

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the hosts' Python does not have tests/ on its path


@pytest.fixture
def ssh_config(ssh_server, monkeypatch):
    monkeypatch.setenv("NBACCEL_SSH_CONFIG", str(ssh_server.config))
    return ssh_server


@pytest.fixture
def user(monkeypatch):
    """The kernel's input(): types the scripted lines, keeps the prompts."""
    asked: list[str] = []
    lines: list[str] = []

    def typed(prompt: str = "") -> str:
        asked.append(prompt)
        return lines.pop(0)

    monkeypatch.setattr(builtins, "input", typed)
    return asked, lines


def stops_on_rank_three(base):
    rank = int(os.environ["RANK"])
    value = base + rank
    if rank == 3:
        breakpoint()
    return value


def asks():
    return input(f"rank {os.environ['RANK']} name? ")


def test_breakpoint_on_another_host_is_answered_in_the_kernel(ssh_config, user, capsys):
    asked, lines = user
    lines += ["p value", "value = 99", "c"]
    results = notebook_launcher(stops_on_rank_three, (10,), num_processes=2, hosts=list(HOSTS), dashboard=False)
    assert results == [10, 11, 12, 99]  # the answer changed the rank's variable
    assert asked == [f"[{HOSTS[1]} rank 3] (Pdb) "] * 3, asked
    assert f"[{HOSTS[1]} rank 3] 13" in capsys.readouterr().out.splitlines()


def test_rank_pool_on_hosts_asks_in_the_kernel(ssh_config, user):
    asked, lines = user
    lines += ["a", "b"]
    with RankPool(1, hosts=list(HOSTS)) as pool:
        assert pool.run(asks) == ["a", "b"]
    # labelled with the rank (and its host, once the pool knows it)
    assert [re.sub(r"^\[(\S+ )?rank", "[rank", prompt) for prompt in asked] == [
        "[rank 0] rank 0 name? ", "[rank 1] rank 1 name? "], asked
