"""utils.other and utils.constants: unwrapping models, main-process saving, small helpers."""

from __future__ import annotations

import os
import random
import socket
from collections import OrderedDict

import pytest
import torch

from nbaccel.utils import constants, other
from nbaccel.utils.other import (
    convert_bytes,
    extract_model_from_parallel,
    get_free_port,
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


def test_save_safetensors_with_shared_tensors(tmp_path, monkeypatch, caplog):
    from safetensors.torch import load_file

    monkeypatch.setenv("RANK", "0")
    weight = torch.arange(4.0)
    state_dict = OrderedDict(w=weight, tied=weight, b=torch.zeros(1))  # what a model's state_dict() is
    with caplog.at_level("WARNING"):  # a log record, as in Accelerate (its test_utils asserts it with assertLogs)
        save(state_dict, tmp_path / "m.safetensors", safe_serialization=True)
    assert [r.levelname for r in caplog.records] == ["WARNING"] and "Removed shared tensor(s) tied" in caplog.text
    loaded = load_file(tmp_path / "m.safetensors")
    assert set(loaded) == {"w", "b"} and torch.equal(loaded["w"], weight)
    with pytest.raises(RuntimeError, match="share memory"):  # another dict: nothing dropped, as in Accelerate
        save(dict(state_dict), tmp_path / "d.safetensors", safe_serialization=True)
    assert not (tmp_path / "d.safetensors").exists()
    with pytest.raises(ValueError, match="dict of tensors"):  # Accelerate's type (safetensors' ValueError)
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



def test_a_free_port_lies_below_the_ephemeral_range_where_no_connection_can_take_it():
    """The ranks bind the port a second or more after it is picked. A port from the ephemeral range (what port 0
    gives) can meanwhile become the source port of another process's outgoing connection: the store's bind then
    fails with EADDRINUSE while its peers wait (seen as a rank hung for 180 s in test_reliability's 50 runs)."""
    start = other._ephemeral_start()
    if start is None:
        pytest.skip("no /proc/sys/net/ipv4/ip_local_port_range here: the system picks the port")
    with socket.socket() as server:  # a connection of the kind that would take an ephemeral port
        server.bind(("127.0.0.1", 0))
        server.listen()
        with socket.create_connection(server.getsockname()) as client:
            assert client.getsockname()[1] >= start
            for _ in range(50):
                port = get_free_port("127.0.0.1")
                assert other.LOWEST_PICKED_PORT <= port < start
                with socket.socket() as store:
                    store.bind(("127.0.0.1", port))


def test_picking_a_port_leaves_the_seeded_random_stream_alone():
    random.seed(1234)
    expected = [random.random() for _ in range(3)]
    random.seed(1234)
    get_free_port()
    assert [random.random() for _ in range(3)] == expected


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_forked_child_picks_other_ports_than_its_parent():
    """The generator of ports is reseeded in a forked child, as `random` reseeds its own: a child that copied
    the parent's state would pick the very port the parent picks next, and the later bind of one would fail."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(write_end, repr(other._port_choice.random()).encode())
        os._exit(0)
    os.close(write_end)
    os.waitpid(pid, 0)
    with os.fdopen(read_end) as child:
        assert float(child.read()) != other._port_choice.random()


def test_without_a_known_ephemeral_range_the_system_picks_the_port(monkeypatch):
    monkeypatch.setattr(other, "_EPHEMERAL_RANGE", "/nonexistent/ip_local_port_range")
    port = get_free_port("127.0.0.1")
    with socket.socket() as store:
        store.bind(("127.0.0.1", port))


# --- Accelerate 1.15 names: safetensors cleaning, regional compilation, module order, load ----------------


def test_clean_state_dict_for_safetensors_drops_aliases(caplog):
    from nbaccel.utils.other import clean_state_dict_for_safetensors

    weight = torch.arange(6.0).reshape(2, 3)
    state = {"w": weight, "view": weight[0], "t": weight.t(), "b": torch.zeros(1), "note": "kept"}
    with caplog.at_level("WARNING"):
        cleaned = clean_state_dict_for_safetensors(state)
    assert "Removed shared tensor(s) view, t" in caplog.text
    assert list(cleaned) == ["w", "b", "note"] and cleaned["note"] == "kept"
    assert len(state) == 5  # the caller's dict is left as it was


def test_get_module_children_bottom_up():
    from nbaccel.utils.other import get_module_children_bottom_up

    inner = torch.nn.Sequential(torch.nn.Linear(1, 1))
    model = torch.nn.Sequential(inner, torch.nn.ReLU())
    named = get_module_children_bottom_up(model, return_fqns=True)
    assert [name for name, _ in named] == ["0.0", "0", "1", ""]
    assert named[-1][1] is model
    assert get_module_children_bottom_up(model) == [module for _, module in named]


def test_compile_regions_compiles_each_repeated_block():
    from torch._dynamo.eval_frame import OptimizedModule

    from nbaccel.utils.other import compile_regions, extract_model_from_parallel, has_compiled_regions

    model = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(2, 2) for _ in range(3)]), torch.nn.ReLU())
    compiled = compile_regions(model, backend="eager")
    assert all(isinstance(block, OptimizedModule) for block in compiled[0])
    assert isinstance(compiled[1], OptimizedModule)
    assert has_compiled_regions(compiled) and not has_compiled_regions(model)
    assert not any(isinstance(m, OptimizedModule) for m in model.modules())  # the original is untouched
    assert compiled._orig_mod is model
    x = torch.ones(1, 2)
    expected = model[1](model[0][2](model[0][1](model[0][0](x))))
    out = compiled[1](compiled[0][2](compiled[0][1](compiled[0][0](x))))
    assert torch.equal(out, expected)
    assert isinstance(compile_regions(torch.nn.Linear(2, 2), backend="eager"), OptimizedModule)
    whole = compile_regions(torch.nn.Linear(2, 2), backend="eager")
    assert type(extract_model_from_parallel(whole, keep_torch_compile=False)) is torch.nn.Linear
    assert extract_model_from_parallel(compiled, keep_torch_compile=False) is model  # the regional copy too
    assert extract_model_from_parallel(compiled) is compiled


def test_load_defaults_to_weights_only(tmp_path):
    import numpy as np

    from nbaccel.utils.other import load

    torch.save({"t": torch.ones(2), "rng": np.arange(3, dtype=np.uint32)}, tmp_path / "ok.pt")
    loaded = load(tmp_path / "ok.pt", map_location="cpu")
    assert torch.equal(loaded["t"], torch.ones(2)) and loaded["rng"].tolist() == [0, 1, 2]
    torch.save({"obj": socket.AddressFamily.AF_INET}, tmp_path / "obj.pt")
    with pytest.raises(Exception, match="[Ww]eights only"):
        load(tmp_path / "obj.pt")
    assert load(tmp_path / "obj.pt", weights_only=False)["obj"] is socket.AddressFamily.AF_INET


def test_wait_for_everyone_importable_from_other():
    from nbaccel.utils import operations, other

    assert other.wait_for_everyone is operations.wait_for_everyone
