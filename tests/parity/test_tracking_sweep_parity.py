"""Experiment tracking written for Accelerate, run on Accelerate 1.15 and on nbaccel in the same test and compared:
`log_with` spellings, `get_available_trackers`, registered tracker classes, `init_trackers` configurations that
TensorBoard records (read back from the event files) and `log` with dicts. Found by a parity sweep (2026-12-01);
each comparison failed on nbaccel before its fix. The deliberate differences the scenarios meet (docs/compat.md,
"Trackers") are stated on both sides.
"""

from __future__ import annotations

import enum
import glob
import logging
import os
import warnings

import pytest
from parity_harness import assert_same, run_both

pytest.importorskip("accelerate")
pytest.importorskip("tensorboard")
pytestmark = pytest.mark.timeout(300)


def _outcome(call):
    """("ok", value, warnings) or ("raised", the exception's type name): what code written for Accelerate sees."""
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            value = call()
        return ("ok", value, sorted({w.category.__name__ for w in caught}))
    except Exception as exc:  # the exception's type is what code written for Accelerate catches
        return ("raised", type(exc).__name__)


def _folder():
    """A folder of this run, shared by its ranks (the harness's per-run temporary folder)."""
    return os.path.dirname(os.environ["PARITY_OUT"])


def _names(log_with):
    return [(type(t).__name__, str(getattr(t, "value", None) or getattr(t, "name", t))) for t in log_with]


def choosing_trackers(lib):
    """`log_with` spellings, registered classes and `get_available_trackers` (naming only TensorBoard, which this
    module requires: a named tracker that is not installed is an ImportError on nbaccel, docs/compat.md)."""
    tracking = lib.tracking

    class Camel(tracking.GeneralTracker):  # a registered class whose name is not lowercase
        name, requires_logging_directory, tracker = "CamelTracker", False, None

        def __init__(self, run_name, **kwargs):
            super().__init__()
            self.run_name = run_name

    class Mine(tracking.GeneralTracker):
        name, requires_logging_directory, tracker = "mine", False, None

    found = {"available": _names(tracking.get_available_trackers()),
             "register": _outcome(lambda: tracking.register_tracker_class(Camel))}
    found["available after registering"] = _names(tracking.get_available_trackers())
    found["filter_trackers"] = _names(tracking.filter_trackers(["tensorboard", "CamelTracker", Mine()], _folder()))
    for label, log_with in (("empty list", []), ("empty tuple", ()), ("a class", Mine), ("a number", 3),
                            ("registered", "CamelTracker"), ("named then all", ["tensorboard", "all"]),
                            ("instance after all", ["tensorboard", "all", Mine()])):
        lib.state.AcceleratorState._reset_state(True)
        found[label] = _outcome(lambda log_with=log_with: _names(
            lib.Accelerator(cpu=True, log_with=log_with, project_dir=_folder()).log_with))
    lib.state.AcceleratorState._reset_state(True)
    accelerator = lib.Accelerator(cpu=True, log_with="CamelTracker")
    accelerator.init_trackers("camel")
    found["registered started"] = [(type(t).__name__, t.run_name) for t in accelerator.trackers]
    lib.state.AcceleratorState._reset_state(True)
    accelerator = lib.Accelerator(cpu=True, log_with="tensorboard", project_dir=_folder())
    found["config not a dict"] = _outcome(lambda: accelerator.init_trackers("listed", config=[("lr", 0.1)]))
    return found


def test_log_with_choices_and_registered_trackers_as_in_accelerate():
    """nbaccel gave no warning for `log_with=[]`, raised TypeError (not ValueError) for a class or a number in
    `log_with`, listed registered classes in `get_available_trackers()` (as strings) and started them for "all",
    refused a registered class named in capitals, met a configuration that is no dict with AttributeError, and
    its `filter_trackers` returned built-in trackers as strings where Accelerate's returns `LoggerType` members."""
    results = run_both(choosing_trackers, num_processes=1)
    theirs, ours = results["accelerate"][0], results["nbaccel"][0]
    assert theirs["empty list"] == ("ok", [], ["UserWarning"]) and theirs["a class"] == ("raised", "ValueError")
    assert theirs["available"][0] == ("LoggerType", "tensorboard") and theirs["registered started"]
    assert_same(theirs, ours, "choosing_trackers")


