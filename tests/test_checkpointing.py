"""nbaccel.checkpointing: round trips, resume, atomic saves, rotation, damaged files, save_model shards."""

from __future__ import annotations

import os
import pickle
import random
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

from nbaccel.checkpointing import (
    CheckpointError,
    CheckpointFileCorruptError,
    CheckpointFileMissingError,
    latest_checkpoint_dir,
    list_checkpoints,
    load_accelerator_state,
    load_sharded_state_dict,
    next_checkpoint_dir,
    save_accelerator_state,
    save_model,
)
from nbaccel.utils import ProjectConfiguration

ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------------------ helpers
def listing(path: Path) -> list[str]:
    """The checkpoint's files, without the hidden marker a whole save writes."""
    return sorted(name for name in os.listdir(path) if not name.startswith("."))


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 8)
        self.drop = torch.nn.Dropout(0.3)
        self.fc2 = torch.nn.Linear(8, 2)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.calls += 1
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight


class FakePreparedLoader:
    """What the Accelerator's prepared data loader exposes: a seeded order and a resumable position."""

    def __init__(self, dataset: TensorDataset, batch_size: int, seed: int = 0) -> None:
        self.dataset, self.batch_size, self.seed = dataset, batch_size, seed
        self.epoch, self.position = 0, 0

    def __len__(self) -> int:
        return (len(self.dataset) + self.batch_size - 1) // self.batch_size

    def __iter__(self):
        order = torch.randperm(len(self.dataset), generator=torch.Generator().manual_seed(self.seed + self.epoch))
        while self.position < len(self):
            start = self.position * self.batch_size
            index = order[start:start + self.batch_size]
            self.position += 1
            yield self.dataset[index]
        self.epoch, self.position = self.epoch + 1, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position, self.seed = state["epoch"], state["position"], state["seed"]


class Counter:
    def __init__(self) -> None:
        self.count = 0

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.count = state["count"]


def make_run(seed: int = 0):
    torch.manual_seed(seed)
    model, other = Net(), Tied()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    sgd = torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9)
    schedulers = [torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5),
                  torch.optim.lr_scheduler.LambdaLR(sgd, lambda epoch: 0.9**epoch)]
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    data_rng = torch.Generator().manual_seed(42)  # the same data set in every run
    data = TensorDataset(torch.randn(24, 4, generator=data_rng), torch.randn(24, 2, generator=data_rng))
    fake = FakePreparedLoader(data, batch_size=4, seed=7)
    plain = DataLoader(data, batch_size=4, sampler=RandomSampler(data, generator=torch.Generator().manual_seed(3)))
    return SimpleNamespace(models=[model, other], optimizers=[optimizer, sgd], schedulers=schedulers,
                           scaler=scaler, dataloaders=[fake, plain], custom=[Counter()])


def train_step(run, x, y) -> None:
    model, other = run.models
    loss = torch.nn.functional.mse_loss(model(x), y) + other.head(other.embed(torch.tensor([1, 2]))).pow(2).mean()
    run.scaler.scale(loss).backward()
    for optimizer in run.optimizers:
        run.scaler.step(optimizer)
        optimizer.zero_grad()
    run.scaler.update()
    for scheduler in run.schedulers:
        scheduler.step()
    run.custom[0].count += 1


def kwargs_of(run) -> dict:
    return dict(models=run.models, optimizers=run.optimizers, schedulers=run.schedulers,
                dataloaders=run.dataloaders, scaler=run.scaler, custom_objects=run.custom)


def snapshot(run) -> dict:
    return {
        "models": [{k: v.clone() for k, v in m.state_dict().items()} for m in run.models],
        "optimizers": [repr(o.state_dict()) for o in run.optimizers],
        "schedulers": [s.state_dict()["last_epoch"] for s in run.schedulers],
        "scaler": run.scaler.state_dict(),
        "fake": run.dataloaders[0].state_dict(),
        "plain": run.dataloaders[1].sampler.generator.get_state().clone(),
        "custom": run.custom[0].count,
        "rng": (random.random(), float(np.random.rand()), torch.rand(1).item()),
    }


def assert_same(a: dict, b: dict) -> None:
    for ma, mb in zip(a["models"], b["models"]):
        assert ma.keys() == mb.keys()
        for key in ma:
            assert torch.equal(ma[key], mb[key]), key
    for key in ("optimizers", "schedulers", "scaler", "fake", "custom", "rng"):
        assert a[key] == b[key], key
    assert torch.equal(a["plain"], b["plain"])


