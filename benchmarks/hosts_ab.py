"""Two checkouts of nbaccel, A and B, launching on 2 hosts x 2 ranks over SSH, interleaved with torchrunx and
the floor.

The launch of benchmarks/hosts.py (`notebook_launcher(f, num_processes=2, hosts=[a, b])`, f joins the process
group and returns its rank; torchrunx's `Launcher(hostnames=[a, b], workers_per_host=2).run(f)`), on one
private sshd of 127.0.0.1 (tests/ssh_server.py), both hosts this machine. The floor is the least code that
gives the same result over SSH (benchmarks/hosts.py run_floor: per host one `ssh HOST python -c ...` at once,
which imports torch and forks 2 ranks that join the group through the first host's TCPStore and print their
ranks): how far a launch is from what the logins and torch's import allow. Each variant lives in a process of
its own that imports its checkout (as a kernel would, for many launches), warmed up by one launch; then every
round runs one launch of each variant, in an order shuffled per round, so load drifts hit all alike. The ratios
are taken per round; their medians are reported with the machine's load.

    python benchmarks/hosts_ab.py A_ROOT B_ROOT [rounds] [--no-torchrunx] [--no-floor] [--floor-nogc]
    (--floor-nogc: also the floor with torch imported without garbage collection, as nbaccel's agent does)
    (e.g. a checkout of main as A, this worktree as B)
"""

from __future__ import annotations

import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def child(kind: str, root: str) -> None:
    """Serve launches: one per line read from stdin, its wall time (s) written back as a JSON line."""
    import cloudpickle
    import hosts  # this folder's hosts.py (it puts its own checkout on sys.path: ours goes before it)

    sys.path.insert(0, root)
    for name in [name for name in sys.modules if name == "nbaccel" or name.startswith("nbaccel.")]:
        del sys.modules[name]
    cloudpickle.register_pickle_by_value(hosts)
    config = Path(os.environ["NBACCEL_SSH_CONFIG"])
    if kind == "torchrunx":
        hosts.force_torchrunx_over_ssh()
        run = lambda: hosts.run_torchrunx(config)  # noqa: E731
    elif kind == "floor":
        run = lambda: hosts.run_floor(config)  # noqa: E731
    elif kind == "floor-nogc":
        run = lambda: hosts.run_floor(config, program=hosts.FLOOR_PROGRAM_NO_GC)  # noqa: E731
    else:
        run = hosts.run_nbaccel
    import nbaccel

    assert str(Path(nbaccel.__file__).resolve()).startswith(str(Path(root).resolve())), nbaccel.__file__
    for _ in sys.stdin:
        start = time.perf_counter()
        result = run()
        took = time.perf_counter() - start
        assert sorted(result) == [0, 1, 2, 3], result
        print(json.dumps(took), flush=True)


def main() -> None:
    args = [arg for arg in sys.argv[1:] if not arg.startswith("--")]
    a_root, b_root = (str(Path(arg).resolve()) for arg in args[:2])
    rounds = int(args[2]) if len(args) > 2 else 5
    sys.path.insert(0, str(HERE))
    import hosts  # noqa: F401  (puts tests/ on sys.path)
    import ssh_server

    folder = Path(tempfile.mkdtemp(prefix="nbaccel-bench-hosts-ab-"))
    server = ssh_server.start_server(folder)
    variants = {"A": ("nbaccel", a_root), "B": ("nbaccel", b_root)}
    if "--no-torchrunx" not in sys.argv:
        variants["torchrunx"] = ("torchrunx", b_root)
    if "--no-floor" not in sys.argv:
        variants["floor"] = ("floor", b_root)
    if "--floor-nogc" in sys.argv:
        variants["floor-nogc"] = ("floor-nogc", b_root)
    children: dict[str, subprocess.Popen] = {}
    try:
        env = dict(os.environ, NBACCEL_SSH_CONFIG=str(hosts.bench_config(server)), TORCHRUNX_LOG_DIR="")
        for name, (kind, root) in variants.items():
            children[name] = subprocess.Popen([sys.executable, __file__, "--child", kind, root], env=env,
                                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

        def once(name: str) -> float:
            process = children[name]
            process.stdin.write("go\n")
            process.stdin.flush()
            line = process.stdout.readline()
            if not line:
                raise RuntimeError(f"variant {name} ended (exit code {process.wait()})")
            return json.loads(line)

        for name in children:
            once(name)  # warm-up: imports, page cache
        times: dict[str, list[float]] = {name: [] for name in children}
        loads = []
        for _ in range(rounds):
            order = list(children)
            random.shuffle(order)
            for name in order:
                times[name].append(once(name))
            loads.append(os.getloadavg()[0])
        print(f"2 hosts x 2 ranks over SSH (both hosts this machine), {rounds} interleaved rounds, load average "
              f"{min(loads):.1f}-{max(loads):.1f}; A = {a_root}, B = {b_root}")
        for name, values in times.items():
            print(f"  {name:10s} median {statistics.median(values):.2f} s  min {min(values):.2f} s  "
                  f"all {', '.join(f'{v:.2f}' for v in values)}")

        def ratios(top: str, bottom: str) -> str:
            by_medians = statistics.median(times[top]) / statistics.median(times[bottom])
            by_rounds = statistics.median(x / y for x, y in zip(times[top], times[bottom]))
            return f"{by_medians:.2f}x (medians), {by_rounds:.2f}x (median of the rounds' ratios)"

        print(f"  B / A: {ratios('B', 'A')}")
        for name in ("A", "B"):
            for anchor in ("torchrunx", "floor", "floor-nogc"):
                if anchor in times:
                    print(f"  {name} / {anchor}: {ratios(name, anchor)}")
        if "torchrunx" in times and "floor" in times:
            print(f"  torchrunx / floor: {ratios('torchrunx', 'floor')}")
    finally:
        for process in children.values():
            if process.poll() is None:
                process.stdin.close()
                try:
                    process.wait(30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)  # its keys and configs


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2], sys.argv[3])
    else:
        main()
