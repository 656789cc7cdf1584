"""Hello from every rank: the bundled example (`./run.sh demo` runs it on 2 CPU processes through
`nbaccel launch --num_processes 2 --cpu examples/hello_ranks.py`).

Each process joins the run through `PartialState`, takes part in an all-reduce and a gather, and says what
it saw. The same file runs under `accelerate launch` after replacing `nbaccel` with `accelerate`.
"""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist

from nbaccel.state import PartialState


def main() -> None:
    state = PartialState()  # reads the launcher's environment and initializes the process group once
    rank, world, device = state.process_index, state.num_processes, state.device

    # all_reduce: every rank contributes rank + 1, so everyone gets 1 + 2 + ... + world.
    value = torch.tensor([float(rank + 1)], device=device)
    if state.use_distributed:
        dist.all_reduce(value)
    # gather: every rank learns who the others are.
    everyone = [f"{rank}@{socket.gethostname()}"]
    if state.use_distributed:
        everyone = [None] * world
        dist.all_gather_object(everyone, f"{rank}@{socket.gethostname()}")

    expected = world * (world + 1) / 2
    status = "ok" if value.item() == expected else f"WRONG (expected {expected:g})"
    print(f"rank {rank}/{world} on {device.type}: all_reduce(sum of rank+1) = {value.item():g} {status}; "
          f"gathered {everyone}", flush=True)
    state.wait_for_everyone()
    state.print(f"Hello from {world} process(es): all ranks took part.")  # main process only
    state.destroy_process_group()
    if status != "ok":
        raise SystemExit(1)


if __name__ == "__main__":
    main()