# -------------------------------------------------------------------------------------- round trip
@pytest.mark.parametrize("safe_serialization", [True, False])
def test_round_trip_restores_every_piece(tmp_path, safe_serialization):
    run = make_run()
    x, y = next(iter(run.dataloaders[0]))
    train_step(run, x, y)
    random.seed(11), np.random.seed(11), torch.manual_seed(11)
    out = save_accelerator_state(tmp_path / "ckpt", **kwargs_of(run), safe_serialization=safe_serialization, step=5)
    expected = snapshot(run)  # also draws from every RNG: the loaded state must replay the same draws

    names = listing(out)
    weights = ["model.safetensors", "model_1.safetensors"] if safe_serialization else \
        ["pytorch_model.bin", "pytorch_model_1.bin"]
    assert names == sorted(weights + ["optimizer.bin", "optimizer_1.bin", "scheduler.bin", "scheduler_1.bin",
                                      "scaler.pt", "dl_state_dict.bin", "sampler_1.bin", "custom_checkpoint_0.pkl",
                                      "random_states_0.pkl"])

    # A different run: different weights, positions, RNG; then load.
    fresh = make_run(seed=1)
    train_step(fresh, x + 1, y)
    next(iter(fresh.dataloaders[0]))
    list(fresh.dataloaders[1])
    overrides = load_accelerator_state(out, **kwargs_of(fresh))
    assert overrides == {"step": 5}
    assert_same(snapshot(fresh), expected)
    assert fresh.models[1].head.weight is fresh.models[1].embed.weight  # still tied after loading


def test_every_file_except_custom_objects_loads_with_weights_only(tmp_path):
    run = make_run()
    out = save_accelerator_state(tmp_path / "c", **kwargs_of(run), safe_serialization=False)
    from nbaccel.checkpointing import _numpy_safe_globals

    for name in listing(out):
        if name.startswith("random_states"):  # numpy's state, as Accelerate stores it: arrays allowlisted
            with pytest.raises(pickle.UnpicklingError):
                torch.load(out / name, weights_only=True)
            with torch.serialization.safe_globals(_numpy_safe_globals()):
                torch.load(out / name, weights_only=True)
        else:
            torch.load(out / name, weights_only=True)  # raises if anything needs full unpickling


class Opaque:
    def __init__(self, value):
        self.value = value

    def __eq__(self, other):
        return isinstance(other, Opaque) and other.value == self.value


class HoldsObjects(Counter):
    def state_dict(self) -> dict:
        return {"count": self.count, "thing": Opaque(self.count)}

    def load_state_dict(self, state: dict) -> None:
        assert state["thing"] == Opaque(state["count"])
        self.count = state["count"]


def test_custom_object_with_python_objects_needs_explicit_trust(tmp_path):
    obj = HoldsObjects()
    obj.count = 3
    out = save_accelerator_state(tmp_path / "c", custom_objects=[obj])
    fresh = HoldsObjects()
    load_accelerator_state(out, custom_objects=[fresh])
    assert fresh.count == 3
    with pytest.raises(CheckpointFileCorruptError, match="custom_checkpoint_0.pkl.*weights_only"):
        load_accelerator_state(out, custom_objects=[HoldsObjects()], load_kwargs={"weights_only": True})


def test_custom_objects_must_be_checkpointable_and_match_count(tmp_path):
    with pytest.raises(TypeError, match="needs both `state_dict\\(\\)` and `load_state_dict"):
        save_accelerator_state(tmp_path / "c", custom_objects=[object()])
    out = save_accelerator_state(tmp_path / "c", custom_objects=[Counter(), Counter()])
    with pytest.raises(CheckpointError, match="holds 2 custom objects .* but 1 are registered"):
        load_accelerator_state(out, custom_objects=[Counter()])


def test_hooks_can_take_over_saving_and_loading(tmp_path):
    model, other = Net(), Net()
    calls = []

    def save_hook(models, weights, directory):
        calls.append(("save", len(models), Path(directory).name))
        torch.save(weights.pop(0), Path(directory) / "mine.pt")

    def load_hook(models, directory):
        calls.append(("load", len(models)))
        models[0].load_state_dict(torch.load(Path(directory) / "mine.pt", weights_only=True))
        models.pop(0)

    out = save_accelerator_state(tmp_path / "c", models=[model, other], pre_hooks=[save_hook])
    assert listing(out) == ["mine.pt", "model.safetensors", "random_states_0.pkl"]
    new, new_other = Net(), Net()
    load_accelerator_state(out, models=[new, new_other], pre_hooks=[load_hook])
    assert calls == [("save", 2, ".c.nbaccel-tmp"), ("load", 2)]
    assert torch.equal(new.fc1.weight, model.fc1.weight) and torch.equal(new_other.fc2.bias, other.fc2.bias)


