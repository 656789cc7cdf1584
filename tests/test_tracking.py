"""nbaccel.tracking: built-in trackers write what was logged; missing libraries fail clearly; adapters."""

from __future__ import annotations

import importlib.machinery
import json
import sys
import types

import pytest
import torch

from nbaccel import telemetry, tracking
from nbaccel.tracking import (
    GeneralTracker,
    JSONLTracker,
    TensorBoardTracker,
    filter_trackers,
    finish_trackers,
    get_tracker,
    init_trackers,
    log_to_trackers,
    register_tracker_class,
)
from nbaccel.utils.dataclasses import LoggerType


class Recorder(GeneralTracker):
    name = "recorder"
    requires_logging_directory = False

    def __init__(self, *args, **kwargs):
        super().__init__()
        self.calls = [("init", args, kwargs)]

    @property
    def tracker(self):
        return self.calls

    def start(self):
        self.calls.append(("start",))

    def store_init_configuration(self, values):
        self.calls.append(("config", values))

    def log(self, values, step=None, **kwargs):
        self.calls.append(("log", values, step, kwargs))

    def finish(self):
        self.calls.append(("finish",))


@pytest.fixture
def sink():
    messages = []
    telemetry.attach(messages.append, rank=0)
    yield messages
    telemetry.detach()


