"""Experiment trackers behind `Accelerator(log_with=...)`, `init_trackers`, `log` and `end_training`.

Built in: `"jsonl"` (needs nothing: one JSON object per `log` call in `logging_dir/<project>/metrics.jsonl`)
and `"tensorboard"` (`pip install nbaccel[tensorboard]`). Thin adapters for wandb, comet_ml, mlflow, aim,
clearml, dvclive, trackio and swanlab use those libraries' public APIs when installed; naming one that is
not installed raises ImportError saying what to install. `log_with="all"` takes every available one.
Custom trackers subclass `GeneralTracker` and are passed as instances (or registered by name with
`register_tracker_class`).

`log_to_trackers` is what `Accelerator.log` calls: every tracker logs, and `nbaccel.telemetry` gets the
numbers so the live dashboard charts them.
"""

from __future__ import annotations

import enum
import functools
import importlib
import importlib.util
import json
import logging
import math
import os
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from . import telemetry
from .utils.atomic_files import write_text
from .utils.dataclasses import LoggerType

logger = logging.getLogger(__name__)

JSONL = "jsonl"


# ------------------------------------------------------------------------------ main-process guard
def _is_main_process() -> bool:
    """Rank 0 of torch.distributed when initialized, else by the launcher's RANK variable (default 0)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            from .utils.collectives import _rank

            return _rank() == 0
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    return int(os.environ.get("RANK", "0") or 0) == 0


def on_main_process(function: Callable[..., Any]) -> Callable[..., Any]:
    """Method decorator: run only on the main process when the object's `main_process_only` is true
    (`GeneralTracker` sets it; on an object without the attribute the method runs everywhere, as in Accelerate).

    The check happens at call time and initializes nothing (no process group, no state object).
    """

    @functools.wraps(function)
    def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, "main_process_only", False) and not _is_main_process():
            return None
        return function(self, *args, **kwargs)

    return guarded


# ------------------------------------------------------------------------------------- base class
class GeneralTracker:
    """Base of every tracker. Subclasses set `name` and `requires_logging_directory`, define the
    `tracker` property (the underlying run/writer object) and override what they support:
    `start()` (open the run), `store_init_configuration(config)`, `log(values, step, **kwargs)`,
    `finish()`. `main_process_only` (default True) makes `on_main_process` methods run on rank 0 only.
    """

    main_process_only = True

    def __init__(self, _blank: bool = False) -> None:
        if _blank:
            return
        missing = [attr for attr in ("name", "requires_logging_directory") if not hasattr(self, attr)]
        if "tracker" not in dir(self):
            missing.append("tracker")
        if missing:
            raise NotImplementedError(
                f"{type(self).__name__} is missing required tracker attributes: {', '.join(missing)}. "
                "Define them in the class (name: str, requires_logging_directory: bool, tracker property)."
            )

    def start(self) -> None:
        """Open the run. Called by `init_trackers` after construction, once the process group exists."""

    def store_init_configuration(self, values: dict) -> None:
        """Record `values` (hyperparameters: bool, str, int, float or None) as the run's configuration."""

    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        """Record `values` (name -> number, string or dict of numbers), at `step` when given."""

    def finish(self) -> None:
        """Flush and close the run."""


@functools.lru_cache(maxsize=4096)
def _warn_once(message: str) -> None:
    """Log `message` once per process. Accelerate's trackers warn through `warning_once`, so a value logged at
    every step is named once, not at every step."""
    logger.warning(message)


def _warn_skipped(tracker: str, key: str, value: Any, kind: str = "a number") -> None:
    """Name a value `tracker` cannot record (its key, type and value, shortened) once per distinct text."""
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    _warn_once(f"{tracker}: {key!r} is {type(value).__name__} {shown}, not {kind}; not logged")


def _require(tracker: str) -> Any:
    """Import the library behind the built-in tracker `tracker`, or say what to install (`_REQUIREMENTS`)."""
    module, install = _REQUIREMENTS[tracker]
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(
            f"The {tracker!r} tracker needs the `{module.split('.')[0]}` package, which is not installed: "
            f"run `{install}`, or remove {tracker!r} from log_with."
        ) from error


_NO_ITEM = object()


