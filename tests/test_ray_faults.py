"""hosts="ray" when the cluster misbehaves, for real (tests/ray_cluster.py's two nodes, plus a third node of
this file's own at 127.0.0.3, the one it loses): a node lost while its ranks wait in a collective, a launch
right after that loss, more than a node can ever hold, nodes held by other work, and the user's own
`ray.init` (kept, in its own namespace; local_mode refused). After each, nothing of the launch is left.

The third node has an address of its own so that the kernel's Ray driver never attaches to its raylet (Ray
attaches a driver to a raylet of its own address; two nodes at 127.0.0.1 are a coin toss): losing it loses
the launch's ranks there, never the kernel's connection."""

from __future__ import annotations

import json
import re
import signal
import time

import psutil
import pytest
from process_helpers import SESSION_HELPERS, kill_and_reap
from test_ray_launch import agents_and_ranks, assert_nothing_left

pytestmark = [pytest.mark.kernel, pytest.mark.slow, pytest.mark.timeout(300)]

THIRD_RESOURCE = "nbaccel_node_c"
THIRD_ADDRESS = "127.0.0.3"

SETUP = """
import os, time, threading
from pathlib import Path
import ray
from nbaccel import notebook_launcher, LaunchError
from nbaccel.launch import RayHosts
from nbaccel.launch.kernel import ray_backend
from nbaccel.launch.kernel.hosts import HostError
ray.init(address="auto", namespace="mine", logging_level="ERROR", log_to_driver=False)  # the user's own

def node_id(resource):
    return next(n["NodeID"] for n in ray.nodes() if n["Alive"] and resource in n["Resources"])
"""

WAIT_DEAD = """
import time, ray
ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
deadline = time.monotonic() + 60
while any(n["Alive"] and "{resource}" in n["Resources"] for n in ray.nodes()):
    assert time.monotonic() < deadline, "Ray still lists the lost node as alive"
    time.sleep(0.2)
"""


def _raylet_of(cluster, resource: str) -> psutil.Process:
    return next(proc for proc in cluster.processes()
                if proc.name() == "raylet" and resource in " ".join(proc.cmdline()))


@pytest.fixture(scope="module")
def third_node(ray_cluster):
    """A third node (127.0.0.3, custom resource nbaccel_node_c) in the session's cluster, for this file only:
    stopped (by pid) and known dead to Ray before the file ends, so the other files see their two nodes."""
    import ray_cluster as cluster_module

    before = {proc.pid for proc in ray_cluster.processes()}
    # `ray start --node-ip-address` caches its address in the session's folder, where every driver started
    # later on this machine takes it for its own: put the first nodes' address back
    cached = {path: path.read_text() for path in ray_cluster.folder.glob("ray*/session_*/node_ip_address.json")}
    pid = cluster_module._node(ray_cluster, 52600, "third", f"--address={ray_cluster.address}",
                               f"--node-ip-address={THIRD_ADDRESS}",
                               f"--resources={json.dumps({THIRD_RESOURCE: 1})}",
                               "--min-worker-port=30000", "--max-worker-port=39999")
    ray_cluster.nodes.remove(pid)  # the session's stop would SIGTERM it too; it is this file's
    for path, text in cached.items():
        path.write_text(text)
    try:
        yield pid
    finally:
        try:
            psutil.Process(pid).send_signal(signal.SIGTERM)  # its node's daemons stop; Ray marks it dead
            psutil.Process(pid).wait(20)
        except psutil.Error:
            pass
        kill_and_reap([proc for proc in ray_cluster.processes() if proc.pid not in before
                       and _of_third_node(proc)])
        ray_cluster.python(WAIT_DEAD.replace("{resource}", THIRD_RESOURCE))


def _of_third_node(proc: psutil.Process) -> bool:
    try:
        line = " ".join(proc.cmdline())
        return THIRD_RESOURCE in line or "=5260" in line or any(
            parent.name() == "raylet" and THIRD_RESOURCE in " ".join(parent.cmdline()) for parent in proc.parents())
    except psutil.Error:
        return False


