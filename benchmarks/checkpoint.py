"""save_state / load_state speed: nbaccel vs the raw torch floor vs Accelerate (when installed).

One process, CPU. A ~5M-parameter model with an AdamW state (about 60 MB on disk). The variants run
interleaved, several rounds, and the medians are compared. nbaccel's save also fsyncs every file and
renames the folder into place (atomicity); the floor is two plain torch.save calls without fsync.
Both nbaccel variants include the manifest (SHA-256 of every file, hashed after the save and checked
before the load); `manifest_cost` measures that part alone, in MB/s.
"""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nbaccel.checkpoint_manifest import MANIFEST_NAME, check_manifest, write_manifest  # noqa: E402
from nbaccel.checkpointing import load_accelerator_state, save_accelerator_state  # noqa: E402

ROUNDS = 5


def make():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(5)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, 1024)).sum().backward()
    optimizer.step()
    return model, optimizer


def floor_save(directory: Path, model, optimizer) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), directory / "pytorch_model.bin")
    torch.save(optimizer.state_dict(), directory / "optimizer.bin")


def floor_load(directory: Path, model, optimizer) -> None:
    model.load_state_dict(torch.load(directory / "pytorch_model.bin", weights_only=True))
    optimizer.load_state_dict(torch.load(directory / "optimizer.bin", weights_only=True))


def nbaccel_save(directory: Path, model, optimizer) -> None:
    save_accelerator_state(directory, models=[model], optimizers=[optimizer])


def nbaccel_save_no_fsync(directory: Path, model, optimizer) -> None:
    save_accelerator_state(directory, models=[model], optimizers=[optimizer], durable=False)


def nbaccel_load(directory: Path, model, optimizer) -> None:
    load_accelerator_state(directory, models=[model], optimizers=[optimizer])


def accelerate_variants():
    try:
        from accelerate.checkpointing import load_accelerator_state as acc_load
        from accelerate.checkpointing import save_accelerator_state as acc_save
    except ImportError:
        return None

    def save(directory: Path, model, optimizer) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        acc_save(str(directory), [model.state_dict()], [optimizer], [], [], 0, 0)

    def load(directory: Path, model, optimizer) -> None:
        acc_load(str(directory), [model], [optimizer], [], [], 0)

    return save, load


def main() -> None:
    model, optimizer = make()
    variants = {"torch floor": (floor_save, floor_load), "nbaccel": (nbaccel_save, nbaccel_load),
                "nbaccel durable=False": (nbaccel_save_no_fsync, nbaccel_load)}
    acc = accelerate_variants()
    if acc is not None:
        variants["accelerate"] = acc
    times = {name: {"save": [], "load": []} for name in variants}
    root = Path(tempfile.mkdtemp(prefix="nbaccel-bench-ckpt-"))
    try:
        for round_index in range(ROUNDS):
            for name, (save, load) in variants.items():
                directory = root / f"{name.replace(' ', '_')}_{round_index}"
                start = time.perf_counter()
                save(directory, model, optimizer)
                times[name]["save"].append(time.perf_counter() - start)
                start = time.perf_counter()
                load(directory, model, optimizer)
                times[name]["load"].append(time.perf_counter() - start)
                shutil.rmtree(directory)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    size = sum(p.numel() for p in model.parameters()) * 4 * 3 / 1e6
    print(f"model {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params + AdamW, ~{size:.0f} MB; "
          f"median of {ROUNDS} interleaved rounds")
    base = {op: statistics.median(times["torch floor"][op]) for op in ("save", "load")}
    for name in variants:
        cells = []
        for op in ("save", "load"):
            median = statistics.median(times[name][op])
            cells.append(f"{op} {median * 1000:7.1f} ms ({median / base[op]:.2f}x floor)")
        print(f"{name:22s} " + "   ".join(cells))
    if "accelerate" in variants:
        for op in ("save", "load"):
            for name in ("nbaccel", "nbaccel durable=False"):
                ratio = statistics.median(times[name][op]) / statistics.median(times["accelerate"][op])
                print(f"{name} / accelerate {op}: {ratio:.2f}x")
    manifest_cost(model, optimizer)


def manifest_cost(model, optimizer) -> None:
    """Hashing time of the checkpoint's files alone: writing the manifest (save) and checking it (load)."""
    root = Path(tempfile.mkdtemp(prefix="nbaccel-bench-manifest-"))
    try:
        directory = save_accelerator_state(root / "ckpt", models=[model], optimizers=[optimizer], durable=False)
        megabytes = sum(p.stat().st_size for p in directory.iterdir() if p.name != MANIFEST_NAME) / 1e6
        writes, checks = [], []
        for _ in range(ROUNDS):
            start = time.perf_counter()
            write_manifest(directory, skip=(".nbaccel-checkpoint.json",))
            writes.append(time.perf_counter() - start)
            start = time.perf_counter()
            assert check_manifest(directory) == []
            checks.append(time.perf_counter() - start)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for op, values in (("write manifest (save)", writes), ("check manifest (load)", checks)):
        median = statistics.median(values)
        print(f"{op}: {median * 1000:.1f} ms for {megabytes:.0f} MB ({megabytes / median:.0f} MB/s)")


if __name__ == "__main__":
    main()
