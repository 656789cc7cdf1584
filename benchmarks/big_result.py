"""Large results: each of 2 ranks returns a 200 MB float32 tensor to the kernel.

Measured: from the moment the last rank's function returns (its clock, CLOCK_MONOTONIC, shared by every
process of the machine) to the moment `notebook_launcher` returns the results in the kernel.
Floor: the host's memory bandwidth, i.e. the least any hand-over can do: one copy of each rank's 200 MB
into fresh memory (page faults included), `torch.empty(n).copy_(src)` in the kernel. The ranks can copy at
the same time on 2 cores, so the strict floor is ONE 200 MB copy; two copies in a row are shown too.
Fresh memory costs what the machine's page faults cost, which a VM can make slow and variable: the last
variant does the same memory traffic with the least code (2 raw forked processes, each makes its tensor
and copies it into a /dev/shm file that the parent maps, no launcher) to show what nbaccel itself adds.
Variants interleaved round by round. Goal: nbaccel <= 1.5x the strict floor.
Run: python benchmarks/big_result.py [rounds]
"""

from __future__ import annotations

import contextlib
import io
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from nbaccel import notebook_launcher  # noqa: E402

NUMEL = 50_000_000  # 200 MB of float32 per rank


def big_result(stamp_dir: str) -> torch.Tensor:
    rank = int(os.environ["RANK"])
    value = torch.full((NUMEL,), float(rank + 1))
    Path(stamp_dir, str(rank)).write_text(repr(time.monotonic()))
    return value


def run_nbaccel() -> float:
    with tempfile.TemporaryDirectory() as stamps:
        with contextlib.redirect_stdout(io.StringIO()):
            results = notebook_launcher(big_result, args=(stamps,), num_processes=2, dashboard=False)
        done = time.monotonic()
        ready = max(float(Path(stamps, str(rank)).read_text()) for rank in range(2))
    assert [float(r[-1]) for r in results] == [1.0, 2.0] and results[0].numel() == NUMEL
    del results
    return done - ready


def _raw_rank(rank: int, stamp_dir: str, conn) -> None:
    """The least a forked process can do to hand 200 MB to its parent: one copy into a /dev/shm file."""
    value = torch.full((NUMEL,), float(rank + 1))
    Path(stamp_dir, str(rank)).write_text(repr(time.monotonic()))
    path = os.path.join(stamp_dir, f"result-{rank}")
    with open(path, "wb", buffering=0) as file:  # write() into tmpfs: the one copy (as nbaccel's ranks do)
        file.write(value.numpy())
    conn.send(path)
    conn.close()


def run_raw_handover() -> float:
    """Fork 2 processes that make the same tensors and hand them over through shared memory, as the least
    code would (no supervision, no output forwarding, no process group); the parent maps both files."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    with tempfile.TemporaryDirectory(dir="/dev/shm") as stamps:
        pipes = [ctx.Pipe(duplex=False) for _ in range(2)]
        procs = [ctx.Process(target=_raw_rank, args=(rank, stamps, pipes[rank][1])) for rank in range(2)]
        for proc in procs:
            proc.start()
        results = []
        for read, _ in pipes:
            path = read.recv()
            results.append(torch.from_file(path, shared=True, size=NUMEL, dtype=torch.float32))
            os.unlink(path)
        for proc in procs:
            proc.join()
        done = time.monotonic()
        ready = max(float(Path(stamps, str(rank)).read_text()) for rank in range(2))
    assert [float(r[-1]) for r in results] == [1.0, 2.0]
    del results
    return done - ready


def run_floor(sources: list[torch.Tensor]) -> float:
    start = time.monotonic()
    copies = [torch.empty(NUMEL).copy_(src) for src in sources]
    elapsed = time.monotonic() - start
    del copies
    return elapsed


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 7
    sources = [torch.full((NUMEL,), 1.0), torch.full((NUMEL,), 2.0)]
    run_nbaccel(), run_floor(sources), run_raw_handover()  # warm-up
    times: dict[str, list[float]] = {"floor (1 x 200 MB copy)": [], "2 x 200 MB copies": [],
                                     "raw fork + shm hand-over": [], "nbaccel": []}
    for _ in range(rounds):
        times["floor (1 x 200 MB copy)"].append(run_floor(sources[:1]))
        times["2 x 200 MB copies"].append(run_floor(sources))
        times["raw fork + shm hand-over"].append(run_raw_handover())
        times["nbaccel"].append(run_nbaccel())
    print(f"return a 200 MB tensor from each of 2 ranks: last rank ready -> results in the kernel, {rounds} rounds")
    for name, values in times.items():
        print(f"  {name:<24} median {statistics.median(values) * 1000:8.1f} ms   min {min(values) * 1000:8.1f} ms")
    floor, serial, nb = times["floor (1 x 200 MB copy)"], times["2 x 200 MB copies"], times["nbaccel"]
    print(f"nbaccel / floor = {statistics.median(nb) / statistics.median(floor):.2f}x median, "
          f"{min(nb) / min(floor):.2f}x min   (goal <= 1.5x)")
    print(f"nbaccel / 2 copies in a row = {statistics.median(nb) / statistics.median(serial):.2f}x median")
    raw = times["raw fork + shm hand-over"]
    print(f"nbaccel / raw fork + shm hand-over = {statistics.median(nb) / statistics.median(raw):.2f}x median, "
          f"{min(nb) / min(raw):.2f}x min   (the same memory traffic with no launcher)")


if __name__ == "__main__":
    main()
