"""Persistent ranks: latency of running a trivial statement on 2 ranks and getting both results back.

Variants, interleaved call by call in one run:
  floor        2 forked processes that exec() what a raw multiprocessing pipe brings and send back the value
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
        exec(source, namespace)
        conn.send(namespace.get("a"))


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

    def call(self) -> list:
        for conn in self.conns:
            conn.send(STATEMENT)
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


def main() -> None:
    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    floor = Floor()
    pool = RankPool(2)
    cluster, view = start_ipyparallel()
    variants = {
        "floor (raw pipes)": floor.call,
        "nbaccel exec (statement)": lambda: pool.exec(STATEMENT),
        "nbaccel exec (value back)": lambda: pool.exec("1 + 1").values,
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
    print(f"nbaccel / floor:        {nb / statistics.median(samples['floor (raw pipes)']):.2f}x (median)")
    if view is not None:
        ipp_median = statistics.median(samples["ipyparallel execute (%px)"])
        print(f"nbaccel / ipyparallel:  {nb / ipp_median:.2f}x (median; goal <= 1)")
    else:
        print("ipyparallel not installed: no comparison")
    print(f"nbaccel median < 10 ms: {'yes' if nb < 10 else 'NO'}")


if __name__ == "__main__":
    main()