@pytest.fixture(scope="module")
def kernel(ray_cluster, third_node, tmp_path_factory):
    from ray_cluster import NamespaceKernel

    kernel = NamespaceKernel(ray_cluster, tmp_path_factory.mktemp("ray-faults-kernel"))
    SESSION_HELPERS.add(kernel.pid)
    try:
        setup = kernel.run(SETUP)
        assert setup.error is None, setup.error
        yield kernel
        kept = kernel.run("print('kept', ray.is_initialized(), ray.get_runtime_context().namespace, "
                          "ray.get(ray.remote(lambda: 5).remote(), timeout=60))")
        assert "kept True mine 5" in kept.stdout, (kept.stdout, kept.error)  # the user's connection, untouched
    finally:
        kernel.stop()
        SESSION_HELPERS.discard(kernel.pid)


def test_more_than_a_node_can_ever_hold_fails_at_once(kernel, ray_cluster):
    """Ray keeps a placement group it can never place pending for ever: the launch waited out its 60 s, then
    blamed 'other work'. Now it compares with each node's total before it reserves anything."""
    cell = kernel.run("""
for hosts, n in (("ray", 5), (RayHosts(resources={"nbaccel_node_b": 2}), 1)):
    try:
        notebook_launcher(print, num_processes=n, hosts=hosts, dashboard=False)
    except HostError as exc:
        print("refused:", exc)
""")
    assert cell.error is None, cell.error
    refused = [line for line in cell.stdout.splitlines() if line.startswith("refused:")]
    assert len(refused) == 2, cell.stdout
    assert "has {'CPU': 4.0} in all" in refused[0] and "Ray can never place them" in refused[0], refused[0]
    assert "Pass num_processes=4 or fewer" in refused[0], refused[0]
    assert "'nbaccel_node_b': 1.0} in all" in refused[1] and "Ask less of each rank" in refused[1], refused[1]
    assert_nothing_left(ray_cluster)


def test_nodes_held_by_other_work_wait_with_a_notice_and_a_bound(kernel, ray_cluster):
    """Other work holds the third node's CPUs: the launch waits (Ray's way), says so once with its bound, and
    gives up at NBACCEL_RAY_PLACE_TIMEOUT; once the work lets go, a waiting launch runs."""
    cell = kernel.run("""
holder = ray.util.placement_group([{"CPU": 4}], bundle_label_selector=[{"ray.io/node-id": node_id("nbaccel_node_c")}])
assert holder.wait(30)
only_c = RayHosts(resources={"nbaccel_node_c": 0.1})
ray_backend.PLACE_TIMEOUT = 3
try:
    notebook_launcher(print, num_processes=1, hosts=only_c, dashboard=False)
except HostError as exc:
    print("gave up:", exc)
ray_backend.PLACE_TIMEOUT = 120
threading.Timer(3, ray.util.remove_placement_group, (holder,)).start()
print("then", notebook_launcher(lambda: 7, num_processes=1, hosts=only_c, dashboard=False))
""")
    assert cell.error is None, cell.error
    assert "could not reserve {'CPU': 1, 'nbaccel_node_c': 0.1} on each of ['127.0.0.3'] within 3 s" in cell.stdout, \
        cell.stdout
    assert "waiting for Ray to free {'CPU': 1, 'nbaccel_node_c': 0.1} on each of ['127.0.0.3']" in cell.stderr, \
        cell.stderr
    assert "then [7]" in cell.stdout, cell.stdout
    assert_nothing_left(ray_cluster)


