"""A rank's breakpoint()/input() on other hosts (hosts=[...]): the prompt and its answer travel over the host
agent's channel (a real sshd on 127.0.0.1, tests/ssh_server.py). The kernel's input() is the user here:
`builtins.input` answers as a person would type, and records what it was asked."""

from __future__ import annotations

import builtins
import linecache
import os
import re
import sys

import cloudpickle
import pytest
from ssh_server import HOSTS

from nbaccel import LaunchError
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


CELL_FILE = "/tmp/ipykernel_0/nbaccel-hosts-cell.py"  # as ipykernel names a cell: only the kernel's linecache has it
CELL = "import linecache, traceback\ndef where():\n    return traceback.format_stack(limit=1)[0]\n"


def test_rank_pool_on_hosts_asks_in_the_kernel(ssh_config, user, monkeypatch):
    asked, lines = user
    lines += ["a", "b"]
    monkeypatch.setitem(linecache.cache, CELL_FILE, (len(CELL), None, CELL.splitlines(True), CELL_FILE))
    cell = {"__name__": "__main__"}
    exec(compile(CELL, CELL_FILE, "exec"), cell)
    with RankPool(1, hosts=list(HOSTS)) as pool:
        names = pool.run(asks)
        # a cell's function shows its line on the other host too (what pdb and tracebacks read)
        assert pool.run(cell["where"]) == [
            f'  File "{CELL_FILE}", line 3, in where\n    return traceback.format_stack(limit=1)[0]\n'] * 2
    # labelled with the rank (and its host, once the pool knows it); served one at a time, in either order
    labels = [re.sub(r"^\[(\S+ )?rank", "[rank", prompt) for prompt in asked]
    assert sorted(labels) == ["[rank 0] rank 0 name? ", "[rank 1] rank 1 name? "], asked
    assert names == [["a", "b"][labels.index(f"[rank {rank}] rank {rank} name? ")] for rank in (0, 1)], (names, asked)


def killed_at_its_prompt_on_rank_three():
    import signal
    import threading

    if os.environ["RANK"] == "3":
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGKILL)).start()
        input("name? ")
    return 1


def test_a_rank_killed_at_its_prompt_on_another_host_withdraws_it(ssh_config, monkeypatch, capfd):
    """The agent's exit report reaches the prompt's watch: the question is withdrawn, the launch fails."""
    asked = []

    def nobody_answers(prompt=""):
        asked.append(prompt)
        import time

        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            time.sleep(0.01)
        raise AssertionError("the question was not withdrawn")

    monkeypatch.setattr(builtins, "input", nobody_answers)
    with pytest.raises(LaunchError) as info:
        notebook_launcher(killed_at_its_prompt_on_rank_three, num_processes=2, hosts=list(HOSTS), dashboard=False)
    assert info.value.first_rank == 3 and "SIGKILL" in str(info.value), str(info.value)
    assert asked == [f"[{HOSTS[1]} rank 3] name? "], asked
    assert f"the question of {HOSTS[1]} rank 3 was withdrawn" in capfd.readouterr().err
