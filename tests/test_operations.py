"""Operations in one process (no process group) and the nested-structure helpers."""

from __future__ import annotations

import collections
import pickle
import warnings
from collections.abc import Mapping

import pytest
import torch
from nested_data import Pair, Record

import nbaccel
from nbaccel.utils import operations as ops
from nbaccel.utils.dataclasses import TensorInformation


def nested():
    return {
        "outer": [(torch.arange(6.0).reshape(2, 3), torch.tensor([1, 2])), Pair(torch.ones(3, 2).t(), torch.tensor(3.0))],
        "record": Record({"half": torch.ones(2, dtype=torch.float16), "n": 4}),
        "ordered": collections.OrderedDict(z=torch.zeros(2), a=torch.ones(2)),
        "default": collections.defaultdict(list, {"x": torch.ones(1)}),
    }


def assert_same_types(a, b):
    assert type(a) is type(b)
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same_types(x, y)
    elif isinstance(a, Mapping):
        assert list(a.keys()) == list(b.keys())
        for key in a:
            assert_same_types(a[key], b[key])


def test_public_names_resolve_from_nbaccel_and_nbaccel_utils():
    import nbaccel.utils as utils

    for name in ops.__all__:
        assert getattr(ops, name) is not None
    for name in ("gather", "reduce", "broadcast", "pad_across_processes", "gather_object", "broadcast_object_list",
                 "send_to_device", "recursively_apply", "DistributedOperationException", "wait_for_everyone",
                 "debug_mode_enabled", "copy_tensor_to_devices", "TensorInformation", "CannotPadNestedTensorWarning"):
        assert getattr(utils, name) is getattr(ops, name)
    assert nbaccel.gather is ops.gather and nbaccel.wait_for_everyone is ops.wait_for_everyone


def test_collectives_in_one_process_return_their_input():
    data = nested()
    data["record"] = Record({"half": torch.ones(2, dtype=torch.float16)})
    assert ops.gather(data) is data
    scalar = torch.tensor(2.0)
    assert ops.gather(scalar) is scalar
    assert ops.broadcast(data, from_process=0) is data
    assert ops.pad_across_processes(data) is data
    assert ops.gather_object({"a": 1}) == {"a": 1}
    objects = [1, "x"]
    assert ops.broadcast_object_list(objects) is objects and objects == [1, "x"]
    assert ops.copy_tensor_to_devices(scalar) is scalar
    ops.wait_for_everyone()
    reduced = ops.reduce(data["outer"], "sum")
    assert_same_types(reduced, data["outer"])
    assert torch.equal(reduced[0][0], data["outer"][0][0]) and reduced[0][0] is not data["outer"][0][0]
    assert ops.reduce(torch.tensor([2.0]), "mean", scale=3.0).tolist() == [2.0]  # a copy, as Accelerate's


def test_bad_arguments_fail_in_one_process_too():
    with pytest.raises(ValueError, match=r"reduction must be one of 'mean', 'sum', 'max', 'min', 'none', got 'avg'"):
        ops.reduce(torch.ones(1), reduction="avg")
    # a dim that fits no tensor, or only some, leaves the others alone (as in Accelerate's own test_utils)
    lone = torch.ones(2, 2)
    assert ops.pad_across_processes(lone, dim=3) is lone and ops.pad_across_processes(lone, dim=-4) is lone
    data = {"a": torch.ones(2, 2), "b": torch.ones(2)}
    assert ops.pad_across_processes(data, dim=1) is data
    with pytest.raises(TypeError, match=r"Unsupported types \(<class 'str'>\) passed to `.*`: data\['x'\]\[1\] is a str"):
        ops.reduce({"x": [torch.ones(1), "oops"]})
    with pytest.raises(ValueError, match="no process passed a tensor"):
        ops.copy_tensor_to_devices(None)


def test_recursively_apply_keeps_container_types():
    data = nested()
    doubled = ops.recursively_apply(lambda t: t * 2, data)
    assert_same_types(doubled, data)
    assert doubled["default"].default_factory is list
    assert doubled["record"]["n"] == 4  # non-tensor leaves pass through
    assert torch.equal(doubled["outer"][1].left, data["outer"][1].left * 2)
    with pytest.raises(TypeError, match=r"data\['record'\]\['n'\] is a int"):
        ops.recursively_apply(lambda t: t, data, error_on_other_type=True)
    ints = ops.recursively_apply(lambda x, k: x + k, [1, (2, 3)], 10, test_type=lambda x: isinstance(x, int))
    assert ints == [11, (12, 13)]


def test_honor_type_and_is_namedtuple():
    assert ops.honor_type(Pair(1, 2), iter([3, 4])) == Pair(3, 4)
    assert ops.honor_type((1, 2), (x for x in [5])) == (5,)
    assert ops.is_namedtuple(Pair(1, 2)) and not ops.is_namedtuple((1, 2))
    assert ops.is_torch_tensor(torch.nn.Parameter(torch.ones(1))) and not ops.is_torch_tensor([1])


