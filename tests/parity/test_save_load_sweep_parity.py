"""save_state / load_state, register_for_checkpointing, the save/load hooks, save_model and Accelerator.save, run on
Accelerate 1.15 and on nbaccel (1 and 2 gloo ranks) and compared: return values, exception types, what hooks get,
the files written and what they hold.

Each scenario is code written for Accelerate (`lib` is the library's top-level module) and returns plain values:
`_outcome` turns a call into ("ok", value) or ("raised", the builtin exception types). Every folder is made under
the test's tmp_path, in a folder rank 0 creates and broadcasts, so both ranks see the same checkpoint. Where nbaccel
differs on purpose (docs/compat.md), `test_checkpoint_calls_nbaccel_takes_or_refuses_on_purpose` shows both sides.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
from parity_harness import assert_same, run_both

pytest.importorskip("accelerate")
pytestmark = pytest.mark.timeout(600)


def _root(lib, accelerator, base: str) -> str:
    """A folder of this run under the test's `base`, the same on every rank (asked after the Accelerator is made: a
    bare `PartialState()` first would be a single process on each CPU rank under Accelerate)."""
    root = tempfile.mkdtemp(prefix=f"{lib.__name__}-", dir=base) if accelerator.is_main_process else None
    return lib.utils.broadcast_object_list([root])[0]


def _kinds(error: BaseException) -> list[str]:
    """The builtin exception types `error` is an instance of (a subclass of nbaccel's counts as its bases)."""
    kinds = (ValueError, TypeError, RuntimeError, FileNotFoundError, FileExistsError, NotADirectoryError, OSError,
             NotImplementedError, IndexError)
    return [kind.__name__ for kind in kinds if isinstance(error, kind)]


def _outcome(call) -> tuple:
    try:
        value = call()
    except Exception as error:  # noqa: BLE001 - the type is what is compared
        return ("raised", _kinds(error))
    if isinstance(value, os.PathLike):
        return ("ok", type(value).__name__, os.fspath(value))
    return ("ok", value)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))


class Counter:
    """A registered object: anything with state_dict() and load_state_dict()."""

    def __init__(self) -> None:
        self.count = 3

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.count = state["count"]


def hooks_and_paths(lib, base):
    """What register_*_pre_hook return (torch's RemovableHandle, usable as a context manager), what the hooks get,
    what save_state returns for a relative folder, and load_state of "~/..." and of a folder with a slash."""
    accelerator = lib.Accelerator(cpu=True)
    root = _root(lib, accelerator, base)
    accelerator.prepare(_model())
    seen = []
    save_handle = accelerator.register_save_state_pre_hook(
        lambda models, weights, output_dir: seen.append(("save", type(output_dir).__name__)))
    load_handle = accelerator.register_load_state_pre_hook(
        lambda models, input_dir: seen.append(("load", input_dir.replace(root, "ROOT"))))
    found = {"handles": [(type(h).__module__, type(h).__name__, isinstance(h, torch.utils.hooks.RemovableHandle))
                         for h in (save_handle, load_handle)]}
    cwd = os.getcwd()
    os.chdir(root)
    try:
        found["relative"] = _outcome(lambda: accelerator.save_state("checkpoint"))
        accelerator.wait_for_everyone()
        found["slash"] = _outcome(lambda: accelerator.load_state(os.path.join(root, "checkpoint") + "/"))
        home = os.environ["HOME"]
        os.environ["HOME"] = root
        try:
            found["tilde"] = _outcome(lambda: accelerator.load_state("~/checkpoint"))
        finally:
            os.environ["HOME"] = home
        with save_handle:  # torch's handle removes its hook when the block ends
            pass
        load_handle.remove()
        load_handle.remove()  # a second remove does nothing
        accelerator.save_state("checkpoint")
        accelerator.load_state("checkpoint")
    finally:
        os.chdir(cwd)
    found["seen"] = seen
    return found


@pytest.mark.parametrize("num_processes", [1, 2])
def test_hooks_handles_and_checkpoint_paths_are_accelerates(num_processes, tmp_path):
    """nbaccel's hook handles were a class of its own (not torch's RemovableHandle: no `with handle:`), save_state
    returned an absolute path for a relative folder, load_state did not expand "~" and handed load hooks the
    folder without its trailing slash."""
    results = run_both(hooks_and_paths, num_processes, args=(str(tmp_path),))
    assert results["nbaccel"][0]["handles"] == [("torch.utils.hooks", "RemovableHandle", True)] * 2
    assert results["nbaccel"][0]["relative"] == ("ok", "PosixPath", "checkpoint")
    assert_same(results["accelerate"], results["nbaccel"])


