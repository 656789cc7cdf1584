"""Check every distributed operation across the ranks of this launch; exit non-zero on any failure.

Run on N processes: `torchrun --nproc_per_node 2 check_operations.py` or `nbaccel launch` / `nbaccel test`.
It sets up the process group through `nbaccel.state.PartialState` when that is importable (otherwise from
the launcher's environment), runs each check on every rank, and prints one line per check on rank 0
("ok   <name>" or "FAIL <name>: <why>"; failing ranks also print their own line).
"""

from __future__ import annotations

import collections
import datetime
import os
import sys
import traceback
from pathlib import Path

if __name__ == "__main__" and __package__ in (None, ""):  # run as a file: make this checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch
import torch.distributed as dist

Pair = collections.namedtuple("Pair", "left right")


def _setup() -> torch.device:
    """Initialize the process group; return the device each rank works on."""
    try:
        from nbaccel.state import PartialState
    except ImportError:
        PartialState = None
    if PartialState is not None:
        return torch.device(PartialState().device)
    if not dist.is_initialized():
        use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("WORLD_SIZE", "1"))
        if use_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if "RANK" in os.environ:
            dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(seconds=60))
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _checks(rank: int, world: int, device: torch.device) -> dict:
    from nbaccel.utils import operations as ops

    def arange(n: int, offset: float = 0.0) -> torch.Tensor:
        return torch.arange(n, dtype=torch.float32, device=device) + offset

    def check_gather() -> None:
        data = {"a": [arange(4, 10 * rank).reshape(2, 2)], "b": Pair(torch.tensor(float(rank), device=device), None)}
        data["b"] = Pair(data["b"].left, arange(3).reshape(3, 1)[:, 0])  # non-contiguous view
        out = ops.gather(data)
        expected = torch.cat([arange(4, 10 * r).reshape(2, 2) for r in range(world)])
        assert torch.equal(out["a"][0], expected), out["a"][0]
        assert isinstance(out["b"], Pair) and out["b"].left.reshape(-1).tolist() == [float(r) for r in range(world)]
        assert out["b"].right.shape == (3 * world,)

    def check_reduce() -> None:
        value = arange(3, rank)
        total = sum(range(world))
        assert ops.reduce(value, "sum").tolist() == [i * world + total for i in range(3)]
        assert torch.allclose(ops.reduce(value, "mean"), arange(3, total / world))
        assert ops.reduce({"m": value}, "max")["m"].tolist() == arange(3, world - 1).tolist()
        try:
            ops.reduce(value, "avg")
        except ValueError:
            pass
        else:
            raise AssertionError("an unknown reduction was accepted")

    def check_broadcast() -> None:
        data = [arange(4, rank), {"i": torch.full((2,), rank, dtype=torch.int64, device=device)}]
        ops.broadcast(data, from_process=world - 1)
        assert data[0].tolist() == arange(4, world - 1).tolist() and data[1]["i"].tolist() == [world - 1] * 2

    def check_pad_across_processes() -> None:
        padded = ops.pad_across_processes(arange(rank + 1), pad_index=-1)
        assert padded.shape == (world,) and padded[rank + 1 :].eq(-1).all()
        first = ops.pad_across_processes({"x": arange(rank + 1)}, pad_first=True)["x"]
        assert first[-1].item() == rank and first.shape == (world,)

    def check_gather_object() -> None:
        assert ops.gather_object([{"rank": rank}]) == [{"rank": r} for r in range(world)]
        assert [len(s) for s in ops.gather_object(["x" * 5000 * (rank + 1)])] == [5000 * (r + 1) for r in range(world)]

    def check_broadcast_object_list() -> None:
        objects = [{"seed": 7}, list(range(3000))] if rank == 0 else [None, None]
        ops.broadcast_object_list(objects)
        assert objects == [{"seed": 7}, list(range(3000))]

    def check_copy_tensor_to_devices() -> None:
        out = ops.copy_tensor_to_devices(arange(6).reshape(2, 3) if rank == 0 else None)
        assert out.tolist() == arange(6).reshape(2, 3).tolist()

    def check_wait_for_everyone() -> None:
        ops.wait_for_everyone()

    return {name[len("check_"):]: fn for name, fn in locals().items() if name.startswith("check_")}


def main() -> int:
    device = _setup()
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    failures = 0
    for name, check in _checks(rank, world, device).items():
        try:
            check()
            ok = 1
        except Exception as exc:
            ok = 0
            print(f"FAIL {name} [rank {rank}]: {type(exc).__name__}: {exc}", flush=True)
            traceback.print_exc()
        if world > 1:  # every rank learns whether the check passed everywhere
            flag = torch.tensor([ok], dtype=torch.int64, device=device)
            dist.all_reduce(flag, dist.ReduceOp.MIN)
            ok = int(flag.item())
        failures += 1 - ok
        if rank == 0 and ok:
            print(f"ok   {name} ({world} processes, {device.type})", flush=True)
    if rank == 0:
        print(f"{'all operations passed' if not failures else f'{failures} check(s) failed'}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    code = main()
    if dist.is_initialized():
        dist.barrier()  # every rank is done before any tears down its connections
        dist.destroy_process_group()
    sys.exit(code)
