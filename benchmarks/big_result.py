"""Large results: each of 2 ranks returns a 200 MB float32 tensor to the kernel.

Measured: from the moment the last rank's function returns (its clock, CLOCK_MONOTONIC, shared by every
process of the machine) to the moment `notebook_launcher` returns the results in the kernel.
Floor: the host's memory bandwidth, i.e. the least any hand-over can do: one copy of each rank's 200 MB
into fresh memory (page faults included), `torch.empty(n).copy_(src)` in the kernel. The ranks can copy at
the same time on 2 cores, so the strict floor is ONE 200 MB copy; two copies in a row are shown too.
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


def run_floor(sources: list[torch.Tensor]) -> float:
    start = time.monotonic()
    copies = [torch.empty(NUMEL).copy_(src) for src in sources]
    elapsed = time.monotonic() - start
    del copies
    return elapsed


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 7
    sources = [torch.full((NUMEL,), 1.0), torch.full((NUMEL,), 2.0)]
    run_nbaccel(), run_floor(sources)  # warm-up
    times: dict[str, list[float]] = {"floor (1 x 200 MB copy)": [], "2 x 200 MB copies": [], "nbaccel": []}
    for _ in range(rounds):
        times["floor (1 x 200 MB copy)"].append(run_floor(sources[:1]))
        times["2 x 200 MB copies"].append(run_floor(sources))
        times["nbaccel"].append(run_nbaccel())
    print(f"return a 200 MB tensor from each of 2 ranks: last rank ready -> results in the kernel, {rounds} rounds")
    for name, values in times.items():
        print(f"  {name:<24} median {statistics.median(values) * 1000:8.1f} ms   min {min(values) * 1000:8.1f} ms")
    floor, serial, nb = times["floor (1 x 200 MB copy)"], times["2 x 200 MB copies"], times["nbaccel"]
    print(f"nbaccel / floor = {statistics.median(nb) / statistics.median(floor):.2f}x median, "
          f"{min(nb) / min(floor):.2f}x min   (goal <= 1.5x)")
    print(f"nbaccel / 2 copies in a row = {statistics.median(nb) / statistics.median(serial):.2f}x median")


if __name__ == "__main__":
    main()
