"""The GPU checks that CI cannot run: one CUDA device, nbaccel beside Accelerate, results in one JSON file.

    PYTHONPATH=. python3 scripts/gpu_checks.py OUT_DIR [CHECK ...]

Meant for a borrowed GPU machine with torch (CUDA) and Accelerate installed; nbaccel runs from the checkout
(PYTHONPATH), nothing is installed. Each check runs in a process of its own with a time limit, so one that
hangs or crashes is recorded and the others still run. Writes OUT_DIR/gpu_checks.json (each check's outcome
and numbers) and OUT_DIR/gpu_checks.log (everything the checks printed).

Checks: `environment`; `bf16` and `fp16` (the same training on Accelerate and on nbaccel: losses, final
weights, GradScaler state, a step skipped on an inf gradient); `memory` (the CUDA memory the dashboard
reports); `launcher` (notebook_launcher in a process that initialized CUDA); `fsdp2` (one process started three ways:
torchrun with an FSDP2 plugin, the library's launcher, its launcher with --use_fsdp; distributed type, backend,
operations, model class, losses and weights); `bench`
(a bf16 train step: raw torch, nbaccel, Accelerate, interleaved in one process, medians and ratios).
With one GPU, nothing here runs 2 NCCL ranks: NCCL refuses two ranks on one device.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# seconds per check, in the order they run (most wanted first): a borrowed GPU comes with minutes, not hours
LIMITS = {"environment": 45, "bf16": 90, "fp16": 90, "memory": 45, "fsdp2": 200, "bench": 120, "launcher": 90}


# ----------------------------------------------------------------------------------------- in a check's process
def _mlp():
    import torch

    return torch.nn.Sequential(torch.nn.Linear(784, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                               torch.nn.ReLU(), torch.nn.Linear(512, 10))


def _data(steps: int, batch: int):
    import torch

    generator = torch.Generator().manual_seed(1)
    x = torch.randn(steps * batch, 784, generator=generator)
    y = torch.randint(0, 10, (steps * batch,), generator=generator)
    return torch.utils.data.TensorDataset(x, y)


def train_with(library: str, precision: str, out: str) -> None:
    """30 AdamW steps of an MLP with `library`'s Accelerator on CUDA; step 10's gradients are made inf."""
    import importlib

    import torch

    package = importlib.import_module(library)
    set_seed = importlib.import_module(f"{library}.utils").set_seed
    accelerator = package.Accelerator(mixed_precision=precision)
    set_seed(0)
    model = _mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(_data(30, 64), batch_size=64)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses, skipped = [], []
    for step, (x, y) in enumerate(loader):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        accelerator.backward(loss * float("inf") if step == 10 and precision == "fp16" else loss)
        optimizer.step()
        skipped.append(bool(optimizer.step_was_skipped))
        optimizer.zero_grad()
        losses.append(loss.item())
    scaler = accelerator.scaler
    torch.save({
        "device": str(accelerator.device), "losses": losses, "skipped": skipped,
        "weights": {k: v.detach().float().cpu() for k, v in accelerator.unwrap_model(model).state_dict().items()},
        "scaler": None if scaler is None else {"class": type(scaler).__name__, "scale": float(scaler.get_scale())},
        "autocast_dtype": str(torch.get_autocast_dtype("cuda")) if hasattr(torch, "get_autocast_dtype") else "",
    }, out)


def check_environment() -> dict:
    import accelerate
    import torch

    import nbaccel
    from nbaccel import PartialState
    from nbaccel.utils import is_bf16_available

    state = PartialState()
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "device_name": torch.cuda.get_device_name(0),
            "accelerate": accelerate.__version__, "nbaccel": nbaccel.__version__, "state_device": str(state.device),
            "distributed_type": str(state.distributed_type), "bf16_available": is_bf16_available()}


def check_precision(precision: str, work: Path) -> dict:
    import torch

    runs = {}
    for library in ("accelerate", "nbaccel"):
        out = work / f"{precision}-{library}.pt"
        subprocess.run([sys.executable, __file__, "--train", library, precision, str(out)], check=True, timeout=80)
        runs[library] = torch.load(out, weights_only=False)
    ours, theirs = runs["nbaccel"], runs["accelerate"]
    worst = max((ours["weights"][k] - theirs["weights"][k]).abs().max().item() for k in ours["weights"])
    return {
        "device": ours["device"], "same_losses": ours["losses"] == theirs["losses"], "max_weight_difference": worst,
        "skipped_steps": [i for i, s in enumerate(ours["skipped"]) if s],
        "accelerate_skipped_steps": [i for i, s in enumerate(theirs["skipped"]) if s],
        "scaler": ours["scaler"], "accelerate_scaler": theirs["scaler"], "final_loss": ours["losses"][-1],
        "accelerate_final_loss": theirs["losses"][-1],
        "ok": ours["losses"] == theirs["losses"] and worst == 0.0 and ours["skipped"] == theirs["skipped"]
        and ours["scaler"] == theirs["scaler"],
    }


def check_memory() -> dict:
    import torch

    from nbaccel import telemetry

    before = telemetry.memory_sample()
    block = torch.empty(1 << 28, dtype=torch.float32, device="cuda")  # 1 GiB
    during = telemetry.memory_sample()
    del block
    after = telemetry.memory_sample()
    gib = 1 << 30
    return {"before": before, "during": during, "after": after,
            "ok": during["device_allocated"] >= gib and after["device_peak"] >= gib
            and after["device_allocated"] < gib}


def _device_and_value() -> tuple[str, int]:
    import torch

    from nbaccel import PartialState

    state = PartialState()
    return str(state.device), int(torch.ones(3, device=state.device).sum().item())


def check_launcher() -> dict:
    import torch

    from nbaccel import notebook_launcher

    torch.zeros(1, device="cuda")  # the kernel has initialized CUDA, as after a cell that used the GPU
    result = {"one_process": notebook_launcher(_device_and_value, num_processes=1)}
    try:  # 2 ranks, 1 GPU
        result["two_processes"] = notebook_launcher(_device_and_value, num_processes=2)
    except Exception as error:  # noqa: BLE001 - the message is the result
        result["two_processes_error"] = f"{type(error).__name__}: {str(error)[:600]}"
    result["ok"] = result["one_process"] == [("cuda:0", 3)] or result["one_process"] == [("cuda", 3)]
    return result


ONE_GPU_SCRIPT = """
import sys, torch
from accelerate import Accelerator, FullyShardedDataParallelPlugin
from accelerate.utils import set_seed, gather, reduce, broadcast, pad_across_processes
if sys.argv[2] == "plugin":
    accelerator = Accelerator(mixed_precision="bf16", fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
else:  # what the launcher says
    accelerator = Accelerator()
backend = torch.distributed.get_backend() if torch.distributed.is_initialized() else None
ops = [gather(torch.arange(3, device=accelerator.device)).tolist(), reduce(torch.ones(2, device=accelerator.device)).tolist(),
       broadcast(torch.full((2,), 5.0, device=accelerator.device)).tolist(),
       list(pad_across_processes(torch.ones(2, device=accelerator.device)).shape)]
set_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 4))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, optimizer = accelerator.prepare(model, optimizer)
generator = torch.Generator().manual_seed(1)
losses = []
for _ in range(10):
    x = torch.randn(32, 64, generator=generator).to(accelerator.device)
    loss = model(x).float().pow(2).mean()
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    losses.append(loss.item())
state = accelerator.get_state_dict(model)
torch.save({"type": accelerator.distributed_type.value, "backend": backend, "ops": ops, "losses": losses,
            "model_class": type(model).__name__,
            "weights": {k: v.float().cpu() for k, v in state.items()}}, sys.argv[1])