def test_send_to_device_and_skip_keys():
    data = nested()
    moved = ops.send_to_device(data, "meta", skip_keys="ordered")
    assert moved["outer"][0][0].device.type == "meta" and moved["ordered"]["a"].device.type == "cpu"
    assert_same_types(moved, data)
    moved = ops.send_to_device(data, torch.device("meta"), non_blocking=True, skip_keys=["record", "default"])
    assert moved["record"]["half"].device.type == "cpu" and moved["outer"][1].right.device.type == "meta"

    class OnlyTo:  # an object with a `.to` that takes no non_blocking
        def to(self, device):
            return f"moved to {device}"

    assert ops.send_to_device([OnlyTo()], "cpu") == ["moved to cpu"]
    assert ops.send_to_device("text", "cpu") == "text"


def test_data_structure_round_trip():
    data = {"a": [torch.ones(2, 3), torch.zeros((), dtype=torch.int64)]}
    structure = ops.get_data_structure(data)
    assert structure["a"][0] == TensorInformation(shape=torch.Size([2, 3]), dtype=torch.float32)
    assert ops.is_tensor_information(structure["a"][1])
    made = ops.initialize_tensors(structure)
    assert made["a"][0].shape == (2, 3) and made["a"][1].dtype == torch.int64 and made["a"][1].ndim == 0
    assert ops.get_shape(data) == {"a": [[2, 3], []]}


def test_find_batch_size_find_device_listify():
    data = {"ids": torch.ones(5, 2), "other": [torch.ones(3)]}
    assert ops.find_batch_size(data) == 5 and ops.find_batch_size([Pair(torch.ones(7), 1)]) == 7
    with pytest.raises(ValueError, match="empty"):
        ops.find_batch_size([])
    with pytest.raises(TypeError, match="can only find the batch size of tensors"):
        ops.find_batch_size({"a": "text"})
    assert ops.ignorant_find_batch_size({"a": "text"}) is None and ops.ignorant_find_batch_size([]) is None
    assert ops.find_device([1, {"x": torch.empty(1, device="meta")}]).type == "meta"
    assert ops.find_device([1, "a"]) is None
    assert ops.listify({"a": torch.tensor([1.5], dtype=torch.bfloat16), "b": (torch.tensor(2),)}) == {
        "a": [1.5], "b": (2,)
    }


def test_slice_and_concatenate():
    data = {"a": torch.arange(6).reshape(3, 2), "b": Pair(torch.arange(3), [torch.arange(3) * 2])}
    first = ops.slice_tensors(data, slice(0, 2), process_index=0, num_processes=2)
    assert first["a"].tolist() == [[0, 1], [2, 3]] and type(first["b"]) is Pair
    joined = ops.concatenate([first, ops.slice_tensors(data, slice(2, 3))])
    assert torch.equal(joined["a"], data["a"]) and torch.equal(joined["b"].right[0], data["b"].right[0])
    assert ops.concatenate([{"x": torch.ones(1, 2)}, {"x": torch.ones(1, 2)}], dim=1)["x"].shape == (1, 4)
    assert ops.concatenate(["single"]) == "single"
    with pytest.raises(TypeError, match="can only concatenate tensors"):
        ops.concatenate(["a", "b"])


def test_pad_input_tensors():
    assert ops.pad_input_tensors(torch.ones(3, 4, 4), batch_size=3, num_processes=4).shape == (4, 4, 4)
    padded = ops.pad_input_tensors({"x": torch.ones(5, 2), "y": [torch.arange(5)]}, batch_size=5, num_processes=4)
    assert padded["x"].shape == (8, 2) and padded["y"][0].tolist() == [0, 1, 2, 3, 4, 0, 0, 0]
    assert ops.pad_input_tensors(torch.ones(8), batch_size=8, num_processes=2).shape == (8,)
    with pytest.raises(ValueError, match="num_processes must be >= 1"):
        ops.pad_input_tensors(torch.ones(2), 2, 0)


def test_convert_to_fp32_and_outputs_decorator():
    data = {"h": torch.ones(2, dtype=torch.float16), "b": [torch.ones(1, dtype=torch.bfloat16)], "i": torch.ones(1, dtype=torch.int64)}
    converted = ops.convert_to_fp32(data)
    assert converted["h"].dtype == torch.float32 and converted["b"][0].dtype == torch.float32
    assert converted["i"].dtype == torch.int64

    def forward(x):
        """Docstring kept."""
        return {"out": x.half()}

    wrapped = ops.convert_outputs_to_fp32(forward)
    assert wrapped(torch.ones(2))["out"].dtype == torch.float32
    assert wrapped.__wrapped__.__doc__ == "Docstring kept."
    with pytest.raises(pickle.PicklingError, match="unwrap"):
        pickle.dumps(wrapped.__wrapped__)


