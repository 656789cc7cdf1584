"""The two copies of issue 42's gather, with warm and with cold caches, in one process.

    python benchmarks/gather_copies.py [--rounds 2000]

A gather of benchmarks/ops.py's dict (16 float32 tensors of 1,024 elements) on 2 ranks copies its data twice
around the all-gather: the pack (`torch.stack` of the 16 tensors into one send buffer, 64 KiB) and the
reordering copy (the (2, 16, 1024) received rows into a new (16, 2, 1024) results tensor, 128 KiB), as
`collectives._gather_known_stacked` and `packing.fill_stacked` do. Both are the least code for that result:
gloo sends one dense buffer and writes rank-major rows, and each returned tensor is one key's rows of every
rank, contiguous. This times each copy alone (one torch thread), alternated round by round in two states:
warm (the same copy just ran) and cold (a 32 MiB buffer written in between, as torch, gloo and the other
rank's work leave the caches between two gathers of a training loop). Printed: the medians and the
cold/warm ratio, against which gather_steps.py's per-step figures read.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    items = [torch.randn(1024) for _ in range(16)]
    rows = torch.randn(2, 16 * 1024)
    evict = torch.zeros(8 * 1024 * 1024)  # 32 MiB: more than this machine's caches

    def pack() -> torch.Tensor:
        return torch.stack(items)

    def reorder() -> torch.Tensor:
        results = torch.empty(16, 2 * 1024)
        results.view(16, 2, 1024).copy_(rows.view(2, 16, 1024).transpose(0, 1))
        return results

    copies = {"pack (torch.stack, 64 KiB)": pack, "reordering copy (128 KiB)": reorder}
    times: dict[tuple[str, str], list[float]] = {(name, state): [] for name in copies for state in ("warm", "cold")}
    clock = time.perf_counter
    for round_ in range(-50, args.rounds):
        for name, copy in copies.items():
            copy()
            start = clock()
            copy()
            warm = clock() - start
            evict.add_(1.0)
            start = clock()
            copy()
            cold = clock() - start
            if round_ >= 0:
                times[name, "warm"].append(warm)
                times[name, "cold"].append(cold)
    print(f"torch {torch.__version__}, one thread, {args.rounds} rounds (load average {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} CPUs)")
    for name in copies:
        warm, cold = (statistics.median(times[name, state]) for state in ("warm", "cold"))
        print(f"  {name:<28} warm {warm * 1e6:6.1f} us  cold {cold * 1e6:6.1f} us  cold/warm {cold / warm:4.1f}x")


if __name__ == "__main__":
    main()