def test_state_dicts_are_accepted_in_place_of_models(tmp_path):
    model = Net()
    out = save_accelerator_state(tmp_path / "c", models=[model.state_dict()], safe_serialization=False)
    fresh = Net()
    load_accelerator_state(out, models=[fresh])
    assert torch.equal(fresh.fc2.weight, model.fc2.weight)


def test_checkpoint_of_ddp_style_keys_loads_into_plain_model(tmp_path):
    model = Net()
    state = {f"module.{k}": v for k, v in model.state_dict().items()}
    save_model(state, tmp_path / "w")
    (tmp_path / "c").mkdir()
    os.replace(tmp_path / "w" / "model.safetensors", tmp_path / "c" / "model.safetensors")
    torch.save({"random_state": random.getstate()}, tmp_path / "c" / "random_states_0.pkl")
    fresh = Net()
    load_accelerator_state(tmp_path / "c", models=[fresh])
    assert torch.equal(fresh.fc1.weight, model.fc1.weight)
    with pytest.raises(CheckpointError, match=r"model 0 \(Tied, model.safetensors\): missing keys embed.weight"):
        load_accelerator_state(tmp_path / "c", models=[Tied()])


# ------------------------------------------------------------------------------- resume end to end
def train_epochs(run, epochs: int, *, save_at=None, directory=None, record=None) -> None:
    loader = run.dataloaders[0]
    while loader.epoch < epochs:
        for x, y in loader:
            train_step(run, x + 0.01 * torch.randn_like(x), y)  # the global RNG shapes training too
            if record is not None:
                record.append(x.clone())
            if save_at is not None and (loader.epoch, loader.position) == save_at:
                save_accelerator_state(directory, **kwargs_of(run), step=run.custom[0].count)


def test_resumed_run_matches_uninterrupted_run_bit_for_bit(tmp_path):
    straight, seen_straight = make_run(), []
    torch.manual_seed(123)
    train_epochs(straight, 2, save_at=(0, 3), directory=tmp_path / "mid", record=seen_straight)

    resumed, seen_resumed = make_run(seed=99), []  # different initial weights and RNG: all must come back
    overrides = load_accelerator_state(tmp_path / "mid", **kwargs_of(resumed))
    assert overrides == {"step": 3} and resumed.dataloaders[0].state_dict()["position"] == 3
    train_epochs(resumed, 2, record=seen_resumed)

    assert len(seen_resumed) == len(seen_straight) - 3
    for a, b in zip(seen_straight[3:], seen_resumed):
        assert torch.equal(a, b)
    for a, b in zip(straight.models, resumed.models):
        for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
            assert torch.equal(p, q), name
    assert repr(straight.optimizers[0].state_dict()) == repr(resumed.optimizers[0].state_dict())


# ------------------------------------------------------------------------------------ atomic saves
KILL_SCRIPT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import torch
    from nbaccel.checkpointing import save_accelerator_state

    target, signal_file = Path(sys.argv[1]), Path(sys.argv[2])

    class Slow:
        def state_dict(self):
            signal_file.write_text("writing")
            time.sleep(60)
            return {}

        def load_state_dict(self, state):
            pass

    model = torch.nn.Linear(256, 256)
    with torch.no_grad():
        model.weight.fill_(1.0)
    save_accelerator_state(target, models=[model])
    with torch.no_grad():
        model.weight.fill_(2.0)
    save_accelerator_state(target, models=[model], optimizers=[torch.optim.SGD(model.parameters(), lr=1)],
                           custom_objects=[Slow()])
