"""Two checkouts of nbaccel, A and B, through the three front doors, interleaved round by round (A B A B ...).

  launch      notebook_launcher(fn, num_processes=2) as in benchmarks/launch.py (PartialState, all_reduce,
              results back, dashboard "auto" with its output captured): ms per launch, in one kernel-like process
  pool.exec   RankPool(2).exec("a = 1 + 1") as in benchmarks/ranks.py: ms per call on running ranks, the calls
              right after the pool started (the ranks may still finish their own start meanwhile)
  pool.exec settled   the same calls 1 s after the pool started: the steady state of a notebook's later cells
  cli         `nbaccel launch --num_processes 2 --cpu script.py` (join, one all_reduce, exit) as in
              benchmarks/cli_launch.py: wall seconds of the whole command

Each round runs every variant once for A and once for B, each in a fresh process importing that checkout
(PYTHONPATH), so machine load drifts hit both alike; the ratio A/B is taken per round and its median reported.
Run: python benchmarks/front_doors_ab.py A_ROOT B_ROOT [rounds]   (e.g. this worktree against main's)
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cli_launch import SCRIPT  # benchmarks/cli_launch.py's script: the same `nbaccel launch` row

INNER = {"launch": 5, "pool.exec": 200, "pool.exec settled": 200}  # repetitions inside one process (median taken there)

CHILD = r"""
import contextlib, io, json, os, statistics, sys, time
what, inner = sys.argv[1], int(sys.argv[2])
settle = 1.0 if what.endswith("settled") else 0.0
import torch, torch.distributed as dist
if what == "launch":
    from nbaccel import notebook_launcher

    def worker():
        from nbaccel import PartialState

        PartialState()
        value = torch.ones(1)
        dist.all_reduce(value)
        return value.item()

    def once():
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            assert notebook_launcher(worker, num_processes=2) == [2.0, 2.0]
    once()  # warm-up: first-use costs
    times = []
    for _ in range(inner):
        start = time.perf_counter(); once(); times.append(time.perf_counter() - start)
else:
    from nbaccel import RankPool

    with RankPool(2, timeout=30) as pool:
        time.sleep(settle)
        for _ in range(20):
            pool.exec("a = 1 + 1")
        times = []
        for _ in range(inner):
            start = time.perf_counter(); pool.exec("a = 1 + 1"); times.append(time.perf_counter() - start)
print(json.dumps(statistics.median(times)))
"""



def measure(root: str, what: str, tmp: Path) -> float:
    """Seconds: the in-process median (launch, pool.exec) or the whole command's wall time (cli)."""
    env = {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1", "NBACCEL_CONFIG_FILE": str(tmp / "none.yaml")}
    if what == "cli":
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "nbaccel", "launch", "--num_processes", "2", "--cpu",
                        str(tmp / "allreduce.py")], env=env, cwd=tmp, check=True, timeout=300,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return time.perf_counter() - start
    done = subprocess.run([sys.executable, "-c", CHILD, what, str(INNER[what])], env=env, cwd=tmp, check=True,
                          timeout=600, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    root_a, root_b = sys.argv[1], sys.argv[2]
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 5
    whats = ("launch", "pool.exec", "pool.exec settled", "cli")
    times: dict[tuple[str, str], list[float]] = {(w, r): [] for w in whats for r in "AB"}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        (tmp / "allreduce.py").write_text(SCRIPT)
        for _ in range(rounds):
            for what in whats:
                for label, root in (("A", root_a), ("B", root_b)):
                    times[(what, label)].append(measure(root, what, tmp))
    print(f"A = {root_a}\nB = {root_b}\n{rounds} interleaved rounds; median (min-max)")
    for what in whats:
        a, b = times[(what, "A")], times[(what, "B")]
        ratio = statistics.median(x / y for x, y in zip(a, b))
        unit, scale = ("s", 1) if what == "cli" else ("ms", 1000)
        print(f"  {what:<17} A {statistics.median(a) * scale:8.2f} {unit} ({min(a) * scale:.2f}-{max(a) * scale:.2f})"
              f"   B {statistics.median(b) * scale:8.2f} {unit} ({min(b) * scale:.2f}-{max(b) * scale:.2f})"
              f"   A/B {ratio:.3f}")


if __name__ == "__main__":
    main()
