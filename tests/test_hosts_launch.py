"""notebook_launcher on several hosts, for real: a session sshd on 127.0.0.1 (tests/ssh_server.py) and two
aliases of this machine, 2 ranks each. Results by global rank, world size 4, `[host rank N]` lines, a
failure on the second host, errors and hang reports naming each rank's host, a killed agent, an interrupted kernel, the checks before anything starts, and no
process of a launch left when it returns."""

from __future__ import annotations

import _thread
import os
import re
import signal
import socket
import stat
import sys
import threading
import time
from pathlib import Path

import cloudpickle
import psutil
import pytest
from process_helpers import all_gone, is_alive, run_in_session
from ssh_server import HOSTS

from nbaccel.launch import HostError
from nbaccel.launch.agent.session import SESSION_END_GRACE
from nbaccel.launch.errors import LaunchError
from nbaccel.launch.host_protocol import AGENT_MODULE
from nbaccel.launch.kernel.hosts import resolve_hosts
from nbaccel.launch.kernel.launcher import notebook_launcher
from nbaccel.utils.atomic_files import write_text

pytestmark = pytest.mark.timeout(240)
# the functions below travel by value, as a notebook's do: the hosts' Python does not have tests/ on its path
cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture
def ssh_config(ssh_server, monkeypatch):
    monkeypatch.setenv("NBACCEL_SSH_CONFIG", str(ssh_server.config))
    return ssh_server


def agents_of(server) -> list[int]:
    """The host agents running under the test sshd (each launch's own: sessions of this server only)."""
    found = []
    for proc in psutil.Process(server.process.pid).children(recursive=True):
        try:
            if AGENT_MODULE in " ".join(proc.cmdline()):
                found.append(proc.pid)
        except psutil.NoSuchProcess:
            pass
    return found


def assert_nothing_left(server, pids: list[int]) -> None:
    assert pids, "the ranks reported no pid"
    assert all_gone(pids, within=5), f"ranks still running: {[p for p in pids if psutil.pid_exists(p)]}"
    # an agent has SESSION_END_GRACE to stop its ranks once its session ends, then its own exit (slow on a busy
    # machine): the guarantee is that it ends, not how fast
    assert all_gone(agents_of(server), within=SESSION_END_GRACE + 10), "a host agent outlived its launch"


def rank_pids(folder: Path) -> list[int]:
    return [int(p.read_text()) for p in folder.glob("pid-*")]


def write_my_pid(folder) -> None:
    """Write this rank's pid file whole (rank_pids is polled while ranks start: a file it finds is complete)."""
    write_text(Path(folder, f"pid-{os.environ['RANK']}"), str(os.getpid()), durable=False)


# ------------------------------------------------------------------------------------------ functions run
def meet(tag):
    import torch
    import torch.distributed as dist

    from nbaccel import PartialState

    state = PartialState()
    value = torch.tensor([state.process_index + 1])
    dist.all_reduce(value)
    print(f"hello {tag} from {state.process_index}", flush=True)
    return state.process_index, state.num_processes, state.local_process_index, int(value), os.getpid()


def fail_on_second_host(folder):
    rank = int(os.environ["RANK"])
    write_my_pid(folder)
    if rank == 3:
        time.sleep(1)
        raise ValueError("boom on the second host")
    time.sleep(120)


def kill_my_agent(folder):
    rank = int(os.environ["RANK"])
    write_my_pid(folder)
    if rank == 2:
        time.sleep(1)
        os.kill(os.getppid(), signal.SIGKILL)  # this host's agent
    time.sleep(120)


def kill_my_agent_on_rank(rank):
    if int(os.environ["RANK"]) == rank:
        time.sleep(0.5)
        os.kill(os.getppid(), signal.SIGKILL)  # this host's agent
    time.sleep(5)


def sleep_long(folder):
    write_my_pid(folder)
    time.sleep(120)


def detached_child_then(folder, ending):
    """Each rank starts `sleep 300` in a session of its own (its pid into `folder`); then rank 3 raises
    (`raise`: the agents end as a failed launch's do) or rank 2 SIGKILLs its agent (`agent`: its keeper ends
    what is left); the others wait to be stopped."""
    import subprocess

    rank = int(os.environ["RANK"])
    child = subprocess.Popen(["sleep", "300"], start_new_session=True)
    write_text(Path(folder, f"child-{rank}"), str(child.pid), durable=False)
    time.sleep(1)
    if rank == 3 and ending == "raise":
        raise ValueError("boom on the second host")
    if rank == 2 and ending == "agent":
        os.kill(os.getppid(), signal.SIGKILL)
    time.sleep(120)


def exit_3_on_the_second_host():
    if int(os.environ["RANK"]) == 3:
        os._exit(3)
    time.sleep(120)


def different_collectives_per_host():
    import torch

    from nbaccel import PartialState
    from nbaccel.utils import broadcast, reduce

    state = PartialState()
    t = torch.ones(3)
    if state.process_index < 2:  # the first host's ranks
        reduce(t)
    else:
        broadcast(t)


def session_pipes_held():
    """(how many pipes the agent shares with its sshd: its SSH session, those of them this rank holds)."""
    def pipes(pid):
        found = set()
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("pipe:"):
                found.add(target)
        return found

    agent = psutil.Process(os.getppid())
    session = pipes(agent.pid) & pipes(agent.ppid())
    return len(session), sorted(session & pipes(os.getpid()))


def read_env(names):
    return {name: os.environ.get(name) for name in names}


