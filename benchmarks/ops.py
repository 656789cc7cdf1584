"""Benchmark: nbaccel's collectives against the raw torch floor and Accelerate, on 2 gloo processes.

    python benchmarks/ops.py [--rounds 1500]

Gathers a dict of 16 float32 tensors of 1,024 elements with (a) nbaccel.utils.gather, (b) ONE raw
torch.distributed all-gather of a flat buffer of the same size (the floor: what any implementation must
at least pay through torch.distributed's functions), and the same all-gather called on the process group
itself (without torch's Python wrapper, as nbaccel's gather starts its all-gather), (c) the least raw-torch code returning the same dict (cat, all-gather, transpose, split; no
checks), and the same overlapped (the all-gather started asynchronously, each rank's rows received
straight into a strided slot of the results, which are made while it runs), and that overlapped code inside nbaccel's collective trace with a launcher's telemetry sink
attached, its enter announced once the all-gather started (the least a launched rank's gather can cost
with its hang report on), (d) accelerate.utils.gather
when Accelerate is installed, (e) nbaccel.utils.gather with a launcher's
telemetry sink attached (what a notebook_launcher worker runs: every collective queues its `collective`
enter/exit messages for the kernel's deadlock detection). Then gather_object and
broadcast_object_list of a small dict, nbaccel against Accelerate.

Each round times ONE call of every variant, in an order shuffled per round (the same on both ranks: they
run each collective together), so machine load and the position after another variant hit them alike;
no barrier is timed (each collective synchronizes the ranks itself). Reported: the median wall time per
call and the mean CPU time of rank 0's process per call, with ratios; for nbaccel's gather against the
floor, also the median of the ratios within each round (the two ran back to back there), whose quartiles
show how much the machine's noise moves the answer.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from two_ranks import drained_sink, join_ranks, leave_ranks, run_ranks  # noqa: E402 - beside this file


def _worker(rank: int, world: int, port: int, queue, rounds: int, raw_watch: bool = False) -> None:
    join_ranks(rank, world, port, init=False)  # Accelerate's PartialState opens the group when installed
    import torch.distributed as dist

    try:
        import accelerate.utils as acc
        from accelerate import PartialState as AccPartialState

        AccPartialState(cpu=True)  # initializes the gloo group; nbaccel uses the same one
    except ImportError:
        acc = None
        dist.init_process_group("gloo", rank=rank, world_size=world)

    from nbaccel.utils import operations as ops

    data = {f"t{i}": torch.randn(1024) for i in range(16)}
    flat = torch.randn(16 * 1024)
    out = torch.empty(world * flat.numel())
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    small = {"loss": 0.25 + rank, "step": 100, "name": "eval"}
    to_send = [dict(small)]

    keys = list(data)

    def by_hand() -> dict:
        """The least code that returns the same dict: cat, one all-gather, reorder, split (no checks)."""
        received = torch.empty(world * flat.numel())
        all_gather(received, torch.cat(list(data.values())))
        parts = received.view(world, len(keys), -1).transpose(0, 1).reshape(len(keys), -1).unbind(0)
        return dict(zip(keys, parts))

    def overlapped() -> dict:
        """The same with the all-gather started asynchronously and the results made while it runs, each
        rank's rows received straight into a strided slot of the results (the list-form all-gather, whose
        copy out of gloo's own buffer is then the reordering): what nbaccel's gather does for tensors of one
        shape since 2026-12-02."""
        results = torch.empty(len(keys), world, flat.numel() // len(keys))
        work = dist.all_gather(list(results.unbind(1)), torch.stack(list(data.values())), None, True)
        gathered = dict(zip(keys, results.view(len(keys), -1).unbind(0)))
        work.wait()
        return gathered

    from nbaccel import telemetry
    from nbaccel.utils.collective_trace import in_collective

    def overlapped_traced() -> dict:
        """The overlapped least code inside nbaccel's collective trace, run with the launcher's sink attached:
        the least a launched rank's gather can cost while a hang can still be named (issue 42's row, whose
        `telemetry on` this is), with none of nbaccel's checks or bookkeeping."""
        buffer = torch.stack(list(data.values()))
        results = torch.empty(len(keys), world, flat.numel() // len(keys))
        trace = in_collective("gather", "all_gather", [buffer], announce=False)
        with trace:
            work = dist.all_gather(list(results.unbind(1)), buffer, None, True)
            trace.announce()  # the listeners' work while the data travels, as nbaccel's gather does
            gathered = dict(zip(keys, results.view(len(keys), -1).unbind(0)))
            work.wait()
        return gathered

    sink = drained_sink(rank)
    traced = "gather: nbaccel, launch telemetry on"
    least_traced = "gather: by hand, overlapped, telemetry on"
    with_sink = {traced, least_traced}
    if raw_watch:  # what a launch's rank runs besides: the thread sampling its stack for raw torch.distributed calls
        from functools import partial

        from nbaccel.launch.worker.raw_calls import watch_raw_collectives

        watch_raw_collectives(partial(sink.send, "collective"))

    group = dist.group.WORLD
    options = dist.distributed_c10d.AllgatherOptions()

    def floor_on_the_group() -> None:
        """The floor without torch.distributed's Python wrapper: the process group's own method, as nbaccel's
        stacked gather starts its all-gather (shows what the wrapper costs every variant that goes through it)."""
        group.all_gather_single(out, flat, options).wait()

    variants = {
        "gather: nbaccel": lambda: ops.gather(data),
        traced: lambda: ops.gather(data),
        "gather: floor (one raw all-gather)": lambda: all_gather(out, flat),
        "gather: floor, on the process group": floor_on_the_group,
        "gather: by hand (cat, all-gather, split)": by_hand,
        "gather: by hand, overlapped": overlapped,
        least_traced: overlapped_traced,
        "gather_object: nbaccel": lambda: ops.gather_object([small]),
        "broadcast_object_list: nbaccel": lambda: ops.broadcast_object_list(to_send),
    }
    if acc is not None:
        variants["gather: accelerate"] = lambda: acc.gather(data)
        variants["gather_object: accelerate"] = lambda: acc.gather_object([small])
        variants["broadcast_object_list: accelerate"] = lambda: acc.broadcast_object_list(to_send)

    # results agree before timing anything
    assert all(torch.equal(ops.gather(data)[k], v) for k, v in by_hand().items())
    assert all(torch.equal(ops.gather(data)[k], v) for k, v in overlapped().items())
    assert all(torch.equal(ops.gather(data)[k], v) for k, v in overlapped_traced().items())
    if acc is not None:
        mine, theirs = ops.gather(data), acc.gather(data)
        assert all(torch.equal(mine[k], theirs[k]) for k in data)
        assert ops.gather_object([small]) == acc.gather_object([small])

    walls: dict[str, list[float]] = {name: [] for name in variants}
    cpus: dict[str, float] = dict.fromkeys(variants, 0.0)
    for fn in variants.values():  # warm-up (the traced variant warms up with the sink attached below)
        for _ in range(5):
            fn()
    order = list(variants)
    clock, cpu_clock = time.perf_counter, time.process_time
    for round_ in range(rounds):
        random.Random(round_).shuffle(order)  # the same order on both ranks: they run each collective together
        for name in order:
            fn = variants[name]
            if name in with_sink:
                telemetry.attach(sink, rank)
            cpu, start = cpu_clock(), clock()
            fn()
            walls[name].append(clock() - start)
            cpus[name] += cpu_clock() - cpu
            if name in with_sink:
                telemetry.detach()
    if rank == 0:
        queue.put(walls)
        queue.put({name: (statistics.median(values), cpus[name] / rounds) for name, values in walls.items()})
    leave_ranks()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1500)
    parser.add_argument("--raw-watch", action="store_true",
                        help="run each rank's raw torch.distributed watch (worker/raw_calls.py), as a launch does")
    args = parser.parse_args()
    world = 2
    walls, medians = run_ranks(_worker, args.rounds, args.raw_watch, world=world, results=2)
    print(f"{world} gloo processes, torch {torch.__version__}, {args.rounds} rounds of one call per variant, "
          f"raw-call watch {'on' if args.raw_watch else 'off'} "
          f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")
    print(f"  {'':<40} {'wall (median)':>13} {'CPU (rank 0, mean)':>19}")
    for name, (wall, cpu) in medians.items():
        print(f"  {name:<40} {wall * 1e6:10.1f} us {cpu * 1e6:16.1f} us")

    def ratio(a: str, b: str, which: int = 0) -> float:
        return medians[a][which] / medians[b][which]

    floor = "gather: floor (one raw all-gather)"
    traced = "gather: nbaccel, launch telemetry on"
    least_traced = "gather: by hand, overlapped, telemetry on"
    print(f"gather, telemetry on / off:     {ratio(traced, 'gather: nbaccel'):5.2f}x wall, "
          f"{ratio(traced, 'gather: nbaccel', 1):5.2f}x CPU  (the collective trace under a launch; goal ~1.0x)")
    print(f"gather, nbaccel / floor:        {ratio('gather: nbaccel', floor):5.2f}x wall, "
          f"{ratio('gather: nbaccel', floor, 1):5.2f}x CPU  (goal <= 1.5x)")
    print(f"gather, telemetry on / floor:   {ratio(traced, floor):5.2f}x wall, "
          f"{ratio(traced, floor, 1):5.2f}x CPU  (what a notebook_launcher worker pays)")
    paired = sorted(a / b for a, b in zip(walls["gather: nbaccel"], walls[floor]))
    quartiles = statistics.quantiles(paired, n=4)
    print(f"gather, nbaccel / floor, paired by round: median {statistics.median(paired):.2f}x, quartiles "
          f"{quartiles[0]:.2f}-{quartiles[2]:.2f}x over {len(paired)} rounds")
    print(f"gather, nbaccel / by hand:      {ratio('gather: nbaccel', 'gather: by hand (cat, all-gather, split)'):5.2f}x "
          f"wall, {ratio('gather: nbaccel', 'gather: by hand (cat, all-gather, split)', 1):5.2f}x CPU")
    print(f"gather, by hand / floor:        {ratio('gather: by hand (cat, all-gather, split)', floor):5.2f}x wall; "
          f"overlapped / floor {ratio('gather: by hand, overlapped', floor):5.2f}x wall "
          f"(nbaccel / overlapped {ratio('gather: nbaccel', 'gather: by hand, overlapped'):5.2f}x)")
    print(f"gather, by hand overlapped, telemetry on / floor: {ratio(least_traced, floor):5.2f}x wall (the least "
          f"code with the trace a launch runs; nbaccel, telemetry on / it {ratio(traced, least_traced):5.2f}x)")
    print(f"gather, floor on the process group / floor: {ratio('gather: floor, on the process group', floor):5.2f}x "
          f"wall (torch.distributed's wrapper left out; nbaccel, telemetry on / it "
          f"{ratio(traced, 'gather: floor, on the process group'):5.2f}x)")
    if "gather: accelerate" in medians:
        print(f"gather, accelerate / nbaccel:   {ratio('gather: accelerate', 'gather: nbaccel'):5.2f}x wall, "
              f"{ratio('gather: accelerate', 'gather: nbaccel', 1):5.2f}x CPU  (goal >= 5x)")
        for op in ("gather_object", "broadcast_object_list"):
            print(f"{op}, accelerate / nbaccel: {ratio(f'{op}: accelerate', f'{op}: nbaccel'):5.2f}x wall, "
                  f"{ratio(f'{op}: accelerate', f'{op}: nbaccel', 1):5.2f}x CPU")

if __name__ == "__main__":
    main()