"""


def _one_gpu_run(library: str, how: str, work: Path) -> dict:
    """ONE_GPU_SCRIPT with `library`, started `how`: "torchrun" (FSDP2 plugin in the code), "launch" (the
    library's launcher, one process) or "launch-fsdp" (its launcher with --use_fsdp --fsdp_version 2)."""
    import re

    import torch

    script = work / f"one_gpu_{library}.py"
    script.write_text(re.sub(r"\baccelerate\b", library, ONE_GPU_SCRIPT))
    out = work / f"{how}-{library}.pt"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "NBACCEL_"))}
    launcher = [sys.executable, "-m", "accelerate.commands.launch" if library == "accelerate" else "nbaccel", *(
        [] if library == "accelerate" else ["launch"]), "--num_processes", "1"]
    if how == "torchrun":
        env["ACCELERATE_USE_FSDP"] = "true"  # the same code, environment and launcher for both
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", str(script),
                   str(out), "plugin"]
    elif how == "launch":
        command = [*launcher, str(script), str(out), "plain"]
    else:
        command = [*launcher, "--use_fsdp", "--fsdp_version", "2", "--mixed_precision", "bf16", str(script), str(out),
                   "plain"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=50)
    if done.returncode != 0:
        return {"failed": " ".join(command[2:5]), "output": (done.stdout + done.stderr)[-1500:]}
    return torch.load(out, weights_only=False)


