"""The rendezvous of 2 forked gloo ranks: torch's FileStore, torch's env:// TCPStore and nbaccel's QuickFileStore.

The second rank starts `gap` ms after the first (as a launch's second fork does, ~3.5 ms on 2 cores); measured:
the second rank's `init_process_group` + `barrier` (what `PartialState()` does), the launch's critical path.
The three variants run interleaved, one launch each per round. Reports median and quartiles.
Run: python benchmarks/file_rendezvous.py [rounds] [gap_ms]
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch.distributed as dist  # noqa: E402

from nbaccel.utils.file_rendezvous import QuickFileStore  # noqa: E402
from nbaccel.utils.other import get_free_port  # noqa: E402


def init(variant: str, folder: str, port: int, rank: int) -> None:
    if variant == "FileStore":
        dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=2)
    elif variant == "TCPStore (env://)":
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=2)
    else:
        store = QuickFileStore(f"{folder}/store", 2, timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    dist.barrier()


def one_launch(variant: str, gap: float) -> float:
    """Seconds the second rank spent in the rendezvous."""
    folder = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    port = get_free_port()
    read_end, write_end = os.pipe()
    pids = []
    for rank in range(2):
        pid = os.fork()
        if pid == 0:
            if rank == 1:
                time.sleep(gap)
            start = time.perf_counter()
            init(variant, folder, port, rank)
            if rank == 1:
                os.write(write_end, f"{time.perf_counter() - start}\n".encode())
            os._exit(0)
        pids.append(pid)
    for pid in pids:
        os.waitpid(pid, 0)
    spent = float(os.read(read_end, 100))
    os.close(read_end)
    os.close(write_end)
    for name in os.listdir(folder):
        os.remove(os.path.join(folder, name))
    os.rmdir(folder)
    return spent


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 25
    gap = float(sys.argv[2]) / 1000 if len(sys.argv) > 2 else 0.0035
    variants = ["FileStore", "TCPStore (env://)", "QuickFileStore"]
    times: dict[str, list[float]] = {variant: [] for variant in variants}
    load = [os.getloadavg()[0]]
    for _ in range(rounds):
        for variant in variants:
            times[variant].append(one_launch(variant, gap))
    load.append(os.getloadavg()[0])
    print(f"the second rank's init_process_group + barrier, started {gap * 1000:.1f} ms after the first; {rounds} "
          f"rounds, load average {min(load):.1f}-{max(load):.1f}")
    for variant, values in times.items():
        low, median, high = statistics.quantiles(values, n=4)
        print(f"  {variant:<18} median {median * 1000:6.2f} ms   quartiles {low * 1000:6.2f}-{high * 1000:6.2f} ms")


if __name__ == "__main__":
    main()
