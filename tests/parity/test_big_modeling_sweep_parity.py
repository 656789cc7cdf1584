"""Big-model utilities side by side with Accelerate 1.15 (one process, CPU placements "cpu", "disk", "meta"):
the hooks `dispatch_model` attaches (tied weights), the order of inferred device maps, and the other corners
that a sweep found different. Each scenario runs on both libraries in the same test."""

from __future__ import annotations

import tempfile

import pytest
import torch
from parity_harness import assert_same, run_both
from torch import nn

pytest.importorskip("accelerate")
pytestmark = pytest.mark.timeout(300)


class _Tied(nn.Module):
    """An embedding whose weight the output layer shares."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 4)
        self.mid = nn.Linear(4, 4)
        self.head = nn.Linear(4, 16, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(self.mid(self.emb(x)))


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 8)
        self.register_buffer("scale", torch.ones(8))


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, 8)
        self.blocks = nn.ModuleList(_Block() for _ in range(4))
        self.head = nn.Linear(8, 32, bias=False)


def _hooks(model: nn.Module) -> dict:
    return {name: module._hf_hook for name, module in model.named_modules() if hasattr(module, "_hf_hook")}


def tied_hooks_scenario(lib):
    """Tied weights offloaded to disk: which hooks know them (`tied_params_names`), and whether the execution
    device still holds a loaded copy after the forward."""
    result = {}
    for device_map in ({"emb": "cpu", "mid": "cpu", "head": "disk"}, {"emb": "disk", "mid": "cpu", "head": "disk"}):
        torch.manual_seed(0)
        model = _Tied()
        with tempfile.TemporaryDirectory() as folder:
            lib.dispatch_model(model, device_map, offload_dir=folder)
            hooks = _hooks(model)
            before = {name: sorted(hook.tied_params_names) for name, hook in hooks.items()}
            output = model(torch.tensor([1, 2]))
            held = {name: sum(len(slot) for slot in hook.tied_params_map.values())
                    for name, hook in hooks.items() if hook.offload}
            result[str(device_map)] = {
                "tied_params_names": before, "output": output.detach(), "held_after_forward": held,
                "pointers_to_remove": {name: len(hook.tied_pointers_to_remove) for name, hook in hooks.items()
                                       if hook.offload},
                "original_devices": {name: (hook.param_original_devices, hook.buffer_original_devices)
                                     for name, hook in hooks.items()},
            }
    return result


def test_dispatched_tied_weights_hooks_match():
    results = run_both(tied_hooks_scenario, 1)
    accelerate, nbaccel = results["accelerate"][0], results["nbaccel"][0]
    assert any(names for case in nbaccel.values() for names in case["tied_params_names"].values())
    assert_same(accelerate, nbaccel, "tied hooks")


def device_map_order_scenario(lib):
    """Inferred maps whose split block has a buffer of its own, and a cleaned map with two merges."""
    from importlib import import_module

    modeling = import_module(f"{lib.__name__}.utils.modeling")
    model = _Net()
    inferred = {str(memory): list(lib.utils.infer_auto_device_map(model, max_memory=memory).items())
                for memory in ({"cpu": 3000}, {"cpu": 1200})}
    raw = {"head": "disk", "x.0": "cpu", "x.1": "cpu", "b.0": "disk", "b.1": "disk", "c": "cpu"}
    return {"inferred": inferred, "cleaned": list(modeling.clean_device_map(dict(raw)).items())}


def test_inferred_device_map_keeps_accelerates_key_order():
    results = run_both(device_map_order_scenario, 1)
    accelerate, nbaccel = results["accelerate"][0], results["nbaccel"][0]
    for memory, items in nbaccel["inferred"].items():
        # nbaccel gives a split block's own buffer a device (docs/compat.md); every other entry, in Accelerate's
        # order, and the buffer's entry right after its block's parts
        buffers = [i for i, (key, _) in enumerate(items) if key.endswith(".scale")]
        assert [item for item in items if not item[0].endswith(".scale")] == accelerate["inferred"][memory]
        for i in buffers:
            block = items[i][0].rsplit(".", 1)[0] + "."
            assert items[i - 1][0].startswith(block) and not items[i + 1][0].startswith(block), items
    assert any(key.endswith(".scale") for items in nbaccel["inferred"].values() for key, _ in items)
    # Accelerate merges children in set order (PYTHONHASHSEED decides); nbaccel in the model's order
    assert sorted(accelerate["cleaned"]) == sorted(nbaccel["cleaned"])
    assert nbaccel["cleaned"] == [("head", "disk"), ("c", "cpu"), ("x", "cpu"), ("b", "disk")]


def set_tensor_scenario(lib):
    """`set_module_tensor_to_device` with a dtype and no value (to the CPU, to meta), and through a submodule
    that is not there."""
    result = {}
    for device in ("cpu", "meta"):
        torch.manual_seed(0)
        model = _Net()
        lib.utils.set_module_tensor_to_device(model, "head.weight", device, dtype=torch.float16)
        lib.utils.set_module_tensor_to_device(model, "blocks.0.scale", device, dtype=torch.float16)
        result[device] = (model.head.weight.dtype, model.blocks[0].scale.dtype, type(model.head.weight).__name__)
    try:
        lib.utils.set_module_tensor_to_device(_Net(), "nowhere.weight", "cpu")
    except AttributeError as error:  # what Accelerate's getattr raises
        result["missing"] = f"AttributeError: {'nowhere' in str(error)}"
    return result


def test_set_module_tensor_to_device_dtype_without_value_matches():
    results = run_both(set_tensor_scenario, 1)
    assert results["nbaccel"][0]["cpu"][0] == torch.float32  # a real tensor keeps its dtype without a value
    assert_same(results["accelerate"][0], results["nbaccel"][0], "set_module_tensor_to_device")


class _Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 4)
        self.b = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))

    def forward(self, x):
        return self.b(self.a(x))


def nested_map_scenario(lib):
    """A device map with a key inside another ("b" on the CPU, "b.0" on disk): the deeper key wins."""
    result = {}
    for device_map in ({"a": "cpu", "b": "cpu", "b.0": "disk"}, {"": "cpu", "b": "disk"}):
        torch.manual_seed(0)
        model = _Stack()
        with tempfile.TemporaryDirectory() as folder:
            lib.dispatch_model(model, dict(device_map), offload_dir=folder)
            output = model(torch.ones(1, 3))
            result[str(device_map)] = {
                "devices": {name: str(t.device) for name, t in model.state_dict().items()},
                "hooks": {name: type(module._hf_hook).__name__ for name, module in model.named_modules()
                          if hasattr(module, "_hf_hook")},
                "output": output.detach(),
            }
    return result


def test_nested_device_map_keys_offload_the_inner_module():
    results = run_both(nested_map_scenario, 1)
    assert "meta" in results["nbaccel"][0]["{'': 'cpu', 'b': 'disk'}"]["devices"].values()
    assert_same(results["accelerate"][0], results["nbaccel"][0], "nested device map")


def tied_check_scenario(lib):
    """`check_tied_parameters_on_same_device` with a tied parameter the map gives no device."""
    check = lib.utils.check_tied_parameters_on_same_device
    result = {"placed": check([["a.weight", "b.weight"]], {"a": "cpu", "b": "cpu"})}
    try:
        check([["a.weight", "c.weight"]], {"a": "cpu", "b": "cpu"})
        result["unplaced"] = "no error"
    except ValueError:
        result["unplaced"] = "ValueError"
    return result


def test_tied_parameter_without_a_device_is_a_value_error():
    results = run_both(tied_check_scenario, 1)
    assert results["nbaccel"][0]["unplaced"] == "ValueError"
    assert_same(results["accelerate"][0], results["nbaccel"][0], "check_tied_parameters_on_same_device")


def load_state_dict_order_scenario(lib):
    """`load_state_dict` of a safetensors file with tensors of several dtypes: keys in the file's order."""
    from safetensors.torch import save_file

    tensors = {"a.weight": torch.ones(2, 3), "a.bias": torch.ones(2, dtype=torch.float16),
               "b.index": torch.tensor([1, 2]), "flag": torch.tensor(True)}
    with tempfile.TemporaryDirectory() as folder:
        path = f"{folder}/model.safetensors"
        save_file(tensors, path, metadata={"format": "pt"})
        loaded = lib.utils.load_state_dict(path)
        return list(loaded.items())


