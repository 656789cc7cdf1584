"""hosts="ray", for real: a two-node Ray cluster and a Jupyter kernel in a private network namespace
(tests/ray_cluster.py). 2 ranks on each node (each rank names the raylet it runs under), results by global
rank, `[node rank N]` lines, a failure on the second node, a kernel interrupt, RankPool and %%ranks cells, a
killed kernel; after each, no actor, placement group, agent or rank of the launch is left."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import psutil
import pytest
from process_helpers import SESSION_HELPERS, run_interrupted_in_import

from nbaccel.launch.host_protocol import AGENT_MODULE

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.kernel, pytest.mark.slow, pytest.mark.timeout(300)]

SETUP = """
import os, time, psutil
from pathlib import Path
from nbaccel import notebook_launcher, LaunchError, RankPool

def my_raylet():
    '''The pid of the raylet (the Ray node) this rank runs under.'''
    for parent in psutil.Process().parents():
        if parent.name() == "raylet":
            return parent.pid
    return None

def meet(tag):
    import torch, torch.distributed as dist
    from nbaccel import PartialState
    state = PartialState()
    value = torch.tensor([state.process_index + 1])
    dist.all_reduce(value)
    print(f"hello {tag} from {state.process_index}", flush=True)
    return state.process_index, state.num_processes, state.local_process_index, int(value), my_raylet(), os.getpid()
"""


@pytest.fixture(scope="module")
def kernel(ray_cluster, tmp_path_factory):
    from ray_cluster import NamespaceKernel

    kernel = NamespaceKernel(ray_cluster, tmp_path_factory.mktemp("ray-kernel"))
    SESSION_HELPERS.add(kernel.pid)
    try:
        setup = kernel.run(SETUP)
        assert setup.error is None, setup.error
        yield kernel
    finally:
        kernel.stop()
        SESSION_HELPERS.discard(kernel.pid)


def raylets(cluster) -> dict[int, str]:
    """pid -> "head" or "second" for the cluster's two raylets."""
    found = {}
    for proc in cluster.processes():
        try:
            if proc.name() == "raylet":
                found[proc.pid] = "second" if "nbaccel_node_b" in " ".join(proc.cmdline()) else "head"
        except psutil.Error:
            pass
    return found


def agents_and_ranks(cluster) -> list[int]:
    """Host agents (and the ranks they forked, which share its command line) running in the namespace."""
    found = []
    for proc in cluster.processes():
        try:
            if AGENT_MODULE in " ".join(proc.cmdline()) or "nbaccel.launch.worker" in " ".join(proc.cmdline()):
                found.append(proc.pid)
        except psutil.Error:
            pass
    return found


def assert_nothing_left(cluster, within: float = 20) -> None:
    """No agent or rank process, no nbaccel actor, no placement group left."""
    deadline = time.monotonic() + within
    while True:
        state = cluster.state()
        left = agents_and_ranks(cluster), [name for name in state["actors"] if name.startswith("nbaccel-")], \
            state["placement_groups"]
        if not any(left) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not any(left), f"left after the launch: processes {left[0]}, actors {left[1]}, placement groups {left[2]}"


def test_two_nodes_two_ranks_each(kernel, ray_cluster):
    cell = kernel.run("results = notebook_launcher(meet, ('ray',), num_processes=2, hosts='ray', dashboard=False)\n"
                      "print('results', results)")
    assert cell.error is None, cell.error
    assert "Warning" not in cell.stderr, cell.stderr  # the kernel's first launch attached to Ray: no tip shown
    results = eval(cell.stdout.split("results ", 1)[1].strip())  # noqa: S307 (the kernel printed a list)
    assert [r[:4] for r in results] == [(0, 4, 0, 10), (1, 4, 1, 10), (2, 4, 0, 10), (3, 4, 1, 10)]
    nodes = raylets(ray_cluster)
    assert [nodes.get(r[4]) for r in results] == ["head", "head", "second", "second"], (results, nodes)
    for rank in range(4):
        assert f" rank {rank}] hello ray from {rank}\n" in cell.stdout, cell.stdout
    labels = {line.split(" rank ")[0] for line in cell.stdout.splitlines() if line.startswith("[")}
    assert len(labels) == 2, labels  # one name per node
    assert all(not psutil.pid_exists(r[5]) for r in results)
    assert_nothing_left(ray_cluster)


