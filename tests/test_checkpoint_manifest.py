"""A checkpoint's manifest (issue 15 item 8): a flipped bit is named at load time; checkpoints without a
manifest still load; Accelerate still loads nbaccel's checkpoints."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from nbaccel.checkpoint_manifest import MANIFEST_NAME, check_manifest
from nbaccel.checkpointing import (
    CheckpointFileCorruptError,
    CheckpointFileMissingError,
    load_accelerator_state,
    save_accelerator_state,
)


def _model(seed: int) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(8, 4)


def _flip_a_weight_bit(path: Path) -> None:
    """Flip one bit inside the tensor data of a safetensors file: the file still parses, one weight changes."""
    data = bytearray(path.read_bytes())
    header_len = struct.unpack("<Q", data[:8])[0]
    data[8 + header_len + 5] ^= 0x10
    path.write_bytes(bytes(data))


def test_manifest_lists_every_file_with_size_and_sha256(tmp_path: Path) -> None:
    model = _model(0)
    out = save_accelerator_state(tmp_path / "ckpt", models=[model],
                                 optimizers=[torch.optim.SGD(model.parameters(), lr=0.1)])
    files = json.loads((out / MANIFEST_NAME).read_text())["files"]
    assert sorted(files) == ["model.safetensors", "optimizer.bin", "random_states_0.pkl"]
    for name, entry in files.items():
        assert entry["size"] == (out / name).stat().st_size and len(entry["sha256"]) == 64
    assert check_manifest(out) == []


def test_bit_flip_in_safetensors_is_named_and_nothing_changes(tmp_path: Path) -> None:
    """On main the flipped weight loaded silently (safetensors has no checksum)."""
    out = save_accelerator_state(tmp_path / "ckpt", models=[_model(0)])
    _flip_a_weight_bit(out / "model.safetensors")
    target = _model(1)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(CheckpointFileCorruptError, match=r"model\.safetensors is truncated or corrupt.*sha256"):
        load_accelerator_state(out, models=[target])
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())


def test_missing_and_resized_files_are_named(tmp_path: Path) -> None:
    out = save_accelerator_state(tmp_path / "ckpt", models=[_model(0)])
    with open(out / "random_states_0.pkl", "ab") as handle:
        handle.write(b"x")
    with pytest.raises(CheckpointFileCorruptError, match=r"random_states_0\.pkl .*bytes"):
        load_accelerator_state(out, models=[_model(1)])
    (out / "random_states_0.pkl").unlink()
    with pytest.raises(CheckpointFileMissingError, match=r"random_states_0\.pkl is missing"):
        load_accelerator_state(out, models=[_model(1)])


def test_checkpoint_without_manifest_still_loads(tmp_path: Path) -> None:
    """As Accelerate (or an older nbaccel) writes it: no manifest, nothing to check, it loads."""
    out = save_accelerator_state(tmp_path / "ckpt", models=[_model(0)])
    (out / MANIFEST_NAME).unlink()
    target = _model(1)
    load_accelerator_state(out, models=[target])
    assert torch.equal(target.weight, _model(0).weight)


def test_damaged_manifest_is_named(tmp_path: Path) -> None:
    out = save_accelerator_state(tmp_path / "ckpt", models=[_model(0)])
    (out / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(CheckpointFileCorruptError, match=MANIFEST_NAME):
        load_accelerator_state(out, models=[_model(1)])


def test_accelerate_accelerator_loads_an_nbaccel_checkpoint_with_its_manifest(tmp_path: Path) -> None:
    """Real Accelerate (`Accelerator(cpu=True).load_state`) reads a checkpoint that nbaccel's Accelerator
    saved, manifest included: the extra file does not disturb it."""
    accelerate = pytest.importorskip("accelerate")
    import nbaccel

    model = _model(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ours = nbaccel.Accelerator(cpu=True)
    model, optimizer = ours.prepare(model, optimizer)
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    out = Path(ours.save_state(str(tmp_path / "ckpt")))
    assert (out / MANIFEST_NAME).is_file()
    nbaccel.state.AcceleratorState._reset_state(True)
    try:
        theirs = accelerate.Accelerator(cpu=True)
        fresh = _model(1)
        fresh_optimizer = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
        fresh, fresh_optimizer = theirs.prepare(fresh, fresh_optimizer)
        theirs.load_state(str(out))
        assert torch.equal(fresh.weight, model.weight)
        assert repr(fresh_optimizer.state_dict()) == repr(optimizer.state_dict())
    finally:
        accelerate.state.AcceleratorState._reset_state(True)
