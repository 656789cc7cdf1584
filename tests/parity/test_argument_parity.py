"""Accelerate code whose arguments or return values are of another type than the usual, run on Accelerate 1.15
and on nbaccel in the same test and compared: numpy integers and digit strings where Accelerate takes them,
`mixed_precision`'s spelling, `save_state`'s return value, `load_state(map_location=)` and the automatic
checkpoint count after loading an older checkpoint. Found by a parity sweep (2026-11-30), each failed on nbaccel
(a crash where Accelerate ran, or the reverse)."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
from parity_harness import assert_same, run_both

pytest.importorskip("accelerate")
pytestmark = pytest.mark.timeout(300)


def _outcome(call):
    try:
        return ("ok", call())
    except Exception as exc:  # the exception's type is what code written for Accelerate catches
        return ("raised", type(exc).__name__)


def numbers_of_other_types(lib):
    """Integers from numpy or argparse (a string) where Accelerate takes them; numpy's bool."""
    import numpy as np

    found = {}
    for name, value in (("digits", "2"), ("int64", np.int64(3))):
        lib.state.AcceleratorState._reset_state(True)
        found[f"gradient_accumulation_steps={name}"] = _outcome(
            lambda value=value: int(lib.Accelerator(cpu=True, gradient_accumulation_steps=value)
                                    .gradient_accumulation_steps))
    utils = lib.utils
    found["plugin num_steps"] = _outcome(lambda: int(utils.GradientAccumulationPlugin(num_steps=np.int64(2)).num_steps))
    found["total_limit"] = _outcome(lambda: int(utils.ProjectConfiguration(total_limit=np.int64(2)).total_limit))
    found["iteration"] = _outcome(lambda: int(utils.ProjectConfiguration(iteration=np.int64(4)).iteration))
    found["split_batches"] = _outcome(lambda: bool(utils.DataLoaderConfiguration(split_batches=np.False_).split_batches))
    lib.state.AcceleratorState._reset_state(True)
    state = lib.PartialState(cpu=True)
    found["on_process"] = _outcome(lambda: state.on_process(lambda: "ran", process_index=np.int64(0))())
    return found


def precision_spelling(lib):
    found = {}
    for value in ("bf16", "BF16", "FP16", "No"):
        lib.state.AcceleratorState._reset_state(True)
        found[value] = _outcome(lambda value=value: lib.Accelerator(cpu=True, mixed_precision=value).mixed_precision)
    return found


def checkpoint_calls(lib):
    """save_state's return value, load_state(map_location=), and saving after going back to checkpoint_0."""
    root = tempfile.mkdtemp(prefix=f"ckpt-{lib.__name__}-")
    config = lib.utils.ProjectConfiguration(project_dir=root, automatic_checkpoint_naming=True)
    accelerator = lib.Accelerator(cpu=True, project_config=config)
    torch.manual_seed(0)
    model = accelerator.prepare(torch.nn.Linear(2, 2))
    saved = [accelerator.save_state() for _ in range(3)]
    found = {"returned": [(type(path).__name__, path.name) for path in saved]}
    with torch.no_grad():
        model.weight.add_(1.0)
    found["map_location"] = _outcome(
        lambda: accelerator.load_state(os.path.join(root, "checkpoints", "checkpoint_0"), map_location="cpu"))
    found["weights"] = model.weight.detach().clone()
    found["iteration after going back"] = accelerator.save_iteration
    found["saved next"] = _outcome(lambda: os.path.basename(accelerator.save_state()))
    return found


@pytest.mark.parametrize("scenario", [numbers_of_other_types, precision_spelling, checkpoint_calls],
                         ids=lambda fn: fn.__name__)
def test_the_same_on_both(scenario):
    results = run_both(scenario, num_processes=1)
    assert_same(results["accelerate"][0], results["nbaccel"][0], scenario.__name__)