def refused_loads_and_saves(lib, base):
    """load_state with more or fewer registered objects than the checkpoint holds (Accelerate: RuntimeError), and
    save_model of a model whose weights are on the meta device (Accelerate: RuntimeError, no folder made)."""
    accelerator = lib.Accelerator(cpu=True)
    root = _root(lib, accelerator, base)
    accelerator.prepare(_model())
    accelerator.register_for_checkpointing(Counter())
    checkpoint = os.path.join(root, "checkpoint")
    accelerator.save_state(checkpoint)
    accelerator.wait_for_everyone()
    found = {}
    accelerator.register_for_checkpointing(Counter())
    found["more objects"] = _outcome(lambda: accelerator.load_state(checkpoint))
    accelerator._custom_objects.clear()
    found["fewer objects"] = _outcome(lambda: accelerator.load_state(checkpoint))
    with lib.init_empty_weights():
        empty = torch.nn.Linear(2, 2)
    found["meta save_model"] = _outcome(lambda: accelerator.save_model(empty, os.path.join(root, "empty")))
    accelerator.wait_for_everyone()
    found["meta folder made"] = os.path.exists(os.path.join(root, "empty"))
    return found


@pytest.mark.parametrize("num_processes", [2])
def test_refused_loads_and_saves_raise_accelerates_types(num_processes, tmp_path):
    """nbaccel raised CheckpointFileMissingError / CheckpointError (no RuntimeError) for a registered-object count
    that differs from the checkpoint's, and NotImplementedError from save_model of a meta model, after making
    its folder. Accelerate's RuntimeError is the type now (nbaccel's also says which file is missing)."""
    results = run_both(refused_loads_and_saves, num_processes, args=(str(tmp_path),))
    assert results["accelerate"][0]["more objects"] == ("raised", ["RuntimeError"])
    assert results["nbaccel"][0]["more objects"] == ("raised", ["RuntimeError", "FileNotFoundError", "OSError"])
    for rank in results["nbaccel"]:  # a FileNotFoundError too, as nbaccel's missing checkpoint files are
        rank["more objects"] = ("raised", ["RuntimeError"])
    assert_same(results["accelerate"], results["nbaccel"])


def saving_single_files(lib, base):
    """Accelerator.save and utils.save: into a folder that does not exist (torch's RuntimeError; safetensors'
    own error), a list with safe_serialization=True (ValueError), and what a good save writes."""
    accelerator = lib.Accelerator(cpu=True)
    root = _root(lib, accelerator, base)
    found = {}
    missing = os.path.join(root, "absent")
    found["no folder"] = _outcome(lambda: accelerator.save({"a": 1}, os.path.join(missing, "a.pt")))
    found["no folder, safetensors"] = _outcome(lambda: accelerator.save(
        {"a": torch.ones(1)}, os.path.join(missing, "a.safetensors"), safe_serialization=True))
    found["folder made"] = os.path.exists(missing)
    found["list, safetensors"] = _outcome(
        lambda: accelerator.save([torch.ones(1)], os.path.join(root, "l.safetensors"), safe_serialization=True))
    found["utils list, safetensors"] = _outcome(
        lambda: lib.utils.save([torch.ones(1)], os.path.join(root, "u.safetensors"), safe_serialization=True))
    found["saved"] = _outcome(lambda: accelerator.save([1, torch.arange(3)], os.path.join(root, "l.pt")))
    accelerator.wait_for_everyone()
    found["read back"] = torch.load(os.path.join(root, "l.pt"), weights_only=True)
    found["files"] = sorted(os.listdir(root))
    return found


@pytest.mark.parametrize("num_processes", [1, 2])
def test_accelerator_save_fails_as_in_accelerate(num_processes, tmp_path):
    """nbaccel's atomic write made its temporary file first, so a missing folder was a FileNotFoundError where
    torch.save raises RuntimeError ("Parent directory ... does not exist") and safetensors its SafetensorError;
    a list with safe_serialization=True was a TypeError (safetensors: ValueError)."""
    results = run_both(saving_single_files, num_processes, args=(str(tmp_path),))
    assert results["nbaccel"][0]["no folder"] == ("raised", ["RuntimeError"])
    assert_same(results["accelerate"], results["nbaccel"])