# ------------------------------------------------------------------------------------------ launches
def test_the_kernels_variables_reach_the_remote_ranks(ssh_config, monkeypatch):
    """The documented set (here HF_* and NCCL_*) and `env_vars=` patterns and values reach a rank on another
    host; a variable outside them does not (the rank starts from its SSH login's environment)."""
    kernel = {"HF_NBACCEL_PROBE": "hub", "NCCL_NBACCEL_PROBE": "nccl", "MYAPP_TOKEN": "by-pattern",
              "OUTSIDE_THE_SET_PROBE": "kernel-only"}
    for name, value in kernel.items():
        monkeypatch.setenv(name, value)
    names = [*kernel, "EXTRA_VALUE_PROBE"]
    results = notebook_launcher(read_env, (names,), num_processes=1, hosts=list(HOSTS), dashboard=False,
                                env_vars={"EXTRA_VALUE_PROBE": "set"})
    assert results == [{**dict.fromkeys(kernel), "HF_NBACCEL_PROBE": "hub", "NCCL_NBACCEL_PROBE": "nccl",
                        "EXTRA_VALUE_PROBE": "set"}] * 2
    results = notebook_launcher(read_env, (names,), num_processes=1, hosts=list(HOSTS), dashboard=False,
                                env_vars=["MYAPP_*"])
    assert [r["MYAPP_TOKEN"] for r in results] == ["by-pattern"] * 2
    assert [r["OUTSIDE_THE_SET_PROBE"] for r in results] == [None, None]


def test_bad_env_vars_are_refused_before_anything_starts():
    with pytest.raises(TypeError, match="pass a dict"):
        notebook_launcher(read_env, ([],), hosts=list(HOSTS), env_vars=["A=1"])
    with pytest.raises(TypeError, match="not the str"):
        notebook_launcher(read_env, ([],), hosts=list(HOSTS), env_vars="MYAPP_*")
    with pytest.raises(ValueError, match="env_vars= is for hosts= launches"):
        notebook_launcher(read_env, ([],), env_vars=["MYAPP_*"])