""")


def test_save_killed_halfway_leaves_previous_checkpoint_whole(tmp_path):
    target, signal_file = tmp_path / "ckpt", tmp_path / "signal"
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, str(target), str(signal_file)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not signal_file.exists():
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.monotonic() < deadline, "the save never started"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=30)
        proc.stdout.close()

    tmp = tmp_path / ".ckpt.nbaccel-tmp"
    assert (tmp / "model.safetensors").exists() and (tmp / "optimizer.bin").exists()  # it died mid-save
    assert listing(target) == ["model.safetensors", "random_states_0.pkl"]
    model = torch.nn.Linear(256, 256)
    load_accelerator_state(target, models=[model])
    assert torch.all(model.weight == 1.0)

    save_accelerator_state(tmp_path / "other", models=[model])  # the next save cleans the stale folder
    assert not tmp.exists()


def test_save_into_folder_with_other_files_keeps_them(tmp_path, caplog):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    out = save_accelerator_state(tmp_path / "out", models=[Net()])
    assert sorted(os.listdir(out)) == [".nbaccel-manifest.json", "model.safetensors", "notes.txt", "random_states_0.pkl"]
    assert "not atomically" not in caplog.text and "one by one" in caplog.text
    save_accelerator_state(tmp_path / "out", models=[Net()])  # again: merged again, nothing lost
    assert (out / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="is a file"):  # Accelerate: os.makedirs's FileExistsError
        save_accelerator_state(tmp_path / "file", models=[Net()])


def test_failed_save_with_automatic_naming_keeps_last_good_checkpoint(tmp_path):
    project = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True)
    model = Net()
    save_accelerator_state(next_checkpoint_dir(project), models=[model])
    project.iteration += 1

    def broken(models, weights, directory):
        (Path(directory) / "partial.txt").write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        save_accelerator_state(next_checkpoint_dir(project), models=[model], pre_hooks=[broken])
    root = tmp_path / "checkpoints"
    assert listing(root) == ["checkpoint_0"]
    assert latest_checkpoint_dir(project) == root / "checkpoint_0"
    load_accelerator_state(latest_checkpoint_dir(project), models=[Net()])


def test_save_interrupted_during_rename_is_recovered(tmp_path):
    model = Net()
    good = save_accelerator_state(tmp_path / "a", models=[model])
    # The state a kill between "target -> .old" and ".tmp -> target" leaves: new one complete in .tmp.
    os.replace(good, tmp_path / ".a.nbaccel-old")
    with torch.no_grad():
        model.fc1.weight.zero_()
    save_accelerator_state(tmp_path / "elsewhere" / "b", models=[model])
    os.replace(tmp_path / "elsewhere" / "b", tmp_path / ".a.nbaccel-tmp")
    (tmp_path / "elsewhere").rmdir()

    fresh = Net()
    load_accelerator_state(tmp_path / "a", models=[fresh])  # reads the completed new one, changes nothing
    assert torch.all(fresh.fc1.weight == 0) and not (tmp_path / "a").exists()
    save_accelerator_state(tmp_path / "c", models=[model])  # a save beside it finishes the rename first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "c"]
    load_accelerator_state(tmp_path / "a", models=[fresh])
    assert torch.all(fresh.fc1.weight == 0)


# ---------------------------------------------------------------------------- rotation and naming
def test_automatic_naming_and_total_limit_keep_newest(tmp_path):
    project = ProjectConfiguration(project_dir=str(tmp_path / "proj"), automatic_checkpoint_naming=True,
                                   total_limit=2)
    counter = Counter()
    for i in range(4):
        counter.count = i
        out = save_accelerator_state(next_checkpoint_dir(project), custom_objects=[counter],
                                     total_limit=project.total_limit)
        assert out == tmp_path / "proj" / "checkpoints" / f"checkpoint_{i}"
        project.iteration += 1
    assert [p.name for p in list_checkpoints(tmp_path / "proj" / "checkpoints")] == ["checkpoint_2", "checkpoint_3"]
    restored = Counter()
    load_accelerator_state(latest_checkpoint_dir(project), custom_objects=[restored])
    assert restored.count == 3
    project.iteration = 3
    with pytest.raises(ValueError, match="checkpoint_3 \\(3\\) already exists.*iteration"):
        next_checkpoint_dir(project)
    with pytest.raises(ValueError, match="project_dir"):
        next_checkpoint_dir(ProjectConfiguration())


def test_rotation_never_deletes_the_checkpoint_just_saved(tmp_path):
    root = tmp_path / "checkpoints"
    for n in (1, 2):
        save_accelerator_state(root / f"checkpoint_{n}", custom_objects=[Counter()])
    # A resumed run whose iteration restarted at 0 saves checkpoint_0: it stays, the oldest other goes.
    save_accelerator_state(root / "checkpoint_0", custom_objects=[Counter()], total_limit=2)
    assert listing(root) == ["checkpoint_0", "checkpoint_2"]


def test_checkpoint_numbers_sort_numerically(tmp_path):
    for n in (9, 10, 2):
        (tmp_path / f"checkpoint_{n}").mkdir()
    (tmp_path / ".checkpoint_11.nbaccel-tmp").mkdir()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint_2", "checkpoint_9", "checkpoint_10"]


# ----------------------------------------------------------------------------- damaged checkpoints
@pytest.fixture
def saved(tmp_path):
    run = make_run()
    return run, save_accelerator_state(tmp_path / "ckpt", **kwargs_of(run))


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("name", ["optimizer_1.bin", "model_1.safetensors", "scheduler.bin", "scaler.pt",
                                  "custom_checkpoint_0.pkl"])
def test_missing_file_is_named(saved, name):
    run, out = saved
    (out / name).unlink()
    with pytest.raises(CheckpointFileMissingError, match=name.split(".")[0]):
        load_accelerator_state(out, **kwargs_of(make_run(seed=2)))


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.bin", "random_states_0.pkl", "dl_state_dict.bin"])
def test_truncated_file_is_named_and_nothing_changes(saved, name):
    run, out = saved
    truncate(out / name)
    target = make_run(seed=2)
    before = snapshot(target)
    random.seed(0), np.random.seed(0), torch.manual_seed(0)  # snapshot drew from the RNGs; reset them
    with pytest.raises(CheckpointFileCorruptError, match=f"{name}.*truncated or corrupt"):
        load_accelerator_state(out, **kwargs_of(target))
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    after = snapshot(target)
    assert_same(after, {**before, "rng": after["rng"]})


def test_missing_directory_and_rng_file(tmp_path, saved):
    with pytest.raises(CheckpointFileMissingError, match="does not exist"):
        load_accelerator_state(tmp_path / "nope")
    run, out = saved
    (out / "random_states_0.pkl").unlink()
    with pytest.raises(CheckpointFileMissingError, match="random_states_0.pkl is missing"):
        load_accelerator_state(out, **kwargs_of(make_run()))


def test_bad_map_location(saved):
    run, out = saved
    with pytest.raises(TypeError, match="Unsupported map_location"):
        load_accelerator_state(out, **kwargs_of(run), map_location=3)
    load_accelerator_state(out, **kwargs_of(run), map_location="on_device", device=torch.device("cpu"))


# ------------------------------------------------------------------------------- multi-process
def _two_rank_save_and_load(rank: int):
    import torch.distributed as dist

    directory = Path(os.environ["CKPT_DIR"])
    torch.manual_seed(0)
    model = Net()
    loader = FakePreparedLoader(TensorDataset(torch.randn(8, 4)), batch_size=2, seed=rank)
    loader.position = rank + 1  # ranks at different positions: each keeps its own
    torch.manual_seed(100 + rank)
    save_accelerator_state(directory, models=[model], dataloaders=[loader], process_index=rank,
                           num_processes=2, is_main_process=rank == 0)
    expected = torch.rand(1).item()
    files = listing(directory)

    def fail_on_rank_1(models, weights, path):
        if rank == 1:
            raise RuntimeError("rank 1 cannot write")

    try:
        save_accelerator_state(directory, models=[Net()], process_index=rank, num_processes=2,
                               is_main_process=rank == 0, pre_hooks=[fail_on_rank_1])
        outcome = "saved"
    except Exception as error:  # noqa: BLE001
        outcome = f"{type(error).__name__}: {error}"
    dist.barrier()
    fresh = FakePreparedLoader(TensorDataset(torch.randn(8, 4)), batch_size=2)
    fresh_model = Net()
    load_accelerator_state(directory, models=[fresh_model], dataloaders=[fresh], process_index=rank)
    return files, fresh.position, torch.rand(1).item() == expected, outcome, torch.equal(
        fresh_model.fc1.weight, model.fc1.weight)


def test_two_processes_save_their_own_states_and_fail_together(tmp_path, monkeypatch):
    from ranks_helper import run_ranks

    monkeypatch.setenv("CKPT_DIR", str(tmp_path / "ckpt"))
    results = run_ranks(_two_rank_save_and_load, world_size=2, init=True, timeout=60)
    files = ["dl_state_dict.bin", "dl_state_dict.rank1.bin", "model.safetensors", "random_states_0.pkl",
             "random_states_1.pkl"]
    assert results[0][0] == files and results[1][0] == files
    assert [r[1] for r in results] == [1, 2]
    assert all(r[2] for r in results)  # each rank got its own RNG state back
    assert results[0][3] == "CheckpointError: Saving " + str(tmp_path / "ckpt") + \
        " failed on process 1 (RuntimeError: rank 1 cannot write); the previous checkpoint is kept."
    assert results[1][3] == "RuntimeError: rank 1 cannot write"
    assert all(r[4] for r in results)  # the failed save did not replace the good one
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def _disk_full_on_rank_1(rank: int) -> tuple[str, list[str]]:
    import errno

    directory = os.environ["CKPT_DIR"]

    def full(models, weights, path):
        if rank == 1:
            raise OSError(errno.ENOSPC, "No space left on device")

    try:
        save_accelerator_state(directory, models=[Net()], process_index=rank, num_processes=2,
                               is_main_process=rank == 0, pre_hooks=[full])
    except Exception as error:  # noqa: BLE001
        return f"{type(error).__name__}: {error}", getattr(error, "__notes__", [])
    return "saved", []


def test_a_full_disk_on_one_process_is_named_on_every_process(tmp_path, monkeypatch):
    """The process whose write failed keeps its own error, with a note on the disk; the others say which
    process failed and how (they said only "failed on another process")."""
    from ranks_helper import run_ranks

    directory = str(tmp_path / "ckpt")
    monkeypatch.setenv("CKPT_DIR", directory)
    (theirs, _), (own, notes) = run_ranks(_disk_full_on_rank_1, world_size=2, init=True, timeout=60)
    assert own == "OSError: [Errno 28] No space left on device", own
    assert len(notes) == 1 and notes[0].startswith("the file system of ") and "the disk is probably full" in notes[0]
    assert theirs.startswith(f"CheckpointError: Saving {directory} failed on process 1 (OSError: [Errno 28] No space "
                             "left on device; the file system of "), theirs
    assert theirs.endswith("the previous checkpoint is kept."), theirs


@pytest.fixture
def small_disk(tmp_path):
    """A real 1 MiB file system (tmpfs), as a full disk meets a save; mounting needs root (skipped otherwise)."""
    folder = tmp_path / "small"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(folder)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({mounted.stderr.strip() or 'mount failed'}): needs root")
    try:
        yield folder
    finally:
        unmounted = subprocess.run(["umount", str(folder)], capture_output=True, text=True)
        if unmounted.returncode != 0:  # a file left open there: detached all the same, never left mounted
            subprocess.run(["umount", "--lazy", str(folder)], check=True)
        assert unmounted.returncode == 0, unmounted.stderr


def test_a_save_onto_a_full_disk_says_the_disk_is_full_and_leaves_no_checkpoint(small_disk):
    """torch's writer reports a full disk as "unexpected pos N vs M", without the system's ENOSPC: the error
    gets a note on the file system's free space."""
    big = torch.nn.Linear(1024, 1024)  # 4 MiB of weights on a 1 MiB disk
    with pytest.raises(Exception) as info:
        save_accelerator_state(small_disk / "ckpt", models=[big], optimizers=[torch.optim.SGD(big.parameters())],
                               safe_serialization=False)
    notes = getattr(info.value, "__notes__", [])
    assert len(notes) == 1 and re.fullmatch(f"the file system of {re.escape(str(small_disk))} has only [01].[0-9] MiB "
                                            "free: the disk is probably full; free some space or save elsewhere",
                                            notes[0]), (info.value, notes)
    assert list(small_disk.iterdir()) == []  # no checkpoint, complete or not, and no temporary folder
    # the failed write's file is closed at once (its frames' variables cleared), not at a garbage collection:
    # the fixture's umount finds nothing open