def save_state_onto_a_file(lib, base):
    """save_state to a path that is a file, and load_state from it; save_state where the folder cannot be made."""
    accelerator = lib.Accelerator(cpu=True)
    root = _root(lib, accelerator, base)
    accelerator.prepare(_model())
    path = os.path.join(root, "not-a-folder")
    if accelerator.is_main_process:
        with open(path, "w") as handle:
            handle.write("notes")
    accelerator.wait_for_everyone()
    found = {"save": _outcome(lambda: accelerator.save_state(path)),
             "load": _outcome(lambda: accelerator.load_state(path)),
             # a folder the system refuses to make (root included): PermissionError from os.makedirs
             "not permitted": _outcome(lambda: accelerator.save_state("/sys/nbaccel-save-sweep/checkpoint"))}
    accelerator.wait_for_everyone()
    found["files"] = sorted(os.listdir(root))
    with open(path) as handle:
        found["kept"] = handle.read()
    return found


@pytest.mark.parametrize("num_processes", [2])
def test_save_state_onto_a_file_or_where_no_folder_can_be_made_raises_oserror(num_processes, tmp_path):
    """Accelerate's os.makedirs raises FileExistsError on each process; nbaccel raised its CheckpointError (no
    OSError), naming process 0 on the others. A folder that cannot be made: Accelerate's PermissionError on each
    process; nbaccel's process 0 raised CheckpointError (it raises the PermissionError now; the others, which made
    nothing, a CheckpointError naming process 0, as for a failed write). load_state of a file is a ValueError on
    both."""
    results = run_both(save_state_onto_a_file, num_processes, args=(str(tmp_path),))
    assert results["accelerate"][0]["save"] == ("raised", ["FileExistsError", "OSError"])
    assert results["accelerate"][0]["not permitted"] == ("raised", ["OSError"])
    for rank in results["nbaccel"][1:]:  # docs/compat.md: the others say which process failed, and how
        assert rank["not permitted"] == ("raised", [])
        rank["not permitted"] = ("raised", ["OSError"])
    for rank in results["nbaccel"]:  # docs/compat.md: a missing load_state folder is also a FileNotFoundError
        assert rank["load"] == ("raised", ["ValueError", "FileNotFoundError", "OSError"])
        rank["load"] = ("raised", ["ValueError"])
    assert_same(results["accelerate"], results["nbaccel"])


def compiled_model_checkpoint(lib, root, phase):
    """A torch.compile'd model: save_state ("save": the keys of model.safetensors, what hooks get, save_model's
    keys and get_state_dict's) or load_state of the checkpoint another library saved ("load": the weights)."""
    accelerator = lib.Accelerator(cpu=True)
    model = accelerator.prepare(torch.compile(_model()))
    checkpoint = os.path.join(root, "checkpoint")
    if phase == "load":
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.zero_()
        found = {"load": _outcome(lambda: accelerator.load_state(checkpoint))}
        found["weights"] = {k: v.clone() for k, v in accelerator.get_state_dict(model).items()}
        return found
    from safetensors.torch import load_file

    seen = []
    accelerator.register_save_state_pre_hook(lambda models, weights, output_dir: seen.append(
        ([type(m).__name__ for m in models], [sorted(w) for w in weights])))
    accelerator.save_state(checkpoint)
    accelerator.save_model(model, os.path.join(root, "model"))
    accelerator.wait_for_everyone()
    return {"checkpoint keys": sorted(load_file(os.path.join(checkpoint, "model.safetensors"))), "hooks": seen,
            "save_model keys": sorted(load_file(os.path.join(root, "model", "model.safetensors"))),
            "get_state_dict keys": sorted(accelerator.get_state_dict(model)),
            "wrapped keys": sorted(accelerator.get_state_dict(model, unwrap=False)),
            "weights": {k: v.clone() for k, v in accelerator.get_state_dict(model).items()}}


