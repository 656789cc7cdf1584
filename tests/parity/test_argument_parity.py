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
from parity_harness import RankFailure, assert_same, run_both, run_ranks

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


def ignored_split_batches(lib):
    """`Accelerator(split_batches=True)`: Accelerate 1.15 keeps the argument in its signature and ignores it
    (the data loader configuration decides). The batches each process gets, and the warnings."""
    import warnings

    from torch.utils.data import DataLoader

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        accelerator = lib.Accelerator(cpu=True, split_batches=True)
    loader = accelerator.prepare(DataLoader(torch.arange(8), batch_size=2))
    return {"split_batches": accelerator.split_batches, "batches": [batch.tolist() for batch in loader],
            "warned": [str(w.message) for w in caught if "split_batches" in str(w.message)]}


def test_split_batches_given_to_the_accelerator_is_ignored_as_in_accelerate_with_a_word():
    results = run_both(ignored_split_batches, num_processes=2)
    assert [rank.pop("warned") for rank in results["accelerate"]] == [[], []]
    assert [rank.pop("warned") for rank in results["nbaccel"]] == [[
        "Accelerator(split_batches=True) is ignored, as in Accelerate 1.x: pass "
        "dataloader_config=DataLoaderConfiguration(split_batches=True)."]] * 2
    assert results["nbaccel"][0] == {"split_batches": False, "batches": [[0, 1], [4, 5]]}
    assert_same(results["accelerate"], results["nbaccel"], "ignored_split_batches")



def _one_rng_type(lib, rng_types):
    from torch.utils.data import DataLoader

    torch.manual_seed(0)
    accelerator = lib.Accelerator(cpu=True, rng_types=rng_types(lib))
    loader = accelerator.prepare(DataLoader(torch.arange(8), batch_size=2, shuffle=True))
    return {"rng_types": [str(r) for r in accelerator.rng_types], "batches": [batch.tolist() for batch in loader]}


def one_rng_type_by_name(lib):
    return _one_rng_type(lib, lambda lib: "torch")


def one_rng_type_in_a_list(lib):
    return _one_rng_type(lib, lambda lib: [lib.utils.RNGType.TORCH])


def test_one_rng_type_as_a_string_is_a_list_of_one_where_accelerate_fails_at_prepare():
    """docs/compat.md: Accelerate's prepare fails with AttributeError ("'str' object has no attribute 'copy'");
    nbaccel reads `rng_types="torch"` as `["torch"]`, with Accelerate's batches for that list."""
    with pytest.raises(RankFailure, match="'str' object has no attribute 'copy'"):
        run_ranks(one_rng_type_by_name, "accelerate", 2)
    assert_same(run_ranks(one_rng_type_in_a_list, "accelerate", 2), run_ranks(one_rng_type_by_name, "nbaccel", 2),
                "one_rng_type_by_name")


def chosen_trackers(lib):
    """`accelerator.log_with`: the trackers chosen, "all" resolved to the installed ones in Accelerate's order."""
    import tempfile
    from importlib import import_module

    tracking = import_module(f"{lib.__name__}.tracking")

    class Mine(tracking.GeneralTracker):
        name, requires_logging_directory, tracker = "mine", False, None

        def __init__(self):
            super().__init__()

    found = {}
    for label, log_with in (("none", None), ("one", "tensorboard"), ("all", "all"),
                            ("enum and instance", [lib.utils.LoggerType.TENSORBOARD, Mine()])):
        lib.state.AcceleratorState._reset_state(True)
        accelerator = lib.Accelerator(cpu=True, log_with=log_with, project_dir=tempfile.mkdtemp())
        found[label] = [(type(t).__name__, getattr(t, "value", None) or t.name) for t in accelerator.log_with]
    return found


def test_log_with_reads_back_as_accelerate_resolves_it():
    results = run_both(chosen_trackers, num_processes=1)
    assert ("LoggerType", "tensorboard") in results["accelerate"][0]["all"]
    assert_same(results["accelerate"][0], results["nbaccel"][0], "chosen_trackers")


