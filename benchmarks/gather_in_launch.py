"""Benchmark: issue 42's gather row inside a real launch, the kernel's supervisor and collective tracker included.

    python benchmarks/gather_in_launch.py [--launches 6] [--rounds 1500]

The other gather benchmarks (ops.py, gather_start_ab.py) run their 2 ranks by hand with a launcher's telemetry
sink whose pipe a thread of the rank drains: they leave out the kernel, which in a launch unpickles every
`collective` message and compares each rank's n-th collective with the others' (kernel/collective_tracker.py).
On a 2-core machine that work competes with the ranks. Here `notebook_launcher(num_processes=2)` runs the
ranks as a user's cell does (telemetry on; no dashboard, so that its drawing is not counted). In each rank,
every round gathers benchmarks/ops.py's dict (16 float32 tensors of 1,024 elements) with nbaccel's `gather`
and runs the floor (one raw all-gather of a flat buffer of the same size), in a shuffled order (the same on
both ranks). The launches alternate two kernels:
- `as it is`: the tracker passes over records that agree (`collective_tracker._same_meeting`);
- `every pair built`: that check made to answer no, as the tracker was before it.
Printed per kernel: the median over its launches of the rank's median gather / median floor, and of the
median per-round ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nbaccel import notebook_launcher  # noqa: E402
from nbaccel.launch.kernel import collective_tracker  # noqa: E402


def _rank(rounds: int) -> tuple[float, float, float]:
    """In a launched rank: (median gather, median floor, median per-round ratio), seconds and x."""
    import random
    import time

    import torch
    import torch.distributed as dist

    from nbaccel import PartialState
    from nbaccel.utils import gather

    state = PartialState()
    torch.set_num_threads(1)
    data = {f"t{i}": torch.randn(1024) for i in range(16)}
    flat, out = torch.randn(16 * 1024), torch.empty(state.num_processes * 16 * 1024)
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    ways = {"gather": lambda: gather(data), "floor": lambda: all_gather(out, flat)}
    walls: dict[str, list[float]] = {name: [] for name in ways}
    clock = time.perf_counter
    for round_ in range(-50, rounds):  # 50 rounds of warm-up, not kept
        order = list(ways)
        random.Random(round_).shuffle(order)
        for name in order:
            start = clock()
            ways[name]()
            if round_ >= 0:
                walls[name].append(clock() - start)
    ratios = [g / f for g, f in zip(walls["gather"], walls["floor"])]
    return statistics.median(walls["gather"]), statistics.median(walls["floor"]), statistics.median(ratios)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=6, help="launches per kernel, alternated")
    parser.add_argument("--rounds", type=int, default=1500)
    args = parser.parse_args()
    same_meeting = collective_tracker._same_meeting
    kernels = {"as it is": same_meeting, "every pair built": lambda one, other: False}
    runs: dict[str, list[tuple[float, float, float]]] = {name: [] for name in kernels}
    for launch in range(args.launches):
        for name in (list(kernels) if launch % 2 == 0 else list(reversed(kernels))):
            collective_tracker._same_meeting = kernels[name]
            runs[name].append(notebook_launcher(_rank, (args.rounds,), num_processes=2, dashboard=False)[0])
    collective_tracker._same_meeting = same_meeting
    print(f"notebook_launcher, 2 gloo ranks, {args.launches} launches per kernel of {args.rounds} rounds each "
          "(rank 0's medians; the median over launches):")
    for name, results in runs.items():
        gather_us = statistics.median(r[0] for r in results) * 1e6
        floor_us = statistics.median(r[1] for r in results) * 1e6
        of_medians = statistics.median(r[0] / r[1] for r in results)
        per_round = statistics.median(r[2] for r in results)
        print(f"  {name:<17} gather {gather_us:6.0f} us, floor {floor_us:6.0f} us: {of_medians:.2f}x the floor "
              f"(per-round ratio {per_round:.2f}x; launches {', '.join(f'{r[0] / r[1]:.2f}' for r in results)})")


if __name__ == "__main__":
    main()
