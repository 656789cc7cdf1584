"""What the dashboard costs a training loop: steps per second with it on vs off, interleaved in one run.

Two measurements, both with one `log` per step (the metric messages travel as they happen) and the
memory/step sampler running at its default rate:

- worker: the worker-side cost alone. The same process trains with `nbaccel.telemetry` attached to a sink
  that writes every message into a multiprocessing Pipe (drained by a reader process, as the kernel
  does), vs detached (every report a no-op).
- launcher: end to end through `nbaccel.notebook_launcher(..., dashboard=...)` on 2 CPU ranks, the
  dashboard ("plain" view, so it runs outside a notebook) vs `dashboard=False`. Runs when nbaccel.launch
  is present.

Variants alternate round by round so drifts in machine load hit both; the ratio is of medians.

    python benchmarks/dashboard.py [--rounds 7] [--steps 300] [--skip-launcher]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from nbaccel import telemetry  # noqa: E402


def make_training(width: int = 256, batch: int = 64, seed: int = 0):
    """A small MLP step on CPU: forward, backward, SGD step; `one_step(step)` returns the loss."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                                torch.nn.ReLU(), torch.nn.Linear(width, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    inputs, targets = torch.randn(batch, width), torch.randn(batch, 1)

    def one_step(step: int) -> float:
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = loss.item()
        telemetry.report_step(step)  # what the prepared optimizer does
        telemetry.log_metrics({"loss": value, "lr": 1e-3}, step=step)  # accelerator.log, once per step
        return value

    return one_step


def _drain(conn, writer) -> None:
    writer.close()  # the forked copy of the writing end: without closing it, EOF never comes
    try:
        while True:
            conn.recv()
    except (EOFError, OSError):
        pass


class PipeSink:
    """A sink like the launcher's: pickles each message into a Pipe under a lock."""

    def __init__(self, conn):
        import threading

        self.conn, self.lock = conn, threading.Lock()

    def __call__(self, message):
        with self.lock:
            self.conn.send(message)


WORKER_OFF: list[float] = []
CPU_US: dict[str, list[float]] = {"off": [], "on": []}  # process CPU time per step (all threads), by variant


def timed_steps(one_step, steps: int, start: int, variant: str | None = None) -> float:
    began, cpu = time.perf_counter(), time.process_time()
    for step in range(start, start + steps):
        one_step(step)
    if variant is not None:
        CPU_US[variant].append((time.process_time() - cpu) / steps * 1e6)
    return steps / (time.perf_counter() - began)


def bench_worker(rounds: int, steps: int) -> dict[str, list[float]]:
    ctx = mp.get_context("fork")
    reader, writer = ctx.Pipe(duplex=False)
    drain = ctx.Process(target=_drain, args=(reader, writer), daemon=True)
    drain.start()
    reader.close()
    sink = PipeSink(writer)
    one_step = make_training()
    timed_steps(one_step, steps, 1)  # warm-up
    rates: dict[str, list[float]] = {"off": [], "on": []}
    step = 1
    for index in range(rounds):
        for variant in ("off", "on") if index % 2 == 0 else ("on", "off"):
            if variant == "on":
                telemetry.attach(sink, 0)
                telemetry.start_sampler(0.5)
            rates[variant].append(timed_steps(one_step, steps, step, variant))
            step += steps
            if variant == "on":
                telemetry.stop_sampler()
                telemetry.detach()
    writer.close()
    drain.join(timeout=5)
    return rates


def per_call_costs(calls: int = 20000) -> dict[str, float]:
    """Microseconds per report on the training thread (one report_step + one log_metrics), detached and
    attached with the sampler running, and per queued message when the sampler thread sends it into the
    Pipe. Deterministic enough to compare with a step time on a loaded machine, where steps/s is not."""
    ctx = mp.get_context("fork")
    reader, writer = ctx.Pipe(duplex=False)
    drain = ctx.Process(target=_drain, args=(reader, writer), daemon=True)
    drain.start()
    reader.close()
    costs = {}

    def loop() -> float:
        began = time.perf_counter()
        for step in range(calls):
            telemetry.report_step(step)
            telemetry.log_metrics({"loss": 0.5, "lr": 1e-3}, step=step)
        return (time.perf_counter() - began) / calls * 1e6

    costs["detached"] = min(loop() for _ in range(3))
    telemetry.attach(PipeSink(writer), 0)
    telemetry.start_sampler(3600)  # running (so reports are queued) but not waking during the loop
    costs["attached"] = min(loop() for _ in range(3))
    sampler = telemetry._current().sampler
    telemetry._current().queue.clear()
    # What one sampler tick sends: the logs of a quarter second at 200 steps/s, as one message.
    per_tick, ticks, spent = 50, 200, 0.0
    for _ in range(ticks):
        for step in range(per_tick):
            telemetry.log_metrics({"loss": 0.5, "lr": 1e-3}, step=step)
        began = time.perf_counter()
        sampler.flush()
        spent += time.perf_counter() - began
    costs["send_per_message"] = spent / (ticks * per_tick) * 1e6
    telemetry.stop_sampler()
    telemetry.detach()
    writer.close()
    drain.join(timeout=10)
    return costs


