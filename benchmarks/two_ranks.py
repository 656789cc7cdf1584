"""The two-rank harness of the collective benchmarks (ops.py, telemetry_path.py, gather_steps.py).

`run_ranks(worker, *args)` spawns one process per rank on a free local port, each running
`worker(rank, world, port, queue, *args)`, and returns what the ranks put on `queue` (rank 0 by convention),
killing any rank left behind. In a rank, `join_ranks(rank, world, port, tree)` puts `tree` first on the path
(to time an earlier checkout's nbaccel), sets the torch.distributed variables and one thread per rank, and
opens the gloo group unless told not to; `leave_ranks()` closes it; `drained_sink(rank)` is a launcher's
telemetry sink whose pipe a thread reads and discards, as the kernel's supervisor does.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from queue import Empty
from typing import Any

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    """nbaccel's port pick (below the ephemeral range: a bind(0) port can become another connection's source
    port before the ranks bind it); this checkout's nbaccel, whichever tree the ranks import."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    try:
        from nbaccel.utils.other import get_free_port
    finally:
        del sys.path[0]
    return get_free_port("127.0.0.1")


def run_ranks(worker: Callable[..., None], *args: Any, world: int = 2, results: int = 1,
              timeout: float = 600) -> list[Any]:
    """Spawn `world` ranks running `worker(rank, world, port, queue, *args)`; the `results` items they put
    on the queue, in order (the first waited for up to `timeout` seconds, the others a minute each)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(rank, world, port, queue, *args)) for rank in range(world)]
    for proc in procs:
        proc.start()
    try:
        return [_next(queue, procs, timeout if i == 0 else 60) for i in range(results)]
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()


def _next(queue: Any, procs: list[Any], timeout: float) -> Any:
    """The next item a rank puts on `queue`; RuntimeError as soon as a rank has died (its traceback is on
    stderr) or after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return queue.get(timeout=1)
        except Empty:
            dead = [proc.exitcode for proc in procs if proc.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"the ranks gave no result (exit codes {[p.exitcode for p in procs]})") from None


def join_ranks(rank: int, world: int, port: int, tree: str | None = None, init: bool = True) -> None:
    """In a rank: `tree` first on sys.path, the env:// variables, one torch thread, the gloo group (`init`)."""
    if tree is not None:
        sys.path.insert(0, tree)
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    if init:
        import torch.distributed as dist

        dist.init_process_group("gloo", rank=rank, world_size=world)


def leave_ranks() -> None:
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def tree_arguments(doc: str, rounds: int) -> argparse.Namespace:
    """The command line of a benchmark that times one source tree: `--rounds` and `--tree` (the checkout whose
    nbaccel the ranks import: this one by default, or e.g. a `git archive` of an earlier commit)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--tree", default=str(Path(__file__).resolve().parent.parent))
    return parser.parse_args()


def medians_us(samples: dict[str, list[int]]) -> dict[str, float]:
    """The median of each list of nanosecond samples, in microseconds."""
    return {name: statistics.median(values) / 1e3 for name, values in samples.items()}


def interleaved_walls(names: list[str], prepare: Callable[[str, int], Callable[[], Any]], rounds: int,
                      warmup: int = 20) -> dict[str, list[float]]:
    """Wall seconds of one call per name per round, in an order shuffled per round (seeded by the round, so
    the same on every rank: they run each collective together). `prepare(name, round)` sets the way up
    (untimed) and returns the call to time; the first `warmup` rounds are not kept."""
    walls: dict[str, list[float]] = {name: [] for name in names}
    clock = time.perf_counter
    for round_ in range(-warmup, rounds):
        order = list(names)
        random.Random(round_).shuffle(order)
        for name in order:
            call = prepare(name, round_)
            start = clock()
            call()
            if round_ >= 0:
                walls[name].append(clock() - start)
    return walls


def print_ways(walls: dict[str, list[float]], floor: str, reference: str, skip: tuple[str, ...] = ()) -> None:
    """One line per way (but `skip`): its median wall time, its ratio to the `floor` way's median, and the
    median of its per-round ratios to the `reference` way (the rounds ran them back to back)."""
    floor_median, mine = statistics.median(walls[floor]), walls[reference]
    for name, values in walls.items():
        if name in skip:
            continue
        paired = statistics.median(a / b for a, b in zip(values, mine))
        print(f"  {name:<42} {statistics.median(values) * 1e6:7.1f} us  {statistics.median(values) / floor_median:5.2f}x "
              f"the floor  {paired:5.3f}x {reference} (median of per-round ratios)")


def tree_header(args: argparse.Namespace) -> str:
    """The first line of a report: the tree, the rounds and the machine's load."""
    return f"{args.tree}: {args.rounds} rounds (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)"


def drained_sink(rank: int):
    """A launcher's telemetry sink for this rank (nbaccel's WorkerSink, as a launched rank has), its pipe read
    and discarded by a thread as the kernel's supervisor reads it. Imported from whatever nbaccel is first on
    the path (`--tree`)."""
    from multiprocessing import Pipe
    from threading import Thread

    from nbaccel.launch.channel import WorkerSink

    kernel_end, worker_end = Pipe(duplex=False)

    def drain() -> None:
        try:
            while True:
                kernel_end.recv()
        except (EOFError, OSError):
            pass

    Thread(target=drain, daemon=True).start()
    return WorkerSink(worker_end, rank)
