"""PartialState, AcceleratorState, GradientState: detection, properties, process control, in 1 and 2 ranks."""

from __future__ import annotations

import gc
import io
import os
import re
import sys
import time
from contextlib import redirect_stdout
from datetime import timedelta
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from process_helpers import environment_without, run_in_session
from ranks_helper import free_port, run_ranks

from nbaccel.state import (
    DEFAULT_PG_TIMEOUT_SECONDS,
    AcceleratorState,
    GradientState,
    PartialState,
    _pg_timeout,
    _split,
    is_initialized,
    isolated_states,
)
from nbaccel.utils.dataclasses import DistributedType

_CLEARED = [
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
    "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "PJRT_DEVICE", "TPU_NAME",
    "TPU_ACCELERATOR_TYPE", "COLAB_TPU_ADDR", "XRT_TPU_CONFIG", "TPU_WORKER_ID", "NBACCEL_USE_CPU",
    "ACCELERATE_USE_CPU", "NBACCEL_MIXED_PRECISION", "ACCELERATE_MIXED_PRECISION", "NBACCEL_DEBUG_MODE",
    "ACCELERATE_DEBUG_MODE", "NBACCEL_PG_TIMEOUT", "NBACCEL_TORCH_DEVICE", "ACCELERATE_TORCH_DEVICE",
    "NBACCEL_USE_FSDP", "ACCELERATE_USE_FSDP", "NBACCEL_USE_DEEPSPEED", "ACCELERATE_USE_DEEPSPEED", "FORK_LAUNCHED",
]


@pytest.fixture
def fresh(monkeypatch):
    """A single plain process: no launcher variables, and states that start empty and are put back after."""
    for key in _CLEARED:
        monkeypatch.delenv(key, raising=False)
    with isolated_states():
        yield monkeypatch


# --- one process -----------------------------------------------------------------------------------------


