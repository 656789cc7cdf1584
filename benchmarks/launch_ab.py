"""Two checkouts of nbaccel, A and B, on benchmarks/launch.py's row: notebook_launcher of 2 ranks against the raw
fork floor (and Accelerate), interleaved.

Each round runs one fresh process per checkout (A, then B; the order alternates every round), importing that
checkout's benchmarks/launch.py (and so its nbaccel). Inside, `inner` launches of each variant run interleaved
(floor, nbaccel, accelerate, floor, ...), after one warm-up each; the process reports the medians. Reported: per
checkout, the median over rounds of nbaccel/floor and nbaccel/accelerate (ratios taken inside each process, so
machine load drifts hit the floor and nbaccel alike), and the median of A's ms / B's ms by round.
Run: python benchmarks/launch_ab.py A_ROOT B_ROOT [rounds] [inner]   (e.g. this worktree against main's)
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

CHILD = r"""
import json, statistics, sys, time
root, inner = sys.argv[1], int(sys.argv[2])
sys.path.insert(0, root + "/benchmarks")
import launch  # this checkout's benchmark: it puts its checkout first on sys.path

variants = {"floor": launch.run_floor, "nbaccel": launch.run_nbaccel}
try:
    import accelerate  # noqa: F401
    variants["accelerate"] = launch.run_accelerate
except ImportError:
    pass
for run in variants.values():
    run()
times = {name: [] for name in variants}
for _ in range(inner):
    for name, run in variants.items():
        start = time.perf_counter(); run(); times[name].append(time.perf_counter() - start)
print(json.dumps({name: statistics.median(values) for name, values in times.items()}))
"""


def measure(root: str, inner: int) -> dict[str, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NBACCEL_CONFIG_FILE": os.devnull + ".yaml"}
    env.pop("PYTHONPATH", None)
    done = subprocess.run([sys.executable, "-c", CHILD, os.path.abspath(root), str(inner)], env=env, check=True,
                          timeout=900, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    roots = {"A": sys.argv[1], "B": sys.argv[2]}
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 5
    inner = int(sys.argv[4]) if len(sys.argv) > 4 else 11
    results: dict[str, list[dict[str, float]]] = {"A": [], "B": []}
    load = [os.getloadavg()[0]]
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    for index in range(rounds):
        for label in ("AB" if index % 2 == 0 else "BA"):
            results[label].append(measure(roots[label], inner))
        load.append(os.getloadavg()[0])
    print(f"A = {roots['A']}\nB = {roots['B']}\n{started}, {rounds} rounds x {inner} interleaved launches per variant; "
          f"load average (1 min) {min(load):.1f}-{max(load):.1f}")
    for label in "AB":
        rows = results[label]
        floor = statistics.median(r["floor"] for r in rows) * 1000
        nbaccel = statistics.median(r["nbaccel"] for r in rows) * 1000
        line = (f"  {label}: floor {floor:6.1f} ms, nbaccel {nbaccel:6.1f} ms; nbaccel/floor "
                f"{statistics.median(r['nbaccel'] / r['floor'] for r in rows):.3f} "
                f"(rounds {min(r['nbaccel'] / r['floor'] for r in rows):.2f}-"
                f"{max(r['nbaccel'] / r['floor'] for r in rows):.2f})")
        if all("accelerate" in r for r in rows):
            line += f"; nbaccel/accelerate {statistics.median(r['nbaccel'] / r['accelerate'] for r in rows):.3f}"
        print(line)
    by_round = [a["nbaccel"] / b["nbaccel"] for a, b in zip(results["A"], results["B"])]
    print(f"  A/B nbaccel ms by round: median {statistics.median(by_round):.3f} "
          f"({min(by_round):.2f}-{max(by_round):.2f})")


if __name__ == "__main__":
    main()
