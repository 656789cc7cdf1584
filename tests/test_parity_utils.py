"""Accelerate's utils names that nbaccel now has (issue 14, item 2), called the same way on both, with the same
results; and the integrations nbaccel does not drive, which import and raise on use naming what to install."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import warnings
from collections.abc import Iterator
from unittest import mock

import pytest
import torch

pytest.importorskip("accelerate", reason="parity tests compare with Accelerate 1.15 (a dev dependency)")


def both(module: str):
    """(Accelerate's module, nbaccel's module) for `utils.<module>`-style paths."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return importlib.import_module(f"accelerate.{module}"), importlib.import_module(f"nbaccel.{module}")


@contextlib.contextmanager
def _log_records(level: int = logging.INFO) -> Iterator[list[logging.LogRecord]]:
    """The records that reach the root logger at `level` or above inside the block."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(level)
    handler.emit = records.append  # type: ignore[method-assign]
    root = logging.getLogger()
    previous = root.level
    root.addHandler(handler)
    root.setLevel(min(previous or logging.WARNING, level))
    try:
        yield records
    finally:
        root.removeHandler(handler)
        root.setLevel(previous)


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 16)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(16, 16) for _ in range(3)])
        self.head = torch.nn.Linear(16, 10, bias=False)
        self.head.weight = self.embed.weight


def test_constants_have_accelerates_values():
    theirs, ours = both("utils.constants")
    names = [n for n in dir(theirs) if n.isupper() and not n.startswith("_")]
    assert len(names) > 40
    for name in names:
        assert getattr(ours, name) == getattr(theirs, name), name


def test_environment_and_other_helpers_agree():
    theirs, ours = both("utils")
    env = {"ACCELERATE_DEBUG_MODE": "1", "BAD_ENV_NAME": "<mything", "OTHER_ENV": "2", "EMPTY": "", "A B": "c"}
    assert ours.convert_dict_to_env_variables(env) == theirs.convert_dict_to_env_variables(env)
    model = Tied()
    for path in ("blocks.1", "blocks.1.weight", "head"):
        assert ours.recursive_getattr(model, path) is theirs.recursive_getattr(model, path)
    for release in ("5.4.0-35-generic", "6.1.0"):  # an old kernel gets one WARNING log record, no warning
        records = {}  # (Accelerate logs it through its process-aware logger: it needs a state to exist)
        for name, module in (("ours", ours), ("theirs", theirs)):
            state = importlib.import_module(f"{module.__name__.split('.')[0]}.state")
            state.PartialState(cpu=True)
            with mock.patch("platform.uname", return_value=mock.Mock(release=release, system="Linux")), \
                    warnings.catch_warnings(record=True) as warned, _log_records() as logged:
                warnings.simplefilter("always")
                module.check_os_kernel()
            state.PartialState._reset_state()
            records[name] = ([r.levelname for r in logged], len(warned))
            if logged:
                assert "5.4.0" in logged[0].getMessage() and "5.5.0" in logged[0].getMessage()
        assert records["ours"] == records["theirs"], (release, records)
    other_theirs, other_ours = both("utils.other")
    for module in (model, model.blocks, model.head):
        assert other_ours.is_repeated_blocks(module) == other_theirs.is_repeated_blocks(module)
        assert other_ours.has_repeated_blocks(module) == other_theirs.has_repeated_blocks(module)
    assert ours.model_has_dtensor(model) is theirs.model_has_dtensor(model) is False
    assert other_ours.TORCH_SAFE_GLOBALS[:2] == other_theirs.TORCH_SAFE_GLOBALS[:2]


def test_modeling_helpers_agree():
    theirs, ours = both("utils.modeling")
    model = Tied()
    sizes = theirs.compute_module_sizes(model)
    assert ours.get_module_leaves(sizes) == theirs.get_module_leaves(sizes)
    modules = list(model.named_children())
    args = (["head.weight"], sizes["embed"], sizes, modules)
    mine, their = ours.get_module_size_with_ties(*args), theirs.get_module_size_with_ties(*args)
    assert mine[:2] == their[:2] and mine[2][0] is their[2][0]
    for limit in ("1KB", sizes["blocks.0"], 10**9, "nonsense"):
        mine = ours.fallback_allocate(modules, sizes, limit, tied_parameters=[["embed.weight", "head.weight"]])
        their = theirs.fallback_allocate(modules, sizes, limit, tied_parameters=[["embed.weight", "head.weight"]])
        assert mine[0] == their[0] and [n for n, _ in mine[2]] == [n for n, _ in their[2]], limit
    for first, second in (("cpu", "cpu"), ("cuda", "cuda:0"), ("cuda:1", "cuda:0"), ("cpu", "meta")):
        a, b = torch.device(first), torch.device(second)
        assert ours.check_device_same(a, b) == theirs.check_device_same(a, b)
    state = {"head.weight": "placeholder", "blocks.0.weight": "placeholder"}
    mine = ours.get_state_dict_from_offload(model.head, "head.weight", dict(state))
    their = theirs.get_state_dict_from_offload(model.head, "head.weight", dict(state))
    assert mine.keys() == their.keys() and torch.equal(mine["head.weight"], their["head.weight"])
    assert mine["blocks.0.weight"] == "placeholder"


def test_operations_ao_and_launch_helpers_agree():
    theirs, ours = both("utils.operations")
    assert ours.TENSOR_TYPE_TO_INT == theirs.TENSOR_TYPE_TO_INT
    assert ours.TENSOR_INT_TO_DTYPE == theirs.TENSOR_INT_TO_DTYPE
    ao_theirs, ao_ours = both("utils.ao")
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 17),
                                torch.nn.Linear(17, 32))
    assert ao_ours.find_first_last_linear_layers(model) == ao_theirs.find_first_last_linear_layers(model)
    for name, module in model.named_modules():
        assert (ao_ours.filter_first_and_last_linear_layers(module, name)
                == ao_theirs.filter_first_and_last_linear_layers(module, name)), name
        assert (ao_ours.filter_linear_layers(module, name, ["0"])
                == ao_theirs.filter_linear_layers(module, name, ["0"])), name
    launch_theirs, launch_ours = both("utils.launch")
    assert launch_ours.env_var_path_add("PATH", "/x") == launch_theirs.env_var_path_add("PATH", "/x")
    fp8 = argparse.Namespace(fp8_backend="te", fp8_format="E4M3", fp8_margin=0, fp8_override_linear_precision=(
        False, True, False), other=1)
    assert launch_ours.setup_fp8_env(fp8, {}) == launch_theirs.setup_fp8_env(fp8, {})
    versions_theirs, versions_ours = both("utils.versions")
    assert versions_ours.torch_version == versions_theirs.torch_version


def test_prepare_for_launch_sets_the_ranks_as_accelerates(monkeypatch):
    launch_theirs, launch_ours = both("utils.launch")
    seen = {}
    for side, module in (("theirs", launch_theirs), ("ours", launch_ours)):
        monkeypatch.setenv("NPROC", "2")
        monkeypatch.setenv("NODE_RANK", "1")

        def record(value, side=side):
            import os

            seen[side] = (value, os.environ["LOCAL_RANK"], os.environ["RANK"], os.environ["FORK_LAUNCHED"])

        module.PrepareForLaunch(record, distributed_type="MULTI_CPU")(1, "x")
    assert seen["ours"] == seen["theirs"] == ("x", "1", "3", "1")


def test_dataclasses_additions_agree():
    theirs, ours = both("utils.dataclasses")
    assert [m.value for m in ours.SageMakerDistributedType] == [m.value for m in theirs.SageMakerDistributedType]
    assert [m.value for m in ours.FP8BackendType] == [m.value for m in theirs.FP8BackendType]
    assert ours.TorchContextParallelConfig().cp_comm_strategy == theirs.TorchContextParallelConfig().cp_comm_strategy
    for cls in (theirs.TorchContextParallelConfig, ours.TorchContextParallelConfig):
        with pytest.raises(ValueError):
            cls(cp_comm_strategy="ring")
    for cls in (theirs.DeepSpeedSequenceParallelConfig, ours.DeepSpeedSequenceParallelConfig):
        assert cls().sp_seq_length_is_variable is True
        with pytest.raises(ValueError):
            cls(sp_seq_length_is_variable=False)
        with pytest.raises(ValueError):
            cls(sp_attn_implementation="eager")
    model = Tied()
    for name in ("Linear", "Embedding", "Conv2d"):
        assert ours.get_module_class_from_name(model, name) is theirs.get_module_class_from_name(model, name)


@pytest.mark.parametrize(("call", "install"), [
    (lambda: importlib.import_module("nbaccel.utils.deepspeed").DummyOptim([]), "pip install deepspeed"),
    (lambda: importlib.import_module("nbaccel.utils").HfDeepSpeedConfig({}), "pip install deepspeed"),
    (lambda: importlib.import_module("nbaccel.utils.megatron_lm").initialize(None), "pip install megatron-core"),
    (lambda: importlib.import_module("nbaccel.utils").MegatronLMPlugin(), "pip install megatron-core"),
    (lambda: importlib.import_module("nbaccel.utils.bnb").load_and_quantize_model(None, None),
     "pip install bitsandbytes"),
    (lambda: importlib.import_module("nbaccel.utils").convert_model(None), "pip install transformer-engine"),
    (lambda: importlib.import_module("nbaccel.utils").convert_model_to_fp8_ao(None), "pip install torchao"),
])
def test_integrations_import_and_raise_on_use_naming_what_to_install(call, install):
    """None of deepspeed, megatron-core, bitsandbytes, transformer-engine, torchao is installed here, so
    Accelerate's own versions of these cannot run either; nbaccel's import and say what to install."""
    with pytest.raises(ImportError, match=install):
        call()
    theirs, ours = both("utils.bnb")
    assert ours.has_4bit_bnb_layers(Tied()) is False


def test_get_model_tp_size_reads_where_each_transformers_version_keeps_it():
    """`model.tp_size` (transformers < 5), else `model.config.distributed_config` (>= 5: an object, or a dict
    after a JSON round trip): the same answers as Accelerate's."""
    from types import SimpleNamespace

    theirs, ours = both("utils")
    model = torch.nn.Linear(2, 2)
    answers = []
    for tp_size, config in ((None, None), (2, None), (None, SimpleNamespace(distributed_config=SimpleNamespace(tp_size=4))),
                            (None, SimpleNamespace(distributed_config={"tp_size": 8}))):
        model.tp_size, model.config = tp_size, config
        answers.append((ours.get_model_tp_size(model), theirs.get_model_tp_size(model)))
    assert answers == [(None, None), (2, 2), (4, 4), (8, 8)]