def safetensors_of_shared_tensors(lib):
    """`accelerator.save(..., safe_serialization=True)` of tensors that share memory: a model's state_dict (an
    OrderedDict, tied weights written once) and a plain dict (safetensors refuses it; no entry is dropped)."""
    from safetensors.torch import load_file

    root = tempfile.mkdtemp(prefix=f"safe-{lib.__name__}-")
    accelerator = lib.Accelerator(cpu=True)
    model = torch.nn.Sequential(torch.nn.Embedding(4, 2), torch.nn.Linear(2, 4, bias=False))
    model[1].weight = model[0].weight
    found = {}
    path = os.path.join(root, "tied.safetensors")
    found["state_dict"] = _outcome(lambda: (accelerator.save(model.state_dict(), path, safe_serialization=True),
                                            sorted(load_file(path)))[1])
    numbers = torch.arange(4.0)
    path = os.path.join(root, "plain.safetensors")
    found["plain dict"] = _outcome(lambda: accelerator.save({"all": numbers, "half": numbers[:2]}, path,
                                                            safe_serialization=True))
    found["plain dict written"] = os.path.exists(path)
    return found


def test_safetensors_of_shared_tensors_as_accelerate():
    results = run_both(safetensors_of_shared_tensors, num_processes=1)
    assert results["accelerate"][0]["plain dict"] == ("raised", "RuntimeError")
    assert_same(results["accelerate"][0], results["nbaccel"][0], "safetensors_of_shared_tensors")


def reductions_and_scale(lib):
    """`reduce` with each reduction, with and without `scale`: Accelerate applies `scale` on XLA only and sums
    for "none"; what nbaccel warns about it."""
    import warnings

    accelerator = lib.Accelerator(cpu=True)
    values = torch.tensor([1.0 + accelerator.process_index, 5.0 - accelerator.process_index])
    found = {}
    for reduction in ("sum", "mean", "max", "none"):
        for scale in (1.0, 10.0):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                found[f"{reduction} x{scale}"] = accelerator.reduce(values, reduction, scale=scale).tolist()
            found[f"{reduction} x{scale} warned"] = [str(w.message).split(":")[0] for w in caught]
            found[f"{reduction} x{scale} warned at"] = [os.path.basename(w.filename) for w in caught]
    return found


@pytest.mark.parametrize("num_processes", [1, 2])
def test_reduce_reductions_and_scale_as_accelerate(num_processes):
    results = run_both(reductions_and_scale, num_processes=num_processes)
    ours = results["nbaccel"]
    for theirs, mine in zip(results["accelerate"], ours):
        warned = {key: mine.pop(key) for key in list(mine) if "warned" in key}
        assert all(not value for key, value in theirs.items() if "warned" in key)
        if num_processes == 2:
            assert warned["none x1.0 warned"] == ["reduce(reduction='none') sums across processes, as Accelerate's "
                                                  "reduce does"]
            assert warned["sum x10.0 warned"] == ["reduce(scale=10.0) applies on XLA only, as in Accelerate"]
            # at the user's line (this scenario's), not at nbaccel's accelerator.py that passed the call on
            assert warned["none x1.0 warned at"] == warned["sum x10.0 warned at"] == ["test_argument_parity.py"]
        else:
            assert not any(warned.values())
        assert_same({k: v for k, v in theirs.items() if "warned" not in k}, mine)
    if num_processes == 2:
        assert ours[0]["none x10.0"] == ours[0]["sum x1.0"] == [3.0, 9.0]


def objects_of_other_kinds(lib):
    """gather_object and gather_for_metrics(use_gather_object=True) of what is not a list: each process's object
    contributes its items. Of a tensor that is its rows, so the last batch's repeated samples are dropped
    row by row (nbaccel gathered whole tensors and kept the repeated sample)."""
    from torch.utils.data import DataLoader

    accelerator = lib.Accelerator(cpu=True)
    loader = accelerator.prepare(DataLoader(torch.arange(7.0), batch_size=2))
    found = {"tensor batches": [accelerator.gather_for_metrics(batch, use_gather_object=True) for batch in loader]}
    for label, value in (("string", "ab"), ("tuple", (1, 2)), ("dict", {"k": 1}), ("tensor", torch.tensor([1.0, 2.0]))):
        found[label] = lib.utils.gather_object(value)
    return found


@pytest.mark.parametrize("num_processes", [1, 2])
def test_gather_object_of_other_kinds_as_accelerate(num_processes):
    results = run_both(objects_of_other_kinds, num_processes=num_processes)
    if num_processes == 2:
        assert [len(batch) for batch in results["accelerate"][0]["tensor batches"]] == [4, 3]
    assert_same(results["accelerate"], results["nbaccel"], "objects_of_other_kinds")
