"""A real local Ray cluster of two nodes for the tests of `hosts="ray"`, in a private network namespace.

Outside a namespace `ray start` advertises the machine's outward address even when given
`--node-ip-address 127.0.0.1`, and its daemons bind every interface. So the fixture makes a network namespace
with only loopback (`unshare --net`, `ip link set lo up`; held by a `sleep` process) and starts everything of
the cluster inside it (`nsenter --net`): the head node (`ray start --head --block`), a second node
(`ray start --address ... --block`, with its own custom resource `nbaccel_node_b` and its own ports), and the
test's Jupyter kernel, which talks to the test over Unix sockets (jupyter_client's ipc transport), since the
namespace has no other way out. Nothing of it can be reached from beyond the machine.

The nodes are started detached (not children of the test process: Ray's workers come and go, they are the
cluster's, not a test's) and stopped by pid, never by `ray stop` (which stops every Ray cluster of the user):
SIGTERM to each `ray start --block`, which stops its node's daemons, then SIGKILL to any process still in the
namespace, then the namespace's holder.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from process_helpers import kill_and_reap

ROOT = Path(__file__).resolve().parent.parent
RAY = Path(sys.executable).with_name("ray")
GCS_PORT = 6379  # inside the private namespace: no other cluster on this machine shares its ports
SECOND_NODE_RESOURCE = "nbaccel_node_b"
CPUS_PER_NODE = 4  # logical CPUs: 2 ranks per node and Ray Train's coordinator fit on a 2-core machine
STARTUP_NICENESS = -10  # a raylet gives its agents little time to come up on a busy machine; reset once up


def missing_reason() -> str | None:
    """Why no cluster can run here, or None."""
    try:
        import ray  # noqa: F401
    except ImportError:
        return "ray is not installed (pip install nbaccel[ray]; ./run.sh installs it with the dev extra)"
    for tool in ("unshare", "nsenter", "ip", "setsid"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (apt-get install util-linux iproute2)"
    if os.geteuid() != 0:
        return "a private network namespace needs root (CI runs as root)"
    return None


def _netns(pid: int) -> int:
    return os.stat(f"/proc/{pid}/ns/net").st_ino


@dataclass
class RayCluster:
    holder: int  # the pid of the `sleep` holding the namespace open
    folder: Path
    nodes: list[int] = field(default_factory=list)  # the pids of `ray start --block`: head, second node
    address: str = f"127.0.0.1:{GCS_PORT}"

    def inside(self, command: list[str]) -> list[str]:
        """`command`, run in the cluster's network namespace."""
        return ["nsenter", f"--target={self.holder}", "--net", "--", *command]

    def environ(self) -> dict[str, str]:
        """The environment of the cluster's processes and of the test's kernel: this checkout importable,
        the cluster's address, no usage reports."""
        path = os.pathsep.join(dict.fromkeys(filter(None, [str(ROOT), *os.environ.get("PYTHONPATH", "").split(os.pathsep)])))
        return dict(os.environ, PYTHONPATH=path, RAY_ADDRESS=self.address, RAY_USAGE_STATS_ENABLED="0",
                    OMP_NUM_THREADS="1")

    def python(self, code: str, timeout: float = 120) -> str:
        """Run Python code in the namespace (with this venv), return its stdout; RuntimeError if it fails."""
        done = subprocess.run(self.inside([sys.executable, "-c", code]), env=self.environ(), capture_output=True,
                              text=True, timeout=timeout)
        if done.returncode:
            raise RuntimeError(f"python in the cluster's namespace failed: {done.stderr[-3000:]}")
        return done.stdout

    def state(self) -> dict[str, list]:
        """What the cluster's GCS lists as alive: named actors (nbaccel names its agents' actors), placement
        groups not removed; asked by a driver of its own (the caller's kernel may be gone). The dashboard,
        which `ray.util.state` needs, is left out: its start times out on a busy 2-core machine."""
        return json.loads(self.python(STATE_SCRIPT).strip().splitlines()[-1])

    def processes(self) -> list[psutil.Process]:
        """Every process in the cluster's namespace but its holder."""
        ns = _netns(self.holder)
        found = []
        for proc in psutil.process_iter():
            try:
                if proc.pid != self.holder and _netns(proc.pid) == ns:
                    found.append(proc)
            except (OSError, psutil.Error):
                pass
        return found

    def kernel_spec(self, folder: Path) -> str:
        """A kernelspec (in `folder`) whose kernel runs in the namespace; its name."""
        spec = folder / "kernels" / "nbaccel-ray"
        spec.mkdir(parents=True, exist_ok=True)
        env = {key: value for key, value in self.environ().items()
               if key in ("PYTHONPATH", "RAY_ADDRESS", "RAY_USAGE_STATS_ENABLED", "OMP_NUM_THREADS")}
        (spec / "kernel.json").write_text(json.dumps({
            "argv": self.inside([sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]),
            "display_name": "nbaccel on Ray", "language": "python", "env": env, "interrupt_mode": "signal"}))
        return "nbaccel-ray"

    def stop(self) -> None:
        """Stop both nodes by pid, then anything left in the namespace, then the namespace."""
        self.stop_nodes()
        _kill(self.holder)

    def stop_nodes(self) -> None:
        """SIGTERM to each `ray start --block` (it stops its node's daemons), then SIGKILL to what is left in
        the namespace."""
        nodes = []
        for pid in reversed(self.nodes):
            try:
                nodes.append(psutil.Process(pid))
                nodes[-1].send_signal(signal.SIGTERM)
            except psutil.Error:
                pass
        _, alive = psutil.wait_procs(nodes, timeout=20)
        kill_and_reap(alive + self.processes())
        self.nodes.clear()