def test_a_compiled_models_checkpoint_has_accelerates_keys_and_loads_across(tmp_path):
    """Accelerate keeps torch.compile's wrapper: its checkpoints, save_model files and get_state_dict carry
    `_orig_mod.` keys. nbaccel dropped the prefix on one process (and kept it in save_model on two), so
    Accelerate could not resume nbaccel's checkpoint (missing keys) nor nbaccel Accelerate's. Each library now
    resumes the other's checkpoint to the saved weights. (One process: on two, nbaccel's checkpoint differed in the
    same way, and the code path is the same.)"""
    from parity_harness import run_ranks

    saved = {lib: run_ranks(compiled_model_checkpoint, lib, 1, args=(str(tmp_path / lib), "save"))
             for lib in ("accelerate", "nbaccel")}
    assert saved["accelerate"][0]["checkpoint keys"][0].startswith("_orig_mod.")
    assert_same(saved["accelerate"], saved["nbaccel"])
    for saved_by, loaded_by in (("accelerate", "nbaccel"), ("nbaccel", "accelerate")):
        [resumed] = run_ranks(compiled_model_checkpoint, loaded_by, 1, args=(str(tmp_path / saved_by), "load"))
        assert resumed["load"] == ("ok", None), f"saved by {saved_by}, loaded by {loaded_by}"
        assert_same(saved[saved_by][0]["weights"], resumed["weights"], f"{loaded_by} resuming {saved_by}'s")


class _Records:
    """WARNING records of the library's loggers, by the step they came in."""

    def __init__(self, lib) -> None:
        import logging

        self.step, self.seen, self.prefix = "", [], lib.__name__ + "."
        handler = logging.Handler()
        handler.emit = self._emit
        logging.getLogger().addHandler(handler)

    def _emit(self, record) -> None:
        if record.levelno >= 30 and record.name.startswith(self.prefix):
            self.seen.append((self.step, record.levelname))


def tied_weights_and_rotation(lib, base):
    """A model with a tied embedding/head (the embedding first, as in a language model): the name save_model and
    save_state keep in model.safetensors, the weights after load_state, and the warnings of both saves and of
    total_limit's rotation."""
    accelerator = lib.Accelerator(cpu=True)
    root = _root(lib, accelerator, base)
    accelerator.project_configuration.automatic_checkpoint_naming = True
    accelerator.project_configuration.project_dir = root
    accelerator.project_configuration.total_limit = 1
    records = _Records(lib)
    torch.manual_seed(0)
    embedding, head = torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False)
    head.weight = embedding.weight
    model = accelerator.prepare(torch.nn.ModuleDict({"wte": embedding, "lm_head": head}))
    from safetensors.torch import load_file

    found = {}
    records.step = "save_model"
    accelerator.save_model(model, os.path.join(root, "model"))
    for index in range(2):
        records.step = f"save_state {index}"
        checkpoint = accelerator.save_state()
        accelerator.wait_for_everyone()
    found["save_model keys"] = sorted(load_file(os.path.join(root, "model", "model.safetensors")))
    found["save_state keys"] = sorted(load_file(os.path.join(checkpoint, "model.safetensors")))
    found["kept"] = sorted(os.listdir(os.path.join(root, "checkpoints")))
    with torch.no_grad():
        embedding.weight.zero_()
    records.step = "load_state"
    accelerator.load_state()
    found["tied after load"] = head.weight is embedding.weight
    found["weights"] = embedding.weight.detach().clone()
    found["warnings"] = records.seen
    return found


@pytest.mark.parametrize("num_processes", [1, 2])
def test_tied_weights_and_rotation_write_and_warn_as_in_accelerate(num_processes, tmp_path):
    """nbaccel kept the alphabetically first name of tied weights (`lm_head.weight`; Accelerate: the first in the
    state dict, `wte.weight`), silently; and deleted checkpoints over total_limit with an INFO record (Accelerate
    warns, so the deletion shows without any logging set up)."""
    results = run_both(tied_weights_and_rotation, num_processes, args=(str(tmp_path),))
    assert results["accelerate"][0]["save_model keys"] == ["wte.weight"]
    assert results["accelerate"][0]["warnings"] == [("save_model", "WARNING"), ("save_state 0", "WARNING"),
                                                    ("save_state 1", "WARNING"), ("save_state 1", "WARNING")]
    assert_same(results["accelerate"], results["nbaccel"])


class Note:
    """A Python object (not a tensor) in a registered object's state."""

    def __init__(self, text: str) -> None:
        self.text = text


