"""Benchmark: what a launcher's telemetry costs per collective inside a real gather loop (2 gloo processes).

    python benchmarks/telemetry_path.py [--rounds 1500] [--tree PATH]

Each round gathers the dict of benchmarks/ops.py (16 float32 tensors of 1,024 elements) twice, in a shuffled
order: once with no telemetry and once with a launcher's sink attached (`telemetry.attach(WorkerSink)`, read
by a thread as the kernel would). On rank 0, the collective trace's three steps are timed one by one with
`perf_counter_ns` around each call: the call-site look-up (`collective_trace._caller_site`, which runs only
while a listener is registered), and `in_collective.__enter__` and `__exit__` whole (the trace's own
bookkeeping, the record or whatever the listeners build, the listeners). Between two gathers the process
runs torch and gloo, so these run with cold caches, as between two training steps: a warm loop
(benchmarks/collective_trace.py) shows a fraction of it. Printed: the median of each step in microseconds,
without and with telemetry (each includes ~0.1-0.3 us of the timer itself, shown as `timer alone`), and the
median wall time of the gather without and with telemetry.

`--tree`: the source tree whose `nbaccel` to import (default: this one), so that another version (a `git
archive` of an earlier commit) can be timed with the same script, alternated with this one.
"""

from __future__ import annotations

import random
import statistics
import time

import torch
from two_ranks import (  # beside this file
    drained_sink,
    join_ranks,
    leave_ranks,
    run_ranks,
    tree_arguments,
    tree_header,
)


def _worker(rank: int, world: int, port: int, queue, rounds: int, tree: str) -> None:
    join_ranks(rank, world, port, tree)
    from nbaccel import telemetry
    from nbaccel.utils import collective_trace
    from nbaccel.utils import operations as ops

    sink = drained_sink(rank)
    spent: dict[str, list[int]] = {}
    clock = time.perf_counter_ns
    variant = "off"
    trace = collective_trace.in_collective
    enter, leave, site = trace.__enter__, trace.__exit__, collective_trace._caller_site

    def timed(step, fn, tagged=True):
        def run(*args):
            start = clock()
            result = fn(*args)
            spent.setdefault(f"{step}, telemetry {variant}" if tagged else step, []).append(clock() - start)
            return result
        return run

    def nothing():
        return None

    trace.__enter__, trace.__exit__ = timed("enter", enter), timed("exit", leave)
    collective_trace._caller_site = timed("call site", site)  # looked up by each collective
    data = {f"t{i}": torch.randn(1024) for i in range(16)}
    walls: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(20):
        ops.gather(data)
    for round_ in range(rounds):
        order = list(walls)
        random.Random(round_).shuffle(order)  # the same on both ranks
        for name in order:
            variant = name
            if name == "on":
                telemetry.attach(sink, rank)
            start = time.perf_counter()
            ops.gather(data)
            walls[name].append(time.perf_counter() - start)
            if name == "on":
                telemetry.detach()
        timed("timer alone", nothing, tagged=False)()
    if rank == 0:
        queue.put(({name: statistics.median(values) / 1e3 for name, values in sorted(spent.items())},
                   {name: statistics.median(values) * 1e6 for name, values in walls.items()}))
    leave_ranks()


def main() -> None:
    args = tree_arguments(__doc__, rounds=1500)
    [(steps, walls)] = run_ranks(_worker, args.rounds, args.tree)
    print(tree_header(args))
    print("  per collective, rank 0, median:")
    for name, us in steps.items():
        print(f"    {name:<24} {us:6.2f} us")
    print(f"  gather wall, median: off {walls['off']:.1f} us, telemetry on {walls['on']:.1f} us "
          f"({walls['on'] / walls['off']:.3f}x)")


if __name__ == "__main__":
    main()
