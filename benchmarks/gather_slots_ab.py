"""Benchmark: a launched rank's stacked gather before and after it all-gathers straight into its results' slots.

    python benchmarks/gather_slots_ab.py [--rounds 3000] [--cold]

2 gloo processes gather benchmarks/ops.py's dict (16 float32 tensors of 1,024 elements) with a launcher's
telemetry sink attached, as a notebook_launcher worker runs, two ways toggled call by call in the same processes:
- nbaccel as it is: `ProcessGroup.allgather` (the list form) writes each rank's rows straight into a strided
  slot of the results (`packing.rank_slots`): the copy out of gloo's own receive buffer is the reordering;
- before (as at cda42c2): a single-tensor all-gather (`all_gather_single`) into a receive buffer kept by the
  layout's plan, then one reordering copy into the results (`packing.fill_stacked`).
Each round also runs the floor (one raw all-gather of a flat buffer of the same size); the order is shuffled
per round, the same on both ranks. `--cold`: 32 MiB are written before each call, so every variant starts with
caches as cold as a training step leaves them. Printed: each way's median wall time, its ratio to the floor,
and the median of its per-round ratios to nbaccel as it is.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from two_ranks import drained_sink, interleaved_walls, join_ranks, leave_ranks, print_ways, run_ranks  # noqa: E402 - beside this file


def _worker(rank: int, world: int, port: int, queue, rounds: int, cold: bool) -> None:
    join_ranks(rank, world, port)
    import torch.distributed as dist

    from nbaccel import telemetry
    from nbaccel.utils import collectives, operations, packing
    from nbaccel.utils.collective_trace import in_collective

    def before(data, tensors, facts, plan, buffer=None):
        """The stacked gather as it was: receive buffer, all_gather_single, one reordering copy."""
        if buffer is None:
            buffer = packing.pack(plan, tensors)
        rows, held = collectives._take_receive_buffer(plan, buffer, facts.world)
        try:
            trace = in_collective("gather", "all_gather_single", collectives._traced(tensors, buffer), announce=False)
            with trace:
                work = facts.group().all_gather_single(rows, buffer, collectives._async_options())
                trace.announce()
                results = packing.stacked_results(plan, buffer)
                gathered = collectives.rebuild_flat(data, list(results.unbind(0)))
                work.wait()
            packing.fill_stacked(plan, rows, results)
            return gathered
        finally:
            if held:
                plan.lock.release()

    data = {f"t{i}": torch.randn(1024) + rank for i in range(16)}
    flat, out = torch.randn(16 * 1024), torch.empty(world * 16 * 1024)
    junk = torch.empty(8 << 20)  # 32 MiB of float32
    as_it_is = collectives._gather_stacked
    ways = {"nbaccel as it is": as_it_is, "before (receive buffer, reordering copy)": before}
    mine = operations.gather(data)
    collectives._gather_stacked = before
    theirs = operations.gather(data)
    collectives._gather_stacked = as_it_is
    assert all(torch.equal(mine[k], theirs[k]) for k in data)

    def prepare(name: str, round_: int):
        if cold:
            junk.fill_(round_)
        if name not in ways:
            return lambda: dist.all_gather_single(out, flat)
        collectives._gather_stacked = ways[name]
        return lambda: operations.gather(data)

    sink = drained_sink(rank)
    telemetry.attach(sink, rank)
    walls = interleaved_walls([*ways, "floor (one raw all-gather)"], prepare, rounds)
    collectives._gather_stacked = as_it_is
    telemetry.detach()
    if rank == 0:
        queue.put(walls)
    leave_ranks()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3000)
    parser.add_argument("--cold", action="store_true", help="write 32 MiB before each call (cold caches)")
    args = parser.parse_args()
    (walls,) = run_ranks(_worker, args.rounds, args.cold)
    print(f"2 gloo processes, torch {torch.__version__}, {args.rounds} rounds, cold caches: {args.cold} "
          f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")
    print_ways(walls, "floor (one raw all-gather)", "nbaccel as it is")


if __name__ == "__main__":
    main()