def test_load_state_dict_keeps_the_files_key_order():
    results = run_both(load_state_dict_order_scenario, 1)
    assert [key for key, _ in results["nbaccel"][0]] != sorted(key for key, _ in results["nbaccel"][0])
    assert_same(results["accelerate"][0], results["nbaccel"][0], "load_state_dict")


class _Int8(nn.Module):
    """A layer with an int8 weight whose forward reports the weight's `SCB` scales (as 8-bit layers read them)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(2, 2, dtype=torch.int8), requires_grad=False)

    def forward(self, x):
        return x, getattr(self.weight, "SCB", None)


def int8_offload_scenario(lib):
    """An offloaded int8 weight brought back by AlignDevicesHook with the `SCB` scales stored beside it."""
    model = _Int8()
    weights = {"weight": torch.full((2, 2), 3, dtype=torch.int8), "SCB": torch.tensor([5.0, 6.0])}
    lib.hooks.add_hook_to_module(model, lib.hooks.AlignDevicesHook(execution_device="cpu", offload=True,
                                                                   weights_map=weights))
    _, scales = model(torch.ones(1))
    lib.hooks.remove_hook_from_module(model)
    return {"in_forward": scales, "weight": model.weight, "after_removal": getattr(model.weight, "SCB", None)}


def test_offloaded_int8_weight_gets_its_scales():
    results = run_both(int8_offload_scenario, 1)
    assert results["nbaccel"][0]["in_forward"] is not None
    assert_same(results["accelerate"][0], results["nbaccel"][0], "int8 offload")


def keep_in_fp32_scenario(lib):
    """`load_checkpoint_in_model(..., keep_in_fp32_modules=...)` with float16 and with bfloat16."""
    from safetensors.torch import save_file

    result = {}
    for dtype in (torch.float16, torch.bfloat16):
        torch.manual_seed(0)
        source = _Stack()
        with tempfile.TemporaryDirectory() as folder:
            path = f"{folder}/model.safetensors"
            save_file(source.state_dict(), path, metadata={"format": "pt"})
            model = _Stack()
            lib.load_checkpoint_in_model(model, path, device_map={"": "cpu"}, dtype=dtype, keep_in_fp32_modules=["a"])
            result[str(dtype)] = {name: tensor.dtype for name, tensor in model.state_dict().items()}
    return result


def test_keep_in_fp32_modules_applies_against_float16_only():
    results = run_both(keep_in_fp32_scenario, 1)
    assert results["nbaccel"][0]["torch.float16"]["a.weight"] == torch.float32
    assert_same(results["accelerate"][0], results["nbaccel"][0], "keep_in_fp32_modules")


def test_get_max_memory_leaves_the_callers_dict_alone():
    """Deliberate difference (docs/compat.md): both return the sizes in bytes, but Accelerate also writes them
    back into the dict the caller passed; nbaccel leaves that dict as it was."""
    import accelerate.utils

    import nbaccel.utils

    returned = {}
    for lib in (accelerate.utils, nbaccel.utils):
        given = {"cpu": "1GB", 0: 5}
        returned[lib.__name__] = (lib.get_max_memory(given), given)
    assert returned["accelerate.utils"][0] == returned["nbaccel.utils"][0] == {"cpu": 10**9, 0: 5}
    assert returned["accelerate.utils"][1] == {"cpu": 10**9, 0: 5}
    assert returned["nbaccel.utils"][1] == {"cpu": "1GB", 0: 5}


def test_load_state_dict_reads_a_meta_mapped_tensor_as_meta(tmp_path):
    """Deliberate difference (docs/compat.md): a safetensors tensor mapped to "meta" is read as an empty tensor
    of its shape and dtype; Accelerate passes "meta" to safetensors, which refuses it."""
    import accelerate.utils
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    import nbaccel.utils

    path = str(tmp_path / "w.safetensors")
    save_file({"weight": torch.ones(2, 3), "bias": torch.zeros(2, dtype=torch.float16)}, path, metadata={"format": "pt"})
    loaded = nbaccel.utils.load_state_dict(path, device_map={"weight": "meta", "bias": "cpu"})
    assert (loaded["weight"].device.type, loaded["weight"].shape) == ("meta", (2, 3))
    assert torch.equal(loaded["bias"], torch.zeros(2, dtype=torch.float16))
    with pytest.raises(SafetensorError, match="meta"):
        accelerate.utils.load_state_dict(path, device_map={"weight": "meta", "bias": "cpu"})
