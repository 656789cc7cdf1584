"""Big-model inference: empty init, hooks, dispatch across cpu and disk, sharded checkpoints, memory bound."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from nbaccel import (
    cpu_offload,
    cpu_offload_with_hook,
    disk_offload,
    dispatch_model,
    infer_auto_device_map,
    init_empty_weights,
    init_on_device,
    load_checkpoint_and_dispatch,
)
from nbaccel.hooks import AlignDevicesHook, ModelHook, add_hook_to_module, remove_hook_from_module
from nbaccel.utils import compute_module_sizes, load_checkpoint_in_model


class Block(nn.Module):
    def __init__(self, d: int = 16):
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, d))

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x))) * self.scale


class Net(nn.Module):
    def __init__(self, d: int = 16, n: int = 6, tie: bool = True):
        super().__init__()
        self.emb = nn.Embedding(50, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 50, bias=False)
        if tie:
            self.head.weight = self.emb.weight

    def forward(self, ids, scale: float = 1.0):
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x) * scale


def save_sharded(model: nn.Module, folder, shards: int = 3, skip=("head.weight",)) -> None:
    """Write `model` as a sharded safetensors checkpoint with model.safetensors.index.json (tied head left out,
    as transformers does)."""
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k not in skip}
    keys = list(state)
    per = -(-len(keys) // shards)
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: state[k] for k in keys[i * per:(i + 1) * per]}
        save_file(part, os.path.join(folder, name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as handle:
        json.dump({"metadata": {}, "weight_map": weight_map}, handle)


@pytest.fixture
def reference(tmp_path):
    torch.manual_seed(0)
    model = Net().eval()
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_sharded(model, ckpt)
    ids = torch.randint(0, 50, (2, 7))
    with torch.no_grad():
        expected = model(ids)
    return model, ckpt, ids, expected


def test_init_empty_weights_and_on_device():
    with init_empty_weights():
        model = Net()
    assert all(p.is_meta for p in model.parameters())
    assert not model.blocks[0].scale.is_meta  # buffers stay real unless include_buffers=True
    assert model.head.weight is model.emb.weight  # ties survive
    with init_empty_weights(include_buffers=True):
        model = Net()
    assert model.blocks[0].scale.is_meta
    with init_on_device("meta"):
        layer = nn.Linear(4, 4)
    assert layer.weight.is_meta
    assert not nn.Linear(2, 2).weight.is_meta  # the patch is undone on exit


def test_hooks_wrap_forward_with_kwargs_and_are_removed():
    class Double(ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            kwargs["scale"] = kwargs.get("scale", 1.0) * 2
            return args, kwargs

        def post_forward(self, module, output):
            return output + 1

    model = Net(n=1).eval()
    ids = torch.randint(0, 50, (1, 3))
    with torch.no_grad():
        plain = model(ids, scale=3.0)
        add_hook_to_module(model, Double())
        assert torch.allclose(model(ids, scale=3.0), plain * 2 + 1)
        add_hook_to_module(model, Double(), append=True)  # chained: scale x4, +2
        assert torch.allclose(model(ids, scale=3.0), plain * 4 + 2)
        add_hook_to_module(model.blocks[0], AlignDevicesHook(execution_device="cpu"))
        remove_hook_from_module(model, recurse=True)
        assert torch.allclose(model(ids, scale=3.0), plain)
    assert not hasattr(model, "_hf_hook") and not hasattr(model.blocks[0], "_old_forward")


@pytest.mark.parametrize("offload_buffers", [False, True])
def test_load_checkpoint_and_dispatch_cpu_and_disk(reference, tmp_path, offload_buffers):
    _, ckpt, ids, expected = reference
    with init_empty_weights():
        model = Net()
    sizes = compute_module_sizes(model)
    budget = sizes["emb"] + 3 * sizes["blocks.0"]
    offload = tmp_path / "offload"
    model = load_checkpoint_and_dispatch(model, ckpt, device_map="auto", max_memory={"cpu": budget},
                                         no_split_module_classes=["Block"], offload_folder=offload,
                                         offload_buffers=offload_buffers)
    placed = model.hf_device_map
    assert "disk" in placed.values() and "cpu" in placed.values()
    disk_blocks = [k for k, v in placed.items() if v == "disk"]
    assert model.get_submodule(disk_blocks[0]).fc1.weight.is_meta
    with torch.no_grad():
        assert torch.allclose(model(ids), expected, atol=1e-6)
        assert torch.allclose(model(ids), expected, atol=1e-6)  # weights dropped and re-read each call
    assert model.get_submodule(disk_blocks[0]).fc1.weight.is_meta
    # disk weights point into the safetensors shards: nothing was copied into the offload folder
    index = json.loads((offload / "index.json").read_text())
    assert index and all("safetensors_file" in info for info in index.values())
    assert not [f for f in os.listdir(offload) if f.endswith(".dat")]
    with pytest.raises(RuntimeError, match="offloaded"):
        model.to("cpu")


def test_torch_bin_checkpoint_offloads_to_dat_files(reference, tmp_path):
    ref, _, ids, expected = reference
    torch.save(ref.state_dict(), tmp_path / "pytorch_model.bin")
    with init_empty_weights():
        model = Net()
    device_map = {"emb": "cpu", "blocks.0": "cpu", "blocks.1": "cpu", "blocks.2": "disk", "blocks.3": "disk",
                  "blocks.4": "disk", "blocks.5": "disk", "head": "cpu"}
    model = load_checkpoint_and_dispatch(model, tmp_path, device_map=device_map, offload_folder=tmp_path / "off")
    assert (tmp_path / "off" / "blocks.2.fc1.weight.dat").exists()
    with torch.no_grad():
        assert torch.allclose(model(ids), expected, atol=1e-6)


def test_dispatch_model_with_cpu_state_dict_and_dtype(reference, tmp_path):
    ref, ckpt, ids, expected = reference
    with init_empty_weights():
        model = Net()
    load_checkpoint_in_model(model, ckpt, device_map={"": "cpu"}, dtype=torch.float64)
    assert model.blocks[0].fc1.weight.dtype == torch.float64
    model = Net()
    model.load_state_dict(ref.state_dict())
    dispatch_model(model, {"emb": "cpu", "blocks": "disk", "head": "cpu"}, offload_dir=tmp_path / "o2")
    with torch.no_grad():
        assert torch.allclose(model(ids), expected, atol=1e-6)


def test_cpu_and_disk_offload(reference, tmp_path):
    ref, _, ids, expected = reference
    for offload in (lambda m: cpu_offload(m, execution_device="cpu"),
                    lambda m: disk_offload(m, tmp_path / "full", execution_device="cpu")):
        model = Net().eval()
        model.load_state_dict(ref.state_dict())
        offload(model)
        assert model.blocks[0].fc1.weight.is_meta
        with torch.no_grad():
            assert torch.allclose(model(ids), expected, atol=1e-6)
        remove_hook_from_module(model, recurse=True)
        with torch.no_grad():
            assert torch.allclose(model(ids), expected, atol=1e-6)  # detach puts the weights back


def test_cpu_offload_with_hook_pipeline(reference):
    ref, _, ids, expected = reference
    model, hook = cpu_offload_with_hook(ref, execution_device="cpu")
    with torch.no_grad():
        assert torch.allclose(model(ids), expected)
    hook.offload()
    hook.remove()
    assert not hasattr(model, "_hf_hook")


def test_bad_inputs(reference, tmp_path):
    _, ckpt, _, _ = reference
    with init_empty_weights():
        model = Net()
    missing_gpu = torch.cuda.device_count()
    with pytest.raises(ValueError, match=f"device_map\\['blocks'\\] names accelerator {missing_gpu}"):
        load_checkpoint_and_dispatch(model, ckpt, device_map={"emb": "cpu", "blocks": missing_gpu, "head": "cpu"})
    with pytest.raises(ValueError, match="device_map='fastest' is not supported"):
        load_checkpoint_and_dispatch(model, ckpt, device_map="fastest")
    with pytest.raises(ValueError, match="offload_folder"):
        load_checkpoint_and_dispatch(model, ckpt, device_map={"": "disk"})
    with pytest.raises(ValueError, match="names no class of this model"):
        load_checkpoint_and_dispatch(model, ckpt, device_map="auto", no_split_module_classes=["GPTJBlock"])
    with pytest.raises(ValueError, match="not a folder containing"):
        load_checkpoint_and_dispatch(model, tmp_path, device_map={"": "cpu"})

    # a checkpoint missing a key the empty model needs
    broken = tmp_path / "broken"
    broken.mkdir()
    torch.manual_seed(1)
    save_sharded(Net(), broken, skip=("head.weight", "blocks.3.fc2.bias"))
    with init_empty_weights():
        model = Net()
    with pytest.raises(ValueError, match=r"has no value for 1 tensor\(s\).*blocks\.3\.fc2\.bias"):
        load_checkpoint_and_dispatch(model, broken, device_map={"": "cpu"})
    # strict: unexpected keys are errors too
    extra = tmp_path / "extra.safetensors"
    save_file({**{k: v.contiguous() for k, v in Net(tie=False).state_dict().items()}, "junk": torch.zeros(1)}, str(extra),
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match="unexpected keys \\['junk'\\]"):
        load_checkpoint_in_model(Net(tie=False), str(extra), strict=True)


_PEAK_CHILD = textwrap.dedent("""
    import json, sys, torch
    from torch import nn
    from nbaccel import init_empty_weights, load_checkpoint_and_dispatch
    ckpt, offload, budget, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    class Tower(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(2048, 2048) for _ in range(12))
        def forward(self, x):
            for layer in self.layers:
                x = torch.tanh(layer(x))
            return x
    def status(field):  # kB values of /proc/self/status, this process only (ru_maxrss inherits the parent's)
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    with init_empty_weights():
        model = Tower()
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")  # reset the peak-RSS mark (VmHWM) to the current RSS
    except OSError as error:
        print(json.dumps({"skip": f"cannot reset the peak-RSS mark: {error}"}))
        sys.exit(0)
    before = status("VmRSS")
    model = load_checkpoint_and_dispatch(model, ckpt, device_map="auto", max_memory={"cpu": budget},
                                         offload_folder=offload)
    load_peak = status("VmHWM") - before
    with torch.no_grad():  # the forward reads the disk layers one at a time and drops each afterwards
        torch.manual_seed(0)
        y = model(torch.randn(4, 2048))
        y = model(torch.randn(4, 2048)) * 0 + y
    peak = status("VmHWM") - before
    torch.save(y, out)
    print(json.dumps({"peak": peak, "load_peak": load_peak, "map": {k: str(v) for k, v in model.hf_device_map.items()}}))