class Notes(Counter):
    def state_dict(self) -> dict:
        return {"count": self.count, "note": Note("kept")}


class NotCallable:
    state_dict = load_state_dict = None


class WithExtraState(torch.nn.Module):
    """A module whose state dict holds a Python object (`_extra_state`), which safetensors cannot store."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(2, 2)

    def get_extra_state(self) -> dict:
        return {"note": "kept"}

    def set_extra_state(self, state: dict) -> None:
        self.note = state["note"]


def deliberate_differences(lib, base):
    """docs/compat.md ("Checkpoint calls nbaccel takes or refuses on purpose"): each case's outcome."""
    accelerator = lib.Accelerator(cpu=True)
    root = _root(lib, accelerator, base)
    model = _model()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    accelerator.register_for_checkpointing(Notes())
    checkpoint = os.path.join(root, "checkpoint")
    accelerator.save_state(checkpoint)
    accelerator.wait_for_everyone()
    found = {"a device": _outcome(lambda: accelerator.load_state(checkpoint, map_location=torch.device("cpu"))),
             "on_device": _outcome(lambda: accelerator.load_state(checkpoint, map_location="on_device")),
             "weights_only": _outcome(lambda: accelerator.load_state(checkpoint, load_kwargs={"weights_only": True})),
             "in load_kwargs": _outcome(lambda: accelerator.load_state(checkpoint, load_kwargs={"map_location": "cpu"}))}
    no_random_states = os.path.join(root, "no-random-states")  # the checkpoint without its random_states_N.pkl
    if accelerator.is_main_process:
        os.makedirs(no_random_states)
        for name in os.listdir(checkpoint):
            if not name.startswith((".", "random_states")):
                os.link(os.path.join(checkpoint, name), os.path.join(no_random_states, name))
    accelerator.wait_for_everyone()
    found["no random states"] = _outcome(lambda: accelerator.load_state(no_random_states))
    found["not callable"] = _outcome(lambda: accelerator.register_for_checkpointing(NotCallable()))
    if accelerator.num_processes > 1:  # Accelerate's rank 1 lists checkpoints/ while rank 0 deletes in it (no barrier)
        return found
    # Accelerate registered it (its save_state then fails calling None); the next saves are about folders
    accelerator._custom_objects[:] = [obj for obj in accelerator._custom_objects if not isinstance(obj, NotCallable)]
    with torch.no_grad():  # the same folder saved again, as torch.save files: which weights load back?
        model[0].bias.fill_(7.0)
    accelerator.save_state(checkpoint, safe_serialization=False)
    with torch.no_grad():
        model[0].bias.zero_()
    accelerator.load_state(checkpoint)
    found["resaved as .bin"] = (sorted(os.listdir(checkpoint)), model[0].bias.tolist() == [7.0] * 4)
    weights = os.path.join(root, "weights")  # save_model in shards, then whole, into one folder
    accelerator.save_model(model, weights, max_shard_size=40)
    accelerator.save_model(model, weights)
    found["save_model again, whole"] = sorted(os.listdir(weights))
    def pops_models(models, weights, output_dir):  # saves the models itself and takes them out of the list
        while models:
            models.pop()
            weights.pop()

    handle = accelerator.register_save_state_pre_hook(pops_models)
    accelerator.save_state(os.path.join(root, "popped"))
    handle.remove()
    found["models after a hook popped them"] = len(accelerator._models)
    extra = WithExtraState()
    found["extra state, safetensors"] = _outcome(lambda: accelerator.save_model(extra, os.path.join(root, "extra")))
    found["extra state, torch.save"] = _outcome(
        lambda: accelerator.save_model(extra, os.path.join(root, "extra"), safe_serialization=False))
    config = accelerator.project_configuration
    config.automatic_checkpoint_naming, config.total_limit = True, 1
    found["no project_dir"] = _outcome(lambda: accelerator.save_state())
    config.project_dir = root
    os.makedirs(os.path.join(root, "checkpoints"), exist_ok=True)
    found["no checkpoint yet"] = _outcome(lambda: accelerator.load_state())
    config.iteration = 0
    found["first"] = _outcome(lambda: os.path.basename(accelerator.save_state()))
    accelerator.wait_for_everyone()
    notes = os.path.join(root, "checkpoints", "notes.txt")
    if accelerator.is_main_process:
        with open(notes, "w") as handle:
            handle.write("mine")
    accelerator.wait_for_everyone()
    found["a file among checkpoints"] = _outcome(lambda: os.path.basename(accelerator.save_state()))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        os.remove(notes)
    accelerator.wait_for_everyone()
    newest = max(int(name.split("_")[1]) for name in os.listdir(os.path.join(root, "checkpoints")))
    config.iteration = newest  # back onto the newest checkpoint, which total_limit=1 keeps
    found["onto an existing one"] = _outcome(lambda: accelerator.save_state() and None)
    found["left"] = sorted(os.listdir(os.path.join(root, "checkpoints")))
    return found


