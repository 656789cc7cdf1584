"""Provoke gloo's abort on a gather of different sizes, many times, beside busy processes, and count the
launches whose error told the wrong story.

    python scripts/stress_abort_reports.py [--launches 60] [--busy 3]

Each launch runs 2 ranks that gather tensors of different sizes (a plain tensor, or a dict of two: the stacked
gather), as tests/test_launch_deadlock.py's `gathers_*` functions do, in a fresh interpreter each (the window
shows in a kernel's first launch, not in a warm loop of launches: 0 wrong of 60 that way before the fix). gloo kills the rank whose buffer is too
small (SIGABRT). Right stories: the differing shapes, or the killed rank with its stack. The wrong one this
counts: a mismatch naming `PartialState`, a collective every rank had left, whose `exit` was still in a
rank's telemetry batch when the other rank died. `--busy N` processes spin meanwhile. Exit status 1 when one
was wrong.

Results (2 shared cores, `--busy 3`, 2026-11-29), before the tracker's fix (collective_tracker.py `at_failure`:
a running rank that shows a collective another rank has returned from is no longer believed there): 1 wrong
of 60 launches (and 4 of 60 in a loop of the two pytest cases); after: 0 of 100 (0 of 100 in the loop).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nbaccel import notebook_launcher  # noqa: E402
from nbaccel.launch import LaunchError  # noqa: E402


def _gathers(as_dict: bool) -> object:
    import torch

    from nbaccel import PartialState
    from nbaccel.utils import gather

    size = 3 + PartialState().process_index
    return gather({"a": torch.ones(size), "b": torch.zeros(size)} if as_dict else torch.ones(size))


def _spin() -> None:
    while True:
        pass


def _one(as_dict: bool) -> None:
    """One launch in this interpreter; its error's text on stdout."""
    try:
        notebook_launcher(_gathers, (as_dict,), num_processes=2, dashboard=False, timeout=60)
        print("returned")
    except LaunchError as error:
        print(error)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=60)
    parser.add_argument("--busy", type=int, default=3)
    parser.add_argument("--one", type=int, choices=(0, 1), help=argparse.SUPPRESS)  # a launch of the loop
    args = parser.parse_args()
    if args.one is not None:
        _one(bool(args.one))
        return 0
    spinners = [mp.get_context("spawn").Process(target=_spin, daemon=True) for _ in range(args.busy)]
    for spinner in spinners:
        spinner.start()
    wrong, stories = [], {"shapes": 0, "killed rank": 0, "other": 0}
    try:
        for launch in range(args.launches):
            started = time.monotonic()
            one = subprocess.run([sys.executable, __file__, "--one", str(launch % 2)], capture_output=True,
                                 text=True, timeout=120)
            message = one.stdout
            if "PartialState" in message:
                wrong.append((launch, message.splitlines()[:3]))
            elif "The shapes differ" in message:
                stories["shapes"] += 1
            elif "killed by SIGABRT" in message:
                stories["killed rank"] += 1
            else:
                stories["other"] += 1
            print(f"launch {launch}: {time.monotonic() - started:.1f} s", file=sys.stderr)
    finally:
        for spinner in spinners:
            spinner.kill()
    print(f"{args.launches} launches beside {args.busy} busy processes: {len(wrong)} wrong; {stories}")
    for launch, lines in wrong:
        print(f"  launch {launch}: " + " / ".join(lines))
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
