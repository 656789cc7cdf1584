"""Benchmark: a launched rank's stacked gather with and without this round's three changes, interleaved in one run.

    python benchmarks/gather_start_ab.py [--rounds 3000] [--accelerate]

2 gloo processes gather benchmarks/ops.py's dict (16 float32 tensors of 1,024 elements) with a launcher's
telemetry sink attached, as a notebook_launcher worker runs, in five ways, toggled call by call in the same
processes so that the machine's drift hits them alike:
- nbaccel as it is: a remembered layout of tensors of one dtype and shape found from its first tensor, with
  `torch.stack` (the packing) checking the others (`collectives._gather_known_stacked`); the all-gather
  started on the process group itself (`collectives._start_all_gather`); the collective trace's enter
  announced once it started (`in_collective(..., announce=False)`);
- the same with the whole layout key built for the look-up (as at c7c8a71);
- the same with the enter announced before the start (as every other collective does);
- the same with the all-gather started through torch.distributed's function (its Python wrapper);
- both ways of starting as at c7c8a71 (with the stacked look-up).
Each round also runs the floor (one raw all-gather of a flat buffer of the same size) and, with
`--accelerate`, Accelerate's gather, whose ~5 ms of Python between the others leaves the caches as cold as
benchmarks/ops.py does. The order is shuffled per round, the same on both ranks. Printed: each way's median
wall time, its ratio to the floor, and the median of its per-round ratios to nbaccel as it is.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from two_ranks import drained_sink, interleaved_walls, join_ranks, leave_ranks, print_ways, run_ranks  # noqa: E402 - beside this file


def _worker(rank: int, world: int, port: int, queue, rounds: int, with_accelerate: bool) -> None:
    join_ranks(rank, world, port)
    import torch.distributed as dist

    from nbaccel import telemetry
    from nbaccel.utils import collectives, operations
    from nbaccel.utils.collective_trace import in_collective

    data = {f"t{i}": torch.randn(1024) for i in range(16)}
    flat, out = torch.randn(16 * 1024), torch.empty(world * 16 * 1024)

    def through_torch(group, slots, rows):  # the start before: torch.distributed's function
        return dist.all_gather(slots, rows, None, True)

    def announced_first(op, call, tensors, announce=True):  # the enter before: heard at `with`
        return in_collective(op, call, tensors)

    def whole_key(data, items, facts):  # the look-up before: the whole layout key built for every gather
        return None

    direct_start, late_trace = collectives._start_all_gather, collectives.in_collective
    stacked_check = collectives._gather_known_stacked
    ways = {
        "nbaccel as it is": (direct_start, late_trace),
        "whole layout key": (direct_start, late_trace),
        "enter announced first": (direct_start, announced_first),
        "started through torch's function": (through_torch, late_trace),
        "both as before": (through_torch, announced_first),
    }
    variants = [*ways, "floor (one raw all-gather)"]
    if with_accelerate:
        import accelerate.utils as acc

        variants.append("accelerate")

    def prepare(name: str, round_: int):
        if name == "accelerate":
            return lambda: acc.gather(data)
        if name not in ways:
            return lambda: dist.all_gather_single(out, flat)
        collectives._start_all_gather, collectives.in_collective = ways[name]
        collectives._gather_known_stacked = whole_key if name == "whole layout key" else stacked_check
        return lambda: operations.gather(data)

    sink = drained_sink(rank)
    telemetry.attach(sink, rank)
    operations.gather(data)  # the layout passes the checks once
    walls = interleaved_walls(variants, prepare, rounds)
    collectives._start_all_gather, collectives.in_collective = direct_start, late_trace
    collectives._gather_known_stacked = stacked_check
    telemetry.detach()
    if rank == 0:
        queue.put(walls)
    leave_ranks()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3000)
    parser.add_argument("--accelerate", action="store_true", help="run Accelerate's gather in each round too")
    args = parser.parse_args()
    (walls,) = run_ranks(_worker, args.rounds, args.accelerate)
    print(f"2 gloo processes, torch {torch.__version__}, {args.rounds} rounds, accelerate in each round: "
          f"{args.accelerate} (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")
    print_ways(walls, "floor (one raw all-gather)", "nbaccel as it is", skip=("accelerate",))


if __name__ == "__main__":
    main()