# ---------------------------------------------------------------------------------- save_model
def test_save_model_shards_with_index_and_reads_back(tmp_path):
    model = Tied()
    model.extra = torch.nn.Linear(10, 10)
    state = model.state_dict()
    files = save_model(state, tmp_path, max_shard_size="300B")
    names = sorted(p.name for p in files)
    assert names == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                     "model.safetensors.index.json"]
    import json
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert "head.weight" not in index["weight_map"]  # tied: once
    # the Hub's sharding (what Accelerate writes; tests/parity/test_everyday_api_parity.py compares the files):
    # extra.weight (400 B) is over the limit and gets a shard at once, the small ones share the next
    assert index["weight_map"] == {"extra.weight": "model-00001-of-00002.safetensors",
                                   "embed.weight": "model-00002-of-00002.safetensors",
                                   "extra.bias": "model-00002-of-00002.safetensors"}
    assert index["metadata"] == {"total_size": 600}
    loaded = load_sharded_state_dict(tmp_path)
    fresh = Tied()
    fresh.extra = torch.nn.Linear(10, 10)
    missing = fresh.load_state_dict(loaded, strict=False).missing_keys
    assert missing == ["head.weight"] and torch.equal(fresh.head.weight, model.embed.weight)

    save_model(state, tmp_path)  # one file now: the old shards and index go away
    assert listing(tmp_path) == ["model.safetensors"]


