"""What live progress bars cost a training loop: a tqdm loop of fast steps on 2 ranks, three ways.

- `handled`: nbaccel's handling, as in a notebook: the bar goes to the rank's stderr pipe; the kernel reads
  it as a terminal would (launch/screen.py), sends `live` messages to observers and the cell renderer,
  and prints the final state once.
- `lines`: the same launch with the kernel forwarding plain lines only (the line splitter nbaccel used
  before live bars; a bar's redraws are then held back and printed as one `\\r` history at the end).
- `discarded`: the bar writes to os.devnull: no output cost at all (the floor).

Each rank times its own loop (`perf_counter` around it, launch excluded); a round's time is the slower
rank's. Variants alternate round by round so drifts in machine load hit all three; ratios are of medians.

    python benchmarks/live_output.py [--rounds 7] [--steps 10000]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("OMP_NUM_THREADS", "1")

from nbaccel import notebook_launcher  # noqa: E402
from nbaccel.launch.kernel import supervisor  # noqa: E402

VARIANTS = ("handled", "lines", "discarded")


def tqdm_loop(steps: int, discard: bool) -> float:
    """`steps` fast steps (a little arithmetic each) under a tqdm bar; returns the loop's seconds."""
    from tqdm import tqdm

    sink = open(os.devnull, "w") if discard else None
    total = 0
    started = time.perf_counter()
    for step in tqdm(range(steps), file=sink):
        total += sum(i * step for i in range(200))
    seconds = time.perf_counter() - started
    if sink is not None:
        sink.close()
    return seconds


class LinesOnly:
    """The kernel-side line splitter without a screen model: complete lines only, `\\r` kept in them."""

    def __init__(self, deliver: Callable[[str], None], *_: object) -> None:
        self._deliver = deliver
        self._partial = ""

    def feed(self, data: bytes) -> None:
        *lines, self._partial = (self._partial + data.decode("utf-8", "replace")).split("\n")
        for line in lines:
            self._deliver(line.rstrip("\r"))

    def finish(self) -> None:
        if self._partial:
            self._deliver(self._partial)
        self._partial = ""


@contextlib.contextmanager
def forwarding(variant: str) -> Iterator[None]:
    saved = supervisor.LineForwarder
    if variant == "lines":
        supervisor.LineForwarder = LinesOnly
    try:
        yield
    finally:
        supervisor.LineForwarder = saved


def run(variant: str, steps: int) -> float:
    live: list[dict] = []
    with forwarding(variant), contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        seconds = notebook_launcher(tqdm_loop, (steps, variant == "discarded"), num_processes=2, dashboard=False,
                                    observers=[lambda message: live.append(message) if message["kind"] == "live"
                                               else None])
    if variant == "handled" and not live:
        raise RuntimeError("the handled variant sent no live messages: nbaccel's handling did not run")
    return max(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10_000)
    args = parser.parse_args()
    times: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    run("handled", 200)  # warm-up: imports and the first fork
    for round_index in range(args.rounds):
        order = VARIANTS if round_index % 2 == 0 else tuple(reversed(VARIANTS))
        for variant in order:
            times[variant].append(run(variant, args.steps))
    medians = {variant: statistics.median(values) for variant, values in times.items()}
    print(f"tqdm loop of {args.steps} steps on 2 ranks, {args.rounds} rounds (loop seconds, slower rank):")
    for variant in VARIANTS:
        values = " ".join(f"{value:.3f}" for value in times[variant])
        print(f"  {variant:<10} median {medians[variant]:.3f} s  ({args.steps / medians[variant]:,.0f} steps/s)  [{values}]")
    floor = medians["discarded"]
    print(f"ratio handled / discarded: {medians['handled'] / floor:.3f} (goal <= 1.05)")
    print(f"ratio lines / discarded:   {medians['lines'] / floor:.3f}")
    print(f"ratio handled / lines:     {medians['handled'] / medians['lines']:.3f}")


if __name__ == "__main__":
    main()
