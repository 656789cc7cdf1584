"""Persistent ranks: start-up, and latency of a trivial statement / function on 2 ranks, both results back.

Start (interleaved round by round): RankPool(2) until both ranks are ready for a cell (process group and
PartialState built) against the floor: fork 2 raw processes and get one answer from each through a pipe.

Calls, interleaved call by call in one run:
  floor        2 forked processes that exec() what a raw multiprocessing pipe brings and send back the value
  floor fn     the same processes called with a function (pickled by reference) instead of source
  nbaccel      RankPool(2).exec("a = 1 + 1") (the %%ranks path: output capture, per-rank namespaces, hang
               watch) and .exec("1 + 1") (also returns and pickles the value of the last expression)
  ipyparallel  view.execute("a = 1 + 1", block=True) on a local 2-engine cluster: what `%px` does (when
               ipyparallel is installed)
Goals: nbaccel median <= ipyparallel's and < 10 ms.
Run: python benchmarks/ranks.py [calls]
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("OMP_NUM_THREADS", "1")

from nbaccel.launch.pool import RankPool  # noqa: E402

STATEMENT = "a = 1 + 1"


def _floor_worker(conn) -> None:
    namespace: dict = {}
    while True:
        source = conn.recv()
        if source is None:
            return
        if callable(source):
            conn.send(source())
            continue
        exec(source, namespace)
        conn.send(namespace.get("a"))


def trivial() -> int:
    return 2


class Floor:
    """The least any kernel<->rank round trip can cost here: one pipe message each way per rank."""

    def __init__(self) -> None:
        ctx = mp.get_context("fork")
        self.conns, self.procs = [], []
        for _ in range(2):
            kernel, worker = ctx.Pipe()
            proc = ctx.Process(target=_floor_worker, args=(worker,), daemon=True)
            proc.start()
            self.conns.append(kernel)
            self.procs.append(proc)

    def call(self, what: object = STATEMENT) -> list:
        for conn in self.conns:
            conn.send(what)
        return [conn.recv() for conn in self.conns]

    def close(self) -> None:
        for conn in self.conns:
            conn.send(None)
        for proc in self.procs:
            proc.join(5)


def start_ipyparallel():
    try:
        import ipyparallel as ipp
    except ImportError:
        return None, None
    cluster = ipp.Cluster(n=2, log_level=40)
    client = cluster.start_and_connect_sync()
    client.wait_for_engines(2, timeout=120)
    view = client[:]
    view.block = True
    return cluster, view


def timed(call, samples: list[float]) -> None:
    start = time.perf_counter()
    call()
    samples.append((time.perf_counter() - start) * 1000)


def describe(name: str, samples: list[float]) -> str:
    ordered = sorted(samples)
    p90 = ordered[int(len(ordered) * 0.9) - 1]
    return f"{name:<28} median {statistics.median(samples):7.2f} ms   p90 {p90:7.2f} ms   min {ordered[0]:6.2f} ms"


def start_floor() -> None:
    floor = Floor()
    floor.call()
    floor.close()


def start_pool() -> None:
    pool = RankPool(2)
    pool.shutdown()


def measure_start(rounds: int) -> None:
    samples: dict[str, list[float]] = {"start floor (raw fork)": [], "start RankPool(2)": []}
    for _ in range(rounds):
        timed(start_floor, samples["start floor (raw fork)"])
        timed(start_pool, samples["start RankPool(2)"])
    for name, values in samples.items():
        print(describe(name, values))
    pool_ms = statistics.median(samples["start RankPool(2)"])
    print(f"RankPool start: {pool_ms / 1000:.2f} s median (goal <= 0.5 s), "
          f"{pool_ms / statistics.median(samples['start floor (raw fork)']):.0f}x the raw fork")


def main() -> None:
    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    measure_start(int(os.environ.get("RANKS_START_ROUNDS", "5")))
    floor = Floor()
    pool = RankPool(2)
    cluster, view = start_ipyparallel()
    variants = {
        "floor (raw pipes)": floor.call,
        "nbaccel exec (statement)": lambda: pool.exec(STATEMENT),
        "nbaccel exec (value back)": lambda: pool.exec("1 + 1").values,
        "floor fn (raw pipes)": lambda: floor.call(trivial),
        "nbaccel run(fn)": lambda: pool.run(trivial),
    }
    if view is not None:
        variants["ipyparallel execute (%px)"] = lambda: view.execute(STATEMENT, block=True)
    samples: dict[str, list[float]] = {name: [] for name in variants}
    try:
        for call in variants.values():  # warm up each path once
            call()
        assert pool.exec("1 + 1").values == [2, 2]
        for _ in range(calls):
            for name, call in variants.items():
                timed(call, samples[name])
    finally:
        pool.shutdown()
        floor.close()
        if cluster is not None:
            cluster.stop_cluster_sync()
    print(f"{calls} calls per variant, 2 ranks, interleaved")
    for name, values in samples.items():
        print(describe(name, values))
    nb = statistics.median(samples["nbaccel exec (statement)"])
    print(f"nbaccel exec / floor:   {nb / statistics.median(samples['floor (raw pipes)']):.2f}x (median; goal <= 1.3x)")
    run_ratio = statistics.median(samples["nbaccel run(fn)"]) / statistics.median(samples["floor fn (raw pipes)"])
    print(f"nbaccel run / floor fn: {run_ratio:.2f}x (median; goal <= 1.5x)")
    if view is not None:
        ipp_median = statistics.median(samples["ipyparallel execute (%px)"])
        print(f"nbaccel / ipyparallel:  {nb / ipp_median:.2f}x (median; goal <= 1)")
    else:
        print("ipyparallel not installed: no comparison")
    print(f"nbaccel median < 10 ms: {'yes' if nb < 10 else 'NO'}")


if __name__ == "__main__":
    main()