# ----------------------------------------------------------------------------------------- jsonl
def test_jsonl_tracker_writes_one_object_per_log(tmp_path, sink):
    trackers = init_trackers(filter_trackers("jsonl", tmp_path), "proj", logging_dir=tmp_path,
                             config={"lr": 0.1, "layers": [2, 3], "device": torch.device("cpu")})
    log_to_trackers(trackers, {"loss": torch.tensor(0.5), "acc": 0.75, "note": "warm"}, step=1)
    log_to_trackers(trackers, {"loss": 0.25}, step=2)
    finish_trackers(trackers)

    lines = (tmp_path / "proj" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [(r["step"], r["values"]) for r in records] == [
        (1, {"loss": 0.5, "acc": 0.75, "note": "warm"}), (2, {"loss": 0.25})]
    assert all(isinstance(r["time"], float) for r in records)
    assert json.loads((tmp_path / "proj" / "config.json").read_text()) == \
        {"lr": 0.1, "layers": [2, 3], "device": "cpu"}
    # the live dashboard's channel got the numbers (strings dropped)
    assert [(m["kind"], m["values"], m["step"]) for m in sink] == [
        ("metrics", {"loss": 0.5, "acc": 0.75}, 1), ("metrics", {"loss": 0.25}, 2)]


def test_jsonl_only_writes_on_main_process(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    tracker = JSONLTracker("proj", tmp_path)
    tracker.start()
    tracker.log({"loss": 1.0}, step=0)
    tracker.finish()
    assert not (tmp_path / "proj").exists()


# ----------------------------------------------------------------------------------- tensorboard
def test_tensorboard_event_files_hold_the_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trackers = init_trackers(filter_trackers(LoggerType.TENSORBOARD, tmp_path), "tb", logging_dir=tmp_path,
                             config={"lr": 0.1, "optimizer": "sgd"})
    for step in range(3):
        log_to_trackers(trackers, {"loss": 1.0 / (step + 1), "lrs": {"a": 0.1, "b": 0.2}, "text": "x"}, step=step)
    finish_trackers(trackers)

    run_dir = tmp_path / "tb"
    assert list(run_dir.glob("events.out.tfevents.*"))
    assert (run_dir / "hparams.yml").exists()
    events = EventAccumulator(str(run_dir))
    events.Reload()
    scalars = events.Scalars("loss")
    assert [(s.step, round(s.value, 5)) for s in scalars] == [(0, 1.0), (1, 0.5), (2, 0.33333)]


def test_tensorboard_missing_names_the_extra(tmp_path, monkeypatch):
    # neither tensorboard nor tensorboardX importable, whatever this environment has installed
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(tracking.importlib.util, "find_spec",
                        lambda name, *a: None if name in ("tensorboard", "tensorboardX") else real_find_spec(name, *a))
    monkeypatch.setattr(tracking, "_is_main_process", lambda: True)  # start() runs only there
    tracker = TensorBoardTracker("tb", tmp_path)
    with pytest.raises(ImportError, match=r"pip install nbaccel\[tensorboard\]"):
        tracker.start()
    with pytest.raises(ImportError, match=r"pip install nbaccel\[tensorboard\]"):
        filter_trackers("tensorboard", tmp_path)


# -------------------------------------------------------------------------------- choosing trackers
def test_missing_library_gives_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed (it is a dev dependency)
    with pytest.raises(ImportError, match="needs the `wandb` package.*pip install wandb"):
        filter_trackers(["wandb"])
    with pytest.raises(ImportError, match="pip install wandb"):
        tracking.WandBTracker("p").start()


def test_filter_trackers_validates_and_deduplicates(tmp_path):
    custom = Recorder()
    assert filter_trackers(None) == []
    assert filter_trackers(["jsonl", LoggerType.TENSORBOARD, "tensorboard", custom, custom], tmp_path) == [
        "jsonl", "tensorboard", custom]
    with pytest.raises(ValueError, match="Unsupported tracker 'neptune'.*'all'.*'jsonl'"):
        filter_trackers("neptune")
    with pytest.raises(ValueError, match="Logging with `jsonl` requires a `logging_dir`"):
        filter_trackers("jsonl")
    accelerate_tracking = pytest.importorskip("accelerate.tracking")
    for check in (accelerate_tracking.filter_trackers, filter_trackers):  # the phrase Accelerate's tests match
        with pytest.raises(ValueError, match="Logging with `tensorboard` requires a `logging_dir`"):
            check("tensorboard")
    with pytest.raises(ValueError, match="pass an instance"):  # Accelerate's type for an entry it cannot use
        filter_trackers([Recorder])


def test_all_means_every_available_tracker(tmp_path):
    custom = Recorder()
    chosen = filter_trackers(["all", custom], tmp_path)
    assert chosen[0] is custom and "tensorboard" in chosen[1:] and "jsonl" not in chosen  # as Accelerate's "all"
    assert chosen[1:] == tracking.get_available_trackers()
    assert filter_trackers("all") == [n for n in tracking.get_available_trackers()
                                      if not tracking.LOGGER_TYPE_TO_CLASS[n].requires_logging_directory]


def test_custom_tracker_instance_and_log_kwargs(sink):
    custom = Recorder()
    trackers = init_trackers([custom], "proj", config={"a": 1}, init_kwargs={"wandb": {"entity": "ignored"}})
    log_to_trackers(trackers, {"x": 2}, step=3, log_kwargs={"recorder": {"commit": False}, "other": {"y": 1}})
    finish_trackers(trackers)
    assert custom.calls[1:] == [("start",), ("config", {"a": 1}), ("log", {"x": 2}, 3, {"commit": False}),
                                ("finish",)]
    assert get_tracker(trackers, "recorder") is custom
    assert get_tracker(trackers, "recorder", unwrap=True) is custom.calls
    with pytest.raises(ValueError, match="wandb is not an available tracker"):
        get_tracker(trackers, "wandb")
    blank = get_tracker([], "recorder")
    blank.log({"x": 1})  # non-main processes get a tracker that does nothing


def test_registered_tracker_class_by_name(tmp_path, monkeypatch):
    monkeypatch.setattr(tracking, "LOGGER_TYPE_TO_CLASS", dict(tracking.LOGGER_TYPE_TO_CLASS))
    register_tracker_class(Recorder)
    [tracker] = init_trackers(filter_trackers("recorder"), "proj", init_kwargs={"recorder": {"flag": True}})
    assert tracker.calls[:2] == [("init", ("proj",), {"flag": True}), ("start",)]
    with pytest.raises(ValueError, match="subclass of GeneralTracker"):
        register_tracker_class(dict)


def test_incomplete_tracker_class_is_rejected():
    class NoName(GeneralTracker):
        requires_logging_directory = False

    with pytest.raises(NotImplementedError, match="name, tracker"):
        NoName()


def test_finish_trackers_finishes_all_then_raises():
    class Broken(Recorder):
        name = "broken"

        def finish(self):
            raise OSError("flush failed")

    good = Recorder()
    with pytest.raises(OSError, match="flush failed"):
        finish_trackers([Broken(), good])
    assert good.calls[-1] == ("finish",)


def test_a_failed_start_finishes_the_trackers_started_before_it():
    class NoStart(Recorder):
        name = "nostart"

        def start(self):
            raise OSError("no run")

    first, last = Recorder(), Recorder()
    with pytest.raises(OSError, match="no run"):
        init_trackers([first, NoStart(), last], "proj")
    assert first.calls[1:] == [("start",), ("finish",)] and last.calls[1:] == []


# ------------------------------------------------------------------------- adapters (fake modules)
class Call:
    """Records every attribute access and call made on it, returning itself (a chainable fake API)."""

    def __init__(self, log, path):
        self._log, self._path = log, path

    def __getattr__(self, name):
        return Call(self._log, f"{self._path}.{name}")

    def __call__(self, *args, **kwargs):
        self._log.append((self._path, args, kwargs))
        return Call(self._log, f"{self._path}()")

    def __setitem__(self, key, value):
        self._log.append((f"{self._path}[{key!r}]", (value,), {}))

    def __setattr__(self, name, value):
        if name.startswith("_"):
            object.__setattr__(self, name, value)
        else:
            self._log.append((f"{self._path}.{name}=", (value,), {}))

    def __bool__(self):
        return False


def fake_module(monkeypatch, name, log, **attributes):
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.__getattr__ = lambda attr: Call(log, f"{name}.{attr}")
    for key, value in attributes.items():
        setattr(module, key, value)
    monkeypatch.setitem(sys.modules, name, module)
    return module


def test_wandb_adapter_uses_public_api(monkeypatch):
    log = []
    fake_module(monkeypatch, "wandb", log)
    [tracker] = init_trackers(filter_trackers("wandb"), "proj", config={"lr": 1},
                              init_kwargs={"wandb": {"entity": "me"}})
    log_to_trackers([tracker], {"loss": 1.5}, step=4)
    finish_trackers([tracker])
    assert [entry[0] for entry in log] == ["wandb.init", "wandb.init().config.update", "wandb.init().log",
                                           "wandb.init().finish"]
    assert log[0][2] == {"project": "proj", "entity": "me"}
    assert log[1] == ("wandb.init().config.update", ({"lr": 1},), {"allow_val_change": True})
    assert log[2] == ("wandb.init().log", ({"loss": 1.5},), {"step": 4})
    log.clear()
    tracker.log_table("preds", columns=["x"], data=[[1]], step=5)
    assert [entry[0] for entry in log] == ["wandb.Table", "wandb.init().log"]
    assert log[0][2] == {"columns": ["x"], "data": [[1]], "dataframe": None} and log[1][2] == {"step": 5}


def test_clearml_images_and_tables(monkeypatch):
    """Accelerate's ClearMLTest (run against nbaccel with clearml installed: scripts/accelerate_unit_tests.py)
    checks the offline session; here, without clearml, the calls it makes."""
    log = []
    fake_module(monkeypatch, "clearml", log)
    [tracker] = init_trackers(filter_trackers("clearml"), "proj")
    log.clear()
    tracker.log_images({"eval_sample": "IMAGE"}, step=2)
    tracker.log_table("test_preds", columns=["a", "b"], data=[[1, 2]], step=3)
    tracker.log_table("rows", data=[["h"], [1]])
    reports = [(entry[0].rsplit(".", 1)[1], entry[2]) for entry in log if ".report_" in entry[0]]
    assert reports == [
        ("report_image", {"title": "sample", "series": "eval", "iteration": 2, "image": "IMAGE"}),
        ("report_table", {"title": "preds", "series": "test", "table_plot": [["a", "b"], [1, 2]], "iteration": 3}),
        ("report_table", {"title": "rows", "series": "train", "table_plot": [["h"], [1]], "iteration": None}),
    ]
    with pytest.raises(ValueError, match="needs `data`"):
        tracker.log_table("empty")


def test_trackio_and_swanlab_adapters_open_a_project_run(monkeypatch):
    log = []
    fake_module(monkeypatch, "trackio", log)
    fake_module(monkeypatch, "swanlab", log)
    trackio, swanlab = init_trackers(filter_trackers(["trackio", "swanlab"]), "proj", config={"lr": 1},
                                     init_kwargs={"trackio": {"space_id": "me/s"}, "swanlab": {"mode": "local"}})
    log_to_trackers([trackio, swanlab], {"loss": 1.5}, step=4)
    finish_trackers([trackio, swanlab])
    assert [entry[0] for entry in log] == [
        "trackio.init", "swanlab.init", "trackio.config.update", "swanlab.config.update",
        "trackio.init().log", "swanlab.log", "trackio.init().finish", "swanlab.finish"]
    assert log[0][2] == {"project": "proj", "space_id": "me/s"} and log[1][2] == {"project": "proj", "mode": "local"}
    assert log[4][1:] == log[5][1:] == (({"loss": 1.5},), {"step": 4})
    assert trackio.tracker is trackio.run and swanlab.tracker is swanlab.run


def test_mlflow_adapter_uses_public_api(monkeypatch):
    log = []
    fake_module(monkeypatch, "mlflow", log, search_experiments=lambda **kw: [])
    fake_module(monkeypatch, "mlflow.utils.validation", log, MAX_PARAM_VAL_LENGTH=10, MAX_PARAMS_TAGS_PER_BATCH=1)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    [tracker] = init_trackers(filter_trackers("mlflow"), "exp", config={"a": 1, "b": "x" * 20, "c": 3})
    log_to_trackers([tracker], {"loss": torch.tensor(2.0), "note": "skip"}, step=1)
    finish_trackers([tracker])
    assert [entry[0] for entry in log] == ["mlflow.create_experiment", "mlflow.start_run", "mlflow.log_params",
                                           "mlflow.log_params", "mlflow.log_metrics", "mlflow.end_run"]
    assert log[0][2]["name"] == "exp" and log[1][2]["run_name"] is None
    assert [entry[1] for entry in log[2:4]] == [({"a": 1},), ({"c": 3},)]  # too long dropped, batches of 1
    assert log[4][1:] == (({"loss": 2.0},), {"step": 1})


def test_clearml_and_dvclive_adapters(monkeypatch):
    log = []
    fake_module(monkeypatch, "clearml", log)
    fake_module(monkeypatch, "dvclive", log)
    trackers = init_trackers(filter_trackers(["clearml", "dvclive"]), "proj")
    log_to_trackers(trackers, {"eval_loss": 1.0, "acc": 2}, step=5)
    names = [entry[0] for entry in log]
    assert "clearml.Task.init" in names and "dvclive.Live" in names
    scalars = [entry[2] for entry in log if entry[0].endswith("report_scalar")]
    assert scalars == [{"title": "loss", "series": "eval", "value": 1.0, "iteration": 5},
                       {"title": "acc", "series": "train", "value": 2, "iteration": 5}]
    assert ("dvclive.Live().step=", (5,), {}) in log and ("dvclive.Live().next_step", (), {}) in log


def test_accelerator_logs_to_jsonl_on_the_main_process_only(tmp_path):
    pytest.importorskip("nbaccel.accelerator")
    from ranks_helper import run_ranks

    def body(rank):
        from nbaccel import Accelerator

        accelerator = Accelerator(log_with=["jsonl"], project_dir=str(tmp_path))
        accelerator.init_trackers("run", config={"lr": 0.1})
        accelerator.log({"loss": 1.0 + rank}, step=1)
        tracker = accelerator.get_tracker("jsonl")
        accelerator.end_training()
        return type(tracker).__name__

    names = run_ranks(body, world_size=2, timeout=60)
    assert names[0] == "JSONLTracker"
    logs = sorted(tmp_path.rglob("metrics.jsonl"))
    assert len(logs) == 1
    [record] = [json.loads(line) for line in logs[0].read_text().splitlines()]
    assert (record["step"], record["values"]) == (1, {"loss": 1.0})
    assert json.loads((logs[0].parent / "config.json").read_text()) == {"lr": 0.1}