def test_save_model_bin_and_not_main_process(tmp_path):
    state = Net().state_dict()
    assert save_model(state, tmp_path / "x", is_main_process=False) == []
    assert not (tmp_path / "x").exists()
    files = save_model(state, tmp_path / "b", safe_serialization=False, max_shard_size=200)
    assert [p.name for p in files][-1] == "pytorch_model.bin.index.json"
    loaded = load_sharded_state_dict(tmp_path / "b")
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    with pytest.raises(ValueError, match="max_shard_size"):
        save_model(state, tmp_path / "c", max_shard_size="ten gigs")
    assert [p.name for p in files[:-1]] == ["pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin"]
    files[1].unlink()
    with pytest.raises(CheckpointFileMissingError, match="pytorch_model-00002-of-00002.bin"):
        load_sharded_state_dict(tmp_path / "b")


# ------------------------------------------------------------------------------- Accelerate files
def test_reads_checkpoint_in_accelerate_format(tmp_path):
    """Accelerate pickles numpy's RNG tuple (arrays inside): read through an allowlist, not full unpickling."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    directory = tmp_path / "acc"
    directory.mkdir()
    save_file(model.state_dict(), str(directory / "model.safetensors"), metadata={"format": "pt"})
    torch.save(optimizer.state_dict(), directory / "optimizer.bin")
    np.random.seed(5)
    torch.save({"step": 7, "random_state": random.getstate(), "numpy_random_seed": np.random.get_state(),
                "torch_manual_seed": torch.get_rng_state()}, directory / "random_states_0.pkl")
    expected = np.random.rand()

    fresh = torch.nn.Linear(3, 3)
    np.random.seed(0)
    overrides = load_accelerator_state(directory, models=[fresh],
                                       optimizers=[torch.optim.SGD(fresh.parameters(), lr=0.1)])
    assert overrides == {"step": 7}
    assert torch.equal(fresh.weight, model.weight)
    assert np.random.rand() == expected


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_model_optimizer_and_rng_round_trip(tmp_path):
    model = Net().cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 4, device="cuda")).sum().backward()
    optimizer.step()
    torch.cuda.manual_seed_all(3)
    out = save_accelerator_state(tmp_path / "c", models=[model], optimizers=[optimizer])
    expected = torch.rand(2, device="cuda")
    fresh = Net().cuda()
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    load_accelerator_state(out, models=[fresh], optimizers=[fresh_optimizer], map_location="on_device",
                           device=torch.device("cuda"))
    assert torch.equal(torch.rand(2, device="cuda"), expected)
    assert torch.equal(fresh.fc1.weight, model.fc1.weight)
    state = fresh_optimizer.state_dict()["state"][0]["exp_avg"]
    assert state.is_cuda and torch.equal(state, optimizer.state_dict()["state"][0]["exp_avg"])


def test_interrupted_save_cleans_up_and_stays_an_interrupt(tmp_path):
    good = save_accelerator_state(tmp_path / "c", custom_objects=[Counter()])

    def interrupt(models, weights, directory):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        save_accelerator_state(tmp_path / "c", custom_objects=[Counter()], pre_hooks=[interrupt])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"] and listing(good) == [
        "custom_checkpoint_0.pkl", "random_states_0.pkl"]


def test_plain_dataloader_with_distributed_sampler_keeps_epoch_and_seed(tmp_path):
    from torch.utils.data.distributed import DistributedSampler

    data = TensorDataset(torch.arange(10.0))
    sampler = DistributedSampler(data, num_replicas=2, rank=0, seed=5)
    sampler.set_epoch(3)
    out = save_accelerator_state(tmp_path / "c", dataloaders=[DataLoader(data, sampler=sampler)])
    assert listing(out) == ["random_states_0.pkl", "sampler.bin"]
    fresh = DistributedSampler(data, num_replicas=2, rank=0, seed=0)
    load_accelerator_state(out, dataloaders=[DataLoader(data, sampler=fresh)])
    assert (fresh.epoch, fresh.seed, list(fresh)) == (3, 5, list(sampler))


# --------------------------------------------------------------------------- through the Accelerator
class Progress:
    """The training loop's own counter, saved with register_for_checkpointing."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]