""")


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc peak-RSS accounting")
def test_peak_memory_stays_under_budget_plus_largest_layer(tmp_path):
    """12 layers of 16 MiB (192 MiB) with a 64 MiB CPU budget: neither the load nor two forward passes may
    hold more than the budget plus one layer, and the outputs must equal the fully loaded model's."""
    torch.manual_seed(0)
    layers = nn.ModuleList(nn.Linear(2048, 2048) for _ in range(12))
    state = {f"layers.{k}": v.contiguous() for k, v in layers.state_dict().items()}
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    weight_map = {}
    for i in range(4):  # 4 shards of 3 layers (48 MiB each)
        name = f"model-{i + 1:05d}-of-00004.safetensors"
        part = {k: v for k, v in state.items() if int(k.split(".")[1]) // 3 == i}
        save_file(part, str(ckpt / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    torch.manual_seed(0)
    x = torch.randn(4, 2048)
    with torch.no_grad():
        for layer in layers:
            x = torch.tanh(layer(x))
    del layers, state

    layer_bytes = (2048 * 2048 + 2048) * 4
    budget = 64 * 2**20
    out = tmp_path / "y.pt"
    result = subprocess.run([sys.executable, "-c", _PEAK_CHILD, str(ckpt), str(tmp_path / "offload"), str(budget),
                             str(out)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    if "skip" in report:
        pytest.skip(report["skip"])
    assert "disk" in report["map"].values() and "cpu" in report["map"].values()
    assert report["load_peak"] < budget + layer_bytes, f"peak {report['load_peak'] / 2**20:.1f} MiB in load"
    assert report["peak"] < budget + layer_bytes, f"peak {report['peak'] / 2**20:.1f} MiB in load + forward"
    assert report["peak"] > 2 * layer_bytes  # the CPU layers and one disk layer really were resident
    assert torch.allclose(torch.load(out), x, atol=1e-5)


def test_infer_map_handles_model_bigger_than_budget():
    with init_empty_weights():
        model = Net(d=64, n=8, tie=False)
    device_map = infer_auto_device_map(model, max_memory={"cpu": "150KB"}, no_split_module_classes=["Block"])
    assert device_map["emb"] == "cpu" and device_map["blocks.0"] == "cpu"
    assert device_map["blocks.1"] == "disk" and device_map["head"] == "disk"


def test_multihead_attention_offloaded_to_disk(tmp_path):
    """nn.MultiheadAttention reads out_proj.weight without calling out_proj: its subtree loads as one unit."""
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(32, 32), nn.MultiheadAttention(32, 4, batch_first=True)).eval()
    x = torch.randn(2, 5, 32)

    def run(model):
        h = model[0](x)
        return model[1](h, h, h, need_weights=False)[0]

    with torch.no_grad():
        expected = run(reference)
    model = copy.deepcopy(reference)
    dispatch_model(model, {"0": "cpu", "1": "disk"}, offload_dir=tmp_path / "mha")
    assert model[1].out_proj.weight.is_meta
    with torch.no_grad():
        assert torch.equal(run(model), expected)


def test_state_dict_of_offloaded_model(reference, tmp_path):
    from nbaccel.utils import align_module_device, get_state_dict_offloaded_model, has_offloaded_params

    ref, ckpt, _, _ = reference
    with init_empty_weights():
        model = Net()
    model = load_checkpoint_and_dispatch(model, ckpt, device_map={"emb": "cpu", "blocks": "disk", "head": "cpu"},
                                         offload_folder=tmp_path / "off")
    layer = model.blocks[4].fc1
    assert has_offloaded_params(layer) and not has_offloaded_params(model.emb)
    with align_module_device(layer, "cpu"):
        assert torch.equal(layer.weight, ref.blocks[4].fc1.weight)
    assert layer.weight.is_meta
    state = get_state_dict_offloaded_model(model)
    expected = ref.state_dict()
    assert set(state) == set(expected)
    assert all(torch.equal(state[k], expected[k]) for k in expected)


def test_layerwise_casting_hooks():
    from nbaccel.big_modeling import attach_layerwise_casting_hooks

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    reference = copy.deepcopy(model)
    attach_layerwise_casting_hooks(model, storage_dtype=torch.bfloat16, compute_dtype=torch.float32,
                                   skip_modules_pattern=("^2$",))
    assert model[0].weight.dtype == torch.bfloat16 and model[2].weight.dtype == torch.float32
    assert model[1].weight.dtype == torch.float32  # norms are not cast
    x = torch.randn(3, 8)
    with torch.no_grad():
        out = model(x)
        reference[0].weight.copy_(reference[0].weight.to(torch.bfloat16).float())
        reference[0].bias.copy_(reference[0].bias.to(torch.bfloat16).float())
        assert out.dtype == torch.float32 and torch.allclose(out, reference(x), atol=1e-6)
    assert model[0].weight.dtype == torch.bfloat16  # back to storage after the forward


def test_recurrent_layers_are_refused_under_sequence_parallelism_as_accelerate():
    """The private check Accelerate runs before sharding a sequence: the same outcome on both libraries."""
    from types import SimpleNamespace

    accelerate_big_modeling = pytest.importorskip("accelerate.big_modeling")
    from nbaccel.big_modeling import _refuse_recurrent_layers_under_sequence_parallelism as ours

    theirs = accelerate_big_modeling._refuse_recurrent_layers_under_sequence_parallelism

    def model(layer_types):
        config = SimpleNamespace(layer_types=layer_types, get_text_config=lambda: config)
        return SimpleNamespace(config=config)

    for case in (model(["full_attention", "linear_attention"]), model(["full_attention"]), model(None),
                 SimpleNamespace(config=None), SimpleNamespace()):
        outcomes = []
        for check in (theirs, ours):
            try:
                check(case)
                outcomes.append(None)
            except ValueError as error:
                outcomes.append("linear_attention" in str(error))
        assert outcomes[0] == outcomes[1], case
