"""Hello from every rank: the bundled example (`./run.sh demo` runs it on 2 CPU processes through
`nbaccel launch --num_processes 2 --cpu examples/hello_ranks.py`).

Each process builds the shared state, takes part in an all-reduce and a gather, and says what it saw.
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist


def setup() -> tuple[int, int, torch.device]:
    """(rank, world size, device) from nbaccel's PartialState; plain torch.distributed while it is missing."""
    try:
        from nbaccel.state import PartialState
    except ModuleNotFoundError as exc:
        if exc.name != "nbaccel.state":
            raise
        if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            dist.init_process_group("gloo")
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        return rank, world, torch.device("cpu")
    state = PartialState()
    return state.process_index, state.num_processes, state.device


def main() -> None:
    rank, world, device = setup()
    # all_reduce: every rank contributes rank + 1, so everyone gets 1 + 2 + ... + world.
    value = torch.tensor([float(rank + 1)], device=device)
    if world > 1:
        dist.all_reduce(value)
    # gather: every rank learns who the others are.
    mine = f"{rank}@{socket.gethostname()}"
    everyone = [None] * world
    if world > 1:
        dist.all_gather_object(everyone, mine)
    else:
        everyone = [mine]
    expected = world * (world + 1) / 2
    status = "ok" if value.item() == expected else f"WRONG (expected {expected:g})"
    print(f"rank {rank}/{world} on {device.type}: all_reduce(sum of rank+1) = {value.item():g} {status}; "
          f"gathered {everyone}", flush=True)
    if dist.is_initialized():
        dist.barrier()
    if rank == 0:
        print(f"Hello from {world} process(es): all ranks took part.", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    if status != "ok":
        raise SystemExit(1)


if __name__ == "__main__":
    main()
