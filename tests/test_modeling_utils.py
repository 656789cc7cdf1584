"""nbaccel.utils modeling/offload helpers: sizes, memory budgets, device maps, tied weights, offload files."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

from nbaccel import init_empty_weights
from nbaccel.utils import (
    OffloadedWeightsLoader,
    PrefixedDataset,
    calculate_maximum_sizes,
    check_device_map,
    compute_module_sizes,
    convert_file_size_to_int,
    dtype_byte_size,
    extract_submodules_state_dict,
    find_tied_parameters,
    get_balanced_memory,
    get_max_layer_size,
    get_max_memory,
    id_tensor_storage,
    infer_auto_device_map,
    load_offloaded_weight,
    load_offloaded_weights,
    load_state_dict,
    named_module_tensors,
    offload_state_dict,
    offload_weight,
    retie_parameters,
    set_module_tensor_to_device,
)
from nbaccel.utils.dataclasses import CustomDtype
from nbaccel.utils.modeling import check_devices_exist


class Block(nn.Module):
    def __init__(self, d: int = 8):
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)
        self.register_buffer("scale", torch.ones(d))
        self.register_buffer("cache", torch.zeros(d), persistent=False)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x))) * self.scale + self.cache


class Net(nn.Module):
    def __init__(self, d: int = 8, n: int = 4, tie: bool = False):
        super().__init__()
        self.emb = nn.Embedding(32, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 32, bias=False)
        if tie:
            self.head.weight = self.emb.weight

    def forward(self, ids):
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_convert_file_size_to_int():
    assert convert_file_size_to_int("1MiB") == 2**20
    assert convert_file_size_to_int("10GiB") == 10 * 2**30
    assert convert_file_size_to_int("500MB") == 500 * 10**6
    assert convert_file_size_to_int("1.5KB") == 1500
    assert convert_file_size_to_int("8Gb") == 10**9  # lowercase b: bits
    assert convert_file_size_to_int(1234) == 1234
    for bad in ("ten GB", "12XB", -1, None):
        with pytest.raises(ValueError, match="size"):
            convert_file_size_to_int(bad)


def test_dtype_byte_size_and_storage_id():
    assert dtype_byte_size(torch.float32) == 4
    assert dtype_byte_size(torch.bfloat16) == 2
    assert dtype_byte_size(torch.int8) == 1
    assert dtype_byte_size(torch.bool) == 1 / 8
    assert dtype_byte_size(CustomDtype.INT4) == 1 / 2
    base = torch.zeros(10)
    assert id_tensor_storage(base[:5]) == id_tensor_storage(base[5:])
    assert id_tensor_storage(base) != id_tensor_storage(torch.zeros(10))


def test_compute_sizes_and_largest_layer():
    model = Net(d=8, n=2)
    sizes = compute_module_sizes(model)
    block = (8 * 16 + 16 + 16 * 8 + 8 + 8 + 8) * 4  # params + both buffers, float32
    assert sizes["blocks.0"] == block
    assert sizes[""] == sum(t.numel() * 4 for _, t in named_module_tensors(model, recurse=True))
    assert compute_module_sizes(model, dtype=torch.float16)["blocks.0"] == block // 2
    top = list(model.named_children())
    assert get_max_layer_size(top, sizes, ["Block"]) == (block, ["blocks.0", "blocks.1"])
    assert get_max_layer_size(top, sizes, [])[0] == sizes["emb"]  # the 32x8 embedding is the largest leaf
    total, (largest, _) = calculate_maximum_sizes(model)
    assert total == sizes[""] and largest == sizes["emb"]
    names = [n for n, _ in named_module_tensors(model.blocks[0], remove_non_persistent=True)]
    assert "cache" not in names and "scale" in names


def test_get_max_memory():
    converted = get_max_memory({"cpu": "1GiB", "disk": 5})
    assert converted == {"cpu": 2**30, "disk": 5}
    measured = get_max_memory()
    assert measured["cpu"] > 0
    with pytest.raises(ValueError, match="not recognized"):
        get_max_memory({"gpu0": "1GB"})
    # without accelerators the balanced budget is the plain budget
    if not torch.cuda.is_available():
        assert get_balanced_memory(Net(), {"cpu": "1MB"}) == {"cpu": 10**6}


def test_tied_parameters_found_and_retied():
    model = Net(tie=True)
    assert find_tied_parameters(model) == [["emb.weight", "head.weight"]]
    model.head.weight = nn.Parameter(torch.zeros(32, 8))
    retie_parameters(model, [["emb.weight", "head.weight"]])
    assert model.head.weight is model.emb.weight
    with init_empty_weights():
        empty = Net(tie=True)
    assert find_tied_parameters(empty) == [["emb.weight", "head.weight"]]


def test_set_module_tensor_to_device():
    model = Net()
    value = torch.full((16, 8), 2.0, dtype=torch.float64)
    set_module_tensor_to_device(model, "blocks.0.fc1.weight", "cpu", value=value)
    weight = model.blocks[0].fc1.weight
    assert isinstance(weight, nn.Parameter) and weight.dtype == torch.float32 and weight.requires_grad
    assert torch.equal(weight, torch.full((16, 8), 2.0))
    set_module_tensor_to_device(model, "blocks.0.fc1.weight", "meta")
    assert model.blocks[0].fc1.weight.is_meta
    with pytest.raises(ValueError, match="meta device"):
        set_module_tensor_to_device(model, "blocks.0.fc1.weight", "cpu")
    with pytest.raises(ValueError, match="shape"):
        set_module_tensor_to_device(model, "blocks.0.fc1.weight", "cpu", value=torch.zeros(3, 3))
    with pytest.raises(ValueError, match="no parameter or buffer"):
        set_module_tensor_to_device(model, "blocks.0.fc1.nope", "cpu")
    set_module_tensor_to_device(model, "blocks.0.scale", "cpu", value=torch.arange(8.0), dtype=torch.float16)
    assert model.blocks[0].scale.dtype == torch.float16


def test_check_device_map_errors():
    model = Net()
    check_device_map(model, {"": "cpu"})
    with pytest.raises(ValueError, match="does not give any device.*head.weight"):
        check_device_map(model, {"emb": "cpu", "blocks": "cpu"})
    # as in Accelerate, check_device_map checks coverage only; dispatching checks that the devices exist
    missing_gpu = torch.cuda.device_count()
    check_device_map(model, {"emb": "cpu", "blocks": missing_gpu, "head": "disk"})
    with pytest.raises(ValueError, match=f"accelerator {missing_gpu}"):
        check_devices_exist({"emb": "cpu", "blocks": missing_gpu, "head": "disk"})
    with pytest.raises(ValueError, match="not a device"):
        check_devices_exist({"": "gpu-7"})
    with pytest.warns(UserWarning, match="do not match any submodules"):
        check_device_map(model, {"": "cpu", "decoder": "cpu"})
    accelerate_modeling = pytest.importorskip("accelerate.utils.modeling")
    for check in (accelerate_modeling.check_device_map, check_device_map):
        check(model, {"": missing_gpu})
        with pytest.warns(UserWarning, match="device_map keys do not match any submodules"):
            check(model, {"": "cpu", "decoder": 0})


def test_infer_auto_device_map_spills_to_disk_and_respects_no_split():
    with init_empty_weights():
        model = Net(d=16, n=6)
    sizes = compute_module_sizes(model)
    block = sizes["blocks.0"]
    assert infer_auto_device_map(model, max_memory={"cpu": sizes[""] * 2}) == {"": "cpu"}
    budget = sizes["emb"] + 2 * block + block  # room for emb and two blocks, plus the largest layer kept free
    device_map = infer_auto_device_map(model, max_memory={"cpu": budget}, no_split_module_classes=["Block"])
    assert device_map["emb"] == "cpu" and device_map["blocks.0"] == "cpu" and device_map["blocks.1"] == "cpu"
    assert device_map["blocks.2"] == "disk" and device_map["head"] == "disk"
    assert all(not key.startswith("blocks.2.") for key in device_map)  # Block never split
    check_device_map(model, device_map)


def test_infer_auto_device_map_keeps_tied_weights_together():
    with init_empty_weights():
        model = Net(d=16, n=6, tie=True)
    sizes = compute_module_sizes(model)
    device_map = infer_auto_device_map(model, max_memory={"cpu": sizes["emb"] + 2 * sizes["blocks.0"]},
                                       no_split_module_classes=["Block"])
    assert device_map["emb"] == device_map["head"]


def test_infer_auto_device_map_bad_no_split_class():
    with pytest.raises(ValueError, match="names no class of this model.*Block"):
        infer_auto_device_map(Net(), max_memory={"cpu": "1MB"}, no_split_module_classes=["LlamaDecoderLayer"])


def test_matches_accelerate_device_maps():
    accelerate_modeling = pytest.importorskip("accelerate.utils.modeling")
    with init_empty_weights():
        model = Net(d=16, n=6)
    sizes = compute_module_sizes(model)
    for budget in (sizes[""] * 2, sizes[""] // 2, sizes[""] // 3, sizes["blocks.0"] * 3):
        for no_split in (["Block"], None):
            ours = infer_auto_device_map(model, max_memory={"cpu": budget}, no_split_module_classes=no_split)
            theirs = accelerate_modeling.infer_auto_device_map(model, max_memory={"cpu": budget},
                                                               no_split_module_classes=no_split)
            # Accelerate leaves the direct buffers of a split module out of its map (dispatch then rejects
            # the map); nbaccel maps them too. Everything else must be identical.
            buffers = {n for n, _ in model.named_buffers()}
            assert {k: v for k, v in ours.items() if k not in buffers} == dict(theirs), (budget, no_split)
    # accelerator budgets (computed the same way without GPUs: only sizes matter) and balancing
    total = sizes[""]
    for budget in ({0: total // 3, 1: total // 3, "cpu": total // 4}, {0: total // 5, "cpu": total // 2}):
        ours = infer_auto_device_map(model, max_memory=dict(budget), no_split_module_classes=["Block"])
        theirs = accelerate_modeling.infer_auto_device_map(model, max_memory=dict(budget),
                                                           no_split_module_classes=["Block"])
        assert dict(ours) == dict(theirs), budget
        for low_zero in (False, True):
            assert get_balanced_memory(model, dict(budget), ["Block"], low_zero=low_zero) == \
                accelerate_modeling.get_balanced_memory(model, dict(budget), ["Block"], low_zero=low_zero)


def test_offload_files_roundtrip(tmp_path):
    tensors = {
        "a": torch.randn(3, 4),
        "b": torch.randn(5).to(torch.bfloat16),
        "c": torch.tensor(7, dtype=torch.int64),
    }
    index = {}
    for name, tensor in tensors.items():
        offload_weight(tensor, name, tmp_path, index=index)
    assert index["b"] == {"dtype": "bfloat16", "shape": [5]}
    for name, tensor in tensors.items():
        loaded = load_offloaded_weight(tmp_path / f"{name}.dat", index[name])
        assert loaded.dtype == tensor.dtype and torch.equal(loaded, tensor)

    folder = tmp_path / "sd"
    offload_state_dict(folder, tensors)
    loader = OffloadedWeightsLoader(state_dict={"x": torch.ones(2)}, save_folder=folder)
    assert sorted(loader) == ["a", "b", "c", "x"] and len(loader) == 4
    assert torch.equal(loader["a"], tensors["a"]) and torch.equal(loader["x"], torch.ones(2))
    assert json.loads((folder / "index.json").read_text())["a"]["shape"] == [3, 4]
    with pytest.raises(ValueError, match="Need either"):
        OffloadedWeightsLoader()

    prefixed = PrefixedDataset({"l1.w": 1, "l1.b": 2, "l2.w": 3}, "l1.")
    assert prefixed["w"] == 1 and len(prefixed) == 2 and sorted(prefixed) == ["l1.b", "l1.w"]
    state = {"h.1.w": 1, "h.10.w": 2, "h.1": 3, "x": 4}
    assert extract_submodules_state_dict(state, ["h.1"]) == {"h.1.w": 1, "h.1": 3}


def test_load_offloaded_weights_and_load_state_dict(tmp_path):
    from safetensors.torch import save_file

    model = Net()
    expected = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    offload_state_dict(tmp_path / "off", expected)
    index = json.loads((tmp_path / "off" / "index.json").read_text())
    load_offloaded_weights(model, index, tmp_path / "off")
    assert all(torch.equal(model.state_dict()[k], v) for k, v in expected.items())
    save_file({k: v.contiguous() for k, v in expected.items()}, str(tmp_path / "w.safetensors"),
              metadata={"format": "pt"})
    loaded = load_state_dict(str(tmp_path / "w.safetensors"))
    assert loaded.keys() == expected.keys() and all(torch.equal(loaded[k], expected[k]) for k in expected)
    torch.save(expected, tmp_path / "w.bin")
    assert torch.equal(load_state_dict(str(tmp_path / "w.bin"))["emb.weight"], expected["emb.weight"])


def test_estimate_memory_command(tmp_path, capsys):
    from nbaccel.commands.estimate import gather_data
    from nbaccel.commands.estimate import main as estimate_main

    source = tmp_path / "tiny_model.py"
    source.write_text(
        "import torch.nn as nn\n"
        "class Tiny(nn.Module):\n"
        "    def __init__(self, d=256):\n"
        "        super().__init__()\n"
        "        self.a = nn.Linear(d, d, bias=False)\n"
        "        self.b = nn.Linear(d, 2 * d, bias=False)\n"
        "def make(d=256):\n"
        "    return Tiny(d)\n"
    )
    assert estimate_main([f"{source}:Tiny", "--model_kwargs", '{"d": 512}']) == 0
    out = capsys.readouterr().out
    total = 512 * 512 * 3 * 4  # 3 MiB in float32
    assert "786,432 parameters" in out and "3.00 MB" in out and "12.00 MB" in out  # Adam: 4x
    assert "1.50 MB" in out and "N/A" in out  # float16 half; int8/int4 training not estimated
    with init_empty_weights():
        model = Net()
    rows = gather_data(model, ["float32", "bfloat16", "int4"])
    fp32_total = compute_module_sizes(model)[""]
    assert [r[2] for r in rows] == [fp32_total, fp32_total / 2, fp32_total / 8]
    assert max(rows[0][3].values()) == 4 * fp32_total and max(rows[1][3].values()) == 2 * fp32_total
    assert total == 3 * 2**20
    assert estimate_main([f"{source}:make"]) == 0  # a factory function
    try:
        from nbaccel.commands.main import main as cli
    except ImportError:
        cli = None
    if cli is not None:  # registered as `nbaccel estimate-memory`
        capsys.readouterr()
        assert cli(["estimate-memory", f"{source}:Tiny", "--dtypes", "bfloat16"]) == 0
        assert "bfloat16" in capsys.readouterr().out
    assert estimate_main(["gpt2"]) == 2
    assert "Hub cannot be reached" in capsys.readouterr().err  # issue 14 item 8: Hub names as in Accelerate
    assert estimate_main([f"{source}:Nope"]) == 2
    assert "has no attribute 'Nope'" in capsys.readouterr().err


def _placement_outcome(infer, model, **kwargs):
    """What infer_auto_device_map gives and says: the map, the warnings' texts, and whether it logged devices
    that could take no module (the INFO record code looks for: "insufficient memory")."""
    import logging
    import warnings

    records = []
    handler = logging.Handler(level=logging.DEBUG)
    handler.emit = records.append
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            device_map = infer(model, **kwargs)
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
    logged = any("insufficient memory" in record.getMessage() for record in records)
    return dict(device_map), [type(w.message) for w in caught], logged


def _tied_trio():
    """Three sub-models in a row, as Accelerate's own tied-weights test builds them."""
    from collections import OrderedDict

    return nn.Sequential(OrderedDict((f"layer{i}", Net(d=4, n=1)) for i in (1, 2, 3)))


