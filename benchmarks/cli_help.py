"""How long the command line takes to answer before it runs anything: `--help` and a bad option.

Variants, interleaved round by round: `nbaccel launch --help`, `accelerate launch --help`, and the floor, an
interpreter that builds one argparse parser and prints its usage (what answering needs, nothing more). The same
for a bad option (`--num_processes two`, refused by argparse). Prints median wall times and ratios.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROUNDS = int(os.environ.get("NBACCEL_BENCH_ROUNDS", "9"))
BIN = Path(sys.executable).parent
FLOOR = "import argparse; p = argparse.ArgumentParser(); p.add_argument('--num_processes', type=int); p.parse_args()"


def variants(args: list[str]) -> dict[str, list[str]]:
    return {
        "nbaccel": [str(BIN / "nbaccel"), "launch", *args],
        "accelerate": [str(BIN / "accelerate"), "launch", *args],
        "floor (argparse alone)": [sys.executable, "-c", FLOOR, *args],
    }


def timed(command: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)
    return time.perf_counter() - started


def main() -> None:
    for title, args in (("--help", ["--help"]), ("a bad option", ["--num_processes", "two", "x.py"])):
        runs = variants(args)
        seconds: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(ROUNDS):
            for name, command in runs.items():
                seconds[name].append(timed(command))
        medians = {name: statistics.median(values) for name, values in seconds.items()}
        floor = medians["floor (argparse alone)"]
        print(f"{title} ({ROUNDS} rounds, median wall)")
        for name, value in medians.items():
            print(f"  {name:24s} {value * 1000:8.1f} ms  {value / floor:6.2f}x the floor")
        print(f"  nbaccel / accelerate     {medians['nbaccel'] / medians['accelerate']:.3f}")


if __name__ == "__main__":
    main()
