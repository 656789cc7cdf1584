"""Big-model loading: nbaccel vs Accelerate (and a raw torch/safetensors floor) on the same sharded checkpoint.

A 16-layer model of 16 MiB Linear layers (256 MiB, float32) saved as 4 safetensors shards with
model.safetensors.index.json. Scenarios:
  offload: init_empty_weights + load_checkpoint_and_dispatch(device_map="auto", max_memory={"cpu": 96 MiB}),
           so most layers go to "disk";
  cpu:     the same with device_map={"": "cpu"} (everything in RAM).
Every measurement runs in a fresh subprocess (peak RSS = Linux VmHWM after resetting it just before the load),
variants interleaved, 3 rounds; medians are printed with the nbaccel/Accelerate ratios. "load" is the
load_checkpoint_and_dispatch call; "load+fwd" adds one forward pass (lazily mapped weights are read there).
Run: python benchmarks/bigmodel.py
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS, WIDTH, SHARDS, CPU_BUDGET = 16, 2048, 4, 96 * 2**20
ROUNDS = 3

_CHILD = r"""
import json, sys, time
import torch
from torch import nn

lib, scenario, ckpt, offload = sys.argv[1:5]
LAYERS, WIDTH, BUDGET = int(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7])
torch.set_num_threads(1)


def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024


class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


if lib == "nbaccel":
    from nbaccel import init_empty_weights, load_checkpoint_and_dispatch
elif lib == "accelerate":
    from accelerate import init_empty_weights, load_checkpoint_and_dispatch
else:
    from safetensors.torch import load_file
    import os
    init_empty_weights = None

x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(0))
if init_empty_weights is not None:
    with init_empty_weights():
        model = Tower()
else:
    with torch.device("meta"):
        model = Tower()
with open("/proc/self/clear_refs", "w") as handle:
    handle.write("5")
before = status("VmRSS")
start = time.perf_counter()
if lib == "torch":  # the floor: read every shard and assign the tensors (no placement, no offload)
    for name in sorted(os.listdir(ckpt)):
        if name.endswith(".safetensors"):
            model.load_state_dict({k[len(""):]: v for k, v in load_file(os.path.join(ckpt, name)).items()},
                                  strict=False, assign=True)
else:
    device_map = "auto" if scenario == "offload" else {"": "cpu"}
    model = load_checkpoint_and_dispatch(model, ckpt, device_map=device_map, max_memory={"cpu": BUDGET},
                                         offload_folder=offload)
load_s = time.perf_counter() - start
load_peak = status("VmHWM") - before
with torch.no_grad():
    y = model(x)
total_s = time.perf_counter() - start
peak = status("VmHWM") - before
print(json.dumps({"load_s": load_s, "total_s": total_s, "load_peak": load_peak, "peak": peak,
                  "checksum": float(y.double().sum())}))
"""


def make_checkpoint(folder: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from torch import nn

    torch.manual_seed(0)
    layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))
    state = {f"layers.{k}": v.contiguous() for k, v in layers.state_dict().items()}
    per = LAYERS // SHARDS
    weight_map = {}
    for shard in range(SHARDS):
        name = f"model-{shard + 1:05d}-of-{SHARDS:05d}.safetensors"
        part = {k: v for k, v in state.items() if int(k.split(".")[1]) // per == shard}
        save_file(part, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def run_child(lib: str, scenario: str, ckpt: Path, work: Path) -> dict:
    offload = work / f"offload-{lib}-{scenario}"
    shutil.rmtree(offload, ignore_errors=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-c", _CHILD, lib, scenario, str(ckpt), str(offload), str(LAYERS), str(WIDTH),
         str(CPU_BUDGET)], capture_output=True, text=True, timeout=600, env=env)
    shutil.rmtree(offload, ignore_errors=True)
    if result.returncode != 0:
        raise RuntimeError(f"{lib}/{scenario} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    if not os.path.exists("/proc/self/clear_refs"):
        print("needs Linux (/proc peak-RSS accounting); skipped")
        return
    try:
        import accelerate  # noqa: F401

        libs = ["nbaccel", "accelerate"]
    except ImportError:
        libs = ["nbaccel"]
        print("accelerate not installed: nbaccel only")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        ckpt = work / "ckpt"
        ckpt.mkdir()
        make_checkpoint(ckpt)
        total_mib = LAYERS * (WIDTH * WIDTH + WIDTH) * 4 / 2**20
        print(f"model: {LAYERS} x Linear({WIDTH},{WIDTH}) = {total_mib:.0f} MiB float32 in {SHARDS} shards; "
              f"cpu budget for 'offload' {CPU_BUDGET / 2**20:.0f} MiB; {ROUNDS} rounds, medians")
        variants = [(lib, sc) for sc in ("offload", "cpu") for lib in libs] + [("torch", "cpu")]
        runs: dict[tuple[str, str], list[dict]] = {v: [] for v in variants}
        started = time.perf_counter()
        for _ in range(ROUNDS):
            for variant in variants:
                runs[variant].append(run_child(*variant, ckpt, work))
        for variant, results in runs.items():
            sums = {round(r["checksum"], 3) for r in results}
            assert len(sums) == 1, f"{variant}: outputs differ between runs {sums}"
        checks = {v: round(r[0]["checksum"], 3) for v, r in runs.items()}
        assert len(set(checks.values())) == 1, f"outputs differ between variants: {checks}"

        def med(variant: tuple[str, str], key: str) -> float:
            return statistics.median(r[key] for r in runs[variant])

        print(f"{'variant':22} {'load s':>8} {'load+fwd s':>11} {'peak load MiB':>14} {'peak load+fwd MiB':>18}")
        for variant in variants:
            print(f"{variant[0] + ' / ' + variant[1]:22} {med(variant, 'load_s'):8.3f} {med(variant, 'total_s'):11.3f}"
                  f" {med(variant, 'load_peak') / 2**20:14.1f} {med(variant, 'peak') / 2**20:18.1f}")
        if "accelerate" in libs:
            print("ratios nbaccel / accelerate (time: < 1 is faster; memory: < 1 is lower):")
            for scenario in ("offload", "cpu"):
                ours, theirs = ("nbaccel", scenario), ("accelerate", scenario)
                parts = []
                for key, label in (("load_s", "load time"), ("total_s", "load+fwd time"),
                                   ("load_peak", "peak load"), ("peak", "peak load+fwd")):
                    parts.append(f"{label} {med(ours, key) / max(med(theirs, key), 1e-9):.2f}")
                print(f"  {scenario}: " + ", ".join(parts))
        floor = ("torch", "cpu")
        print(f"ratio nbaccel / torch floor (cpu, load+fwd time): "
              f"{med(('nbaccel', 'cpu'), 'total_s') / med(floor, 'total_s'):.2f}")
        print(f"(all outputs identical; {time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
