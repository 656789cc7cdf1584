"""Large tensors in launch results come back through shared memory (nbaccel/launch/shared_tensors.py)."""

from __future__ import annotations

import glob
import os

import cloudpickle
import pytest
import torch

from nbaccel.launch import LaunchError, notebook_launcher, shared_tensors
from nbaccel.launch.shared_tensors import MIN_BYTES, RESULT_DIR_ENV, dumps_value

BIG = MIN_BYTES // 4 + 10  # float32 elements: just over the threshold


@pytest.fixture
def result_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(RESULT_DIR_ENV, str(tmp_path))
    return tmp_path


def test_large_storages_go_to_files_and_come_back_equal(result_dir):
    base = torch.arange(BIG * 2, dtype=torch.float32)
    value = {
        "big": base,
        "view": base[1::2],  # a strided view: the whole storage travels, offset and strides kept
        "param": torch.nn.Parameter(torch.randn(BIG)),
        "int": torch.arange(BIG, dtype=torch.int64),
        "bool": torch.ones(MIN_BYTES + 1, dtype=torch.bool),
        "small": torch.ones(3),
        "other": ["text", 1.5],
    }
    data = dumps_value(value)
    assert len(data) < 20_000  # the bytes are in files, not in the pickle
    assert len(os.listdir(result_dir)) == 5  # one file per large storage (big and view each have one)
    back = cloudpickle.loads(data)
    assert os.listdir(result_dir) == []  # the kernel unlinks each file once mapped
    for key in ("big", "view", "int", "bool", "small"):
        assert back[key].dtype == value[key].dtype
        assert back[key].stride() == value[key].stride()
        assert torch.equal(back[key], value[key])
    assert isinstance(back["param"], torch.nn.Parameter) and back["param"].requires_grad
    assert torch.equal(back["param"].detach(), value["param"].detach())
    assert back["other"] == ["text", 1.5]
    back["big"] += 1  # the mapped memory is the tensor's own
    assert back["big"][0].item() == 1.0 and value["big"][0].item() == 0.0


def test_without_a_result_dir_everything_is_pickled(monkeypatch):
    monkeypatch.delenv(RESULT_DIR_ENV, raising=False)
    tensor = torch.randn(BIG)
    data = dumps_value(tensor)
    assert len(data) > MIN_BYTES
    assert torch.equal(cloudpickle.loads(data), tensor)


def test_a_file_that_cannot_be_written_falls_back_to_the_pickle(tmp_path, monkeypatch):
    monkeypatch.setenv(RESULT_DIR_ENV, str(tmp_path / "missing"))  # mkstemp fails, as with a full tmpfs
    tensor = torch.randn(BIG)
    data = dumps_value(tensor)
    assert len(data) > MIN_BYTES
    assert torch.equal(cloudpickle.loads(data), tensor)


def _result_dirs() -> set[str]:
    """This process's launches' result folders (named by its pid), not those of other launches on the machine."""
    return set(glob.glob(os.path.join(shared_tensors.SHM_ROOT, f"{shared_tensors.DIR_PREFIX}{os.getpid()}-*")))


def big_tensor_per_rank():
    rank = int(os.environ["RANK"])
    return torch.full((BIG * 4,), float(rank + 1)), rank


def big_tensor_then_rank_1_fails():
    if int(os.environ["RANK"]) == 1:
        raise ValueError("rank 1 fails")
    return torch.ones(BIG * 4)


@pytest.mark.skipif(not os.path.isdir(shared_tensors.SHM_ROOT),
                    reason="no /dev/shm: results are pickled through the pipe")
def test_launch_returns_large_tensors_and_leaves_no_files():
    before = _result_dirs()
    results = notebook_launcher(big_tensor_per_rank, num_processes=2, dashboard=False, timeout=120)
    assert [rank for _, rank in results] == [0, 1]
    for rank, (tensor, _) in enumerate(results):
        assert tensor.shape == (BIG * 4,) and torch.all(tensor == rank + 1)
    assert _result_dirs() <= before
    with pytest.raises(LaunchError, match="rank 1 fails"):
        notebook_launcher(big_tensor_then_rank_1_fails, num_processes=2, dashboard=False, timeout=120)
    assert _result_dirs() <= before  # files no result was read from go with the folder


def test_folders_of_a_killed_kernel_are_removed_by_the_next_launch(monkeypatch, tmp_path):
    import subprocess

    monkeypatch.setattr(shared_tensors, "SHM_ROOT", str(tmp_path))
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid that no longer runs: the "killed kernel"
    orphan = tmp_path / f"{shared_tensors.DIR_PREFIX}{gone.pid}-abc"
    orphan.mkdir()
    (orphan / "x.storage").write_bytes(b"left")
    mine = tmp_path / f"{shared_tensors.DIR_PREFIX}{os.getpid()}-def"  # a live kernel's folder stays
    mine.mkdir()
    made = shared_tensors.make_result_dir()
    assert made is not None and os.path.isdir(made)
    assert not orphan.exists() and mine.exists()