# outcome under Accelerate, under nbaccel, by case; the cases not listed are the same
DELIBERATE = {
    "a device": (("raised", ["TypeError"]), ("ok", None)),
    "in load_kwargs": (("raised", ["TypeError"]), ("ok", None)),  # Accelerate: torch.load gets it twice
    "on_device": (("raised", []), ("ok", None)),  # safetensors' SafetensorError: "device cpu:0 is invalid"
    "weights_only": (("ok", None), ("raised", ["RuntimeError"])),
    "not callable": (("ok", None), ("raised", ["ValueError"])),
    "no random states": (("ok", None), ("raised", ["FileNotFoundError", "OSError"])),
    "no project_dir": (("raised", ["TypeError"]), ("raised", ["ValueError"])),
    "no checkpoint yet": (("raised", ["IndexError"]), ("raised", ["FileNotFoundError", "OSError"])),
    "a file among checkpoints": (("raised", ["IndexError"]), ("ok", "checkpoint_1")),
    "onto an existing one": (("ok", None), ("raised", ["ValueError"])),
    "left": (["checkpoint_0"], ["checkpoint_1"]),
    "save_model again, whole": (  # Accelerate removes stale shards of pytorch_model*.bin only, never the index
        ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors",
         "model.safetensors.index.json"], ["model.safetensors"]),
    "models after a hook popped them": (0, 1),  # Accelerate hands save hooks its own list, accelerator._models
    "extra state, safetensors": (("raised", []), ("raised", ["TypeError"])),  # Accelerate: AttributeError
    "extra state, torch.save": (("raised", []), ("ok", None)),
    "resaved as .bin": (  # Accelerate keeps the first save's model.safetensors beside the new file, and loads it
        (["custom_checkpoint_0.pkl", "model.safetensors", "optimizer.bin", "pytorch_model.bin", "random_states_0.pkl"],
         False),
        ([".nbaccel-checkpoint.json", ".nbaccel-manifest.json", "custom_checkpoint_0.pkl", "optimizer.bin",
          "pytorch_model.bin", "random_states_0.pkl"], True)),
}


@pytest.mark.parametrize("num_processes", [1, 2])
def test_checkpoint_calls_nbaccel_takes_or_refuses_on_purpose(num_processes, tmp_path):
    """docs/compat.md lists each with its reason: a device as map_location, "on_device" on CPU processes,
    load_kwargs' weights_only for registered objects too, a checkpoint without any random_states_N.pkl,
    a folder saved again in the other format, save_model's earlier shards, a save hook that pops `models`, a state
    dict holding a Python object,
    state_dict attributes that are not methods, automatic
    naming without project_dir or checkpoints, other entries in checkpoints/, and total_limit applied after the
    save (so the count cannot land on an existing checkpoint). Everything else the scenario does is the same."""
    results = run_both(deliberate_differences, num_processes, args=(str(tmp_path),))
    for theirs, ours in zip(results["accelerate"], results["nbaccel"]):
        for case, (accelerate_outcome, nbaccel_outcome) in DELIBERATE.items():
            if case not in theirs and num_processes > 1:
                continue  # the folder cases run on one process
            if case == "on_device" and num_processes == 1:
                accelerate_outcome = ("ok", None)  # fails on several CPU processes only
            assert (theirs.pop(case), ours.pop(case)) == (accelerate_outcome, nbaccel_outcome), case
        assert_same(theirs, ours)