def _accelerator_run(project_dir: str, stop_at: int | None, resume: bool, total_steps: int = 14):
    """Train on 2 ranks with DDP; save every 3 steps (automatic naming, keep 2); stop early or resume."""

    def body(rank):
        from nbaccel import Accelerator
        from nbaccel.utils import ProjectConfiguration, set_seed

        accelerator = Accelerator(project_config=ProjectConfiguration(
            project_dir=project_dir, automatic_checkpoint_naming=True, total_limit=2))
        set_seed(0)
        model = Net()
        # Dropout stays on: the resumed pass must not shift the global RNG (see data_loader._PreparedLoaderMixin._open_pass).
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
        data_rng = torch.Generator().manual_seed(42)
        data = TensorDataset(torch.randn(40, 4, generator=data_rng), torch.randn(40, 2, generator=data_rng))
        loader = DataLoader(data, batch_size=4, shuffle=True)
        model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
        progress = Progress()
        accelerator.register_for_checkpointing(progress)
        if resume:
            accelerator.load_state()  # the newest checkpoint_N
        seen = []
        while progress.step < total_steps:
            for x, y in loader:
                loss = torch.nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
                progress.step += 1
                seen.append((progress.step, x.sum().item()))
                if progress.step % 3 == 0:
                    accelerator.save_state()
                if progress.step in (stop_at, total_steps):
                    break
            if progress.step == stop_at:
                break
        weights = {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
        return weights, seen

    from ranks_helper import run_ranks

    return run_ranks(body, world_size=2, timeout=120)


def test_accelerator_resume_mid_epoch_ends_with_the_same_weights(tmp_path):
    pytest.importorskip("nbaccel.accelerator")
    straight = _accelerator_run(str(tmp_path / "straight"), stop_at=None, resume=False)
    crashed = _accelerator_run(str(tmp_path / "run"), stop_at=13, resume=False)
    assert [p.name for p in list_checkpoints(tmp_path / "run" / "checkpoints")] == ["checkpoint_2", "checkpoint_3"]
    resumed = _accelerator_run(str(tmp_path / "run"), stop_at=None, resume=True)
    for rank in range(2):
        straight_weights, straight_seen = straight[rank]
        resumed_weights, resumed_seen = resumed[rank]
        assert crashed[rank][1] == straight_seen[:13]
        assert resumed_seen == straight_seen[12:]  # from step 13 (after checkpoint_3 at step 12) on, same batches
        for name, tensor in straight_weights.items():
            assert torch.equal(tensor, resumed_weights[name]), name
    assert torch.equal(straight[0][0]["fc1.weight"], straight[1][0]["fc1.weight"])  # DDP kept ranks in step


def test_accelerate_reads_checkpoint_written_by_nbaccel(tmp_path, monkeypatch):
    import logging

    accelerate_checkpointing = pytest.importorskip("accelerate.checkpointing")
    # Accelerate's logger insists on an initialized accelerate state; a plain logger keeps this test local.
    monkeypatch.setattr(accelerate_checkpointing, "logger", logging.getLogger("accelerate-under-test"))
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    out = save_accelerator_state(tmp_path / "c", models=[model], optimizers=[optimizer], step=4)
    expected = (random.random(), float(np.random.rand()), torch.rand(1).item())

    fresh = Net()
    fresh_optimizer = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    overrides = accelerate_checkpointing.load_accelerator_state(str(out), [fresh], [fresh_optimizer], [], [], 0)
    assert overrides == {"step": 4}
    assert (random.random(), float(np.random.rand()), torch.rand(1).item()) == expected
    assert torch.equal(fresh.fc1.weight, model.fc1.weight)
    assert repr(fresh_optimizer.state_dict()) == repr(optimizer.state_dict())


def test_save_and_load_custom_state_use_save_states_file(tmp_path, monkeypatch):
    from nbaccel.checkpointing import load_custom_state, save_custom_state

    for key in ("RANK", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    obj = HoldsObjects()  # holds a Python object: loaded with full unpickling, as Accelerate does
    obj.count = 4
    save_custom_state(obj, tmp_path, index=2)
    assert listing(tmp_path) == ["custom_checkpoint_2.pkl"]
    fresh = HoldsObjects()
    load_custom_state(fresh, tmp_path, index=2)
    assert fresh.count == 4

    counter = Counter()
    counter.count = 9
    out = save_accelerator_state(tmp_path / "c", custom_objects=[counter])  # same file name as save_state
    restored = Counter()
    load_custom_state(restored, out)
    assert restored.count == 9
    with pytest.raises(CheckpointFileMissingError, match="custom_checkpoint_5.pkl"):
        load_custom_state(Counter(), out, index=5)
    with pytest.raises(TypeError, match="state_dict"):
        save_custom_state(object(), tmp_path)
    monkeypatch.setenv("RANK", "1")
    save_custom_state(counter, tmp_path, index=7)  # only the main process writes
    assert not (tmp_path / "custom_checkpoint_7.pkl").exists()