def test_failure_on_the_second_node_stops_every_rank(kernel, ray_cluster, tmp_path):
    cell = kernel.run(f"""
def fail_on_second_node(folder):
    rank = int(os.environ["RANK"])
    Path(folder, f"pid-{{rank}}").write_text(str(os.getpid()))
    if rank == 3:
        time.sleep(1)
        raise ValueError("boom on the second node")
    time.sleep(120)
started = time.monotonic()
try:
    notebook_launcher(fail_on_second_node, ({str(tmp_path)!r},), num_processes=2, hosts='ray', dashboard=False)
except LaunchError as exc:
    print("caught", type(exc).__name__, "after", round(time.monotonic() - started))
    print(exc)
""")
    assert cell.error is None, cell.error
    assert "caught LaunchError" in cell.stdout, cell.stdout + cell.stderr
    assert "rank 3" in cell.stdout and "ValueError: boom on the second node" in cell.stdout, cell.stdout
    pids = [int(p.read_text()) for p in tmp_path.glob("pid-*")]
    assert len(pids) == 4
    assert_nothing_left(ray_cluster)
    assert not any(psutil.pid_exists(pid) for pid in pids)


def test_kernel_interrupt_stops_every_rank(kernel, ray_cluster, tmp_path):
    import threading

    marker = tmp_path / "started"

    def interrupt() -> None:
        deadline = time.monotonic() + 120
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)
        kernel.manager.interrupt_kernel()

    thread = threading.Thread(target=interrupt, daemon=True)
    thread.start()
    cell = kernel.run(f"""
def sleep_long(marker):
    if os.environ["RANK"] == "3":
        open(marker, "w").close()
    time.sleep(120)
notebook_launcher(sleep_long, ({str(marker)!r},), num_processes=2, hosts='ray', dashboard=False)
""")
    thread.join(5)
    assert marker.exists()
    assert cell.error is not None and cell.error[0] == "KeyboardInterrupt", cell.error
    assert_nothing_left(ray_cluster)
    again = kernel.run("print('again', notebook_launcher(lambda: 7, num_processes=1, hosts='ray', dashboard=False))")
    assert "again [7, 7]" in again.stdout, (again.stdout, again.error)


def test_an_interrupt_while_the_nodes_are_taken_stops_at_once(kernel, ray_cluster):
    """Ctrl-C 0.3 s into a launch, while it reserves the nodes and makes the agents' actors (no agent was told
    to start a rank yet): the launch kills those actors rather than wait for each to come up and hear the stop
    (2-3 s on a busy machine, up to STOP_WAIT), nothing is left, and the next launch works."""
    import threading

    from nbaccel.launch.kernel.ssh_backend import STOP_WAIT

    timer = threading.Timer(0.3, kernel.manager.interrupt_kernel)
    timer.start()
    started = time.monotonic()
    cell = kernel.run("notebook_launcher(time.sleep, (120,), num_processes=2, hosts='ray', dashboard=False)")
    took = time.monotonic() - started
    timer.join()
    assert cell.error is not None and cell.error[0] == "KeyboardInterrupt", (cell.error, cell.stderr)
    assert took < STOP_WAIT, took  # it never waits out the agents' stop time
    assert_nothing_left(ray_cluster)
    again = kernel.run("print('again', notebook_launcher(lambda: 7, num_processes=1, hosts='ray', dashboard=False))")
    assert "again [7, 7]" in again.stdout, (again.stdout, again.error)


def test_max_restarts_restarts_the_world(kernel, ray_cluster):
    cell = kernel.run("""
def fail_first_attempt():
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if os.environ["RANK"] == "2" and attempt == 0:
        raise ValueError("first attempt fails")
    return int(os.environ["RANK"]), attempt
print("restarted", notebook_launcher(fail_first_attempt, num_processes=2, hosts='ray', max_restarts=1,
                                     dashboard=False))
""", timeout=200)
    assert cell.error is None, cell.error
    assert "restarted [(0, 1), (1, 1), (2, 1), (3, 1)]" in cell.stdout, cell.stdout
    assert re.search(r"rank 2 on [^:]+: ValueError: first attempt fails; restarting every rank \(1 of max_restarts=1\)",
                     cell.stderr), cell.stderr
    assert_nothing_left(ray_cluster)


def test_rank_pool_and_ranks_cells(kernel, ray_cluster):
    cell = kernel.run("""
with RankPool(num_processes=1, hosts="ray", timeout=20) as pool:
    print("run", pool.run(lambda: (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))))
    print("exec", [r.value for r in pool.exec("import os\\nx = 40 + int(os.environ['RANK'])\\nx")])
""", timeout=200)
    assert cell.error is None, cell.error
    assert "run [(0, 2), (1, 2)]" in cell.stdout, cell.stdout
    assert "exec [40, 41]" in cell.stdout, cell.stdout
    assert_nothing_left(ray_cluster)
    try:
        for source, expected in (("%load_ext nbaccel", None), ("%ranks start -n 1 --hosts ray", "on "),
                                 ("%%ranks\nimport os\nprint('cell on', os.environ['RANK'])", "cell on 1")):
            cell = kernel.run(source, timeout=200)
            assert cell.error is None, (source, cell.error)
            if expected:
                assert expected in cell.stdout + cell.streams["display"], (source, cell.streams)
    finally:
        stopped = kernel.run("%ranks stop", timeout=60)
    assert stopped.error is None, stopped.error
    assert_nothing_left(ray_cluster)


