"""Start-up and barrier cost of the state: nbaccel's PartialState vs raw torch.distributed vs Accelerate.

Start-up: each variant runs as 2 fresh processes on gloo (what every notebook launch pays); measured are
the time to import the state module and the wall time from spawning the pair until both ranks are past
`PartialState()` (detection + `init_process_group`) and a first barrier. Variants are interleaved round by
round. Barrier: in one pair, blocks of raw `dist.barrier()`, nbaccel's and Accelerate's
`wait_for_everyone()` alternate in shuffled order. Medians and ratios are printed. Usage: python benchmarks/state.py [rounds]
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
BLOCKS = 30

from nbaccel.utils.other import get_free_port  # noqa: E402  (ports below the ephemeral range)

_CODE = {
    "torch": (
        "import torch.distributed as dist",
        "dist.init_process_group('gloo', timeout=__import__('datetime').timedelta(minutes=10))",
        "dist.barrier()",
    ),
    "nbaccel": (
        "from nbaccel.state import PartialState",
        "state = PartialState()",
        "state.wait_for_everyone()",
    ),
    "accelerate": (
        "from accelerate.state import PartialState",
        "state = PartialState(cpu=True)",  # Accelerate needs cpu=True to use gloo on a CPU-only machine
        "state.wait_for_everyone()",
    ),
}

_TEMPLATE = """
import json, time
import torch
t0 = time.perf_counter()
{imp}
t1 = time.perf_counter()
{init}
{barrier}
import torch.distributed as dist
print(json.dumps({{"rank": dist.get_rank(), "import": t1 - t0, "ready": time.time()}}))
dist.destroy_process_group()
"""

# One process pair, the three barriers interleaved in blocks (nbaccel's group; Accelerate adopts it).
_BARRIER_CODE = """
import json, random, time
import torch.distributed as dist
from nbaccel.state import PartialState
state = PartialState()
calls = {{"torch": dist.barrier, "nbaccel": state.wait_for_everyone}}
try:
    from accelerate.state import PartialState as AcceleratePartialState
    calls["accelerate"] = AcceleratePartialState(cpu=True).wait_for_everyone
except ImportError:
    pass
times = {{name: [] for name in calls}}
for _ in range(20):
    dist.barrier()
order = list(calls)
rng = random.Random(0)  # the same order on both ranks
for _ in range({blocks}):
    rng.shuffle(order)
    for name in order:
        call = calls[name]
        t = time.perf_counter()
        for _ in range(20):
            call()
        times[name].append((time.perf_counter() - t) / 20)
if dist.get_rank() == 0:
    print(json.dumps(times))
dist.destroy_process_group()
"""




def _env(rank: int, port: str) -> dict:
    return dict(
        os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    )


def _pair(code: str) -> list[str]:
    port = str(get_free_port("127.0.0.1"))
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=_env(rank, port), stdout=subprocess.PIPE, text=True)
        for rank in range(2)
    ]
    outputs = [proc.communicate(timeout=300)[0] for proc in procs]
    if any(proc.returncode for proc in procs):
        raise RuntimeError(f"benchmark processes failed: exit codes {[proc.returncode for proc in procs]}")
    return outputs


def _startup(variant: str) -> dict:
    imp, init, barrier = _CODE[variant]
    spawned = time.time()
    outputs = _pair(_TEMPLATE.format(imp=imp, init=init, barrier=barrier))
    reports = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
    return {
        "import": statistics.mean(r["import"] for r in reports),
        "ready": max(r["ready"] for r in reports) - spawned,
    }


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    variants = ["torch", "nbaccel"]
    if importlib.util.find_spec("accelerate") is not None:
        variants.append("accelerate")
    startup: dict[str, list[dict]] = {name: [] for name in variants}
    for _ in range(rounds):
        order = variants[:]
        random.shuffle(order)
        for name in order:
            startup[name].append(_startup(name))
    barrier = json.loads(_pair(_BARRIER_CODE.format(blocks=BLOCKS))[0].strip().splitlines()[-1])

    print(f"2 ranks on gloo; start-up: {rounds} interleaved rounds of fresh process pairs (medians);")
    print(f"barrier: {BLOCKS} interleaved blocks of 20 calls in one pair (median per call)")
    print(f"{'variant':<11}{'import s':>10}{'spawn->ready s':>16}{'barrier us':>12}")
    med = {
        name: {
            "import": statistics.median(r["import"] for r in startup[name]),
            "ready": statistics.median(r["ready"] for r in startup[name]),
            "barrier": statistics.median(barrier[name]) if name in barrier else float("nan"),
        }
        for name in variants
    }
    for name, values in med.items():
        print(f"{name:<11}{values['import']:>10.3f}{values['ready']:>16.3f}{values['barrier'] * 1e6:>12.1f}")
    print(f"nbaccel / torch: spawn->ready {med['nbaccel']['ready'] / med['torch']['ready']:.2f}x, "
          f"barrier {med['nbaccel']['barrier'] / med['torch']['barrier']:.2f}x "
          "(torch's import is already paid: torch.distributed comes with torch)")
    if "accelerate" in med:
        ratios = ", ".join(f"{key} {med['nbaccel'][key] / med['accelerate'][key]:.2f}x"
                           for key in ("import", "ready", "barrier"))
        print(f"nbaccel / accelerate: {ratios}")


if __name__ == "__main__":
    main()
