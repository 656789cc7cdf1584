"""Benchmark: the kernel's share of a launch's collective trace (kernel/collective_tracker.py), per collective.

    python benchmarks/collective_tracker.py [--collectives 20000] [--reps 7]

A launched rank sends an `enter` and an `exit` message per traced collective; the kernel's supervisor hands
each to `CollectiveTracker.on_message`, which compares every rank's n-th collective with the other ranks'
n-th as it arrives (a divergence is named at once). On a 2-core machine that work competes with the ranks.
Timed here, in one process, for 2 ranks gathering issue 42's dict (16 float32 tensors of 1,024 elements:
16 shapes per record), two ways interleaved in each repetition:
- `as it is`: records that agree in operation, call and shapes are passed over without building the hang
  report's pair (`collective_tracker._same_meeting`);
- `every pair built`: that check made to answer no, so every pair goes through `hang_report.difference`
  (the tracker before the check).
The messages are prebuilt, as the supervisor receives them unpickled. Printed: median microseconds per
collective of both ranks, and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nbaccel.launch.kernel import collective_tracker  # noqa: E402


def _messages(count: int) -> list[dict]:
    started = time.time()
    return [{"op": "gather", "call": "all_gather_single", "shapes": [[1024] for _ in range(16)],
             "dtypes": ["float32"] * 16, "site": "cell 3, line 4", "started": started + i * 1e-4,
             "seq": i + 1, "event": "enter", "kind": "collective", "rank": 0, "time": started}
            for i in range(count)]


def _feed(messages: list[dict]) -> float:
    """Seconds per collective for 2 ranks: each rank's enter, then its exit, rank by rank."""
    tracker = collective_tracker.CollectiveTracker()
    on_message, leave = tracker.on_message, {"event": "exit", "op": "gather"}
    start = time.perf_counter()
    for message in messages:
        on_message(0, message)
        on_message(0, leave)
        on_message(1, message)
        on_message(1, leave)
    assert tracker.divergence is None
    return (time.perf_counter() - start) / len(messages)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--collectives", type=int, default=20000)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    messages = _messages(args.collectives)
    same_meeting = collective_tracker._same_meeting
    ways = {"as it is": same_meeting, "every pair built": lambda one, other: False}
    times: dict[str, list[float]] = {name: [] for name in ways}
    for rep in range(args.reps):
        for name in (list(ways) if rep % 2 == 0 else list(reversed(ways))):
            collective_tracker._same_meeting = ways[name]
            times[name].append(_feed(messages))
    collective_tracker._same_meeting = same_meeting
    medians = {name: statistics.median(values) for name, values in times.items()}
    print(f"{args.collectives} collectives of 2 ranks, {args.reps} repetitions interleaved; median per collective:")
    for name, value in medians.items():
        print(f"  {name:<18} {value * 1e6:7.2f} us   {value / medians['as it is']:.2f}x as it is")


if __name__ == "__main__":
    main()