def _single_item(value: Any) -> Any:
    """The Python value of a one-element tensor or array (`.item()`), else `_NO_ITEM`."""
    item = getattr(value, "item", None)
    numel = getattr(value, "numel", None) or getattr(value, "size", None)
    if callable(item):
        try:
            if (numel() if callable(numel) else numel) == 1:
                return item()
        except (TypeError, ValueError, RuntimeError):
            pass
    return _NO_ITEM


def _plain(value: Any) -> Any:
    """A JSON- and YAML-friendly copy: Enum members become their value, one-element tensors/arrays and numpy
    scalars numbers, containers are walked, the rest str. Subclasses of bool, int, float and str come back as
    the plain type, which `yaml.safe_dump` needs (it refuses a str-valued Enum member or a numpy float64)."""
    if isinstance(value, enum.Enum):
        return _plain(value.value)
    if value is None or isinstance(value, bool):
        return None if value is None else bool(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else str(value)
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    item = _single_item(value)
    if item is not _NO_ITEM:
        return _plain(item)
    if callable(getattr(value, "tolist", None)):
        return _plain(value.tolist())
    return str(value)


def _as_number(value: Any) -> float | int | None:
    """The scalar a tracker records for `value`, or None. As in Accelerate, bools count as ints and NaN or
    infinite floats are recorded as they are (`_plain` turns those into text for JSON); a one-element tensor
    or array gives its number."""
    number = value if isinstance(value, int | float) else _single_item(value)
    return number if isinstance(number, int | float) else None


# ------------------------------------------------------------------------------------------ jsonl
class JSONLTracker(GeneralTracker):
    """Writes `logging_dir/<run_name>/metrics.jsonl`: one line per `log` call, `{"step", "time", "values"}`;
    the configuration goes to `config.json` beside it. Appends, so a resumed run continues the same file.
    Needs no extra package.
    """

    name = JSONL
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str | os.PathLike, **kwargs: Any) -> None:
        super().__init__()
        if kwargs:
            raise TypeError(f"The jsonl tracker takes no options; got {sorted(kwargs)}.")
        self.run_name = run_name
        self.logging_dir = Path(logging_dir) / run_name
        self._file = None

    @on_main_process
    def start(self) -> None:
        self.logging_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(self.logging_dir / "metrics.jsonl", "a", encoding="utf-8")  # noqa: SIM115

    @property
    def tracker(self) -> Any:
        return self._file

    @on_main_process
    def store_init_configuration(self, values: dict) -> None:
        path = self.logging_dir / "config.json"
        write_text(path, json.dumps(_plain(values), indent=2, sort_keys=True) + "\n")

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        if self._file is None:
            raise RuntimeError("The jsonl tracker was not started: call init_trackers() before log().")
        record = {"step": step, "time": time.time(), "values": _plain(values), **_plain(kwargs)}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    @on_main_process
    def finish(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


# ------------------------------------------------------------------------------------- tensorboard
class TensorBoardTracker(GeneralTracker):
    """TensorBoard event files in `logging_dir/<run_name>` through `torch.utils.tensorboard.SummaryWriter`
    (tensorboardX when only that is installed). `kwargs` go to `SummaryWriter`."""

    name = "tensorboard"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str | os.PathLike, **kwargs: Any) -> None:
        super().__init__()
        self.run_name = run_name
        self.logging_dir_param = logging_dir  # Accelerate's attribute: the folder given, before the run's name
        self.logging_dir = os.path.join(logging_dir, run_name)
        self.init_kwargs = kwargs
        self.writer = None

    @on_main_process
    def start(self) -> None:
        self.writer = _summary_writer_class()(self.logging_dir, **self.init_kwargs)

    @property
    def tracker(self) -> Any:
        return self.writer

    @on_main_process
    def store_init_configuration(self, values: dict) -> None:
        import yaml

        self.writer.add_hparams({key: _hparam(value) for key, value in values.items()}, metric_dict={})
        self.writer.flush()
        # the whole text first: a value YAML cannot represent must not leave a half-written file
        text = yaml.safe_dump(_plain(values))
        os.makedirs(self.logging_dir, exist_ok=True)
        write_text(os.path.join(self.logging_dir, "hparams.yml"), text)

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        for key, value in values.items():
            if isinstance(value, str):
                self.writer.add_text(key, value, global_step=step, **kwargs)
            elif isinstance(value, Mapping):
                self.writer.add_scalars(key, _numbers_of(key, value), global_step=step, **kwargs)
            else:
                number = _as_number(value)
                if number is None:
                    _warn_skipped("tensorboard", key, value, "a number, string or dict")
                    continue
                self.writer.add_scalar(key, number, global_step=step, **kwargs)
        self.writer.flush()

    @on_main_process
    def log_images(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        """`values`: name -> batch of images (N,C,H,W array or tensor), through `SummaryWriter.add_images`."""
        for key, images in values.items():
            self.writer.add_images(key, images, global_step=step, **kwargs)
        self.writer.flush()

    @on_main_process
    def finish(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _numbers_of(key: str, values: Mapping) -> dict[str, float | int]:
    """The numbers of a dict logged to TensorBoard (`add_scalars`), each other member named in a warning. Accelerate
    hands the dict over as it is and torch's `ValueError` ("could not convert string to float") ends the run."""
    numbers = {}
    for name, value in values.items():
        number = _as_number(value)
        if number is None:
            _warn_skipped("tensorboard", f"{key}/{name}", value)
        else:
            numbers[name] = number
    return numbers


def _hparam(value: Any) -> bool | int | float | str:
    """What TensorBoard's hparams record for a configuration value: bool, int, float and str as they are (an
    Enum member as its value), a one-element tensor or array or a numpy scalar as its number, as torch's
    `add_hparams` reads a one-element tensor; anything else (None, a list, a dict) as its text."""
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, bool | int | float | str):
        return value
    number = _as_number(value)
    return str(value) if number is None else number


def _summary_writer_class() -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter
    except ImportError as error:
        if importlib.util.find_spec("tensorboardX") is not None:
            from tensorboardX import SummaryWriter

            return SummaryWriter
        raise ImportError(
            "The 'tensorboard' tracker needs the `tensorboard` package, which is not installed: run "
            "`pip install nbaccel[tensorboard]` (or `pip install tensorboard`), or remove 'tensorboard' "
            "from log_with."
        ) from error


# ------------------------------------------------------------------------------- library adapters
class _ProjectRunTracker(GeneralTracker):
    """An adapter whose library opens its run as `<library>.init(project=run_name, **kwargs)` and keeps it
    in `self.run` (wandb, trackio, swanlab); `_library` names the library (a `_REQUIREMENTS` key)."""

    _library: str
    requires_logging_directory = False
    main_process_only = False

    def __init__(self, run_name: str, **kwargs: Any) -> None:
        super().__init__()
        self.run_name, self.init_kwargs, self.run = run_name, kwargs, None

    @on_main_process
    def start(self) -> None:
        self.run = _require(self._library).init(project=self.run_name, **self.init_kwargs)

    @property
    def tracker(self) -> Any:
        return self.run


class WandBTracker(_ProjectRunTracker):
    """Weights & Biases: `wandb.init(project=run_name, **kwargs)`; `kwargs` go to `wandb.init`."""

    name = _library = "wandb"

    @on_main_process
    def store_init_configuration(self, values: dict) -> None:
        self.run.config.update(values, allow_val_change=True)

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        self.run.log(values, step=step, **kwargs)

    @on_main_process
    def log_images(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        """`values`: name -> list of images (arrays or PIL images), logged as `wandb.Image`s."""
        wandb = _require("wandb")
        for key, images in values.items():
            self.run.log({key: [wandb.Image(image) for image in images]}, step=step, **kwargs)

    @on_main_process
    def log_table(self, table_name: str, columns: list[str] | None = None, data: list | None = None,
                  dataframe: Any = None, step: int | None = None, **kwargs: Any) -> None:
        """Log a `wandb.Table` built from `columns` + `data` rows, or from a pandas `dataframe`."""
        wandb = _require("wandb")
        table = wandb.Table(columns=columns, data=data, dataframe=dataframe)
        self.run.log({table_name: table}, step=step, **kwargs)

    @on_main_process
    def finish(self) -> None:
        self.run.finish()


class TrackioTracker(_ProjectRunTracker):
    """trackio (wandb-compatible, local first): `trackio.init(project=run_name, **kwargs)`."""

    name = _library = "trackio"

    @on_main_process
    def store_init_configuration(self, values: dict) -> None:
        trackio = _require("trackio")
        trackio.config.update(values, allow_val_change=True)

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        self.run.log(values, step=step, **kwargs)

    @on_main_process
    def finish(self) -> None:
        self.run.finish()


class CometMLTracker(GeneralTracker):
    """Comet: `comet_ml.start(project_name=run_name, **kwargs)` (API key from Comet's config/env)."""

    name = "comet_ml"
    requires_logging_directory = False

    def __init__(self, run_name: str, **kwargs: Any) -> None:
        super().__init__()
        self.run_name, self.init_kwargs, self.writer = run_name, kwargs, None

    @on_main_process
    def start(self) -> None:
        comet_ml = _require("comet_ml")
        if hasattr(comet_ml, "start"):
            self.writer = comet_ml.start(project_name=self.run_name, **self.init_kwargs)
        else:  # comet_ml < 3.41
            self.writer = comet_ml.Experiment(project_name=self.run_name, **self.init_kwargs)

    @property
    def tracker(self) -> Any:
        return self.writer

    @on_main_process
    def store_init_configuration(self, values: dict) -> None:
        self.writer.log_parameters(values)

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        if step is not None:
            self.writer.set_step(step)
        for key, value in values.items():
            if isinstance(value, str):
                self.writer.log_other(key, value, **kwargs)
            elif isinstance(value, Mapping):
                self.writer.log_metrics(value, step=step, **kwargs)
            else:
                self.writer.log_metric(key, _plain(value), step=step, **kwargs)

    @on_main_process
    def finish(self) -> None:
        self.writer.end()


class AimTracker(GeneralTracker):
    """Aim: an `aim.Run` whose repository is `logging_dir`; hyperparameters under `run["hparams"]`."""

    name = "aim"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str | os.PathLike | None = ".", **kwargs: Any) -> None:
        super().__init__()
        self.run_name, self.aim_repo_path, self.init_kwargs = run_name, logging_dir, kwargs
        self.writer = None

    @on_main_process
    def start(self) -> None:
        aim = _require("aim")
        self.writer = aim.Run(repo=self.aim_repo_path, **self.init_kwargs)
        self.writer.name = self.run_name

    @property
    def tracker(self) -> Any:
        return self.writer

    @on_main_process
    def store_init_configuration(self, values: dict) -> None:
        self.writer["hparams"] = values

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        for key, value in values.items():
            self.writer.track(_plain(value), name=key, step=step, **kwargs)

    @on_main_process
    def finish(self) -> None:
        self.writer.close()


class MLflowTracker(GeneralTracker):
    """MLflow: finds or creates `experiment_name`, starts a run; numbers go to `mlflow.log_metrics`.
    The environment variables MLFLOW_EXPERIMENT_NAME, MLFLOW_RUN_ID, MLFLOW_TAGS (JSON) and
    MLFLOW_NESTED_RUN take priority over the arguments, as in Accelerate."""

    name = "mlflow"
    requires_logging_directory = False

    def __init__(
        self,
        experiment_name: str | None = None,
        logging_dir: str | os.PathLike | None = None,
        run_id: str | None = None,
        tags: dict[str, Any] | str | None = None,
        nested_run: bool | None = False,
        run_name: str | None = None,
        description: str | None = None,
    ) -> None:
        super().__init__()
        experiment_name = os.environ.get("MLFLOW_EXPERIMENT_NAME", experiment_name)
        tags = os.environ.get("MLFLOW_TAGS", tags)
        nested = os.environ.get("MLFLOW_NESTED_RUN", nested_run)
        self.experiment_name = experiment_name
        self.logging_dir = None if logging_dir is None else str(logging_dir)
        self.run_id = os.environ.get("MLFLOW_RUN_ID", run_id)
        self.tags = json.loads(tags) if isinstance(tags, str) else tags
        self.nested_run = nested.strip().lower() in ("1", "true", "yes", "on") if isinstance(nested, str) \
            else bool(nested)
        self.run_name, self.description, self.active_run = run_name, description, None

    @on_main_process
    def start(self) -> None:
        mlflow = _require("mlflow")
        found = mlflow.search_experiments(filter_string=f"name = '{self.experiment_name}'")
        if found:
            experiment_id = found[0].experiment_id
        else:
            experiment_id = mlflow.create_experiment(
                name=self.experiment_name, artifact_location=self.logging_dir, tags=self.tags
            )
        self.active_run = mlflow.start_run(
            run_id=self.run_id, experiment_id=experiment_id, run_name=self.run_name, nested=self.nested_run,
            tags=self.tags, description=self.description,
        )

    @property
    def tracker(self) -> Any:
        return self.active_run

    @on_main_process
    def store_init_configuration(self, values: dict) -> None:
        mlflow = _require("mlflow")
        validation = importlib.import_module("mlflow.utils.validation")
        limit = getattr(validation, "MAX_PARAM_VAL_LENGTH", 6000)
        batch = getattr(validation, "MAX_PARAMS_TAGS_PER_BATCH", 100)
        items = []
        for key, value in values.items():
            if len(str(value)) > limit:
                _warn_once(f"mlflow: parameter {key!r} is longer than {limit} characters; not logged")
            else:
                items.append((key, value))
        for start in range(0, len(items), batch):  # mlflow takes at most `batch` params per call
            mlflow.log_params(dict(items[start:start + batch]))

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        mlflow = _require("mlflow")
        metrics = {}
        for key, value in values.items():
            number = _as_number(value)
            if number is None:
                _warn_skipped("mlflow", key, value)
            else:
                metrics[key] = number
        mlflow.log_metrics(metrics, step=step, **kwargs)

    @on_main_process
    def log_figure(self, figure: Any, artifact_file: str, **save_kwargs: Any) -> None:
        """A matplotlib/plotly figure as a run artifact (`mlflow.log_figure`)."""
        _require("mlflow").log_figure(
            figure=figure, artifact_file=artifact_file, **save_kwargs)

    @on_main_process
    def log_artifacts(self, local_dir: str, artifact_path: str | None = None) -> None:
        """Every file of `local_dir` as run artifacts (`mlflow.log_artifacts`)."""
        _require("mlflow").log_artifacts(
            local_dir=local_dir, artifact_path=artifact_path)

    @on_main_process
    def log_artifact(self, local_path: str, artifact_path: str | None = None) -> None:
        """One file as a run artifact (`mlflow.log_artifact`)."""
        _require("mlflow").log_artifact(
            local_path=local_path, artifact_path=artifact_path)

    @on_main_process
    def finish(self) -> None:
        mlflow = _require("mlflow")
        mlflow.end_run()


class ClearMLTracker(GeneralTracker):
    """ClearML: reuses `Task.current_task()` or calls `Task.init(project_name, task_name, **kwargs)`
    (CLEARML_PROJECT / CLEARML_TASK take priority). With a step, values are scalars whose title/series come
    from an `eval_`/`test_`/`train_` prefix; without one, single values."""

    name = "clearml"
    requires_logging_directory = False

    def __init__(self, run_name: str | None = None, **kwargs: Any) -> None:
        super().__init__()
        self.user_provided_run_name, self.init_kwargs, self.task = run_name, kwargs, None
        self._initialized_externally = False

    @on_main_process
    def start(self) -> None:
        clearml = _require("clearml")
        current = clearml.Task.current_task()
        if current:
            self.task, self._initialized_externally = current, True
            return
        arguments = dict(self.init_kwargs)
        arguments.setdefault("project_name", os.environ.get("CLEARML_PROJECT", self.user_provided_run_name))
        arguments.setdefault("task_name", os.environ.get("CLEARML_TASK", self.user_provided_run_name))
        self.task = clearml.Task.init(**arguments)

    @property
    def tracker(self) -> Any:
        return self.task

    @on_main_process
    def store_init_configuration(self, values: dict) -> Any:
        return self.task.connect_configuration(values)

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        report = self.task.get_logger()
        for key, value in values.items():
            number = _as_number(value)
            if number is None:
                _warn_skipped("clearml", key, value)
                continue
            if step is None:
                report.report_single_value(name=key, value=number, **kwargs)
                continue
            title, series = self._get_title_series(key)
            report.report_scalar(title=title, series=series, value=number, iteration=step, **kwargs)

    @on_main_process
    def log_images(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        """`values`: name -> image (array or PIL image), each through `Logger.report_image`."""
        report = self.task.get_logger()
        for key, image in values.items():
            title, series = self._get_title_series(key)
            report.report_image(title=title, series=series, iteration=step, image=image, **kwargs)

    @on_main_process
    def log_table(self, table_name: str, columns: list[str] | None = None, data: list | None = None,
                  dataframe: Any = None, step: int | None = None, **kwargs: Any) -> None:
        """A table through `Logger.report_table`: a pandas `dataframe`, or `data` rows (headed by `columns`)."""
        if dataframe is None and data is None:
            raise ValueError("ClearMLTracker.log_table needs `data` (rows) when no `dataframe` is given.")
        table = dataframe if dataframe is not None else ([columns, *data] if columns else data)
        title, series = self._get_title_series(table_name)
        self.task.get_logger().report_table(title=title, series=series, table_plot=table, iteration=step, **kwargs)

    @on_main_process
    def finish(self) -> None:
        if self.task is not None and not self._initialized_externally:
            self.task.close()

    @staticmethod
    def _get_title_series(name: str) -> tuple[str, str]:
        """ClearML's (title, series) for a value name: an `eval_`/`test_`/`train_` prefix is the series."""
        for prefix in ("eval", "test", "train"):
            if name.startswith(prefix + "_"):
                return name[len(prefix) + 1:], prefix
        return name, "train"


class DVCLiveTracker(GeneralTracker):
    """DVCLive: a `dvclive.Live(**kwargs)` (or the `live` object given); metrics with `log_metric`,
    steps with `live.step` / `next_step()`."""

    name = "dvclive"
    requires_logging_directory = False

    def __init__(self, run_name: str | None = None, live: Any | None = None, **kwargs: Any) -> None:
        super().__init__()
        self.run_name, self.live, self.init_kwargs = run_name, live, kwargs

    @on_main_process
    def start(self) -> None:
        if self.live is None:
            dvclive = _require("dvclive")
            self.live = dvclive.Live(**self.init_kwargs)

    @property
    def tracker(self) -> Any:
        return self.live

    @on_main_process
    def store_init_configuration(self, values: dict) -> None:
        self.live.log_params(values)

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        if step is not None:
            self.live.step = step
        for key, value in values.items():
            number = _as_number(value)
            if number is None:
                _warn_skipped("dvclive", key, value)
                continue
            self.live.log_metric(key, number, **kwargs)
        self.live.next_step()

    @on_main_process
    def finish(self) -> None:
        self.live.end()


class SwanLabTracker(_ProjectRunTracker):
    """SwanLab: `swanlab.init(project=run_name, **kwargs)`; config through `swanlab.config.update`."""

    name = _library = "swanlab"

    @on_main_process
    def store_init_configuration(self, values: dict) -> None:
        swanlab = _require("swanlab")
        swanlab.config.update(values)

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        swanlab = _require("swanlab")
        swanlab.log(values, step=step, **kwargs)

    @on_main_process
    def finish(self) -> None:
        swanlab = _require("swanlab")
        swanlab.finish()


# ------------------------------------------------------------------------------- registry & choice
LOGGER_TYPE_TO_CLASS: dict[str, type[GeneralTracker]] = {
    "aim": AimTracker, "comet_ml": CometMLTracker, "mlflow": MLflowTracker, "tensorboard": TensorBoardTracker,
    "wandb": WandBTracker, "clearml": ClearMLTracker, "dvclive": DVCLiveTracker, "swanlab": SwanLabTracker,
    "trackio": TrackioTracker, JSONL: JSONLTracker,
}

# name -> (import name checked, what to install)
_REQUIREMENTS: dict[str, tuple[str | None, str]] = {
    "tensorboard": ("tensorboard", "pip install nbaccel[tensorboard]"),
    "wandb": ("wandb", "pip install wandb"),
    "trackio": ("trackio", "pip install trackio"),
    "comet_ml": ("comet_ml", "pip install comet-ml"),
    "mlflow": ("mlflow", "pip install mlflow"),
    "aim": ("aim", "pip install aim"),
    "clearml": ("clearml", "pip install clearml"),
    "dvclive": ("dvclive", "pip install dvclive"),
    "swanlab": ("swanlab", "pip install swanlab"),
    JSONL: (None, ""),
}


def _library_installed(name: str) -> bool:
    module, _ = _REQUIREMENTS.get(name, (None, ""))
    if module is None:
        return True
    if name == "tensorboard" and importlib.util.find_spec("tensorboardX") is not None:
        return True
    return importlib.util.find_spec(module) is not None


# What `log_with="all"` starts, in Accelerate's order; nbaccel's own "jsonl" only when named (an Accelerate
# script asking for "all" gets no file it would not get there)
_ALL_BUILT_IN = ("tensorboard", "wandb", "comet_ml", "aim", "mlflow", "clearml", "dvclive", "swanlab", "trackio")


def get_available_trackers() -> list[LoggerType]:
    """The trackers `log_with="all"` starts here, as Accelerate's: its built-ins whose library is installed, in
    its order, as `LoggerType` members. Classes registered with `register_tracker_class` are used when named,
    not by "all" (as in Accelerate)."""
    return [LoggerType(name) for name in _ALL_BUILT_IN if _library_installed(name)]


def register_tracker_class(tracker_class: type[GeneralTracker]) -> None:
    """Make a `GeneralTracker` subclass usable by its `name` in `log_with` (constructed as
    `cls(project_name, logging_dir, **init_kwargs)` if it requires a logging directory, else
    `cls(project_name, **init_kwargs)`)."""
    if not (isinstance(tracker_class, type) and issubclass(tracker_class, GeneralTracker)):
        raise ValueError(f"`tracker_class` must be a subclass of GeneralTracker, got {tracker_class!r}.")
    if not getattr(tracker_class, "name", None):
        raise ValueError("The tracker class to register must define a non-empty `name` attribute.")
    if not hasattr(tracker_class, "requires_logging_directory"):
        raise ValueError("The tracker class to register must define `requires_logging_directory` (True/False).")
    if tracker_class.name in LOGGER_TYPE_TO_CLASS:
        warnings.warn(f"Tracker {tracker_class.name!r} is already registered; {tracker_class} replaces it.",
                      stacklevel=2)
    LOGGER_TYPE_TO_CLASS[str(tracker_class.name)] = tracker_class


def _built_in_as_enum(name: str) -> str | LoggerType:
    """Accelerate's built-in tracker names as `LoggerType` members (what its `filter_trackers` returns); nbaccel's
    "jsonl" and registered classes' names as they are."""
    return LoggerType(name) if name in {member.value for member in LoggerType} else name


def filter_trackers(
    log_with: str | LoggerType | GeneralTracker | Iterable[str | LoggerType | GeneralTracker] | None,
    logging_dir: str | os.PathLike | None = None,
) -> list[str | GeneralTracker]:
    """Check `log_with` and return the trackers to start: built-in ones as `LoggerType` members (as Accelerate's
    function returns them), other names as str, and `GeneralTracker` instances.

    - `"all"`: the instances listed beside it, then every available built-in tracker (those needing a
      directory only when `logging_dir` is given), in Accelerate's order, then the other names listed beside it
      (which Accelerate drops);
    - a name: ValueError if unknown (listing the choices), ImportError naming the package to install if
      its library is missing, ValueError if it needs `logging_dir` and none is given;
    - repeats are dropped.
    """
    if log_with is None:
        return []
    if isinstance(log_with, str | GeneralTracker) or not isinstance(log_with, Iterable):
        log_with = [log_with]
    entries = list(log_with)
    chosen: list[str | GeneralTracker] = []

    def add(item: str | GeneralTracker) -> None:
        if all(item is not seen and item != seen for seen in chosen):
            chosen.append(item)

    wants_all = any(isinstance(e, str) and str(e).lower() == LoggerType.ALL.value for e in entries)
    for entry in entries:
        if isinstance(entry, GeneralTracker):
            add(entry)
            continue
        # ValueError, not TypeError, for entries of the wrong kind: Accelerate raises ValueError for any entry
        # it cannot use, and code written for it catches that
        if isinstance(entry, type) and issubclass(entry, GeneralTracker):
            raise ValueError(
                f"log_with got the class {entry.__name__}; pass an instance ({entry.__name__}(...)) or "
                "register it with register_tracker_class and pass its name."
            )
        if not isinstance(entry, str):
            raise ValueError(f"log_with entries must be tracker names or GeneralTracker instances, got {entry!r}.")
        name = str(entry.value if isinstance(entry, LoggerType) else entry)
        if name not in LOGGER_TYPE_TO_CLASS:  # a registered class's own spelling first, then any case
            name = name.lower()
        if name == LoggerType.ALL.value:
            continue
        if name not in LOGGER_TYPE_TO_CLASS:
            raise ValueError(
                f"Unsupported tracker {entry!r} in log_with. Choose from {['all', *LOGGER_TYPE_TO_CLASS]} or "
                "pass a GeneralTracker instance."
            )
        if not _library_installed(name):
            module, install = _REQUIREMENTS[name]
            raise ImportError(
                f"log_with={entry!r} needs the `{module}` package, which is not installed: run `{install}`, "
                f"or remove {entry!r} from log_with."
            )
        if LOGGER_TYPE_TO_CLASS[name].requires_logging_directory and logging_dir is None:
            raise ValueError(
                f"Logging with `{name}` requires a `logging_dir`: pass Accelerator(project_dir=...) or "
                "ProjectConfiguration(logging_dir=...)."
            )
        add(_built_in_as_enum(name))
    if wants_all:  # Accelerate's order: the instances, then its built-ins; then the other names given
        named = [item for item in chosen if isinstance(item, str)]
        chosen[:] = [item for item in chosen if not isinstance(item, str)]
        for member in get_available_trackers():
            name = member.value
            if LOGGER_TYPE_TO_CLASS[name].requires_logging_directory and logging_dir is None:
                logger.warning("log_with='all': skipping %r, which needs a logging directory", name)
                continue
            add(member)
        for name in named:
            add(name)
    return chosen


def init_trackers(
    log_with: Iterable[str | GeneralTracker],
    project_name: str,
    *,
    logging_dir: str | os.PathLike | None = None,
    config: dict | None = None,
    init_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[GeneralTracker]:
    """Build (from `filter_trackers`' result), start, and configure the trackers; what
    `Accelerator.init_trackers` does on the main process. `init_kwargs[name]` goes to tracker `name`."""
    if config is not None and not isinstance(config, Mapping):
        # before any run starts; Accelerate's trackers each fail their own way (TypeError, AttributeError)
        raise TypeError(f"init_trackers(config=...) takes a dict of name -> value, got {type(config).__name__}.")
    init_kwargs = dict(init_kwargs or {})
    trackers: list[GeneralTracker] = []
    for entry in log_with:
        if isinstance(entry, GeneralTracker):
            trackers.append(entry)
            continue
        tracker_class = LOGGER_TYPE_TO_CLASS[str(entry)]
        options = dict(init_kwargs.get(str(entry), {}))
        if tracker_class.requires_logging_directory:
            trackers.append(tracker_class(project_name, logging_dir, **options))
        else:
            trackers.append(tracker_class(project_name, **options))
    _start_all(trackers)
    if config is not None:
        for tracker in trackers:
            tracker.store_init_configuration(config)
    return trackers


def _start_all(trackers: list[GeneralTracker]) -> None:
    """Start each tracker; if one fails, finish those already started (a W&B or MLflow run left open would stay
    "running") and raise its error."""
    for index, tracker in enumerate(trackers):
        try:
            tracker.start()
        except BaseException:
            try:
                finish_trackers(trackers[:index])
            except Exception as error:  # noqa: BLE001 - the start failure is the error to report
                logger.error("Finishing the trackers started before the failure failed too: %s", error)
            raise


def log_to_trackers(
    trackers: Iterable[GeneralTracker],
    values: dict,
    step: int | None = None,
    log_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
) -> None:
    """`Accelerator.log`: every tracker logs `values` (with `log_kwargs[tracker.name]`), and the numbers go
    to `nbaccel.telemetry` for the live dashboard (a no-op outside a launcher)."""
    if not isinstance(values, Mapping):
        raise TypeError(f"log() takes a dict of name -> value, got {type(values).__name__}.")
    log_kwargs = log_kwargs or {}
    for tracker in trackers:
        tracker.log(values, step=step, **dict(log_kwargs.get(tracker.name, {})))
    telemetry.log_metrics(dict(values), step)


def finish_trackers(trackers: Iterable[GeneralTracker]) -> None:
    """`Accelerator.end_training`: finish every tracker, even if one of them fails (the first error is
    raised after all were tried)."""
    first_error: BaseException | None = None
    for tracker in trackers:
        try:
            tracker.finish()
        except Exception as error:  # noqa: BLE001 - finish the others first
            logger.error("Finishing tracker %r failed: %s", getattr(tracker, "name", tracker), error)
            first_error = first_error or error
    if first_error is not None:
        raise first_error


def get_tracker(trackers: list[GeneralTracker], name: str, unwrap: bool = False) -> Any:
    """`Accelerator.get_tracker`: the tracker called `name` (its `.tracker` with `unwrap=True`); with no
    trackers (non-main processes) a blank GeneralTracker whose methods do nothing."""
    if not trackers:
        return GeneralTracker(_blank=True)
    for tracker in trackers:
        if tracker.name == name:
            return tracker.tracker if unwrap else tracker
    raise ValueError(f"{name} is not an available tracker stored inside the Accelerator: "
                     f"{[t.name for t in trackers]}.")