class Mode(str, enum.Enum):
    FAST = "fast"


def _hparams(folder):
    """The hyperparameters TensorBoard recorded under `folder`, read back from its event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    found = {}
    for path in glob.glob(f"{folder}/**/events.out.tfevents*", recursive=True):
        events = EventAccumulator(path)
        events.Reload()
        try:
            contents = events.PluginTagToContent("hparams")
        except KeyError:  # an event file with no hparams
            continue
        for content in contents.values():
            data = plugin_data_pb2.HParamsPluginData.FromString(content)
            if data.HasField("session_start_info"):
                found.update({key: value.WhichOneof("kind") + " " + str(getattr(value, value.WhichOneof("kind")))
                              for key, value in data.session_start_info.hparams.items()})
    return found


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record):
        self.count += 1


def tensorboard_configuration(lib):
    """A configuration with a str-valued Enum, a one-element tensor and a numpy float64, which torch's
    `add_hparams` takes; then a dict logged with a string in it."""
    import numpy as np
    import torch

    accelerator = lib.Accelerator(cpu=True, log_with="tensorboard", project_dir=_folder())
    config = {"lr": 0.1, "epochs": 3, "optimizer": "adam", "flag": True, "mode": Mode.FAST,
              "scale": torch.tensor([0.5]), "decay": np.float64(2.5)}
    found = {"init_trackers": _outcome(lambda: accelerator.init_trackers("config", config=config))}
    tracker = accelerator.get_tracker("tensorboard")
    found["tracker attributes"] = sorted(vars(tracker))  # scripts read tracker.logging_dir and logging_dir_param
    found["run folder"] = os.path.relpath(tracker.logging_dir, tracker.logging_dir_param)
    warned = _Warnings()
    logging.getLogger().addHandler(warned)
    found["dict with a string"] = _outcome(lambda: accelerator.log({"parts": {"a": 1.0, "note": "x"}}, step=1))
    logging.getLogger().removeHandler(warned)
    found["warnings logged"] = warned.count
    accelerator.end_training()
    found["hparams"] = _hparams(os.path.join(_folder(), "config"))
    import yaml

    def read(path):
        with open(path, encoding="utf-8") as handle:
            return yaml.safe_load(handle)

    found["hparams.yml"] = [_outcome(lambda path=path: read(path))
                            for path in glob.glob(f"{_folder()}/config/**/hparams.yml", recursive=True)]
    return found


def test_tensorboard_records_the_configuration_accelerate_records():
    """nbaccel raised yaml's RepresenterError for the Enum (writing hparams.yml), recorded the tensor as the
    text "tensor([0.5000])" where Accelerate records 0.5, and its tracker had no `logging_dir_param`. A string inside a logged dict: Accelerate's run ends
    with torch's ValueError; nbaccel records the numbers and names the string in a warning (docs/compat.md)."""
    results = run_both(tensorboard_configuration, num_processes=1)
    theirs, ours = results["accelerate"][0], results["nbaccel"][0]
    assert theirs["hparams"]["scale"] == "number_value 0.5" and theirs["hparams"]["mode"] == "string_value fast"
    assert theirs.pop("dict with a string") == ("raised", "ValueError") and theirs.pop("warnings logged") == 0
    assert ours.pop("dict with a string") == ("ok", None, []) and ours.pop("warnings logged") == 1
    # hparams.yml: plain YAML here, in the run's folder; Accelerate's yaml.dump tags the tensor, the numpy number
    # and the Enum as Python objects, which yaml.safe_load refuses (docs/compat.md)
    assert theirs.pop("hparams.yml") == [("raised", "ConstructorError")]
    assert ours.pop("hparams.yml") == [("ok", {"decay": 2.5, "epochs": 3, "flag": True, "lr": 0.1, "mode": "fast",
                                               "optimizer": "adam", "scale": 0.5}, [])]
    assert_same(theirs, ours, "tensorboard_configuration")