def _kill(pid: int) -> None:
    try:
        process = psutil.Process(pid)
        process.kill()
        process.wait(10)
    except psutil.Error:
        pass


STATE_SCRIPT = """
import json, ray
ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
actors = [entry["name"] for entry in ray.util.list_named_actors(all_namespaces=True)]
groups = [key for key, group in ray.util.placement_group_table().items() if group["state"] != "REMOVED"]
print(json.dumps({"actors": actors, "placement_groups": groups}))
"""

WAIT_NODES_SCRIPT = """
import time, ray
ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
deadline = time.monotonic() + 60
while sum(node["Alive"] for node in ray.nodes()) < 2:
    assert time.monotonic() < deadline, ray.nodes()
    time.sleep(0.2)
"""


def detached(command: list[str], log: Path, env: dict[str, str] | None = None) -> int:
    """Start `command` in the background in a session of its own, not as a child of this process; its pid."""
    done = subprocess.run(["sh", "-c", 'setsid "$@" >"$0" 2>&1 </dev/null & echo $!', str(log), *command],
                          env=env, capture_output=True, text=True, check=True)
    return int(done.stdout.strip())


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _wait_for_line(log: Path, pid: int, needle: str, timeout: float, what: str) -> None:
    """Read the node's log until `needle`; RuntimeError with what it said when it ends or times out."""
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace") if log.exists() else ""
        if needle in text or not _running(pid):
            break
        time.sleep(0.2)
    if needle not in text:
        said = [line for line in text.splitlines() if "determine local IP" not in line][-30:]
        raise RuntimeError(f"{what} did not start: " + "\n".join(said))


def _node(cluster: RayCluster, first_port: int, name: str, *options: str) -> int:
    """`ray start --block` of one node in the namespace, its agents' ports given (from `first_port` on); the
    pid, once Ray says it started."""
    ports = {"--dashboard-agent-listen-port": first_port, "--dashboard-agent-grpc-port": first_port + 1,
             "--runtime-env-agent-port": first_port + 2, "--metrics-export-port": first_port + 3,
             "--node-manager-port": first_port + 4, "--object-manager-port": first_port + 5}
    command = [str(RAY), "start", "--block", "--node-ip-address=127.0.0.1", f"--num-cpus={CPUS_PER_NODE}",
               "--num-gpus=0", "--disable-usage-stats", *(f"{option}={port}" for option, port in ports.items()),
               *options]
    log = cluster.folder / f"{name}-{len(cluster.nodes)}.log"
    pid = detached(cluster.inside(["nice", f"-n{STARTUP_NICENESS}", *command]), log, cluster.environ())
    cluster.nodes.append(pid)
    _wait_for_line(log, pid, "Ray runtime started", 120, f"the {name} node")
    return pid