def kernel_observe_cost(steps: int = 5000, ranks: int = 2) -> float:
    """Microseconds the kernel spends per channel message in `Dashboard.observe` (model update plus the
    throttled redraws of the plain view), over a stream of step + metrics messages from `ranks` ranks."""
    from nbaccel import Dashboard

    dashboard = Dashboard(ranks, mode="plain", plain_interval=3600)
    with contextlib.redirect_stdout(io.StringIO()):
        dashboard.start()
        messages = []
        now = time.time()
        for step in range(1, steps + 1):
            for rank in range(ranks):
                messages.append({"kind": "step", "rank": rank, "time": now + step * 1e-3, "step": step,
                                 "total": steps})
                messages.append({"kind": "metrics", "rank": rank, "time": now + step * 1e-3,
                                 "values": {"loss": 1.0 / step, "lr": 1e-3}, "step": step})
        began = time.perf_counter()
        for message in messages:
            dashboard.observe(message)
        spent = time.perf_counter() - began
        dashboard.finish()
    return spent / len(messages) * 1e6


def _launched(steps: int) -> float:
    one_step = make_training()
    one_step(0)
    return timed_steps(one_step, steps, 1)


def bench_launcher(rounds: int, steps: int) -> dict[str, list[float]] | None:
    try:
        from nbaccel import notebook_launcher
    except (ImportError, AttributeError):
        return None
    rates: dict[str, list[float]] = {"off": [], "on": []}
    for index in range(rounds):
        for variant in ("off", "on") if index % 2 == 0 else ("on", "off"):
            from nbaccel import Dashboard

            dashboard = Dashboard(2, mode="plain") if variant == "on" else False
            with contextlib.redirect_stdout(io.StringIO()):  # the plain view's lines: not this report's
                results = notebook_launcher(_launched, args=(steps,), num_processes=2, dashboard=dashboard)
            rates[variant].append(statistics.mean(results))
    return rates


def report(name: str, rates: dict[str, list[float]]) -> str:
    """Medians of each variant, and the median of the per-round on/off ratios (each round runs both
    variants back to back, so a ratio compares like with like even when the machine's load drifts)."""
    off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
    ratios = sorted(b / a for a, b in zip(rates["off"], rates["on"]))
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) >= 4 else [ratios[0], 0, ratios[-1]]
    line = (f"{name}: off {off:.1f} steps/s, on {on:.1f} steps/s; paired on/off ratio median "
            f"{statistics.median(ratios):.3f} (quartiles {quartiles[0]:.3f}-{quartiles[2]:.3f}, "
            f"{len(ratios)} interleaved rounds)")
    print(line, flush=True)
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--launcher-rounds", type=int, default=6)
    parser.add_argument("--skip-launcher", action="store_true")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, MLP 256x3, batch 64, one log per step", flush=True)
    worker = bench_worker(args.rounds, args.steps)
    WORKER_OFF.extend(worker["off"])
    report("worker (telemetry -> Pipe vs detached)", worker)
    off, on = statistics.median(CPU_US["off"]), statistics.median(CPU_US["on"])
    print(f"worker CPU time per step (this process, all threads): off {off:.0f} us, on {on:.0f} us, "
          f"on/off = {on / off:.3f}", flush=True)
    costs = per_call_costs()
    step_us = 1e6 / statistics.median(WORKER_OFF)
    extra = costs["attached"] - costs["detached"] + costs["send_per_message"]
    print(f"per step on the worker: reports {costs['detached']:.2f} us detached, {costs['attached']:.2f} us "
          f"attached (queued); the sampler thread sends each queued log in {costs['send_per_message']:.1f} us"
          f" -> {extra:.1f} us per step = {100 * extra / step_us:.2f}% of this benchmark's {step_us:.0f} us step",
          flush=True)
    observe_us = kernel_observe_cost()
    print(f"kernel: Dashboard.observe {observe_us:.1f} us per message (model update + throttled redraws); "
          f"one step + one log per step from 2 ranks = {4 * observe_us:.0f} us of kernel CPU per step "
          f"= {100 * 4 * observe_us / step_us:.2f}% of one core at this benchmark's step", flush=True)
    if not args.skip_launcher:
        rates = bench_launcher(args.launcher_rounds, args.steps * 3)
        if rates is None:
            print("launcher: nbaccel.notebook_launcher is not available in this tree; skipped")
        else:
            report("launcher (notebook_launcher dashboard='plain' vs False, 2 ranks)", rates)


if __name__ == "__main__":
    main()