def test_two_hosts_two_ranks_each(ssh_config, capsys, monkeypatch):
    import nbaccel.notebook
    from nbaccel.notebook.render import summary_html

    boards = []
    real = nbaccel.notebook.Dashboard

    def recording(num_processes, **options):  # the launcher's own dashboard, built with the launch's info
        boards.append(real(num_processes, **options))
        return boards[-1]

    monkeypatch.setattr(nbaccel.notebook, "Dashboard", recording)
    statuses = []
    results = notebook_launcher(meet, ("x",), num_processes=2, hosts=list(HOSTS), dashboard="plain",
                                observers=[statuses.append])
    assert [r[:4] for r in results] == [(0, 4, 0, 10), (1, 4, 1, 10), (2, 4, 0, 10), (3, 4, 1, 10)]
    out = capsys.readouterr().out
    for rank in range(4):
        host = HOSTS[rank // 2]
        assert f"[{host} rank {rank}] hello x from {rank}\n" in out
    launch = next(m for m in statuses if m.get("kind") == "launch" and m.get("state") == "started")
    assert launch["hosts"] == list(HOSTS) and launch["world_size"] == 4 and launch["num_processes"] == 4
    where = {m["rank"]: (m["host"], m["device"]) for m in statuses if m.get("kind") == "status" and m.get("device")}
    assert where == {rank: (HOSTS[rank // 2], "cpu") for rank in range(4)}  # each status names its host
    # the summary the dashboard leaves: every rank in its own row, its host in the host column, the device alone
    html = summary_html(boards[0].model)
    assert ">host</th>" in html
    for rank in range(4):
        row = html.split(f"data-rank='{rank}'")[1].split("</tr>")[0]
        assert re.search(r'<td class="nbaccel-host"[^>]*>([^<]*)</td>', row).group(1) == HOSTS[rank // 2], row
        assert "@" not in row and ">cpu</td>" in row and ">finished</td>" in row
    assert_nothing_left(ssh_config, [r[4] for r in results])


def test_failure_on_the_second_host_stops_every_host(ssh_config, tmp_path):
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        notebook_launcher(fail_on_second_host, (str(tmp_path),), num_processes=2, hosts=list(HOSTS),
                          dashboard=False)
    assert time.monotonic() - start < 60  # the others sleep 120 s: they were stopped
    assert info.value.failures[3].exc_type == "ValueError"
    assert "boom on the second host" in str(info.value)
    assert_nothing_left(ssh_config, rank_pids(tmp_path))


@pytest.mark.parametrize("ending", ["raise", "agent"])
def test_what_a_rank_started_in_a_session_of_its_own_ends_with_the_launch_on_every_host(ssh_config, tmp_path,
                                                                                        ending):
    """Each host's agent keeps a registry of its ranks' groups, as the kernel does for a local launch
    (kernel/rank_groups.py): a process that left its rank's group (setsid) is found by the registry's folder in
    its environment when the agent ends, or by the agent's keeper when the agent is killed."""
    with pytest.raises(LaunchError):
        notebook_launcher(detached_child_then, (str(tmp_path), ending), num_processes=2, hosts=list(HOSTS),
                          dashboard=False, timeout=120)
    children = [int(path.read_text()) for path in tmp_path.glob("child-*")]
    try:
        assert len(children) == 4 and all_gone(children, within=10), \
            f"still running: {[pid for pid in children if is_alive(pid)]}"
    finally:
        for pid in children:
            if is_alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_an_exit_code_names_the_rank_and_its_host(ssh_config):
    with pytest.raises(LaunchError) as info:
        notebook_launcher(exit_3_on_the_second_host, num_processes=2, hosts=list(HOSTS), dashboard=False)
    assert info.value.failures[3].host == HOSTS[1] and info.value.failures[3].exitcode == 3
    text = str(info.value)
    assert f"rank 3 on {HOSTS[1]} failed" in text and f"rank 3 on {HOSTS[1]}: exited with code 3" in text, text
    assert "(exit code 3)" not in text, text  # said once


def test_a_collective_mismatch_across_hosts_names_each_ranks_host(ssh_config):
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        notebook_launcher(different_collectives_per_host, num_processes=2, hosts=list(HOSTS), dashboard=False)
    assert time.monotonic() - start < 60  # detected, not the process group's timeout
    text = str(info.value)
    assert "not every rank entered the same collective" in text, text
    named = re.findall(r"\branks? (\d+)( on [\w-]+)?", text)
    hosts_named = {HOSTS[int(rank) // 2] for rank, _ in named}
    assert hosts_named == set(HOSTS), text  # a rank of each host (which one depends on who arrives first)
    assert all(host == f" on {HOSTS[int(rank) // 2]}" for rank, host in named), text  # each with its host
    assert {rank: failure.host for rank, failure in info.value.failures.items()} == {
        rank: HOSTS[rank // 2] for rank in info.value.failures}


def test_a_killed_agent_fails_the_launch(ssh_config, tmp_path):
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        notebook_launcher(kill_my_agent, (str(tmp_path),), num_processes=2, hosts=list(HOSTS), dashboard=False)
    assert time.monotonic() - start < 60
    assert "nbaccel-host-b" in str(info.value) and "agent" in str(info.value)
    assert "HostLost: the agent on 'nbaccel-host-b' ended (ssh exit code " in str(info.value), str(info.value)
    assert set(info.value.failures) & {2, 3}
    assert_nothing_left(ssh_config, rank_pids(tmp_path))


def test_interrupting_the_kernel_stops_every_host(ssh_config, tmp_path):
    running = set()

    def interrupt_once_all_run(message):
        if message.get("kind") == "status" and message.get("state") == "running":
            running.add(message["rank"])
            if len(running) == 4:
                _thread.interrupt_main()

    with pytest.raises(KeyboardInterrupt):
        notebook_launcher(sleep_long, (str(tmp_path),), num_processes=2, hosts=list(HOSTS), dashboard=False,
                          observers=[interrupt_once_all_run])
    assert_nothing_left(ssh_config, rank_pids(tmp_path))


# the agent's Python on the hosts, held at its `import torch` until the test opens the gate (a file)
IMPORT_GATE = """
import os, sys, time

class _HeldAtTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            gate = os.environ["NBACCEL_TEST_GATE"]
            open(os.path.join(gate, "reached-%d" % os.getpid()), "w").close()
            deadline = time.monotonic() + 120
            while not os.path.exists(os.path.join(gate, "open")) and time.monotonic() < deadline:
                time.sleep(0.05)
            sys.meta_path.remove(self)
        return None

sys.meta_path.insert(0, _HeldAtTorch())
"""


def test_an_interrupt_while_the_agents_import_ends_them_at_once(ssh_config, tmp_path, monkeypatch):
    """Ctrl-C while the hosts' agents import torch (held there until the test lets go): each agent reads its
    session from its first line on and leaves at once. It used to see the stop only once its imports were done
    (seconds), and an agent still importing when the kernel gave up waiting outlived the launch."""
    gate = tmp_path / "gate"
    gate.mkdir()
    (gate / "sitecustomize.py").write_text(IMPORT_GATE)
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nNBACCEL_TEST_GATE={gate} PYTHONPATH={gate}${{PYTHONPATH:+:$PYTHONPATH}} exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    monkeypatch.setenv("NBACCEL_SSH_PYTHON", str(python))

    def interrupt_once_both_import():
        deadline = time.monotonic() + 120
        while len(list(gate.glob("reached-*"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # as Jupyter's stop button: a signal

    threading.Thread(target=interrupt_once_both_import, daemon=True).start()
    try:
        with pytest.raises(KeyboardInterrupt):
            notebook_launcher(meet, ("x",), num_processes=2, hosts=list(HOSTS), dashboard=False)
        held = [int(p.name.split("-")[1]) for p in gate.glob("reached-*")]
        assert len(held) == 2
        assert all_gone(held, within=5), "an agent went on importing after the launch was interrupted"
    finally:
        (gate / "open").touch()
    assert all_gone(agents_of(ssh_config), within=SESSION_END_GRACE + 10)


# an agent run as sshd runs it, by a process that adopts the agent's orphans (PR_SET_CHILD_SUBREAPER): whatever
# of the agent's process group is still there once the agent was reaped, even a zombie, outlived the agent
AGENT_LEAVES_ALONE = """
import ctypes, os, subprocess, sys
from multiprocessing.connection import Connection
from nbaccel.launch.host_protocol import AGENT_MODULE, Hello, Probe

ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
to_r, to_w = os.pipe()
from_r, from_w = os.pipe()
agent = subprocess.Popen([sys.executable, "-m", AGENT_MODULE], stdin=to_r, stdout=from_w, start_new_session=True)
os.close(to_r)
os.close(from_w)
kernel, answers = Connection(to_w, readable=False), Connection(from_r, writable=False)
kernel.send(Probe(port=0))  # as to the first host: the agent opens the ranks' store in a process of its own
hello = answers.recv()
assert isinstance(hello, Hello) and hello.port, hello
kernel.close()  # the session ends before any rank started
agent.wait(60)
try:
    os.killpg(agent.pid, 0)
    print("left:", subprocess.run(["ps", "-o", "pid,stat,args", "-g", str(agent.pid)], capture_output=True,
                                  text=True).stdout)
except ProcessLookupError:
    print("nothing left")
"""


def test_an_agent_ends_its_store_before_it_leaves(tmp_path):
    """The agent's store process ends (and is reaped) before the agent exits: a process left in the agent's
    group held `srun` ~3 s after the agent had gone (SLURM's proctrack/pgid waits for the whole group), on
    every SLURM launch and interrupt."""
    done = run_in_session([sys.executable, "-c", AGENT_LEAVES_ALONE], env=dict(os.environ), cwd=tmp_path,
                          timeout=120)
    assert done.returncode == 0, done.stdout
    assert done.stdout.strip().endswith("nothing left"), done.stdout


# ------------------------------------------------------------------------------------------ checks first
def test_unreachable_host_is_named(ssh_config):
    with pytest.raises(HostError, match="'nbaccel-no-such-host.invalid' is unreachable") as info:
        notebook_launcher(meet, ("x",), num_processes=1, hosts=[HOSTS[0], "nbaccel-no-such-host.invalid"],
                          dashboard=False)
    assert info.value.host == "nbaccel-no-such-host.invalid"
    assert all_gone(agents_of(ssh_config), within=5)


def test_a_host_whose_session_ended_before_the_probe_is_named(ssh_config, monkeypatch):
    """The window of the test above, every time: ssh has already given up on the host when the kernel sends its
    probe (it raised BrokenPipeError instead of the HostError now and then on a busy machine)."""
    from nbaccel.launch.kernel.ssh_backend import SshBackend

    open_agents = SshBackend._open_agents

    def open_and_let_the_unreachable_end(self, plan):
        open_agents(self, plan)
        self.agents[1].process.wait(60)

    monkeypatch.setattr(SshBackend, "_open_agents", open_and_let_the_unreachable_end)
    with pytest.raises(HostError, match="'nbaccel-no-such-host.invalid' is unreachable"):
        notebook_launcher(meet, ("x",), num_processes=1, hosts=[HOSTS[0], "nbaccel-no-such-host.invalid"],
                          dashboard=False)


def test_refused_host_key_is_named(ssh_config, tmp_path, monkeypatch):
    text = ssh_config.config.read_text()
    block = text[text.index(f"Host {HOSTS[1]}"):].replace(HOSTS[1], "nbaccel-host-stranger")
    empty = tmp_path / "known_hosts"
    empty.write_text("")  # this alias knows no host key
    config = tmp_path / "ssh_config"
    config.write_text(text + block.replace(str(ssh_config.folder / "known_hosts"), str(empty)))
    monkeypatch.setenv("NBACCEL_SSH_CONFIG", str(config))
    with pytest.raises(HostError, match="SSH refused the host key of 'nbaccel-host-stranger'"):
        notebook_launcher(meet, ("x",), num_processes=1, hosts=[HOSTS[0], "nbaccel-host-stranger"],
                          dashboard=False)
    assert all_gone(agents_of(ssh_config), within=5)


def test_different_versions_on_a_host_are_named(ssh_config, tmp_path, monkeypatch):
    python = tmp_path / "older-nbaccel-python"
    python.write_text(
        f"#!/bin/sh\nexec {sys.executable} -c 'import sys, runpy, nbaccel; nbaccel.__version__ = \"0.0.1\"; "
        f"sys.argv = sys.argv[:1]; runpy.run_module(\"{AGENT_MODULE}\", run_name=\"__main__\")'\n")
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("NBACCEL_SSH_PYTHON", str(python))
    with pytest.raises(HostError, match=r"host 'nbaccel-host-a' runs different versions: nbaccel 0\.0\.1 there"):
        notebook_launcher(meet, ("x",), num_processes=1, hosts=list(HOSTS), dashboard=False)
    assert all_gone(agents_of(ssh_config), within=5)


def test_a_rendezvous_port_the_first_host_cannot_open_is_named(ssh_config):
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(HostError, match=f"rendezvous cannot listen on 'nbaccel-host-a': port {port}"):
            notebook_launcher(meet, ("x",), num_processes=1, hosts=list(HOSTS), use_port=port, dashboard=False)
    assert all_gone(agents_of(ssh_config), within=5)


def touch(path):
    Path(path).touch()


def test_a_store_torch_refuses_on_the_first_host_is_named_before_any_rank_starts(ssh_config, tmp_path,
                                                                                  monkeypatch):
    # the first host's agent listens on the port itself and torch's store serves that socket in a process of
    # its own (host_agent.open_store): the hello waits for torch's answer, so no rank of any host starts
    python = tmp_path / "store-refusing-python"
    python.write_text(
        f"#!/bin/sh\nexec {sys.executable} -c 'import runpy, sys, torch.distributed as dist\n"
        "real = dist.TCPStore\n"
        "def refusing(*args, **kwargs):\n"
        "    if kwargs.get(\"master_listen_fd\") is not None:\n"
        "        raise RuntimeError(\"refused by the test\")\n"
        "    return real(*args, **kwargs)\n"
        "dist.TCPStore = refusing\n"
        f"sys.argv = sys.argv[:1]; runpy.run_module(\"{AGENT_MODULE}\", run_name=\"__main__\")'\n")
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("NBACCEL_SSH_PYTHON", str(python))
    ran = tmp_path / "a-rank-ran"
    with pytest.raises(HostError, match=r"rendezvous cannot listen on 'nbaccel-host-a': the store could not "
                       r"open on port \d+ of .*refused by the test"):
        notebook_launcher(touch, (str(ran),), num_processes=1, hosts=list(HOSTS), dashboard=False)
    assert not ran.exists()
    assert all_gone(agents_of(ssh_config), within=SESSION_END_GRACE + 10)


def test_a_module_the_hosts_cannot_import_is_named_before_any_rank_starts(ssh_config, tmp_path, monkeypatch):
    # a training function in a .py file next to the notebook: importable in the kernel (its folder is on the
    # kernel's path), so cloudpickle sends it by name; the hosts' Python does not have that folder on its path
    module = f"nbaccel_train_{os.getpid()}_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{module}.py").write_text("def train(x):\n    return x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    train = __import__(module).train
    seen = []
    try:
        with pytest.raises(HostError) as info:
            notebook_launcher(train, (1,), num_processes=1, hosts=list(HOSTS), dashboard=False,
                              observers=[seen.append])
    finally:
        sys.modules.pop(module, None)
    text = str(info.value)
    assert info.value.host == HOSTS[0] and f"host {HOSTS[0]!r} cannot import {module!r}" in text
    assert "define the function in the notebook" in text and f"install that module on {HOSTS[0]!r}" in text
    assert not [m for m in seen if m.get("kind") == "status"]  # no rank started
    assert all_gone(agents_of(ssh_config), within=5)


def test_every_kernel_only_module_is_named_before_any_rank_starts(ssh_config, tmp_path, monkeypatch):
    # a notebook function (by value) that uses os and two modules next to the notebook: cloudpickle writes its
    # module loader once and refers to it by memo for the next two; the hosts cannot import either
    first, second = (f"nbaccel_kernelonly_{tag}_{os.getpid()}" for tag in ("a", "b"))
    (tmp_path / f"{first}.py").write_text("def work():\n    return 1\n")
    (tmp_path / f"{second}.py").write_text("def work():\n    return 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    namespace = {"os": os, "first": __import__(first), "second": __import__(second)}
    exec("def train():\n    return os.getcwd(), first.work() + second.work()\n", namespace)
    seen = []
    try:
        with pytest.raises(HostError) as info:
            notebook_launcher(namespace["train"], num_processes=1, hosts=list(HOSTS), dashboard=False,
                              observers=[seen.append])
    finally:
        sys.modules.pop(first, None)
        sys.modules.pop(second, None)
    text = str(info.value)
    assert info.value.host == HOSTS[0] and f"host {HOSTS[0]!r} cannot import" in text
    assert repr(first) in text and repr(second) in text, text
    assert not [m for m in seen if m.get("kind") == "status"]  # no rank started
    assert all_gone(agents_of(ssh_config), within=5)


def test_a_module_the_hosts_cannot_import_fails_one_rank_pool_call_naming_the_host(ssh_config, tmp_path,
                                                                                  monkeypatch):
    # RankPool receives its functions cell by cell, after its ranks started: the call fails on each rank, naming
    # the module, the host and what to do, and the pool stays usable
    module = f"nbaccel_pooltrain_{os.getpid()}_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{module}.py").write_text("def train(x):\n    return x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    train = __import__(module).train
    from nbaccel.launch import RankFailedError, RankPool

    try:
        with RankPool(num_processes=1, hosts=list(HOSTS), timeout=10) as pool:
            with pytest.raises(RankFailedError) as info:
                pool.run(train, 1)
            assert pool.run(len, "ab") == [2, 2]
    finally:
        sys.modules.pop(module, None)
    text = str(info.value)
    for host in HOSTS:
        assert f"No module named {module!r} on host {host!r}" in text
    assert "define the function in the notebook" in text
    assert all_gone(agents_of(ssh_config), within=5)


def test_the_modules_a_pickled_function_needs_are_read_from_the_pickle(tmp_path, monkeypatch):
    from nbaccel.launch.serialize import dumps_payload, missing_modules, referenced_modules

    (tmp_path / "nbaccel_refmod_a.py").write_text("def train():\n    return 1\n")
    (tmp_path / "nbaccel_refmod_b.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import nbaccel_refmod_a
    import nbaccel_refmod_b

    def uses_module():  # travels by value (this test module is registered so), the module object by name
        return nbaccel_refmod_b.X

    try:
        names = referenced_modules(dumps_payload(nbaccel_refmod_a.train, (uses_module,), {}))
        assert "nbaccel_refmod_a" in names and "nbaccel_refmod_b" in names and "__main__" not in names
        assert "test_hosts_launch" not in names  # registered by value: nothing to import
        assert missing_modules(names) == []  # this Python has them
        monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(tmp_path)])
        for name in ("nbaccel_refmod_a", "nbaccel_refmod_b"):
            del sys.modules[name]
        assert [name for name, _ in missing_modules(names)] == ["nbaccel_refmod_a", "nbaccel_refmod_b"]
        __import__("json")  # a package already imported: its missing submodule is named too
        assert missing_modules(["json", "json.no_such_part"]) == [("json.no_such_part",
                                                                  "'json' has no module 'json.no_such_part'")]
    finally:
        sys.modules.pop("nbaccel_refmod_a", None)
        sys.modules.pop("nbaccel_refmod_b", None)


@pytest.fixture
def kernel_modules(tmp_path, monkeypatch):
    """Modules m0..m3, a package pkg with submodule pkg.sub, and `caller` (whose function uses m3), all next
    to the test, as a notebook's .py files are; forgotten afterwards."""
    tag = f"{os.getpid()}_{tmp_path.name.replace('-', '_')}"
    names = [f"nbaccel_ref{i}_{tag}" for i in range(4)]
    for name in names:
        (tmp_path / f"{name}.py").write_text("X = 1\n")
    package, caller = f"nbaccel_refpkg_{tag}", f"nbaccel_refcaller_{tag}"
    (tmp_path / package).mkdir()
    (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / package / "sub.py").write_text("Y = 2\n")
    (tmp_path / f"{caller}.py").write_text(f"import {names[3]}\ndef work():\n    return {names[3]}.X\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    loaded = [__import__(name) for name in names] + [__import__(caller)]
    __import__(f"{package}.sub")
    yield loaded, sys.modules[package], sys.modules[f"{package}.sub"]
    for name in [*names, caller, package, f"{package}.sub"]:
        sys.modules.pop(name, None)


def by_value(source, **modules):
    """A function defined as a notebook cell defines it (in __main__: cloudpickle sends it by value)."""
    namespace = {"__name__": "__main__", **modules}
    exec(source, namespace)
    return namespace["f"]


def test_every_module_in_a_pickle_is_found_in_any_order_and_nesting(kernel_modules):
    from nbaccel.launch.serialize import dumps_payload, referenced_modules

    (m0, m1, m2, m3, caller), package, sub = kernel_modules
    two = by_value("def f():\n    return a.X + b.X\n", a=m0, b=m1)
    reversed_two = by_value("def f():\n    return b.X + a.X\n", a=m0, b=m1)
    closure = by_value("def f():\n    def inner():\n        return c.X\n    return inner\n", c=m2)()
    uses_submodule = by_value("def f():\n    return p.sub.Y\n", p=package)
    cases = {  # what is pickled -> the modules it must name
        "two module refs": ((two, (), {}), [m0, m1]),
        "reversed, the first one also an argument": ((reversed_two, (m0,), {}), [m0, m1]),
        "in a closure in a list in kwargs": ((two, (), {"steps": [1, {"k": closure}]}), [m0, m1, m2]),
        "one module many times, deep": ((two, ([two, [closure, (m2, m0)]],), {}), [m0, m1, m2]),
        "a module's function using another": ((caller.work, (two,), {}), [caller, m0, m1]),
        "a submodule by attribute": ((uses_submodule, (), {}), [package, sub]),
        "a submodule object": ((two, (sub,), {"again": closure}), [m0, m1, sub, m2]),
    }
    for label, ((function, args, kwargs), expected) in cases.items():
        names = referenced_modules(dumps_payload(function, args, kwargs))
        want = [module.__name__ for module in expected]
        assert set(want) <= set(names), (label, names)
        assert "__main__" not in names, label


def test_a_module_registered_by_value_brings_what_it_uses(kernel_modules):
    from nbaccel.launch.serialize import dumps_payload, referenced_modules

    (m0, m1, m2, m3, caller), package, sub = kernel_modules
    cloudpickle.register_pickle_by_value(caller)  # its function travels by value: m3, which it uses, by name
    try:
        names = referenced_modules(dumps_payload(caller.work, (), {}))
    finally:
        cloudpickle.unregister_pickle_by_value(caller)
    assert m3.__name__ in names and caller.__name__ not in names, names


def test_reading_the_modules_runs_nothing_of_the_pickle(tmp_path):
    from nbaccel.launch.serialize import referenced_modules

    class Boom:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'ran'}",))

    names = referenced_modules(cloudpickle.dumps([Boom(), {"k": {Boom()}}]))
    assert names == ["posix"] and not (tmp_path / "ran").exists()


# ------------------------------------------------------------------------------------------ arguments
def test_bad_hosts_arguments_are_refused_before_anything_starts():
    with pytest.raises(ValueError, match="non-empty list"):
        resolve_hosts([])
    with pytest.raises(ValueError, match="appear more than once"):
        resolve_hosts(["a", "a"])
    with pytest.raises(ValueError, match="is not a host name"):
        resolve_hosts(["-oProxyCommand=x"])
    assert resolve_hosts("a, b").names == ("a", "b")
    with pytest.raises(ValueError, match="leave num_nodes"):
        notebook_launcher(meet, ("x",), num_processes=1, hosts=["a"], num_nodes=2)


def test_slurm_outside_an_allocation_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.delenv("SLURM_JOB_NODELIST", raising=False)
    monkeypatch.delenv("SLURM_NODELIST", raising=False)
    with pytest.raises(HostError, match="needs a SLURM allocation, and SLURM_JOB_NODELIST is not set"):
        notebook_launcher(meet, ("x",), num_processes=1, hosts="slurm")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[1-2]")
    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol there
    with pytest.raises(HostError, match="`scontrol` is not on PATH"):
        resolve_hosts("slurm")


KERNEL = """
import sys, cloudpickle
sys.path.insert(0, {tests!r})
import test_hosts_launch as t
cloudpickle.register_pickle_by_value(t)
from nbaccel.launch.kernel.launcher import notebook_launcher
from nbaccel.utils.atomic_files import write_text
notebook_launcher(t.sleep_long, ({folder!r},), num_processes=2, hosts=list(t.HOSTS), dashboard=False)
"""


def test_a_killed_kernel_leaves_nothing_on_any_host(ssh_config, tmp_path):
    import subprocess

    kernel = subprocess.Popen([sys.executable, "-c", KERNEL.format(tests=str(Path(__file__).parent),
                                                                   folder=str(tmp_path))],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    try:
        while len(rank_pids(tmp_path)) < 4 and time.monotonic() < deadline and kernel.poll() is None:
            time.sleep(0.2)
        assert len(rank_pids(tmp_path)) == 4, kernel.stderr.read().decode() if kernel.poll() is not None else ""
        sessions = [p.pid for p in psutil.Process(kernel.pid).children()]  # the ssh clients
        # every process of the agents' trees, the first host's rendezvous store included (once its agent is
        # gone it is no longer under sshd, where assert_nothing_left looks)
        everything = agents_of(ssh_config)
    finally:
        kernel.kill()  # SIGKILL: no clean-up of its own; the SSH sessions end, and each agent stops its ranks
        kernel.wait()
        kernel.stderr.close()
    assert len(everything) >= 2 + 1 + 4, everything  # the agents, the store, the ranks
    assert_nothing_left(ssh_config, rank_pids(tmp_path))
    assert all_gone(sessions, within=10)
    assert all_gone(everything, within=SESSION_END_GRACE + 10), "a process of a host agent outlived its launch"


# ------------------------------------------------------------------------------------------ RankPool, %ranks
POOL_CELL = """
import torch, torch.distributed as dist
from nbaccel import PartialState
state = PartialState()
x = torch.tensor([state.process_index + 1])
dist.all_reduce(x)
print("on", state.process_index, "of", state.num_processes)
int(x)
"""


def test_rank_pool_on_two_hosts(ssh_config):
    from nbaccel.launch import CollectiveMismatchError, RankPool

    with RankPool(num_processes=1, hosts=list(HOSTS), timeout=10) as pool:
        assert pool.num_processes == 1 and pool.world_size == 2  # per host going in and coming out; every rank
        assert "num_processes=1, hosts=['nbaccel-host-a', 'nbaccel-host-b'], world_size=2" in repr(pool)
        seen = []
        pool.attach(seen.append)  # a dashboard attached to the pool: each rank's status names its host
        results = pool.exec(POOL_CELL)
        pool.detach(seen.append)
        assert [r.value for r in results] == [3, 3]
        assert {m["rank"]: m.get("host") for m in seen if m.get("kind") == "status"} == dict(enumerate(HOSTS))
        assert [r.stdout for r in results] == ["on 0 of 2\n", "on 1 of 2\n"]  # output before its reply
        for cell in range(5):  # short cells: each one's output, all of it, and no other's
            results = pool.exec(f"print('cell {cell} on', state.process_index)\n{cell}")
            assert [r.stdout for r in results] == [f"cell {cell} on 0\n", f"cell {cell} on 1\n"]
            assert [r.value for r in results] == [cell, cell]
        # a rank holds no end of its agent's SSH session (the session ends when the agent does)
        assert [(count > 0, held) for count, held in pool.run(session_pipes_held)] == [(True, [])] * 2
        pids = pool.pids
        assert agents_of(ssh_config) and all(psutil.pid_exists(pid) for pid in pids)
        # the same hang report as on one machine: only rank 0 enters the collective
        with pytest.raises(CollectiveMismatchError, match=f"rank 0 on {HOSTS[0]} waits in") as info:
            pool.exec("if state.process_index == 0:\n    dist.all_reduce(x)")
        assert f"rank 1 on {HOSTS[1]} finished the cell" in str(info.value)  # every rank named with its host
        assert all_gone(pids, within=10)  # the pool restarted its ranks on both hosts
        assert pool.exec("from nbaccel import PartialState\nPartialState().num_processes").values == [2, 2]
        pids = pool.pids
    assert_nothing_left(ssh_config, pids)


def test_a_rank_pool_names_a_lost_agent_as_the_launch_does(ssh_config):
    """The second host's agent is killed during a call: its rank is lost with it, `HostLost`, as in a launch
    (it read `RankDied: the rank process ended (exit code 255)`, ssh's exit code taken for the rank's)."""
    from nbaccel.launch import RankFailedError, RankPool

    with RankPool(num_processes=1, hosts=list(HOSTS), timeout=10) as pool:
        with pytest.raises(RankFailedError) as info:
            pool.run(kill_my_agent_on_rank, 1)
        assert pool.run(int) == [0, 0]  # restarted on both hosts
        pids = pool.pids
    text = str(info.value)
    assert f"rank 1 on {HOSTS[1]}: HostLost: the agent on {HOSTS[1]!r} ended (ssh exit code " in text, text
    assert "RankDied" not in text, text
    assert_nothing_left(ssh_config, pids)


POOL_KERNEL = """
import json, os, sys
from pathlib import Path
sys.path.insert(0, {tests!r})
from ssh_server import HOSTS
from nbaccel.launch import RankPool
folder = Path({folder!r})
pool = RankPool(num_processes=1, hosts=list(HOSTS), timeout=600)
agents = [agent.hello.pid for agent in pool._workers._backend.agents]
(folder / "pids.json").write_text(json.dumps({{"ranks": pool.pids, "agents": agents}}))
if {stuck!r}:
    import threading, time

    def clog():  # 8 MB for rank 0's command pipe while its cell runs: its agent blocks writing it to the rank
        while not list(folder.glob("running-*")):
            time.sleep(0.05)
        pool._workers.ranks[0].channel.send_bytes(bytes(8 << 20))
        (folder / "clogged").write_text("")

    threading.Thread(target=clog, daemon=True).start()
pool.exec("import os, time, pathlib\\n"
          f"pathlib.Path({{str(folder)!r}}, 'running-' + os.environ['RANK']).write_text('')\\n"
          "time.sleep(300)")
"""


@pytest.mark.parametrize("stuck", [False, True], ids=["agents-idle", "agent-loop-stuck"])
def test_a_killed_kernel_leaves_no_rank_pool_on_any_host(ssh_config, tmp_path, stuck):
    # the kernel dies while a long cell runs on every rank: each agent sees its SSH session end and stops its
    # ranks, also one whose relay loop is stuck writing to a busy rank; the test looks only at the agents and
    # ranks this kernel started
    import json
    import subprocess

    kernel = subprocess.Popen([sys.executable, "-c", POOL_KERNEL.format(tests=str(Path(__file__).parent),
                                                                        folder=str(tmp_path), stuck=stuck)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("running-*"))) < 2 and time.monotonic() < deadline and kernel.poll() is None:
        time.sleep(0.2)
    if stuck:
        time.sleep(2)  # the 8 MB are on their way: the relay loop of host a's agent blocks in them
    try:
        assert len(list(tmp_path.glob("running-*"))) == 2, \
            kernel.stderr.read().decode() if kernel.poll() is not None else "the cell did not start on every rank"
        pids = json.loads((tmp_path / "pids.json").read_text())
        sessions = [p.pid for p in psutil.Process(kernel.pid).children()]  # the ssh clients
    finally:
        kernel.kill()  # SIGKILL, mid-call
        kernel.wait()
        kernel.stderr.close()
    assert len(pids["ranks"]) == 2 and len(pids["agents"]) == 2
    ours = pids["ranks"] + pids["agents"]
    assert all_gone(ours, within=20), f"still running: {[p for p in ours if is_alive(p)]}"
    assert all_gone(sessions, within=10)


def test_ranks_magic_with_hosts(ssh_config, tmp_path, monkeypatch):
    import nbclient
    import nbformat

    cells = ["%load_ext nbaccel\n%ranks start -n 1 --hosts " + ",".join(HOSTS),
             "%%ranks\nfrom nbaccel import PartialState\nPartialState().num_processes", "%ranks stop"]
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in cells])
    nbclient.NotebookClient(notebook, timeout=90, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    texts = ["".join(o.get("text", "") or o.get("data", {}).get("text/plain", "") for o in cell.outputs)
             for cell in notebook.cells]
    assert f"Started 2 ranks on {HOSTS[0]}, {HOSTS[1]}" in texts[0], texts
    assert "2" in texts[1], texts
    assert all_gone(agents_of(ssh_config), within=10)


def test_slurm_hosts_start_agents_with_srun(ssh_config, tmp_path, monkeypatch):
    # No SLURM cluster here (docs/launcher.md says why): stand-ins with SLURM's command lines. `scontrol show
    # job -o ID` says the allocation runs; `scontrol show hostnames LIST` expands its list; `srun ...
    # --nodelist=NODE CMD` runs CMD on NODE, here over the session's sshd, its stdin/stdout being the agent's
    # channel as under the real srun.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(
        '#!/bin/sh\n[ "$*" = "show job -o 7" ] && { echo "JobId=7 JobState=RUNNING"; exit 0; }\n'
        '[ "$1 $2 $3" = "show hostnames nbaccel-host-[a-b]" ] || { echo "bad call: $*" >&2; exit 1; }\n'
        f'printf "{HOSTS[0]}\\n{HOSTS[1]}\\n"\n')
    calls = tmp_path / "srun-calls"
    (bin_dir / "srun").write_text(
        f'#!/bin/sh\necho "$*" >> {calls}\nnode=""\nwhile [ "${{1#--}}" != "$1" ]; do\n'
        '  case "$1" in --nodelist=*) node="${1#--nodelist=}";; esac\n  shift\ndone\n'
        f'exec ssh -F {ssh_config.config} -T "$node" -- "$*"\n')
    for script in ("scontrol", "srun"):
        (bin_dir / script).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "nbaccel-host-[a-b]")
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.delenv("NBACCEL_SSH_CONFIG")  # srun, not ssh, reaches the nodes
    results = notebook_launcher(meet, ("slurm",), num_processes=1, hosts="slurm", dashboard=False)
    assert [r[:2] for r in results] == [(0, 2), (1, 2)]
    lines = calls.read_text().splitlines()
    assert len(lines) == 2 and all("--overlap" in line and AGENT_MODULE in line for line in lines), lines
    # one srun per node; the two start at once, so their lines come in either order
    assert sorted(line.split("--nodelist=")[1].split()[0] for line in lines) == sorted(HOSTS)
    assert_nothing_left(ssh_config, [r[4] for r in results])
    folder = tmp_path / "pids"
    folder.mkdir()
    with pytest.raises(LaunchError) as info:  # an agent srun started, lost: named as srun's (it said "ssh")
        notebook_launcher(kill_my_agent, (str(folder),), num_processes=2, hosts="slurm", dashboard=False)
    assert f"HostLost: the agent on {HOSTS[1]!r} ended (srun exit code " in str(info.value), str(info.value)
    assert_nothing_left(ssh_config, rank_pids(folder))


SLURM_KERNEL = """
from nbaccel.launch.kernel.launcher import notebook_launcher
from nbaccel.utils.atomic_files import write_text

def where():
    import os
    from nbaccel import PartialState
    state = PartialState()
    print("in the allocation", state.process_index, flush=True)
    return state.process_index, state.num_processes, os.environ.get("SLURM_STEP_ID") is not None

print("results", notebook_launcher(where, num_processes=2, hosts="slurm", dashboard=False))
"""


def test_slurm_allocation_for_real(slurm_cluster, tmp_path):
    # a kernel started inside `salloc` (as a JupyterLab in an allocation is): the hosts come from the
    # allocation and the agents start as job steps with srun
    env = dict(os.environ, SLURM_CONF=str(slurm_cluster.conf))
    env.pop("NBACCEL_SSH_CONFIG", None)
    script = tmp_path / "kernel.py"
    script.write_text(SLURM_KERNEL)
    done = run_in_session(["salloc", "-N1", "-n1", sys.executable, str(script)], env, tmp_path, timeout=120)
    assert "results [(0, 2, True), (1, 2, True)]" in done.stdout, done.stdout
    assert f"[{slurm_cluster.node} rank 1] in the allocation 1" in done.stdout, done.stdout


def fail_first_attempt():
    rank = int(os.environ["RANK"])
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if rank == 3 and attempt == 0:
        raise ValueError("first attempt fails")
    return rank, attempt, int(os.environ["TORCHELASTIC_MAX_RESTARTS"])


def test_max_restarts_restarts_every_host(ssh_config, capsys):
    results = notebook_launcher(fail_first_attempt, num_processes=2, hosts=list(HOSTS), max_restarts=1,
                                dashboard=False)
    assert results == [(0, 1, 1), (1, 1, 1), (2, 1, 1), (3, 1, 1)]
    err = capsys.readouterr().err
    assert f"rank 3 on {HOSTS[1]}: ValueError: first attempt fails; restarting every rank (1 of max_restarts=1)" \
        in err, err
    with pytest.raises(LaunchError) as caught:
        notebook_launcher(fail_on_second_host_always, num_processes=2, hosts=list(HOSTS), max_restarts=1,
                          dashboard=False)
    assert len(caught.value.attempts) == 1 and 3 in caught.value.attempts[0]


def fail_on_second_host_always():
    if os.environ["RANK"] == "3":
        raise ValueError("always")