def test_debug_mode_flag_reads_both_variables(monkeypatch):
    monkeypatch.delenv("NBACCEL_DEBUG_MODE", raising=False)
    monkeypatch.delenv("ACCELERATE_DEBUG_MODE", raising=False)
    assert not ops.debug_mode_enabled()
    monkeypatch.setenv("ACCELERATE_DEBUG_MODE", "true")
    assert ops.debug_mode_enabled()
    monkeypatch.setenv("ACCELERATE_DEBUG_MODE", "0")
    monkeypatch.setenv("NBACCEL_DEBUG_MODE", "1")
    assert ops.debug_mode_enabled()
    monkeypatch.setenv("ACCELERATE_DEBUG_MODE", "1")
    monkeypatch.setenv("NBACCEL_DEBUG_MODE", "0")  # what PartialState(debug=False) sets: nbaccel's wins
    assert not ops.debug_mode_enabled()


def test_nested_tensor_is_left_unpadded_with_a_warning():
    from nbaccel.utils.collectives import _pad_eligible

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that nested tensors are a prototype
        jagged = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    with pytest.warns(ops.CannotPadNestedTensorWarning):
        assert _pad_eligible({"j": jagged, "x": torch.ones(2)}, 0) != []


def test_packing_round_trips_every_layout():
    """pack/unpack_gathered give what per-tensor torch.cat would, for mixed dtypes, shapes and sizes."""
    from nbaccel.utils import packing

    cases = [
        [torch.randn(4), torch.randn(4)],  # same size: transpose path
        [torch.randn(2, 3), torch.arange(5), torch.tensor(True), torch.randn(3).half()],  # mixed: bytes
        [torch.randn(3, 2).t(), torch.randn(7)],  # non-contiguous, different sizes: index path
        [torch.empty(0, 3), torch.randn(2), torch.empty(0, dtype=torch.int16)],  # empty tensors
    ]
    for tensors in cases:
        for world in (1, 3):
            plan = packing.plan_for(tensors, world)
            buffer = packing.pack(plan, tensors)
            rows = buffer.repeat(world).view(world, -1)  # what an all-gather of identical ranks returns
            for t, out in zip(tensors, packing.unpack_gathered(plan, rows, tensors)):
                expected = torch.cat([t.reshape(1) if t.ndim == 0 else t] * world)
                assert out.dtype == t.dtype and torch.equal(out, expected)
            for t, out in zip(tensors, packing.unpack(plan, buffer, tensors)):
                assert torch.equal(out, t)
    big = [torch.randn(10), torch.randn(11)]
    packing._INDEX_LIMIT, saved = 0, packing._INDEX_LIMIT  # force the per-tensor path of very large groups
    try:
        plan = packing._make_plan(big, 2)
        assert plan.groups[0].index is None and not plan.groups[0].block
        rows = packing.pack(plan, big).repeat(2).view(2, -1)
        assert all(torch.equal(o, torch.cat([t, t])) for o, t in zip(packing.unpack_gathered(plan, rows, big), big))
    finally:
        packing._INDEX_LIMIT = saved


def test_chained_operation_names_the_failing_function():
    @ops.chained_operation
    def outer():
        raise ops.DistributedOperationException("shapes differ")

    with pytest.raises(ops.DistributedOperationException, match=r"outer failed: shapes differ"):
        outer()
    assert ops.verify_operation(lambda tensor: tensor + 1)(torch.ones(1)).tolist() == [2.0]  # one process: a call


def test_gathered_parameters_is_a_no_op_without_zero3_partitioning():
    layer = torch.nn.Linear(2, 2)
    with ops.GatheredParameters(layer.parameters(), modifier_rank=0):
        assert layer.weight.shape == (2, 2)
    with ops.GatheredParameters(layer.weight, enabled=False):
        pass
    assert not ops.is_torch_xpu_tensor(torch.ones(1)) and not ops.is_torch_xpu_tensor([1])


def test_flat_tensors_takes_only_plain_containers_of_tensors():
    from collections import OrderedDict

    from nbaccel.utils.structures import flat_tensors, rebuild_flat

    a, b = torch.ones(1), torch.nn.Parameter(torch.zeros(2))
    assert flat_tensors({"a": a, "b": b}) == [a, b] and flat_tensors((a, b)) == [a, b] and flat_tensors([a]) == [a]
    assert flat_tensors({}) == [] and flat_tensors(a) is None
    assert flat_tensors({"a": a, "n": [b]}) is None and flat_tensors([a, 1]) is None
    assert flat_tensors(OrderedDict(a=a)) is None  # other container types keep their own rebuild
    x, y = torch.full((1,), 7.0), torch.full((2,), 8.0)
    assert rebuild_flat({"a": a, "b": b}, [x, y]) == {"a": x, "b": y}
    assert type(rebuild_flat((a, b), [x, y])) is tuple and type(rebuild_flat([a, b], [x, y])) is list
