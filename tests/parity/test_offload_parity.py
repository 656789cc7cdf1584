"""Big-model offload meets training APIs, compared with Accelerate 1.15: `save_model` (and nbaccel's
`get_state_dict`) on a model with disk-offloaded modules write/return the real weights, and a model loaded in
8-bit with CPU or disk offload is refused by `prepare` with Accelerate's ValueError."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
from parity_harness import assert_same, run_both

pytest.importorskip("accelerate")
pytestmark = pytest.mark.timeout(300)


def offload_scenario(lib):
    from safetensors.torch import load_file

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    original = {k: v.clone() for k, v in model.state_dict().items()}
    accelerator = lib.Accelerator(cpu=True)
    with tempfile.TemporaryDirectory() as tmp:
        lib.big_modeling.disk_offload(model, os.path.join(tmp, "offload"), execution_device="cpu")
        on_meta = sorted(k for k, v in model.state_dict().items() if v.device.type == "meta")
        state = accelerator.get_state_dict(model)
        accelerator.save_model(model, os.path.join(tmp, "saved"))
        saved = load_file(os.path.join(tmp, "saved", "model.safetensors"))
    return {"on_meta": on_meta, "original": original, "saved": saved,
            "get_state_dict_real": sorted(k for k, v in state.items() if v.device.type != "meta"),
            "get_state_dict_values": {k: v for k, v in state.items() if v.device.type != "meta"}}


def test_save_model_of_a_disk_offloaded_model_writes_the_real_weights():
    results = run_both(offload_scenario, 1)
    accelerate, nbaccel = results["accelerate"][0], results["nbaccel"][0]
    assert accelerate["on_meta"] == nbaccel["on_meta"] and nbaccel["on_meta"]  # the weights live on disk
    assert_same(accelerate["saved"], nbaccel["saved"], "save_model")
    assert_same(accelerate["original"], nbaccel["saved"], "save_model against the weights before offload")
    # Deliberate difference (docs/compat.md): Accelerate's get_state_dict returns model.state_dict() as is
    # (meta tensors for the offloaded weights); nbaccel's loads them back, as its save_model does.
    assert accelerate["get_state_dict_real"] == []
    assert_same(accelerate["original"], nbaccel["get_state_dict_values"], "nbaccel get_state_dict")


def eight_bit_scenario(lib):
    out = []
    # (a map of "disk" alone makes Accelerate 1.15 fail earlier, in torch.device("disk"): not compared)
    for devices in ({"0": "cpu", "1": "disk"}, {"": "cpu"}):
        model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
        model.is_loaded_in_8bit = True
        model.hf_device_map = devices
        accelerator = lib.Accelerator(cpu=True)
        try:
            accelerator.prepare(model)
            out.append(("ok",))
        except ValueError as error:
            out.append(("ValueError", "8-bit or 4-bit" in str(error), "CPU or disk offload" in str(error)))
    return out


def test_an_8_bit_model_with_cpu_or_disk_offload_is_refused():
    results = run_both(eight_bit_scenario, 1)
    assert results["accelerate"][0] == [("ValueError", True, True)] * 2
    assert_same(results["accelerate"], results["nbaccel"])