def test_single_process_properties(fresh):
    state = PartialState()
    assert state.initialized
    assert state.distributed_type == DistributedType.NO
    assert state.backend is None
    assert (state.num_processes, state.process_index, state.local_process_index) == (1, 0, 0)
    assert (state.num_machines, state.machine_rank) == (1, 0)
    assert state.is_main_process and state.is_local_main_process and state.is_last_process
    assert not state.use_distributed
    assert state.device == (torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    assert state.default_device.type == state.device.type
    assert state.mixed_precision == "no"
    assert state.debug is False and state.fork_launched is False
    assert state.pg_timeout == timedelta(seconds=DEFAULT_PG_TIMEOUT_SECONDS)
    assert "Distributed environment: DistributedType.NO\n" in repr(state) and "Num processes: 1" in repr(state)
    assert not torch.distributed.is_initialized()
    state.wait_for_everyone()  # a no-op alone
    with state.main_process_first(), state.local_main_process_first():
        pass
    data = [1, 2, 3]
    with state.split_between_processes(data, apply_padding=True) as part:
        assert part is data


def test_instances_share_one_state(fresh):
    first = PartialState(cpu=True)
    second = PartialState()  # cpu=False later changes nothing: the first instance decided
    assert second.device == torch.device("cpu") and second._cpu is True
    first.custom = 42
    assert second.custom == 42 and PartialState._shared_state["custom"] == 42


def test_reset_forgets_and_explains(fresh):
    state = PartialState(cpu=True)
    PartialState._reset_state()
    assert not state.initialized
    with pytest.raises(AttributeError, match=r"`PartialState` object has no attribute `process_index`.*_reset_state"):
        _ = state.process_index
    with pytest.raises(ValueError, match="create PartialState"):
        state.on_main_process(print)
    assert PartialState().process_index == 0


def test_isolated_states_puts_previous_states_back(fresh):
    PartialState(cpu=True)
    GradientState().sync_gradients = False
    with isolated_states():
        assert not PartialState._shared_state and not GradientState._shared_state
        PartialState()
    assert PartialState._shared_state["_cpu"] is True
    assert GradientState().sync_gradients is False


def test_decorators_run_everywhere_in_one_process(fresh):
    state = PartialState(cpu=True)
    calls = []
    for decorator in (
        state.on_main_process, state.on_local_main_process, state.on_last_process,
        state.on_process(process_index=3), state.on_local_process(local_process_index=1),
    ):
        decorator(lambda: calls.append(1))()
    assert len(calls) == 5
    out = io.StringIO()
    with redirect_stdout(out):
        state.print("hello", 1)
    assert out.getvalue() == "hello 1\n"
    with pytest.raises(ValueError, match="process_index must be a non-negative int"):
        state.on_process(process_index=-1)(print)
    with pytest.raises(ValueError, match="local_process_index"):
        state.on_local_process(print, local_process_index="0")


def test_cpu_forced_by_argument_or_environment(fresh):
    fresh.setenv("NBACCEL_USE_CPU", "1")
    assert PartialState().device == torch.device("cpu")
    assert PartialState()._cpu is True


def test_torch_device_override(fresh):
    fresh.setenv("ACCELERATE_TORCH_DEVICE", "meta")
    assert PartialState().device == torch.device("meta")


def test_unknown_keyword_is_a_type_error_naming_the_allowed_ones(fresh):
    with pytest.raises(TypeError, match="unexpected keyword argument.*'bakend'.*init_method"):
        PartialState(bakend="gloo")
    assert not PartialState._shared_state  # nothing half-initialized left behind


def test_process_group_timeout_sources(fresh):
    assert _pg_timeout(None) == timedelta(minutes=10)
    assert _pg_timeout(30) == timedelta(seconds=30)
    assert _pg_timeout(timedelta(minutes=2)) == timedelta(minutes=2)
    fresh.setenv("NBACCEL_PG_TIMEOUT", "12.5")
    assert _pg_timeout(None) == timedelta(seconds=12.5)
    assert PartialState(timeout=timedelta(seconds=7)).pg_timeout == timedelta(seconds=7)
    fresh.setenv("NBACCEL_PG_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="NBACCEL_PG_TIMEOUT='soon'"):
        _pg_timeout(None)
    with pytest.raises(ValueError, match="positive"):
        _pg_timeout(0)
    with pytest.raises(TypeError, match="timedelta or seconds"):
        _pg_timeout("5")


def test_debug_flag_from_either_variable_reaches_utils(fresh):
    fresh.setenv("ACCELERATE_DEBUG_MODE", "true")
    state = PartialState()
    assert state.debug is True
    assert os.environ["NBACCEL_DEBUG_MODE"] == "1"  # what nbaccel.utils.operations reads
    state.debug = False
    assert os.environ["NBACCEL_DEBUG_MODE"] == "0"
    PartialState._reset_state()
    fresh.setenv("NBACCEL_DEBUG_MODE", "1")
    fresh.setenv("ACCELERATE_DEBUG_MODE", "0")
    assert PartialState().debug is True  # nbaccel's name wins


def test_world_size_without_rendezvous_address_fails_before_waiting(fresh):
    fresh.setenv("RANK", "0")
    fresh.setenv("WORLD_SIZE", "2")
    started = time.monotonic()
    with pytest.raises(ValueError, match="MASTER_ADDR and MASTER_PORT are not set.*notebook_launcher"):
        PartialState()
    assert time.monotonic() - started < 5
    assert not torch.distributed.is_initialized() and not PartialState._shared_state


def test_nccl_backend_on_cpu_is_refused(fresh):
    fresh.setenv("RANK", "0")
    fresh.setenv("WORLD_SIZE", "2")
    fresh.setenv("MASTER_ADDR", "127.0.0.1")
    fresh.setenv("MASTER_PORT", "1")
    with pytest.raises(ValueError, match="backend='nccl' needs CUDA GPUs.*use backend='gloo'"):
        PartialState(cpu=True, backend="nccl")


def test_more_processes_than_gpus_is_refused_before_nccl_starts(fresh):
    import nbaccel.state as state_module

    for key, value in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        fresh.setenv(key, value)
    fresh.setattr(state_module, "is_cuda_available", lambda: True)  # pretend: one GPU for two processes
    fresh.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="2 processes on this machine but 1 CUDA device.*one GPU per process"):
        PartialState()
    assert not torch.distributed.is_initialized()


def test_tpu_requested_without_torch_xla(fresh):
    fresh.setenv("PJRT_DEVICE", "TPU")
    with pytest.raises(ImportError, match=r"pip install nbaccel\[tpu\].*torch_xla"):
        PartialState()
    assert PartialState(cpu=True).device == torch.device("cpu")  # cpu=True wins over the TPU request


def test_a_torch_xla_replica_is_recognised_on_any_pjrt_device(monkeypatch):
    """Under xmp.spawn (runtime up, replication set) the state follows torch_xla even on its CPU device,
    where no TPU variable is set; torch_xla merely imported, or not there, changes nothing."""
    import sys

    from nbaccel.utils.xla import inside_spawned_replica as _inside_xla_replica

    monkeypatch.delitem(sys.modules, "torch_xla", raising=False)
    assert not _inside_xla_replica()
    runtime = {"up": False, "replicas": 0}
    xlac = SimpleNamespace(_xla_runtime_is_initialized=lambda: runtime["up"],
                           _xla_get_replication_devices_count=lambda: runtime["replicas"])
    monkeypatch.setitem(sys.modules, "torch_xla", SimpleNamespace(_XLAC=xlac))
    assert not _inside_xla_replica()
    runtime["up"] = True
    assert not _inside_xla_replica()  # a single process using one XLA device
    runtime["replicas"] = 2
    assert _inside_xla_replica()


def test_mixed_precision_from_environment_and_bad_values(fresh):
    fresh.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    assert PartialState().mixed_precision == "bf16"
    fresh.setenv("NBACCEL_MIXED_PRECISION", "FP16")
    assert PartialState().mixed_precision == "fp16"
    fresh.setenv("ACCELERATE_MIXED_PRECISION", "fp32")
    fresh.setenv("NBACCEL_MIXED_PRECISION", "fp16")
    assert PartialState().mixed_precision == "fp16"  # nbaccel's name wins; the other is not looked at
    fresh.delenv("NBACCEL_MIXED_PRECISION")
    with pytest.raises(ValueError, match="ACCELERATE_MIXED_PRECISION='fp32'"):
        _ = PartialState().mixed_precision
    fresh.setenv("NBACCEL_MIXED_PRECISION", "half")
    with pytest.raises(ValueError, match=r"NBACCEL_MIXED_PRECISION='half'.*\['no', 'fp8', 'fp16', 'bf16'\]"):
        _ = PartialState().mixed_precision
    with pytest.raises(ValueError, match=r"mixed_precision='float16' is not a precision: use one of"):
        AcceleratorState(mixed_precision="float16", _from_accelerator=True)
    assert not AcceleratorState._shared_state


def test_accelerator_state(fresh):
    with pytest.raises(ValueError, match="Accelerator"):
        AcceleratorState()
    assert not is_initialized()
    state = AcceleratorState(mixed_precision="BF16", cpu=True, _from_accelerator=True)
    assert state.initialized and is_initialized()
    assert state.mixed_precision == "bf16" and PartialState().mixed_precision == "bf16"
    assert state.distributed_type == DistributedType.NO and state.device == torch.device("cpu")
    assert (state.num_processes, state.process_index, state.local_process_index) == (1, 0, 0)
    assert state.is_main_process and state.is_local_main_process and state.is_last_process
    assert not state.use_distributed and not state.fork_launched and not state.is_fsdp2
    assert state.deepspeed_plugin is None and state.fsdp_plugin is None and state.dynamo_plugin is None
    assert "Mixed precision type: bf16" in repr(state)
    again = AcceleratorState()  # anywhere later: the same state
    assert again.mixed_precision == "bf16"
    with pytest.raises(ValueError, match="already been initialized.*mixed_precision='fp16'"):
        AcceleratorState(mixed_precision="fp16")
    with pytest.raises(ValueError, match="get_deepspeed_plugin needs DeepSpeed"):
        state.get_deepspeed_plugin("x")
    with pytest.raises(RuntimeError, match="Tensor parallelism is not configured"):
        _ = state.tensor_parallel_rank
    with pytest.raises(NotImplementedError):
        _ = state.pipeline_parallel_rank
    calls = []
    state.on_process(process_index=0)(lambda: calls.append(1))()
    with state.split_between_processes([1, 2]) as part, state.main_process_first():
        calls.append(part)
    assert calls == [1, [1, 2]]
    state.debug = True
    assert PartialState().debug is True and os.environ["NBACCEL_DEBUG_MODE"] == "1"
    AcceleratorState._reset_state()
    assert not state.initialized and PartialState().initialized
    with pytest.raises(AttributeError, match=r"This happens if `AcceleratorState._reset_state\(\)` was called"):
        _ = state.distributed_type  # an Accelerator holding the reset state fails early and says why
    AcceleratorState._reset_state(reset_partial_state=True)
    assert not PartialState._shared_state


def test_accelerator_state_parallelism_ranks(fresh):
    config = SimpleNamespace(tp_enabled=False, dp_replicate_enabled=True, dp_shard_enabled=False)
    mesh = SimpleNamespace(get_local_rank=lambda dim: {"dp_replicate": 1}[dim])
    state = AcceleratorState(cpu=True, parallelism_config=config, _from_accelerator=True)
    state.device_mesh = mesh
    assert (state.tensor_parallel_rank, state.data_parallel_rank, state.data_parallel_shard_rank) == (0, 1, 0)


def test_fsdp_plugin_alone_stays_single_process(fresh):
    calls = []
    plugin = SimpleNamespace(set_mixed_precision=calls.append, fsdp_version=2)
    state = AcceleratorState(mixed_precision="bf16", fsdp_plugin=plugin, cpu=True, _from_accelerator=True)
    assert state.distributed_type == DistributedType.NO  # one process: nothing to shard over, as in Accelerate
    assert state.fsdp_plugin is plugin


def test_missing_optional_libraries_are_named(fresh):
    with pytest.raises(ImportError, match="pip install deepspeed"):
        AcceleratorState(deepspeed_plugin=object(), _from_accelerator=True)
    with pytest.raises(ValueError, match="fp8.*pip install transformer-engine"):
        AcceleratorState(mixed_precision="fp8", _from_accelerator=True)
    assert not AcceleratorState._shared_state


# --- GradientState ---------------------------------------------------------------------------------------


class _Loader:
    def __init__(self, end: bool, remainder: int):
        self.end_of_dataloader, self.remainder = end, remainder


def test_gradient_state_defaults_and_plugin(fresh):
    state = GradientState()
    assert state.initialized and state.sync_gradients is True
    assert (state.num_steps, state.adjust_scheduler, state.sync_with_dataloader) == (1, False, True)
    assert state.plugin_kwargs == {} and not state.in_dataloader
    assert state.active_dataloader is None and state.dataloader_references == [None]
    assert state.end_of_dataloader is False and state.remainder == -1
    plugin = SimpleNamespace(num_steps=4, adjust_scheduler=True, sync_with_dataloader=False, sync_each_batch=False)
    again = GradientState(plugin)  # a new plugin updates the shared settings
    assert (state.num_steps, state.adjust_scheduler, state.sync_with_dataloader) == (4, True, False)
    assert again.plugin_kwargs["sync_each_batch"] is False
    GradientState({"num_steps": 2})
    assert state.num_steps == 2
    with pytest.raises(ValueError, match="num_steps must be an int >= 1"):
        GradientState({"num_steps": 0})
    with pytest.raises(TypeError, match="unknown gradient accumulation setting"):
        GradientState({"steps": 2})
    state._set_sync_gradients(False)
    assert GradientState().sync_gradients is False
    state.is_xla_gradients_synced = True
    assert state.is_xla_gradients_synced is True
    fresh.setenv("ACCELERATE_USE_FSDP", "1")
    state.is_xla_gradients_synced = False
    assert state.is_xla_gradients_synced is True  # FSDP always syncs
    assert "Sync Gradients: False" in repr(state)
    GradientState._reset_state()
    assert not GradientState._shared_state


def test_gradient_state_tracks_nested_dataloaders_weakly(fresh):
    state = GradientState()
    outer, inner = _Loader(False, 0), _Loader(True, 3)
    state._add_dataloader(outer)
    assert state.in_dataloader and state.active_dataloader is outer and state.remainder == 0
    state._add_dataloader(inner)
    assert state.active_dataloader is inner and state.end_of_dataloader and state.remainder == 3
    state._remove_dataloader(inner)
    assert state.active_dataloader is outer and not state.end_of_dataloader
    del outer
    gc.collect()
    assert state.dataloader_references == [None, None]  # abandoned loaders are not kept alive


# --- split_between_processes (the share each rank gets) -----------------------------------------------------


def _shares(inputs, n=2, pad=False):
    return [_split(inputs, n, i, pad) for i in range(n)]


def test_split_lists_and_tuples():
    assert _shares(["A", "B", "C"]) == [["A", "B"], ["C"]]
    assert _shares(["A", "B", "C"], pad=True) == [["A", "B"], ["C", "C"]]
    assert _shares(("A", "B", "C", "D")) == [("A", "B"), ("C", "D")]
    assert _shares(("A", "B", "C"), pad=True) == [("A", "B"), ("C", "C")]
    assert _shares([1, 2, 3, 4, 5, 6, 7], n=3) == [[1, 2, 3], [4, 5], [6, 7]]
    assert _shares(["A"], n=3, pad=True) == [["A"], ["A"], ["A"]]  # fewer inputs than processes
    assert _shares(["A"], n=3) == [["A"], [], []]
    with pytest.raises(ValueError, match="cannot pad an empty input"):
        _split([], 2, 0, True)


def test_split_tensors_and_arrays():
    tensor = torch.arange(10).reshape(5, 2)
    first, second = _shares(tensor)
    assert torch.equal(first, tensor[:3]) and torch.equal(second, tensor[3:])
    first, second = _shares(tensor, pad=True)
    assert second.shape == (3, 2) and torch.equal(second[2], tensor[4])
    array = np.arange(5)
    assert [part.tolist() for part in _shares(array, pad=True)] == [[0, 1, 2], [3, 4, 4]]


def test_split_dicts_without_touching_the_input():
    data = {"a": [1, 2, 3], "b": torch.tensor([4, 5, 6])}
    first, second = _shares(data, pad=True)
    assert first["a"] == [1, 2] and second["a"] == [3, 3]
    assert second["b"].tolist() == [6, 6]
    assert data["a"] == [1, 2, 3]  # Accelerate overwrites the caller's dict; nbaccel does not
    with pytest.raises(ValueError, match="same length"):
        _split({"a": [1, 2], "b": [1]}, 2, 0, False)
    with pytest.raises(TypeError, match="got int, which has no length"):
        _split(42, 2, 0, False)
    assert _split("abcde", 2, 1, True) == "abcde"  # sized, not a sequence it splits: whole, as in Accelerate
    assert _split(range(5), 2, 1, False) == range(3, 5) and _split(range(5), 2, 1, True) == [3, 4, 4]


# --- two ranks (gloo) ----------------------------------------------------------------------------------------


def _two_rank_checks(rank: int) -> dict:
    """Runs on each of 2 ranks started with only torch's launcher variables: no cpu=True anywhere."""
    import io
    import os
    import time
    from contextlib import redirect_stdout
    from types import SimpleNamespace

    import torch

    from nbaccel.state import AcceleratorState, PartialState
    from nbaccel.utils.dataclasses import DistributedType

    state = PartialState()
    out: dict = {
        "type": state.distributed_type, "backend": state.backend, "device": str(state.device),
        "num": state.num_processes, "index": state.process_index, "local": state.local_process_index,
        "main": state.is_main_process, "local_main": state.is_local_main_process, "last": state.is_last_process,
        "distributed": state.use_distributed, "machines": state.num_machines,
        "timeout": state.pg_timeout.total_seconds(), "torch_world": torch.distributed.get_world_size(),
    }
    ran = []
    state.on_main_process(lambda: ran.append("main"))()
    state.on_local_main_process(lambda: ran.append("local_main"))()
    state.on_last_process(lambda: ran.append("last"))()
    state.on_process(process_index=1)(lambda: ran.append("process1"))()

    @state.on_local_process(local_process_index=0)
    def local0():
        ran.append("local0")
        return "value"

    out["local0_result"] = local0()
    out["ran"] = ran
    buffer = io.StringIO()
    with redirect_stdout(buffer):
        state.print("only once")
    out["printed"] = buffer.getvalue()

    splits = {}
    for name, data in {
        "list": ["A", "B", "C"], "tuple": ("A", "B", "C"), "tensor": torch.arange(3),
        "dict": {"x": [1, 2, 3], "y": torch.arange(3)},
    }.items():
        for pad in (False, True):
            with state.split_between_processes(data, apply_padding=pad) as part:
                if isinstance(part, dict):
                    part = {key: value.tolist() if torch.is_tensor(value) else value for key, value in part.items()}
                splits[(name, pad)] = part.tolist() if torch.is_tensor(part) else part
    out["splits"] = splits

    log = os.environ["NBACCEL_TEST_LOG"]
    with state.main_process_first():
        with open(log, "a") as handle:
            handle.write(f"enter {rank} {time.time()}\n")
        if state.is_main_process:
            time.sleep(0.3)
        with open(log, "a") as handle:
            handle.write(f"exit {rank} {time.time()}\n")
    state.wait_for_everyone()
    with open(log) as handle:
        out["log"] = [line.split()[:2] for line in handle]

    plugin = SimpleNamespace(fsdp_version=2, set_mixed_precision=lambda value: None)
    accelerator_state = AcceleratorState(fsdp_plugin=plugin, _from_accelerator=True)
    out["fsdp"] = (accelerator_state.distributed_type, PartialState().distributed_type, accelerator_state.is_fsdp2)
    out["fsdp_is"] = accelerator_state.distributed_type == DistributedType.FSDP
    return out


def test_two_ranks_on_cpu_run_distributed_on_gloo_without_flags(tmp_path):
    results = run_ranks(_two_rank_checks, env={"NBACCEL_TEST_LOG": str(tmp_path / "log"), "NBACCEL_PG_TIMEOUT": "60"})
    for rank, out in enumerate(results):
        assert out["type"] == DistributedType.MULTI_CPU and out["backend"] == "gloo" and out["device"] == "cpu"
        assert (out["num"], out["index"], out["local"], out["torch_world"], out["machines"]) == (2, rank, rank, 2, 1)
        assert (out["main"], out["local_main"], out["last"]) == (rank == 0, rank == 0, rank == 1)
        assert out["distributed"] and out["timeout"] == 60
        assert out["fsdp"] == (DistributedType.FSDP, DistributedType.FSDP, True)
    assert results[0]["ran"] == ["main", "local_main", "local0"]
    assert results[1]["ran"] == ["last", "process1"]
    assert (results[0]["local0_result"], results[1]["local0_result"]) == ("value", None)
    assert (results[0]["printed"], results[1]["printed"]) == ("only once\n", "")
    expected = {
        ("list", False): (["A", "B"], ["C"]), ("list", True): (["A", "B"], ["C", "C"]),
        ("tuple", False): (("A", "B"), ("C",)), ("tuple", True): (("A", "B"), ("C", "C")),
        ("tensor", False): ([0, 1], [2]), ("tensor", True): ([0, 1], [2, 2]),
        ("dict", False): ({"x": [1, 2], "y": [0, 1]}, {"x": [3], "y": [2]}),
        ("dict", True): ({"x": [1, 2], "y": [0, 1]}, {"x": [3, 3], "y": [2, 2]}),
    }
    for key, (share0, share1) in expected.items():
        assert (results[0]["splits"][key], results[1]["splits"][key]) == (share0, share1), key
    log = results[0]["log"]
    assert log[:2] == [["enter", "0"], ["exit", "0"]]  # the main process went first, alone
    assert sorted(map(tuple, log[2:])) == [("enter", "1"), ("exit", "1")]


def _mpi_checks(rank: int) -> tuple:
    import os

    from nbaccel.state import PartialState

    port = os.environ["MASTER_PORT"]
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR"):
        del os.environ[key]
    os.environ.update(OMPI_COMM_WORLD_RANK=str(rank), OMPI_COMM_WORLD_SIZE="2",
                      OMPI_COMM_WORLD_LOCAL_RANK=str(rank), OMPI_COMM_WORLD_LOCAL_SIZE="2", MASTER_PORT=port)
    state = PartialState()
    state.wait_for_everyone()
    return (state.distributed_type, state.num_processes, state.process_index, os.environ["MASTER_ADDR"])


def test_a_launcher_world_of_one_is_a_single_process(fresh):
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}.items():
        fresh.setenv(key, value)
    state = PartialState(cpu=True)
    assert (state.distributed_type, state.num_processes, state.backend) == (DistributedType.NO, 1, None)
    assert not torch.distributed.is_initialized()