def on_every_rank(lib):
    """`tracking.on_main_process` on classes with and without `main_process_only`, and the Accelerator's
    tracker calls on every rank: before `init_trackers`, after it, and `end_training` twice."""
    tracking = lib.tracking

    class Plain:  # a user's class decorated with the tracker decorator, with no main_process_only of its own
        @tracking.on_main_process
        def who(self):
            return "ran"

    class Everywhere(Plain):
        main_process_only = False

    class MainOnly(Plain):
        main_process_only = True

    class Recorder(tracking.GeneralTracker):
        name, requires_logging_directory = "recorder", False

        def __init__(self):
            super().__init__()
            self.calls = []

        @property
        def tracker(self):
            return self.calls

        @tracking.on_main_process
        def log(self, values, step=None, **kwargs):
            self.calls.append(("log", sorted(values), step, kwargs))

        @tracking.on_main_process
        def finish(self):
            self.calls.append("finish")

    recorder = Recorder()
    accelerator = lib.Accelerator(cpu=True, log_with=[recorder, "tensorboard"], project_dir=_folder())
    found = {"decorated": [Plain().who(), Everywhere().who(), MainOnly().who()],
             "log before init": _outcome(lambda: accelerator.log({"loss": 1.0}, step=0)),
             "get before init": type(accelerator.get_tracker("recorder", unwrap=True)).__name__,
             "init": _outcome(lambda: accelerator.init_trackers("ranks", config={"lr": 0.1}))}
    found["trackers"] = [type(t).__name__ for t in accelerator.trackers]
    found["get"] = _outcome(lambda: type(accelerator.get_tracker("tensorboard", unwrap=True)).__name__)
    found["get unknown"] = _outcome(lambda: type(accelerator.get_tracker("wandb")).__name__)
    found["log"] = _outcome(lambda: accelerator.log({"loss": 0.5}, step=1, log_kwargs={"recorder": {"k": 1}}))
    found["end"] = _outcome(accelerator.end_training)
    found["end again"] = _outcome(accelerator.end_training)
    found["calls"] = recorder.calls
    return found


def test_tracker_calls_on_every_rank_as_in_accelerate():
    """`on_main_process` on an object without `main_process_only` ran the method on the main process only;
    Accelerate's runs it everywhere (the attribute defaults to False there; GeneralTracker sets True)."""
    results = run_both(on_every_rank, num_processes=2)
    assert [rank["decorated"] for rank in results["accelerate"]] == [["ran"] * 3, ["ran", "ran", None]]
    assert results["accelerate"][1]["trackers"] == [] and results["accelerate"][0]["calls"][-1] == "finish"
    assert_same(results["accelerate"], results["nbaccel"], "on_every_rank")


def mlflow_warnings(lib):
    """Values MLflow cannot record, logged at every step: the same value, then a new value each time."""
    os.environ.update(MLFLOW_TRACKING_URI=f"file:{_folder()}/mlruns", MLFLOW_ALLOW_FILE_STORE="true")
    accelerator = lib.Accelerator(cpu=True, log_with="mlflow")
    accelerator.init_trackers("warned")
    warned = _Warnings()
    logging.getLogger().addHandler(warned)
    for step in range(3):
        accelerator.log({"loss": 1.0 / (step + 1), "phase": "train"}, step=step)
    found = {"same text at every step": warned.count}
    for step in range(3, 6):
        accelerator.log({"loss": 1.0, "note": f"step {step}"}, step=step)
    found["new text at every step"] = warned.count - found["same text at every step"]
    logging.getLogger().removeHandler(warned)
    accelerator.end_training()
    return found


def test_mlflow_names_a_value_it_drops_once_per_distinct_value():
    """nbaccel's MLflow tracker warned at every `log` call about a string logged at every step; Accelerate warns
    once per distinct message (`warning_once`): once for a repeated value, once per step for a changing one."""
    pytest.importorskip("mlflow")
    results = run_both(mlflow_warnings, num_processes=1)
    assert results["accelerate"][0] == {"same text at every step": 1, "new text at every step": 3}
    assert_same(results["accelerate"], results["nbaccel"], "mlflow_warnings")
