"""Launching a small training: the first three launches from one kernel, 2 CPU ranks.

Each rank builds a Linear model and an SGD optimizer, takes one synchronized step and returns its loss. Every
torch optimizer imports torch._dynamo when the first one is built (about 2.3 s of CPU here), so a launch
whose ranks are new processes pays that in each rank unless the kernel already holds the module (nbaccel's
kernel imports it before the launch after one whose ranks imported it). A fresh "kernel" process per variant
and round (so no variant inherits another's imports) times its first three launches; the variants run in a
shuffled order each round.

Variants:
  nbaccel          nbaccel.notebook_launcher: Accelerator(), prepare, backward, step (dashboard off)
  accelerate       accelerate.notebook_launcher with the same function (Accelerator(cpu=True))
  floor            raw torch.multiprocessing.start_processes(fork): init_process_group, DDP, SGD, one step
  floor, preload   the same, after the parent imported torch._dynamo once, untimed (what nbaccel's kernel holds
                   from its second launch on)
Run: python benchmarks/launch_training.py [rounds]
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

KERNEL = textwrap.dedent("""
    import json, os, socket, sys, time
    # Where lomo-optim is installed, Accelerate imports it, and with it transformers (~0.5 s), at every
    # prepare_optimizer. Hidden here, for both libraries: the launches are timed as a user without LOMO
    # gets them.
    sys.modules.setdefault("lomo_optim", None)
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as torch_mp

    variant = sys.argv[1]

    def step(model, optimizer, backward):
        loss = model(torch.ones(8, 16)).square().mean()
        backward(loss)
        optimizer.step()
        return float(loss)

    def with_library(lib_name, **accelerator_kwargs):
        def train():
            import importlib
            lib = importlib.import_module(lib_name)
            accelerator = lib.Accelerator(**accelerator_kwargs)
            torch.manual_seed(0)
            model = torch.nn.Linear(16, 1)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            model, optimizer = accelerator.prepare(model, optimizer)
            return step(model, optimizer, accelerator.backward)
        return train

    def floor_rank(rank, port):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
        dist.init_process_group("gloo", rank=rank, world_size=2)
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        step(model, optimizer, lambda loss: loss.backward())

    from nbaccel.utils.other import get_free_port

    def free_port():  # below the ephemeral range, as every launch's port (utils/other.py get_free_port)
        return get_free_port("127.0.0.1")

    if variant == "nbaccel":
        from nbaccel import notebook_launcher
        launch = lambda: notebook_launcher(with_library("nbaccel"), num_processes=2, dashboard=False)
    elif variant == "accelerate":
        import accelerate
        from accelerate import notebook_launcher
        train = with_library("accelerate", cpu=True)
        launch = lambda: notebook_launcher(train, num_processes=2, use_port=str(free_port()))
    else:
        if variant == "floor, preload":
            import torch._dynamo
        launch = lambda: torch_mp.start_processes(floor_rank, args=(free_port(),), nprocs=2, start_method="fork")
    times = []
    for _ in range(3):
        start = time.perf_counter()
        launch()
        times.append(time.perf_counter() - start)
    print("TIMES " + json.dumps(times), flush=True)
""")

VARIANTS = ("nbaccel", "accelerate", "floor", "floor, preload")


def run_kernel(variant: str) -> list[float]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", KERNEL, variant], capture_output=True, text=True, env=env,
                          timeout=300, cwd=ROOT)
    line = next((line for line in done.stdout.splitlines() if line.startswith("TIMES ")), None)
    if done.returncode != 0 or line is None:
        raise RuntimeError(f"{variant} failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return json.loads(line[len("TIMES "):])


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    try:
        import accelerate  # noqa: F401

        variants = list(VARIANTS)
    except ImportError:
        print("accelerate not installed: nbaccel and the floors only")
        variants = [v for v in VARIANTS if v != "accelerate"]
    times: dict[str, list[list[float]]] = {name: [] for name in variants}
    for _ in range(rounds):
        random.shuffle(variants)
        for name in variants:
            times[name].append(run_kernel(name))
    medians = {name: [statistics.median(t[i] for t in values) for i in range(3)] for name, values in times.items()}
    print(f"launch of a one-step training on 2 CPU ranks, median of {rounds} fresh kernels "
          f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")
    print(f"  {'':<16} {'1st launch':>12} {'2nd launch':>12} {'3rd launch':>12}")
    for name in VARIANTS:
        if name in medians:
            print(f"  {name:<16}" + "".join(f" {value:10.3f} s" for value in medians[name]))
    mine = medians["nbaccel"]
    for other in ("floor", "floor, preload", "accelerate"):
        if other in medians:
            print(f"nbaccel / {other:<15}" + "".join(f"   {label} {a / b:5.2f}x" for label, a, b in
                                                        zip(("1st", "2nd", "3rd"), mine, medians[other])))

if __name__ == "__main__":
    main()