def check_fsdp2(work: Path) -> dict:
    """One GPU, one process, started three ways; Accelerate and nbaccel compared for each."""
    result, ok = {}, True
    for how in ("torchrun", "launch", "launch-fsdp"):
        runs = {library: _one_gpu_run(library, how, work) for library in ("accelerate", "nbaccel")}
        if any("failed" in run for run in runs.values()):
            result[how], ok = runs, False
            continue
        ours, theirs = runs["nbaccel"], runs["accelerate"]
        worst = max((ours["weights"][k] - theirs["weights"][k]).abs().max().item() for k in ours["weights"])
        same = {key: ours[key] == theirs[key] for key in ("type", "backend", "ops", "model_class", "losses")}
        result[how] = {"nbaccel": {k: ours[k] for k in ("type", "backend", "model_class")},
                       "accelerate": {k: theirs[k] for k in ("type", "backend", "model_class")},
                       "same": same, "max_weight_difference": worst}
        ok = ok and all(same.values()) and worst == 0.0
    result["ok"] = ok
    return result


def check_bench() -> dict:
    """bf16 train steps of the MLP at batch 256: raw torch (autocast + AdamW), nbaccel, Accelerate, one process,
    interleaved by round; the per-step median of each round, then the median over rounds."""
    import accelerate
    import torch

    import nbaccel

    data = _data(8, 256)
    batches = [(data.tensors[0][i * 256:(i + 1) * 256].cuda(), data.tensors[1][i * 256:(i + 1) * 256].cuda())
               for i in range(8)]

    def raw_step():
        model = _mlp().cuda()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step(x, y):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        return step

    def library_step(package):
        accelerator = package.Accelerator(mixed_precision="bf16")
        model = _mlp()
        model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))

        def step(x, y):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        return step

    variants = {"raw torch (floor)": raw_step(), "nbaccel": library_step(nbaccel), "accelerate": library_step(accelerate)}
    medians = {name: [] for name in variants}
    for round_index in range(25):
        names = list(variants)
        names = names[round_index % 3:] + names[:round_index % 3]
        for name in names:
            times = []
            for i in range(40):
                torch.cuda.synchronize()
                start = time.perf_counter()
                variants[name](*batches[i % 8])
                torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            medians[name].append(statistics.median(times[5:]))
    result = {name: statistics.median(values) * 1e6 for name, values in medians.items()}
    floor = result["raw torch (floor)"]
    return {"step_us": result, "nbaccel_over_floor": result["nbaccel"] / floor,
            "accelerate_over_floor": result["accelerate"] / floor,
            "nbaccel_over_accelerate": result["nbaccel"] / result["accelerate"], "rounds": 25, "steps_per_round": 35,
            "ok": True}


def run_check(name: str, work: Path) -> dict:
    if name in ("bf16", "fp16"):
        return check_precision(name, work)
    if name == "fsdp2":
        return check_fsdp2(work)
    return globals()[f"check_{name}"]()


# ----------------------------------------------------------------------------------------- the driver
def main() -> None:
    if sys.argv[1] == "--train":
        train_with(*sys.argv[2:5])
        return
    if sys.argv[1] == "--check":
        name, work = sys.argv[2], Path(sys.argv[3])
        print("RESULT " + json.dumps(run_check(name, work), default=str), flush=True)
        return
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    work = Path(os.environ.get("TMPDIR", "/tmp")) / "nbaccel-gpu-checks"
    work.mkdir(parents=True, exist_ok=True)
    names = sys.argv[2:] or list(LIMITS)
    results = {}
    with open(out / "gpu_checks.log", "w") as log:
        for name in names:
            start = time.monotonic()
            try:
                done = subprocess.run([sys.executable, __file__, "--check", name, str(work)], capture_output=True,
                                      text=True, timeout=LIMITS[name], env={**os.environ, "PYTHONUNBUFFERED": "1"})
                lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
                result = json.loads(lines[-1][7:]) if lines else {"ok": False, "exit": done.returncode}
                output = done.stdout + done.stderr
            except subprocess.TimeoutExpired as expired:
                result, output = {"ok": False, "timed_out": LIMITS[name]}, str(expired.stdout or "")
            result["seconds"] = round(time.monotonic() - start, 1)
            results[name] = result
            log.write(f"===== {name}: {result.get('ok')}\n{output[-20000:]}\n")
            log.flush()
            print(f"{name}: ok={result.get('ok')} ({result['seconds']} s)", flush=True)
            (out / "gpu_checks.json").write_text(json.dumps(results, indent=1, default=str))
    print(textwrap.shorten(json.dumps(results, default=str), 6000))


if __name__ == "__main__":
    main()