def fp16_on_the_cpu(lib, root, phase):
    """Accelerator(mixed_precision="fp16") on the CPU: Accelerate trains without a GradScaler there (in fp32) and
    saves no scaler.pt; nbaccel scales (docs/compat.md). Save ("save") or resume the other library's checkpoint."""
    accelerator = lib.Accelerator(cpu=True, mixed_precision="fp16")
    model = _model()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    checkpoint = os.path.join(root, "checkpoint")
    if phase == "save":
        accelerator.save_state(checkpoint)
        return {"weights": {k: v.clone() for k, v in accelerator.get_state_dict(model).items()}}
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
    return {"load": _outcome(lambda: accelerator.load_state(checkpoint)),
            "weights": {k: v.clone() for k, v in accelerator.get_state_dict(model).items()}}


def test_an_fp16_checkpoint_of_the_cpu_loads_across(tmp_path):
    """nbaccel's scaler asked for the scaler.pt that Accelerate's checkpoint of a CPU fp16 run lacks
    (CheckpointFileMissingError); a checkpoint saved without a scaler now loads with a warning, and the scaler
    starts from its initial scale. Accelerate ignores nbaccel's scaler.pt."""
    from parity_harness import run_ranks

    for saved_by, loaded_by in (("accelerate", "nbaccel"), ("nbaccel", "accelerate")):
        folder = str(tmp_path / saved_by)
        [saved] = run_ranks(fp16_on_the_cpu, saved_by, 1, args=(folder, "save"))
        [resumed] = run_ranks(fp16_on_the_cpu, loaded_by, 1, args=(folder, "load"))
        assert resumed.pop("load") == ("ok", None), f"{loaded_by} resuming {saved_by}'s"
        assert_same(saved, resumed, f"{loaded_by} resuming {saved_by}'s")


def into_the_working_directory(lib, base):
    """save_state(".") from a folder of the run's own (twice), then load_state("."), then a relative path; and
    save_state (twice) and load_state through a symbolic link to a folder."""
    accelerator = lib.Accelerator(cpu=True)
    root = _root(lib, accelerator, base)
    model = accelerator.unwrap_model(accelerator.prepare(_model()))
    work = os.path.join(root, "work")
    os.makedirs(work, exist_ok=True)
    cwd = os.getcwd()
    os.chdir(work)
    try:
        found = {"first": _outcome(lambda: accelerator.save_state("."))}
        accelerator.wait_for_everyone()
        found["second"] = _outcome(lambda: accelerator.save_state("."))
        accelerator.wait_for_everyone()
        with torch.no_grad():
            model[0].bias.zero_()
        found["load"] = _outcome(lambda: accelerator.load_state("."))
        found["bias loaded"] = bool(model[0].bias.abs().sum() > 0)
        found["relative path works"] = _outcome(lambda: os.path.isdir(os.path.join(".", os.pardir, "work")))
    finally:
        os.chdir(cwd)
    found["files"] = sorted(name for name in os.listdir(work) if not name.startswith(".nbaccel"))
    real, link = os.path.join(root, "other-disk", "checkpoint"), os.path.join(root, "checkpoint")
    if accelerator.is_main_process:  # a checkpoint folder that is a link to a folder elsewhere
        os.makedirs(real)
        os.symlink(real, link)
    accelerator.wait_for_everyone()
    found["through a link"] = [_outcome(lambda: accelerator.save_state(link) and None) for _ in range(2)]
    accelerator.wait_for_everyone()
    found["link kept"] = os.path.islink(link)
    found["files where it points"] = sorted(name for name in os.listdir(real) if not name.startswith(".nbaccel"))
    found["load through the link"] = _outcome(lambda: accelerator.load_state(link))
    return found


@pytest.mark.parametrize("num_processes", [2])
def test_saving_into_the_working_directory_or_a_link_keeps_it(num_processes, tmp_path):
    """nbaccel replaced the checkpoint folder as a whole, so save_state(".") renamed the working directory away:
    the process was left in a deleted folder (FileNotFoundError for every relative path, the next save_state
    included). A folder that holds the working directory now gets the save's files one by one. A link to a folder
    was renamed, the save then failed ("Cannot call rmtree on a symbolic link"), the link was replaced by a folder
    and every later save failed; the save now goes where the link points."""
    results = run_both(into_the_working_directory, num_processes, args=(str(tmp_path),))
    assert results["accelerate"][0]["second"] == ("ok", "PosixPath", ".")
    assert_same(results["accelerate"], results["nbaccel"])
