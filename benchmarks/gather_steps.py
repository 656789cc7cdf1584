"""Where a launched rank's gather goes, step by step (issue 42): rank 0's time in each step of nbaccel.gather.

    python benchmarks/gather_steps.py [--rounds 800] [--tree PATH]

2 gloo processes gather benchmarks/ops.py's dict (16 float32 tensors of 1,024 elements) with a launcher's
telemetry sink attached (as a notebook_launcher worker runs), alternated round by round with the floor (one
raw all-gather of a flat buffer of the same size, in a shuffled order, the same on both ranks). On rank 0 each
step is wrapped in a perf_counter_ns timer (~0.3-1 us of each figure is the wrapper): the layout key, the
packing, the collective trace's enter and exit (the telemetry's listener included), the all-gather call
itself, the unpacking and the rebuilt dict. Since fast-gather (issue 42) tensors of one shape start the
all-gather asynchronously: its start and its wait are timed apart, with the results tensor and the rebuilt
dict made in between, and the unpacking is one copy into that tensor after the wait. Between two gathers torch and gloo run, so the steps run with
cold caches, as in a training loop. The small steps around them are timed too (the group's facts, debug
mode's check, the dict's items, the receive buffer, the trace's making, the results' views), and what is left
of the gather's median wall time is printed as the rest. Printed: the medians, the gather's and the floor's median wall time,
and the minor page faults of rank 0's main thread per call.

`--tree`: the source tree whose nbaccel to import (default: this one), to time an earlier checkout.
"""

from __future__ import annotations

import random
import resource
import time

import torch
from two_ranks import (  # beside this file
    drained_sink,
    join_ranks,
    leave_ranks,
    medians_us,
    run_ranks,
    tree_arguments,
    tree_header,
)


def _worker(rank: int, world: int, port: int, queue, rounds: int, tree: str) -> None:
    join_ranks(rank, world, port, tree)
    from nbaccel import telemetry
    from nbaccel.utils import collectives, packing

    telemetry.attach(drained_sink(rank), rank)
    clock = time.perf_counter_ns
    spent: dict[str, list[int]] = {}

    def timed(name, fn):
        def run(*args, **kwargs):
            start = clock()
            result = fn(*args, **kwargs)
            spent.setdefault(name, []).append(clock() - start)
            return result
        return run

    raw, call = collectives._all_gather_fn()

    class TimedWork:  # an asynchronous all-gather's handle, its wait timed
        def __init__(self, work) -> None:
            self.wait = timed("the all-gather's wait (async)", work.wait)

    def timed_collective(fn):
        whole, start = timed("the all-gather call", fn), timed("the all-gather call (async: its start)", fn)

        def run(*args):  # (output, input, group, async_op)
            return TimedWork(start(*args)) if len(args) > 3 and args[3] else whole(*args)
        return run

    timed_raw = timed_collective(raw)
    collectives._all_gather_fn = lambda: (timed_raw, call)
    if hasattr(collectives, "_start_all_gather"):  # the stacked gather's start on the process group (2026-11-29)
        timed_start = timed("the all-gather call (async: its start)", collectives._start_all_gather)
        collectives._start_all_gather = lambda *args: TimedWork(timed_start(*args))
    packing.pack = timed("pack", packing.pack)
    packing.unpack_gathered = timed("unpack", packing.unpack_gathered)
    for name, step in (("stacked_results", "results tensor (the all-gather writes into it)"),
                       ("fill_stacked", "unpack (one copy into the results)")):
        if hasattr(packing, name):  # the stacked gather since fast-gather (issue 42)
            setattr(packing, name, timed(step, getattr(packing, name)))
    collectives._layout = timed("layout key", collectives._layout)
    if hasattr(collectives, "_gather_known_stacked"):  # the stacked look-up packs with torch.stack (2026-11-29)
        torch.stack = timed("pack (torch.stack, which compares the shapes)", torch.stack)
    collectives.rebuild_flat = timed("rebuild the dict", collectives.rebuild_flat)
    trace = collectives.in_collective
    trace.__enter__ = timed("trace enter (telemetry)", trace.__enter__)
    trace.__exit__ = timed("trace exit (telemetry)", trace.__exit__)
    if hasattr(trace, "announce"):  # an enter heard once the all-gather started (2026-11-29)
        trace.announce = timed("trace announce (telemetry, during the all-gather)", trace.announce)
    # the smaller steps around them (2026-11-30), so that what is left untimed is the Python between the steps
    for name, step in (("_group_facts", "the group's facts"), ("debug_mode_enabled", "debug mode's check"),
                       ("plain_items", "the dict's items"), ("_take_receive_buffer", "the receive buffer"),
                       ("in_collective", "trace made (its record's fields)")):
        if hasattr(collectives, name):
            setattr(collectives, name, timed(step, getattr(collectives, name)))
    torch.Tensor.unbind = timed("the results' views (unbind)", torch.Tensor.unbind)
    data = {f"t{i}": torch.randn(1024) for i in range(16)}
    flat, out = torch.randn(16 * 1024), torch.empty(world * 16 * 1024)
    for _ in range(30):
        collectives.gather(data)
    spent.clear()
    walls: dict[str, list[int]] = {"gather": [], "floor": []}
    faults = dict.fromkeys(walls, 0)
    for round_ in range(rounds):
        order = list(walls)
        random.Random(round_).shuffle(order)
        for name in order:
            before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
            start = clock()
            if name == "gather":
                collectives.gather(data)
            else:
                raw(out, flat)
            walls[name].append(clock() - start)
            faults[name] += resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
    if rank == 0:
        queue.put((medians_us(spent), medians_us(walls), {name: count / rounds for name, count in faults.items()}))
    leave_ranks()


def main() -> None:
    args = tree_arguments(__doc__, rounds=800)
    [(steps, walls, faults)] = run_ranks(_worker, args.rounds, args.tree)
    print(tree_header(args))
    for name, us in steps.items():
        print(f"  {name:<26} {us:7.1f} us")
    print(f"  the rest (Python between the steps, the wrappers, the frees) {walls['gather'] - sum(steps.values()):7.1f} us")
    print(f"  gather wall {walls['gather']:.1f} us, floor {walls['floor']:.1f} us: {walls['gather'] / walls['floor']:.2f}x;"
          f" minor faults per call: gather {faults['gather']:.2f}, floor {faults['floor']:.2f}")


if __name__ == "__main__":
    main()
