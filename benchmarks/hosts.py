"""Launch latency on 2 hosts x 2 ranks over SSH: nbaccel's `notebook_launcher(hosts=...)` against torchrunx's
`Launcher(hostnames=...).run`, interleaved, on the same sshd.

Both "hosts" are this machine: a private sshd on a free port of 127.0.0.1 with generated keys (the tests'
tests/ssh_server.py), reached under the names `localhost` and `nbaccel-bench-b` through a generated SSH config.
torchrunx never uses SSH for a name that resolves to this machine (it starts its agent with a local shell
instead); so that both tools pay for an SSH login per host, its launcher is told that these two names resolve
to a non-local documentation address (192.0.2.1) when it decides, and only then. Its agents and workers
resolve the names normally. Each run: the function returns its rank after joining the process group
(gloo); the time is the call's wall time in the caller.

    python benchmarks/hosts.py [rounds]
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

import ssh_server  # noqa: E402

NAMES = ("localhost", "nbaccel-bench-b")  # not IP literals: torchrunx never uses SSH for a loopback one


def bench_config(server: ssh_server.SshServer) -> Path:
    """The server's client config, with its two aliases renamed to NAMES."""
    text = server.config.read_text()
    for alias, name in zip(ssh_server.HOSTS, NAMES):
        text = text.replace(f"Host {alias}\n", f"Host {name}\n")
    path = server.folder / "bench_config"
    path.write_text(text)
    return path


def rank_of() -> int:
    import torch.distributed as dist

    if not dist.is_initialized():  # nbaccel: PartialState builds the group from the launcher's environment
        from nbaccel import PartialState

        return PartialState().process_index
    return dist.get_rank()


def run_nbaccel() -> list[int]:
    from nbaccel import notebook_launcher

    return notebook_launcher(rank_of, num_processes=2, hosts=list(NAMES), dashboard=False)


def run_torchrunx(config: Path) -> list[int]:
    import torchrunx

    result = torchrunx.Launcher(hostnames=list(NAMES), workers_per_host=2, backend="gloo",
                                ssh_config_file=str(config)).run(rank_of)
    return [result.rank(i) for i in range(4)]


# The floor's program on each host (`python -c`): import torch, fork 2 ranks that join the process group (gloo)
# through the TCPStore the first host's process opens once they are forked (a fork after the store's server
# thread started copies whatever lock that thread held: 1 launch in 6 hung), print their ranks, exit. Each rank
# waits for the store to listen first (torch's own client would back off 0.3-0.5 s). The barrier is what makes
# it correct, not extra: a rank that exits while another still builds gloo's mesh fails that one. Every process
# leaves with os._exit, as nbaccel's agent does.
FLOOR_PROGRAM = """
import os, socket, sys, time
import torch.distributed as dist
node, address, port = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # both hosts are this machine (nbaccel sets the same)
children = []
for local in range(2):
    pid = os.fork()
    if pid == 0:
        while socket.socket().connect_ex((address, port)):
            time.sleep(0.002)
        dist.init_process_group("gloo", store=dist.TCPStore(address, port, is_master=False),
                                rank=2 * node + local, world_size=4)
        dist.barrier()
        os.write(1, f"{dist.get_rank()}\\n".encode())  # one write: whole lines
        os._exit(0)
    children.append(pid)
if node == 0:
    store = dist.TCPStore(address, port, is_master=True, wait_for_workers=False)
os._exit(max(os.waitpid(pid, 0)[1] for pid in children) and 1)  # not unwinding torch's modules: ~0.3 s
"""

# The same with torch's import run without garbage collection, as nbaccel's agent imports (agent/__main__.py):
# ~0.12 s less on this VM. Not what a user's least code does; what the machine allows.
FLOOR_PROGRAM_NO_GC = "import gc\ngc.disable()\n" + FLOOR_PROGRAM


def run_floor(config: Path, python: str = sys.executable, program: str = FLOOR_PROGRAM) -> list[int]:
    """The least code that gives the same result over SSH: per host one `ssh HOST python -c FLOOR_PROGRAM`,
    all at once; the ranks come back on stdout; wait for both sessions. (`python`, `program`: the timeline's
    stamping wrapper and program, benchmarks/hosts_timeline.py.)"""
    import shlex
    import subprocess

    from nbaccel.utils.other import get_free_port

    port = get_free_port("127.0.0.1")  # the first host's store port, picked as nbaccel's kernel picks one
    sessions = [subprocess.Popen(["ssh", "-F", str(config), "-T", "-o", "BatchMode=yes", "--", name,
                                  shlex.join([python, "-c", program, str(node), "127.0.0.1", str(port)])],
                                 stdout=subprocess.PIPE, text=True)
                for node, name in enumerate(NAMES)]
    ranks = []
    for session in sessions:
        try:
            out, _ = session.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for each in sessions:
                each.kill()
            raise
        assert session.returncode == 0, f"the floor's session ended with {session.returncode}"
        ranks += [int(line) for line in out.split()]
    return ranks


def force_torchrunx_over_ssh() -> None:
    """torchrunx's launcher decides "this machine: no SSH" by resolving the host name; make that one decision
    see a remote address, so it logs in over SSH as it would to another machine."""
    import socket

    from torchrunx.utils import environment

    fake = types.SimpleNamespace(**{name: getattr(socket, name) for name in dir(socket) if not name.startswith("__")})
    fake.gethostbyname = lambda name: "192.0.2.1" if name in NAMES else socket.gethostbyname(name)
    environment.socket = fake


def main(rounds: int = 5) -> None:
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    os.environ.setdefault("TORCHRUNX_LOG_DIR", "")  # no log files in the working folder (nbaccel writes none either)
    folder = Path(tempfile.mkdtemp(prefix="nbaccel-bench-sshd-"))
    server = ssh_server.start_server(folder)
    try:
        config = bench_config(server)
        os.environ["NBACCEL_SSH_CONFIG"] = str(config)
        force_torchrunx_over_ssh()
        assert sorted(run_nbaccel()) == [0, 1, 2, 3]  # warm-up of each (imports, page cache)
        assert sorted(run_torchrunx(config)) == [0, 1, 2, 3]
        times: dict[str, list[float]] = {"nbaccel": [], "torchrunx": []}
        for _ in range(rounds):
            for name, run in (("nbaccel", run_nbaccel), ("torchrunx", lambda: run_torchrunx(config))):
                start = time.perf_counter()
                assert sorted(run()) == [0, 1, 2, 3]
                times[name].append(time.perf_counter() - start)
        load = os.getloadavg()[0]
        print(f"2 hosts x 2 ranks over SSH (both hosts this machine), {rounds} interleaved rounds, "
              f"load average {load:.1f}")
        for name, values in times.items():
            print(f"  {name:9s} median {statistics.median(values):.2f} s  min {min(values):.2f} s  "
                  f"all {', '.join(f'{v:.2f}' for v in values)}")
        ratio = statistics.median(times["nbaccel"]) / statistics.median(times["torchrunx"])
        paired = statistics.median(a / b for a, b in zip(times["nbaccel"], times["torchrunx"]))
        print(f"  nbaccel / torchrunx: {ratio:.2f}x (medians), {paired:.2f}x (median of the rounds' ratios)")
    finally:
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)  # its keys and configs


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
