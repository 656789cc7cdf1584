"""Launch speed: 2 CPU workers that init the process group, all_reduce once and return.

Variants, interleaved round by round in one run:
  floor       raw torch.multiprocessing.start_processes(fork) + init_process_group + all_reduce, nothing
              more (no destroy_process_group: tearing the group down is not part of the job)
  nbaccel     nbaccel.notebook_launcher as a user runs it: PartialState() in the worker, the default
              dashboard ("auto"; its output is captured), results returned, output forwarded, supervision
  accelerate  accelerate.notebook_launcher with PartialState(cpu=True) inside (when installed)
Goals: nbaccel <= 1.3x floor and <= 0.4x accelerate (issue 17). Also the cost of one telemetry message from a worker
(`telemetry.log_metrics`, one per step) against a small training step (goal: < 1%).
Run: python benchmarks/launch.py [rounds]
"""

from __future__ import annotations

import contextlib
import io
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as torch_mp  # noqa: E402

from nbaccel import notebook_launcher  # noqa: E402
from nbaccel.utils.other import get_free_port  # noqa: E402


def free_port() -> int:
    # below the ephemeral range: a port from bind(0) could become another connection's source port before the
    # ranks bind it (a run hung 12 min in Accelerate's variant, its rank 1 connecting to a store never opened)
    return get_free_port("127.0.0.1")


def floor_worker(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    value = torch.ones(1)
    dist.all_reduce(value)


def run_floor() -> None:
    torch_mp.start_processes(floor_worker, args=(free_port(),), nprocs=2, start_method="fork")


def nbaccel_worker() -> float:
    from nbaccel import PartialState

    PartialState()
    value = torch.ones(1)
    dist.all_reduce(value)
    return value.item()


def run_nbaccel() -> None:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        results = notebook_launcher(nbaccel_worker, num_processes=2)  # dashboard="auto", as a user's call
    assert results == [2.0, 2.0], results


def accelerate_worker() -> None:
    from accelerate import PartialState

    PartialState(cpu=True)
    value = torch.ones(1)
    dist.all_reduce(value)


def run_accelerate() -> None:
    import accelerate

    with contextlib.redirect_stdout(io.StringIO()):
        accelerate.notebook_launcher(accelerate_worker, num_processes=2, use_port=str(free_port()))


def telemetry_cost(steps: int = 2000) -> tuple[float, float]:
    """(seconds per log_metrics call, seconds per small training step), measured inside a worker."""

    def measure() -> tuple[float, float]:
        from nbaccel import telemetry

        model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        data, target = torch.randn(64, 256), torch.randint(0, 10, (64,))
        start = time.perf_counter()
        for _ in range(200):
            loss = torch.nn.functional.cross_entropy(model(data), target)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        step = (time.perf_counter() - start) / 200
        assert telemetry.is_attached()
        start = time.perf_counter()
        for i in range(steps):
            telemetry.log_metrics({"loss": 0.5, "lr": 0.01}, step=i)
        return (time.perf_counter() - start) / steps, step

    return notebook_launcher(measure, num_processes=2, dashboard=False)[0]


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 21
    variants = {"floor": run_floor, "nbaccel": run_nbaccel}
    try:
        import accelerate  # noqa: F401

        variants["accelerate"] = run_accelerate
    except ImportError:
        print("accelerate not installed: comparing with the floor only")
    for run in variants.values():  # warm-up: imports, first-use costs
        run()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, run in variants.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(values) for name, values in times.items()}
    print(f"launch of 2 CPU workers (init_process_group + all_reduce + return), median of {rounds} rounds:")
    for name, value in medians.items():
        print(f"  {name:<11} {value * 1000:8.1f} ms   (min {min(times[name]) * 1000:.1f} ms)")
    mins = {name: min(values) for name, values in times.items()}
    print(f"nbaccel / floor      = {medians['nbaccel'] / medians['floor']:.2f}x median, "
          f"{mins['nbaccel'] / mins['floor']:.2f}x min   (goal <= 1.3x)")
    if "accelerate" in medians:
        print(f"nbaccel / accelerate = {medians['nbaccel'] / medians['accelerate']:.2f}x median, "
              f"{mins['nbaccel'] / mins['accelerate']:.2f}x min   (goal <= 0.4x)")
        print(f"floor / accelerate   = {medians['floor'] / medians['accelerate']:.2f}x median "
              "(the lowest ratio any launcher on the same start method can reach)")
    per_log, per_step = telemetry_cost()
    print(f"telemetry: {per_log * 1e6:.1f} us per log_metrics call; small training step {per_step * 1e3:.2f} ms "
          f"-> {100 * per_log / per_step:.2f}% overhead at one log per step (goal < 1%)")


if __name__ == "__main__":
    main()
