"""utils.other and utils.constants: unwrapping models, main-process saving, small helpers."""

from __future__ import annotations

import socket

import pytest
import torch

from nbaccel.utils import constants
from nbaccel.utils.other import (
    convert_bytes,
    extract_model_from_parallel,
    get_pretty_name,
    is_port_in_use,
    merge_dicts,
    save,
)


def test_constants_match_accelerate():
    accelerate_constants = pytest.importorskip("accelerate.utils.constants")
    for name in ("SAFE_WEIGHTS_NAME", "WEIGHTS_NAME", "SAFE_WEIGHTS_INDEX_NAME", "WEIGHTS_INDEX_NAME", "MODEL_NAME",
                 "OPTIMIZER_NAME", "SCHEDULER_NAME", "SAMPLER_NAME", "SCALER_NAME", "RNG_STATE_NAME"):
        assert getattr(constants, name) == getattr(accelerate_constants, name), name
    assert constants.SAFE_WEIGHTS_NAME == "model.safetensors"


def test_extract_model_from_data_parallel_and_compile():
    model = torch.nn.Linear(2, 2)
    assert extract_model_from_parallel(torch.nn.DataParallel(model)) is model
    compiled = torch.compile(torch.nn.DataParallel(model))
    assert extract_model_from_parallel(compiled, keep_torch_compile=False) is model
    kept = extract_model_from_parallel(compiled)
    assert kept is compiled and kept._orig_mod is model


def test_extract_model_drops_autocast_forward_wrapper():
    model = torch.nn.Linear(2, 2)
    model._original_forward = model.forward
    model.forward = lambda x: "wrapped"
    extract_model_from_parallel(model, keep_fp32_wrapper=False)
    assert "forward" not in model.__dict__ and model(torch.ones(1, 2)).shape == (1, 2)


def test_extract_model_from_ddp():
    from ranks_helper import run_ranks

    def body(rank):
        inner = torch.nn.Linear(2, 2)
        return extract_model_from_parallel(torch.nn.parallel.DistributedDataParallel(inner)) is inner

    assert run_ranks(body, world_size=2, init=True) == [True, True]


def test_save_only_on_main_process(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    save({"a": torch.ones(2)}, tmp_path / "rank1.pt")
    assert not (tmp_path / "rank1.pt").exists()
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    save({"a": torch.ones(2)}, tmp_path / "node_main.pt", save_on_each_node=True)
    assert (tmp_path / "node_main.pt").exists()
    monkeypatch.setenv("RANK", "0")
    save({"a": torch.ones(2)}, tmp_path / "main.pt")
    assert torch.equal(torch.load(tmp_path / "main.pt")["a"], torch.ones(2))


def test_save_safetensors_with_shared_tensors(tmp_path, monkeypatch):
    from safetensors.torch import load_file

    monkeypatch.setenv("RANK", "0")
    weight = torch.arange(4.0)
    with pytest.warns(UserWarning, match="Removed shared tensor"):
        save({"w": weight, "tied": weight, "b": torch.zeros(1)}, tmp_path / "m.safetensors", safe_serialization=True)
    loaded = load_file(tmp_path / "m.safetensors")
    assert set(loaded) == {"w", "b"} and torch.equal(loaded["w"], weight)
    with pytest.raises(TypeError, match="dict of tensors"):
        save([weight], tmp_path / "x.safetensors", safe_serialization=True)


def test_small_helpers():
    assert merge_dicts({"a": {"b": 1}, "c": 2}, {"a": {"d": 3}, "c": 0}) == {"a": {"d": 3, "b": 1}, "c": 2}
    assert convert_bytes(512) == "512 bytes" and convert_bytes(1536) == "1.5 KB" and convert_bytes(3 * 2**30) == "3.0 GB"
    assert get_pretty_name(test_small_helpers) == "test_small_helpers"
    assert get_pretty_name(torch.nn.Linear(1, 1)) == "Linear"
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        assert is_port_in_use(server.getsockname()[1])
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    assert not is_port_in_use(free)