def start_cluster(folder: Path, attempts: int = 3) -> RayCluster:
    """The namespace, the head node and the second node; RuntimeError (everything stopped) otherwise. A
    start that fails on a busy machine is tried again, up to `attempts` times."""
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / "namespace.log"
    holder = detached(["unshare", "--net", "--", "sh", "-c", "ip link set lo up && echo up && exec sleep 86400"],
                      log)
    cluster = RayCluster(holder, folder)
    deadline = time.monotonic() + 10
    while "up" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        if "up" not in log.read_text():
            raise RuntimeError(f"no private network namespace: {log.read_text()}")
        for attempt in range(1, attempts + 1):
            try:
                _start_nodes(cluster, folder / f"ray{attempt}")
                return cluster
            except RuntimeError:
                cluster.stop_nodes()
                if attempt == attempts:
                    raise
    except BaseException:
        cluster.stop()
        raise
    raise AssertionError("unreachable")


def _start_nodes(cluster: RayCluster, temp_dir: Path) -> None:
    _node(cluster, 52400, "head", "--head", f"--port={GCS_PORT}", f"--temp-dir={temp_dir}",
          "--include-dashboard=false")
    _node(cluster, 52500, "second", f"--address={cluster.address}",
          f"--resources={json.dumps({SECOND_NODE_RESOURCE: 1})}", "--min-worker-port=20000",
          "--max-worker-port=29999")
    cluster.python(WAIT_NODES_SCRIPT)
    for proc in cluster.processes():
        try:
            proc.nice(0)
        except psutil.Error:
            pass


class NamespaceKernel:
    """A real Jupyter kernel (ipykernel) inside the cluster's namespace, driven over jupyter_client's ipc
    transport (Unix sockets in `folder`: the namespace has no other way out). `run(code)` executes a cell."""

    def __init__(self, cluster: RayCluster, folder: Path) -> None:
        from jupyter_client import KernelManager
        from jupyter_client.kernelspec import KernelSpecManager

        folder.mkdir(parents=True, exist_ok=True)
        name = cluster.kernel_spec(folder)
        specs = KernelSpecManager(kernel_dirs=[str(folder / "kernels")])
        self.manager = KernelManager(kernel_name=name, kernel_spec_manager=specs, transport="ipc",
                                     ip=str(folder / "k"), connection_file=str(folder / "connection.json"))
        self.manager.start_kernel(cwd=str(folder))
        self.client = self.manager.blocking_client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=120)
        self.pid: int = self.manager.provisioner.process.pid  # type: ignore[union-attr]

    def run(self, code: str, timeout: float = 120) -> Cell:
        """Execute `code` as a cell: what it printed (stdout, stderr), its error (ename, evalue) or None."""
        cell = Cell()

        def hook(message: dict) -> None:
            kind, content = message["msg_type"], message["content"]
            if kind == "stream":
                cell.streams[content["name"]] += content["text"]
            elif kind in ("display_data", "execute_result", "update_display_data"):
                cell.streams["display"] += content["data"].get("text/plain", "") + content["data"].get("text/html", "")
            elif kind == "error":
                cell.error = (content["ename"], content["evalue"], "\n".join(content["traceback"]))

        self.client.execute_interactive(code, timeout=timeout, output_hook=hook, allow_stdin=False)
        return cell

    def stop(self) -> None:
        self.client.stop_channels()
        if self.manager.has_kernel:
            self.manager.shutdown_kernel(now=True)


@dataclass
class Cell:
    streams: dict[str, str] = field(default_factory=lambda: {"stdout": "", "stderr": "", "display": ""})
    error: tuple[str, str, str] | None = None

    @property
    def stdout(self) -> str:
        return self.streams["stdout"]

    @property
    def stderr(self) -> str:
        return self.streams["stderr"]