def test_infer_auto_device_map_matches_accelerate_with_ties_fallback_and_buffers():
    accelerate_modeling = pytest.importorskip("accelerate.utils.modeling")
    from collections import OrderedDict

    cases = []
    trio = _tied_trio()
    sizes = compute_module_sizes(trio)
    one = sizes["layer1"]
    trio.layer3.head.weight = trio.layer1.head.weight  # tied across sub-models: the tied part comes along
    cases.append(("tied across", trio, {"max_memory": {0: int(1.6 * one), 1: 2 * one}}))
    three = _tied_trio()
    three.layer3.head.weight = three.layer1.head.weight
    three.layer2.head.weight = three.layer1.head.weight
    three.layer2.emb.weight = three.layer1.emb.weight
    cases.append(("two tie groups", three, {"max_memory": {0: int(1.6 * one), 1: 2 * one}}))
    with init_empty_weights():
        tied_net = Net(d=16, n=6, tie=True)
    net_sizes = compute_module_sizes(tied_net)
    for budget in (net_sizes[""] // 2, net_sizes[""] // 3, net_sizes["blocks.0"] * 3):
        cases.append((f"tied net {budget}", tied_net, {"max_memory": {0: budget, "cpu": budget},
                                                       "no_split_module_classes": ["Block"]}))
    # numbered children (1 and 11): Accelerate's "inside" test is a substring test; the maps must still agree
    numbered = nn.Sequential(*(Net(d=4, n=1) for _ in range(12)))
    numbered[11].head.weight = numbered[1].head.weight
    numbered[2].emb.weight = numbered[11].emb.weight
    numbered_size = compute_module_sizes(numbered)[""]
    for share in (3, 5):
        cases.append((f"numbered {share}", numbered, {"max_memory": {0: numbered_size // share,
                                                                     1: numbered_size // share, "cpu": "1GB"}}))
    inner = nn.Sequential(OrderedDict([("a", nn.Linear(10, 4)), ("b", nn.Linear(4, 4)), ("c", nn.Linear(4, 8))]))
    nested = nn.Sequential(OrderedDict([("module", inner)]))
    for fallback in (False, True):  # only the small middle layer fits next to the reserve for the largest
        cases.append((f"fallback {fallback}", nested, {"max_memory": {0: 256}, "fallback_allocation": fallback}))
    # layers with buffers of their own: offloaded layers' buffers stay on the execution device
    with_buffers = nn.Sequential(OrderedDict([("a", nn.Linear(3, 4)), ("norm", nn.BatchNorm1d(4)),
                                              ("b", nn.Linear(4, 5)), ("c", nn.Linear(4, 5))]))
    for i, module in enumerate(with_buffers):
        module.register_buffer(f"extra{i}", torch.zeros(10, 2 + i % 2))
    for budgets in ({0: 400, 1: 400, "cpu": "1GB"}, {0: 400, 1: 200, "cpu": "1GB"}, {0: 400, "cpu": "1GB"}):
        for offload_buffers in (False, True):
            cases.append((f"buffers {budgets} {offload_buffers}", with_buffers,
                          {"max_memory": budgets, "offload_buffers": offload_buffers}))
    cases.append(("fallback and buffers", with_buffers, {"max_memory": {0: 500}, "fallback_allocation": True}))
    outcomes = set()
    for label, model, kwargs in cases:
        ours = _placement_outcome(infer_auto_device_map, model, **copy.deepcopy(kwargs))
        try:
            theirs = _placement_outcome(accelerate_modeling.infer_auto_device_map, model, **copy.deepcopy(kwargs))
        except IndexError:  # Accelerate fails on a tied weight whose module is already placed; nbaccel maps it
            assert label.startswith("numbered")
            check_device_map(model, ours[0])
            continue
        assert ours == theirs, label
        outcomes.add((bool(ours[1]), ours[2], len(set(ours[0].values()))))
    # the cases reach a warning, the INFO record, and maps over one and several devices
    assert any(warned for warned, _, _ in outcomes) and any(logged for _, logged, _ in outcomes)
    assert {1, 2} <= {devices for _, _, devices in outcomes} or max(d for _, _, d in outcomes) > 2


# --- Accelerate 1.15 names: tied-weights checks, precision helpers, peft ---------------------------------


def test_check_tied_parameters_in_config_reads_transformers_config():
    from types import SimpleNamespace

    from nbaccel.utils.modeling import check_tied_parameters_in_config

    class PreTrainedModel(nn.Module):  # stands in for transformers' base class, matched by name
        def __init__(self, tie: bool):
            super().__init__()
            self.config = SimpleNamespace(tie_word_embeddings=tie)
            self.head = nn.Linear(2, 2)

        def get_output_embeddings(self):
            return self.head

    assert check_tied_parameters_in_config(PreTrainedModel(tie=True)) is True
    assert check_tied_parameters_in_config(PreTrainedModel(tie=False)) is False
    assert check_tied_parameters_in_config(nn.Linear(2, 2)) is False  # not a transformers model


def test_is_peft_model_false_for_plain_module():
    from nbaccel.utils.modeling import is_peft_model

    assert is_peft_model(nn.Linear(2, 2)) is False


def test_get_mixed_precision_context_manager_follows_the_state():
    import contextlib

    from nbaccel.state import AcceleratorState, isolated_states
    from nbaccel.utils import AutocastKwargs
    from nbaccel.utils.modeling import get_mixed_precision_context_manager

    assert isinstance(get_mixed_precision_context_manager(native_amp=False), contextlib.nullcontext)
    with isolated_states():
        with pytest.raises(ValueError, match="Accelerator"):  # Accelerate's type (its uninitialized state's)
            get_mixed_precision_context_manager(native_amp=True)
        AcceleratorState(cpu=True, mixed_precision="bf16", _from_accelerator=True)
        with get_mixed_precision_context_manager(True, AutocastKwargs(cache_enabled=False)):
            out = nn.Linear(4, 4)(torch.ones(2, 4))
        assert out.dtype == torch.bfloat16


def test_get_grad_scaler_picks_the_scaler_class():
    import warnings

    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    from nbaccel.utils import DistributedType
    from nbaccel.utils.environment import get_current_device_type
    from nbaccel.utils.modeling import get_grad_scaler

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch disables a CUDA scaler on a CPU-only machine, with a warning
        scaler = get_grad_scaler(growth_interval=7)
        sharded = get_grad_scaler(DistributedType.FSDP)
    assert type(scaler) is torch.amp.GradScaler and scaler._device == get_current_device_type()[0]
    assert scaler.is_enabled() == (scaler._device == "cuda" and torch.cuda.is_available())
    if scaler.is_enabled():
        assert scaler.get_growth_interval() == 7
    assert isinstance(sharded, ShardedGradScaler)


def test_ensure_weights_retied_keeps_ties_after_reinit():
    from nbaccel.utils.fsdp_utils import ensure_weights_retied

    class Tied(nn.Module):
        _tied_weights_keys = ["a.weight", "b.weight"]

        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 3, bias=False), nn.Linear(3, 3, bias=False)
            self.b.weight = self.a.weight

    def reinit(module):  # re-creates parameters, as FSDP's param_init_fn may
        for name, param in list(module.named_parameters(recurse=False)):
            setattr(module, name, nn.Parameter(torch.zeros_like(param)))
        return module

    model = Tied()
    assert ensure_weights_retied(reinit, nn.Linear(2, 2), "cpu") is reinit  # nothing tied: unchanged
    init = ensure_weights_retied(reinit, model, "cpu")
    init(model.a)
    init(model.b)
    assert model.a.weight is model.b.weight


def test_load_offloaded_weights_importable_from_modeling():
    from nbaccel.utils import modeling, offload

    assert modeling.load_offloaded_weights is offload.load_offloaded_weights