def test_a_launcher_world_of_one_on_the_cpu_has_a_group_of_one_as_in_accelerate(fresh):
    """torchrun with one process, no accelerator, no cpu=True: Accelerate builds a group of one (raw
    torch.distributed calls work) and reports one plain process; with cpu=True, or from nbaccel's own
    one-process launches, there is no group."""
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(free_port())}.items():
        fresh.setenv(key, value)
    try:
        state = PartialState()
        assert (state.distributed_type, state.num_processes, state.backend) == (DistributedType.NO, 1, None)
        assert torch.distributed.is_initialized() and torch.distributed.get_world_size() == 1
        torch.distributed.barrier()
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    for variables in ({"NBACCEL_ONE_PROCESS": "1"}, {"NBACCEL_USE_CPU": "1"}):
        PartialState._reset_state()
        with fresh.context() as patched:
            for key, value in variables.items():
                patched.setenv(key, value)
            assert PartialState().distributed_type == DistributedType.NO and not torch.distributed.is_initialized()


def test_a_launcher_world_of_one_on_an_accelerator_builds_a_group_as_accelerate_does(fresh, tmp_path):
    """Accelerate: torchrun (LOCAL_RANK set) with one process on a GPU gives MULTI_GPU and a one-process NCCL
    group, so FSDP applies (seen on an H200, scripts/gpu_checks.py `fsdp2`). Here the GPU is simulated: the
    device type says cuda, and the group is built with gloo in place of nccl."""
    import nbaccel.state as state_module

    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29500"}.items():  # what torchrun sets
        fresh.setenv(key, value)
    built = []
    real_init = torch.distributed.init_process_group

    def init(backend, **kwargs):
        built.append((backend, kwargs["world_size"], kwargs["rank"]))
        real_init("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)

    fresh.setattr(state_module, "_accelerator_type", lambda cpu, multi_process: "cpu" if cpu else "cuda")
    fresh.setattr(state_module, "check_cuda_p2p_ib_support", lambda: True)
    fresh.setattr(torch.cuda, "device_count", lambda: 1)
    fresh.setattr(torch.cuda, "set_device", lambda index: None)
    fresh.setattr(torch.distributed, "init_process_group", init)
    try:
        state = PartialState()
        assert built == [("nccl", 1, 0)]
        assert (state.distributed_type, state.num_processes, state.backend) == (DistributedType.MULTI_GPU, 1, "nccl")
        assert state.device == torch.device("cuda", 0)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    # nbaccel's own one-process launches (Accelerate runs those without a launcher) stay single processes
    PartialState._reset_state()
    fresh.setenv("NBACCEL_ONE_PROCESS", "1")
    assert PartialState().distributed_type == DistributedType.NO and len(built) == 1


def _describe(rank: int) -> tuple:
    from nbaccel.state import GradientState, PartialState

    state = PartialState()
    return state.distributed_type, state.process_index, GradientState().sync_gradients


def test_states_made_in_the_kernel_do_not_leak_into_forked_workers(fresh):
    assert PartialState(cpu=True).distributed_type == DistributedType.NO  # e.g. made in a notebook cell
    GradientState()._set_sync_gradients(False)
    assert run_ranks(_describe) == [(DistributedType.MULTI_CPU, 0, True), (DistributedType.MULTI_CPU, 1, True)]
    assert PartialState().distributed_type == DistributedType.NO  # the kernel's own state is untouched


def test_mpi_variables_start_a_gloo_group():
    results = run_ranks(_mpi_checks)
    assert results == [
        (DistributedType.MULTI_CPU, 2, 0, "127.0.0.1"), (DistributedType.MULTI_CPU, 2, 1, "127.0.0.1"),
    ]


def _init_kwargs(rank: int) -> tuple:
    import os
    from datetime import timedelta

    from nbaccel.state import PartialState

    address = f"tcp://127.0.0.1:{os.environ.pop('MASTER_PORT')}"
    del os.environ["MASTER_ADDR"]  # only the init_method can bring the ranks together now
    state = PartialState(backend="gloo", init_method=address, timeout=timedelta(seconds=45))
    state.wait_for_everyone()
    return state.backend, state.num_processes, state.pg_timeout.total_seconds()


def test_init_process_group_kwargs_are_honoured():
    assert run_ranks(_init_kwargs) == [("gloo", 2, 45.0), ("gloo", 2, 45.0)]


def _adopt(rank: int) -> tuple:
    from nbaccel.state import PartialState

    state = PartialState()  # the group already exists: it is described, not re-created
    state.wait_for_everyone()
    return (state.distributed_type, state.backend, state.num_processes, state.process_index, state.device.type)


def test_an_existing_process_group_is_adopted():
    assert run_ranks(_adopt, init=True) == [
        (DistributedType.MULTI_CPU, "gloo", 2, 0, "cpu"), (DistributedType.MULTI_CPU, "gloo", 2, 1, "cpu"),
    ]


def _missing_rank(rank: int):
    import time

    from nbaccel.state import PartialState

    state = PartialState()
    if rank == 1:
        time.sleep(1.5)  # never enters the barrier in time
        return None
    started = time.monotonic()
    try:
        state.wait_for_everyone()
    except RuntimeError as error:
        return time.monotonic() - started, "imed out" in str(error), state.pg_timeout.total_seconds()
    return "no error"


def test_a_rank_that_never_arrives_fails_the_barrier_after_the_timeout():
    waited, says_timeout, timeout = run_ranks(_missing_rank, env={"NBACCEL_PG_TIMEOUT": "1"})[0]
    assert timeout == 1 and says_timeout and waited < 10


def test_the_configuration_classes_drive_the_states(fresh):
    from nbaccel.utils import GradientAccumulationPlugin, InitProcessGroupKwargs

    state = PartialState(**InitProcessGroupKwargs(timeout=timedelta(seconds=30)).to_kwargs())
    assert state.pg_timeout == timedelta(seconds=30)
    gradient_state = GradientState(GradientAccumulationPlugin(num_steps=4, adjust_scheduler=False))
    assert (gradient_state.num_steps, gradient_state.adjust_scheduler, gradient_state.sync_with_dataloader) == (
        4, False, True,
    )


def test_accelerator_after_partial_state_reset_alone_sets_the_partial_state_up_again():
    """`PartialState._reset_state()` leaves the AcceleratorState; the next `Accelerator()` builds the
    PartialState again in both libraries (Accelerate's test_tracking relies on it)."""
    accelerate = pytest.importorskip("accelerate")
    import nbaccel

    for library in (accelerate, nbaccel):
        library.state.AcceleratorState._reset_state(True)
        library.Accelerator(cpu=True)
        library.state.PartialState._reset_state()
        assert library.state.PartialState._shared_state == {}
        library.Accelerator(cpu=True)
        assert library.state.PartialState._shared_state != {}, library.__name__
        library.state.AcceleratorState._reset_state(True)


ONE_PROCESS_SCRIPT = """
import os
import torch
from accelerate import PartialState
store = os.environ.get("STORE_FILE")  # set: the group's rendezvous is this file (init_method), not torchrun's
state = PartialState(**({"init_method": f"file://{store}?rank=0&world_size=1"} if store else {}))
print("STATE", state.distributed_type.value, state.num_processes, torch.distributed.is_initialized(),
      bool(store) and os.path.exists(store))
"""
TORCHRUN_ONE = ["-m", "torch.distributed.run", "--nproc_per_node", "1"]


@pytest.mark.parametrize(("how", "init_method"),
                         [(TORCHRUN_ONE, False), (TORCHRUN_ONE, True),
                          (["-m", "accelerate.commands.launch", "--num_processes", "1"], False),
                          (["-m", "accelerate.commands.launch", "--use_fsdp", "--num_processes", "1"], False)],
                         ids=["torchrun", "torchrun-init_method", "launch", "launch-fsdp"])
def test_one_launched_process_has_accelerates_group(tmp_path, how, init_method):
    """One process on the CPU, started by torchrun, by the library's launcher, by its launcher with --use_fsdp
    (torchrun underneath in both libraries): Accelerate and nbaccel agree on a process group of one, and
    both build it with the caller's init_process_group arguments (here `init_method`)."""
    pytest.importorskip("accelerate")
    seen = {}
    env = environment_without() | {"TMPDIR": str(tmp_path)}  # torchrun's torchelastic_* log folder: in tmp_path
    if init_method:
        env["STORE_FILE"] = str(tmp_path / "store")
    for package in ("accelerate", "nbaccel"):
        script = tmp_path / f"{package}_one.py"
        script.write_text(re.sub(r"\baccelerate\b", package, ONE_PROCESS_SCRIPT))
        launcher = [part.replace("accelerate.commands.launch", "nbaccel") for part in how]
        if package == "nbaccel" and "nbaccel" in launcher:
            launcher.insert(launcher.index("nbaccel") + 1, "launch")
        result = run_in_session([sys.executable, *(how if package == "accelerate" else launcher), str(script)],
                                env, tmp_path, 90)
        [line] = [line for line in result.stdout.splitlines() if line.startswith("STATE ")]
        seen[package] = line
    assert seen["nbaccel"] == seen["accelerate"]
    assert seen["nbaccel"] == f"STATE NO 1 {how[1] == 'torch.distributed.run' or '--use_fsdp' in how} {init_method}"