def test_killed_kernel_leaves_nothing(ray_cluster, tmp_path):
    from ray_cluster import NamespaceKernel

    marker = tmp_path / "started"
    kernel = NamespaceKernel(ray_cluster, tmp_path / "kernel")
    SESSION_HELPERS.add(kernel.pid)
    try:
        kernel.client.execute(f"""
import os, time
from nbaccel import notebook_launcher
def sleep_long(marker):
    if os.environ["RANK"] == "3":
        open(marker, "w").close()
    time.sleep(300)
notebook_launcher(sleep_long, ({str(marker)!r},), num_processes=2, hosts='ray', dashboard=False)
""")
        deadline = time.monotonic() + 150
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert marker.exists(), "the ranks did not start"
        assert agents_and_ranks(ray_cluster)
        psutil.Process(kernel.pid).kill()
        assert_nothing_left(ray_cluster, within=60)
    finally:
        kernel.stop()
        SESSION_HELPERS.discard(kernel.pid)


@pytest.mark.timeout(400)
def test_notebook_10(ray_cluster, tmp_path, monkeypatch):
    """notebooks/10_ray_cluster.ipynb, top to bottom, in a kernel inside the cluster's namespace (nbclient,
    over the ipc transport)."""
    import nbformat
    from nbclient import NotebookClient
    from notebook_outputs import read_outputs
    from traitlets.config import Config

    nb = nbformat.read(ROOT / "notebooks" / "10_ray_cluster.ipynb", as_version=4)
    name = ray_cluster.kernel_spec(tmp_path)
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
    config = Config()
    config.KernelManager.transport = "ipc"
    config.KernelManager.ip = str(tmp_path / "k")
    NotebookClient(nb, kernel_name=name, timeout=300, startup_timeout=120, config=config,
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    run = read_outputs(nb, 0.0)
    assert "alive nodes: 2" in run.cell("ray.init(").text
    launch = run.cell('hosts="ray"')
    assert "world size: 2" in launch.text, launch.text
    epochs = re.findall(r"\[([^\]]+) rank 1\] epoch (\d+): accuracy [0-9.]+ on 397 test images", launch.text)
    assert [int(epoch) for _, epoch in epochs] == list(range(8)), launch.text
    assert "class='nbaccel-summary' data-state='finished'" in launch.html, launch.html
    final = run.cell('print("final accuracy:"')
    assert final.error is None and float(re.search(r"final accuracy: ([0-9.]+)", final.text).group(1)) > 0.85
    assert "left after the launch: [] []" in run.cell("left after the launch").text


# `import ray` held at ray._private.worker (ray/__init__ half run)
RAY_IMPORT_INTERRUPTED = """
from nbaccel.launch.kernel.hosts import import_ray
interrupted_then_again(import_ray, lambda: callable(import_ray().init))
"""


def test_an_interrupt_during_the_first_import_of_ray_leaves_it_whole(tmp_path):
    """Ctrl-C while a kernel's first hosts='ray' launch imports Ray (seconds on a busy machine): the launch stops
    and the next one works. The import ran in the kernel's main thread and, interrupted there, left a half-made
    `ray` module: every later launch failed with "partially initialized module 'ray'" until a restart."""
    done = run_interrupted_in_import("ray._private.worker", RAY_IMPORT_INTERRUPTED, tmp_path,
                                     env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.stdout.split() == ["interrupted", "again", "True"], (done.stdout, done.stderr[-3000:])


def test_without_ray_it_says_what_to_install(monkeypatch):
    import sys

    from nbaccel import notebook_launcher

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError, as without the extra
    with pytest.raises(ImportError, match=r"pip install nbaccel\[ray\]"):
        notebook_launcher(print, num_processes=1, hosts="ray", dashboard=False)


@pytest.mark.parametrize(("spec", "message"), [
    ({"nodes": 0}, "RayHosts\\(nodes=...\\) must be a positive number"),
    ({"gpus_per_rank": 2}, "must be 0, 1 or None"),
    ({"cpus_per_rank": -1}, "must be a number >= 0"),
])
def test_bad_ray_hosts_fail_before_anything_starts(spec, message):
    from nbaccel import notebook_launcher
    from nbaccel.launch import RayHosts

    with pytest.raises(ValueError, match=message):
        notebook_launcher(print, num_processes=1, hosts=RayHosts(**spec), dashboard=False)
