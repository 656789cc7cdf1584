"""Start-up cost of `nbaccel launch` against the floor (`torchrun`, the same elastic agent without nbaccel).

`accelerate launch` is not a variant: it cannot start several CPU processes from the command line
(`--cpu --num_processes 2` runs one plain process; `--multi_gpu --cpu` is refused; MULTI_CPU goes through mpirun).

Each variant runs the same 2-process CPU script (join the gloo group, one all_reduce, exit); the variants are
interleaved round by round so machine load hits them alike. Prints median wall times and ratios to torchrun.
`nbaccel, unwatched` runs the ranks with `--no_python python script` (no script entry, no collective watch):
what `nbaccel launch`'s deadlock detection costs at start-up.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
assert t.item() == dist.get_world_size()
dist.destroy_process_group()
"""
ROUNDS = int(os.environ.get("NBACCEL_BENCH_ROUNDS", "5"))


def variants(script: str) -> dict[str, list[str]]:
    py = sys.executable
    return {
        "torchrun": [py, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone", script],
        "nbaccel launch": [py, "-m", "nbaccel", "launch", "--num_processes", "2", "--cpu", script],
        # the ranks run `python script` directly: no entry, no collective watch (what the watch costs)
        "nbaccel, unwatched": [py, "-m", "nbaccel", "launch", "--num_processes", "2", "--cpu", "--no_python", py,
                               script],
    }


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        script = str(Path(tmp) / "allreduce.py")
        Path(script).write_text(SCRIPT)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               "OMP_NUM_THREADS": "1", "NBACCEL_CONFIG_FILE": str(Path(tmp) / "none.yaml")}
        times: dict[str, list[float]] = {name: [] for name in variants(script)}
        for _ in range(ROUNDS):
            for name, cmd in variants(script).items():
                start = time.perf_counter()
                subprocess.run(cmd, env=env, check=True, timeout=300, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
                times[name].append(time.perf_counter() - start)
    floor = statistics.median(times["torchrun"])
    print(f"2 CPU processes, join + one all_reduce + exit; median of {ROUNDS} interleaved rounds")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:18s} {median:6.2f} s   x{median / floor:.2f} vs torchrun")


if __name__ == "__main__":
    main()