def test_local_mode_is_refused_and_kept(ray_cluster):
    """The user's ray.init(local_mode=True) runs actors in the kernel's own process: refused before anything
    starts (it ended as 'the agent ... ended before it answered (exit code 255): no output'), and the user's
    connection still works."""
    out = ray_cluster.python("""
import ray
ray.init(local_mode=True, logging_level="ERROR", log_to_driver=False)
from nbaccel import notebook_launcher
try:
    notebook_launcher(print, num_processes=1, hosts="ray", dashboard=False)
except Exception as exc:
    print("refused:", type(exc).__name__, exc)
print("kept", ray.is_initialized(), ray.get(ray.remote(lambda: 5).remote()))
""")
    assert "refused: HostError hosts='ray' cannot run under ray.init(local_mode=True)" in out, out
    assert "kept True 5" in out, out


def test_a_node_lost_in_a_collective_is_named_and_the_next_launch_runs(kernel, ray_cluster, tmp_path):
    """SIGKILL of the third node's raylet while every rank loops in all_reduce. The others' gloo errors
    ('Connection reset by peer') reached the kernel first and stopped the launch before the node's loss was
    seen: the error named rank 0's gloo error and not the node. Now the node's loss comes first. A launch
    right after (Ray still lists the node alive for its health check's ~15 s) ended after its 60 s wait with
    'other work may hold them'; now it ends when Ray marks the node dead, naming it; the next one runs on the
    two nodes left."""
    marker = tmp_path / "in-collective"
    raylet = _raylet_of(ray_cluster, THIRD_RESOURCE)
    kernel.client.execute(f"""
def train(marker):
    import torch, torch.distributed as dist
    from nbaccel import PartialState
    state = PartialState()
    for step in range(100000):
        dist.all_reduce(torch.ones(100))
        if step == 20 and os.environ["NBACCEL_LAUNCH_HOST"] == "127.0.0.3":
            open(marker, "w").close()
        time.sleep(0.01)
try:
    notebook_launcher(train, ({str(marker)!r},), num_processes=1, hosts="ray", dashboard=False)
except LaunchError as exc:
    print("failed:", exc)
try:
    print("right after", notebook_launcher(lambda: 7, num_processes=1, hosts="ray", dashboard=False))
except HostError as exc:
    print("right after:", exc)
""")
    deadline = time.monotonic() + 120
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert marker.exists(), "the ranks did not start"
    raylet.kill()
    reply = kernel.client.get_shell_msg(timeout=200)
    assert reply["content"]["status"] == "ok", reply["content"]
    out = _stdout_since(kernel, reply)
    failed = next(line for line in out.splitlines() if line.startswith("failed:"))
    assert re.search(r"first: rank \d on 127\.0\.0\.3: HostLost: node '127\.0\.0\.3' lost: the Ray actor of its "
                     r"agent died \(", failed), out
    after = next(line for line in out.splitlines() if line.startswith("right after"))
    # Ray marks the node dead ~15 s after its raylet died; the launch right after either waited for that and
    # names the node, or (a slow first failure) began once Ray knew, on the nodes left
    assert after == "right after [7, 7]" or "node(s) ['127.0.0.3'] left the Ray cluster" in after, out
    ray_cluster.python(WAIT_DEAD.replace("{resource}", THIRD_RESOURCE))
    again = kernel.run("print('again', notebook_launcher(lambda: 7, num_processes=1, hosts='ray', dashboard=False))")
    assert "again [7, 7]" in again.stdout, (again.stdout, again.error)
    assert not agents_and_ranks(ray_cluster)
    assert_nothing_left(ray_cluster)


def _stdout_since(kernel, reply: dict) -> str:
    """What the cell that `reply` answers printed on stdout (its iopub messages up to its idle status)."""
    parent = reply["parent_header"]["msg_id"]
    out = ""
    while True:
        message = kernel.client.get_iopub_msg(timeout=30)
        if message["parent_header"].get("msg_id") != parent:
            continue
        if message["msg_type"] == "stream" and message["content"]["name"] == "stdout":
            out += message["content"]["text"]
        if message["msg_type"] == "status" and message["content"]["execution_state"] == "idle":
            return out
