"""RankPool calls of two (or more) checkouts against the raw-pipe floors, trees alternated (issue 42).

    python benchmarks/pool_calls_ab.py [--calls 300] [--rounds 4] TREE [TREE ...]

Each round runs every tree once (in alternating order), each in a fresh process that imports that tree's
nbaccel (PYTHONPATH) and uses that tree's benchmarks/ranks.py floors. Inside one process the variants are
interleaved call by call in a shuffled order (as ranks.py does):
  floor fn (by reference)   2 forked processes, a pickled `partial(operator.pos, 2)` each way (ranks.py)
  run(module fn)            pool.run(operator.pos, 2)
  floor fn (cloudpickled)   the same processes, a function of a notebook cell cloudpickled by value
  run(cell fn)              pool.run of that function
  floor (raw pipes)         exec of "a = 1 + 1" sent as text
  exec (statement)          pool.exec("a = 1 + 1") (the %%ranks path)
Reported per tree: the median over rounds of each variant's median wall time and of the kernel's CPU time
per call (time.process_time around each call: this process only, the ranks' CPU not included), and the
median over rounds of the per-round ratios to the floors.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import functools, json, operator, os, random, statistics, sys, time
tree, calls = sys.argv[1], int(sys.argv[2])
sys.path.insert(0, os.path.join(tree, "benchmarks"))
import cloudpickle, ranks
from nbaccel.launch.pool import RankPool
floor, pool = ranks.Floor(), RankPool(2)
cell = ranks.notebook_function()
variants = {
    "floor fn (by reference)": lambda: floor.call(functools.partial(operator.pos, 2)),
    "run(module fn)": lambda: pool.run(operator.pos, 2),
    "floor fn (cloudpickled)": lambda: floor.call(cloudpickle.dumps((cell, (), {}))),
    "run(cell fn)": lambda: pool.run(cell),
    "floor (raw pipes)": floor.call,
    "exec (statement)": lambda: pool.exec("a = 1 + 1"),
}
walls = {name: [] for name in variants}
cpus = {name: [] for name in variants}
try:
    for call in variants.values():
        for _ in range(20):
            call()
    order = list(variants.items())
    wall, cpu = time.perf_counter, time.process_time
    for _ in range(calls):
        random.shuffle(order)
        for name, call in order:
            c, w = cpu(), wall()
            call()
            walls[name].append(wall() - w)
            cpus[name].append(cpu() - c)
finally:
    pool.shutdown()
    floor.close()
print(json.dumps({name: [statistics.median(walls[name]), statistics.fmean(cpus[name])] for name in variants}))
"""

RATIOS = (("run(module fn)", "floor fn (by reference)"), ("run(cell fn)", "floor fn (cloudpickled)"),
          ("exec (statement)", "floor (raw pipes)"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("trees", nargs="+")
    args = parser.parse_args()
    got: dict[str, list[dict[str, list[float]]]] = {tree: [] for tree in args.trees}
    loads = []
    for round_ in range(args.rounds):
        for tree in args.trees if round_ % 2 == 0 else args.trees[::-1]:
            env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "1"}
            done = subprocess.run([sys.executable, "-c", CHILD, tree, str(args.calls)], env=env, capture_output=True,
                                  text=True, timeout=900, cwd=tree)
            if done.returncode:
                sys.exit(done.stderr[-3000:])
            got[tree].append(json.loads(done.stdout.strip().splitlines()[-1]))
            loads.append(os.getloadavg()[0])
    print(f"{args.rounds} rounds x {args.calls} calls per variant, trees alternated; load average "
          f"{min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} CPUs")
    for tree, runs in got.items():
        print(tree)
        for name in runs[0]:
            wall = statistics.median(run[name][0] for run in runs) * 1e6
            cpu = statistics.median(run[name][1] for run in runs) * 1e6
            print(f"   {name:<26} wall {wall:7.1f} us   kernel CPU {cpu:6.1f} us")
        for name, floor in RATIOS:
            ratio = statistics.median(run[name][0] / run[floor][0] for run in runs)
            print(f"   {name + ' / ' + floor:<48} {ratio:5.2f}x")


if __name__ == "__main__":
    main()
