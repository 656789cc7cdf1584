"""Training-loop overhead: steps per second of a small MLP on 2 gloo processes, variants interleaved.

Variants (each rank alternates between them step by step, in rotating order, in one run, so the load
that the machine's other users add falls on all of them alike):
- floor: hand-written DistributedDataParallel loop with a DistributedSampler (what nbaccel adds overhead to)
- nbaccel: `nbaccel.Accelerator` prepare + backward + step, the README loop
- accelerate: Hugging Face Accelerate's Accelerator(cpu=True), same loop (when installed)

MLP 784-512-512-10, batch 64 per rank, SGD, synthetic data held in memory. Prints steps/s per variant
(all steps, epoch boundaries included), the median step time, and the ratios. Goal: nbaccel at most 2% slower than the floor and not slower
than Accelerate. Usage: python benchmarks/train.py [--rounds 20] [--steps 20]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nbaccel.utils.other import get_free_port  # noqa: E402  (ports below the ephemeral range)

BATCH = 64




def _model():
    import torch

    return torch.nn.Sequential(
        torch.nn.Flatten(), torch.nn.Linear(784, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(),
        torch.nn.Linear(512, 10),
    )


def _dataset(steps: int, world: int):
    import torch

    gen = torch.Generator().manual_seed(0)
    n = BATCH * world * steps
    return torch.utils.data.TensorDataset(torch.randn(n, 784, generator=gen), torch.randint(0, 10, (n,), generator=gen))


def _floor(steps: int, world: int):
    import torch
    import torch.distributed as dist

    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    dataset = _dataset(steps, world)
    sampler = torch.utils.data.distributed.DistributedSampler(dataset, world, dist.get_rank(), shuffle=True)
    loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH, sampler=sampler)

    def run():
        epoch = 0
        while True:
            sampler.set_epoch(epoch)
            epoch += 1
            for x, y in loader:
                loss = torch.nn.functional.cross_entropy(model(x), y)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                yield

    return run()


def _with_accelerator(accelerator_cls, steps: int, world: int, **kwargs):
    import torch

    torch.manual_seed(0)
    accelerator = accelerator_cls(**kwargs)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(_dataset(steps, world), batch_size=BATCH, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    def run():
        while True:
            for x, y in loader:
                loss = torch.nn.functional.cross_entropy(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                yield

    return run()


def _worker(rank: int, world: int, port: int, rounds: int, steps: int, floor_twice: bool, queue) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from nbaccel import Accelerator

        variants = {"floor": _floor(steps, world), "nbaccel": _with_accelerator(Accelerator, steps, world)}
        try:
            import accelerate

            variants["accelerate"] = _with_accelerator(accelerate.Accelerator, steps, world, cpu=True)
        except ImportError:
            pass
        if floor_twice:  # an A/A check: how far apart two identical variants come out on this machine
            variants["floor-again"] = _floor(steps, world)
        names = list(variants)
        for _ in range(steps):  # warm-up: one epoch each
            for name in names:
                next(variants[name])
        times: dict[str, list[float]] = {name: [] for name in names}
        clock = time.perf_counter
        for cycle in range(rounds * steps):
            shift = cycle % len(names)
            for name in names[shift:] + names[:shift]:
                start = clock()
                next(variants[name])
                times[name].append(clock() - start)
        queue.put((rank, times))
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20, help="epochs timed per variant")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per epoch")
    parser.add_argument("--floor-twice", action="store_true", help="add a second floor variant (A/A check)")
    args = parser.parse_args()
    world = 2
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = get_free_port("127.0.0.1")
    procs = [ctx.Process(target=_worker, args=(r, world, port, args.rounds, args.steps, args.floor_twice, queue)) for r in range(world)]
    for proc in procs:
        proc.start()
    results = {}
    try:
        for _ in range(world):
            rank, rates = queue.get(timeout=900)
            results[rank] = rates
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    times = results[0]
    total = {name: sum(values) for name, values in times.items()}
    rate = {name: len(times[name]) / total[name] for name in times}
    median = {name: statistics.median(values) for name, values in times.items()}

    print(f"MLP 784-512-512-10, batch {BATCH} per rank, {world} gloo processes, variants alternating step by "
          f"step (rotating order), {len(times['floor'])} steps each, epochs of {args.steps} steps")
    for name in times:
        print(f"  {name:<11} {rate[name]:8.1f} steps/s overall, median step {median[name] * 1e3:6.2f} ms")
    print(f"  nbaccel / floor      = {rate['nbaccel'] / rate['floor']:.3f} overall, "
          f"{median['floor'] / median['nbaccel']:.3f} by median step  (goal >= 0.98: a step at most 1.02x the floor)")
    if "accelerate" in times:
        print(f"  nbaccel / accelerate = {rate['nbaccel'] / rate['accelerate']:.3f} overall, "
              f"{median['accelerate'] / median['nbaccel']:.3f} by median step  (goal >= 1.00)")
        print(f"  accelerate / floor   = {rate['accelerate'] / rate['floor']:.3f} overall")
    if "floor-again" in times:
        print(f"  floor-again / floor  = {rate['floor-again'] / rate['floor']:.3f} overall, "
              f"{median['floor'] / median['floor-again']:.3f} by median step  (A/A: the noise floor)")

if __name__ == "__main__":
    main()
