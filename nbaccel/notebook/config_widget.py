"""`config_widget()`: edit and save the launch configuration from a notebook.

A form (ipywidgets) over the fields of `nbaccel.utils.config_file.LaunchConfig`, loaded from the config
file in use; Save validates with `LaunchConfig.validate()` and writes the same YAML as `nbaccel config`
(through `LaunchConfig.save`). A bad value is shown next to its field and nothing is written.
"""

from __future__ import annotations

import dataclasses
import html
import os
from pathlib import Path
from typing import Any

import ipywidgets as widgets

from ..utils import constants
from ..utils.dataclasses import enum_value

START_METHODS = ("auto", *constants.START_METHODS)
MIXED_PRECISION = ("no", "fp16", "bf16", "fp8")
# Form fields not in LaunchConfig's dataclass would be kept in its `extra` mapping, written to the YAML.
_INT_FIELDS = {  # name: (minimum, may be empty)
    "num_processes": (1, True),
    "gradient_accumulation_steps": (1, True),
    "num_machines": (1, False),
    "machine_rank": (0, False),
    "main_process_port": (1, True),
}


def _config_module():
    try:
        from ..utils import config_file
    except ImportError as error:  # pragma: no cover - only before the config module exists
        raise ImportError("config_widget needs nbaccel.utils.config_file (the launch configuration file)") from error
    return config_file


class ConfigWidget:
    """The form; display it in a notebook. `fields` maps a config key to its input widget, `errors` to the
    label shown next to it; `save()` is what the Save button runs (returns the path written, or None)."""

    def __init__(self, path: str | os.PathLike | None = None):
        config_file = _config_module()
        self._config_file = config_file
        self.path = Path(path).expanduser() if path is not None else None
        self.load_error: str | None = None
        try:  # a path that does not exist yet is where the form will save: start from the defaults
            config = None if self.path is not None and not self.path.exists() else config_file.load_config(self.path)
        except (ValueError, OSError) as error:  # an unreadable or invalid file: start from defaults, say why
            self.load_error = str(error)
            config = None
        self.config = config if config is not None else config_file.LaunchConfig()
        self.target = self.path or (self.config.path if config is not None else None) or config_file.default_config_file()
        self.fields, self.errors = self._build_fields()
        self.status = widgets.HTML()
        self.save_button = widgets.Button(description="Save", button_style="primary", icon="save")
        self.save_button.on_click(lambda _button: self.save())
        rows = [widgets.HBox([widget, self.errors[name]]) for name, widget in self.fields.items()]
        heading = widgets.HTML(
            f"<b>nbaccel launch configuration</b> · <code>{html.escape(str(self.target))}</code>"
        )
        self.root = widgets.VBox([heading, *rows, widgets.HBox([self.save_button, self.status])])
        self.root.add_class("nbaccel-config")
        if self.load_error:
            self.status.value = _message(f"could not read the current file: {self.load_error}", error=True)

    # --- the form --------------------------------------------------------------------------------------

    def _value(self, name: str) -> Any:
        if name == "dynamo_backend":
            return str((self.config.dynamo_config or {}).get("dynamo_backend", "NO")).upper()
        if _is_field(self.config, name):
            return getattr(self.config, name)
        return self.config.extra.get(name)

    def _build_fields(self) -> tuple[dict[str, widgets.Widget], dict[str, widgets.HTML]]:
        style = {"description_width": "200px"}
        layout = widgets.Layout(width="420px")
        fields: dict[str, widgets.Widget] = {}

        def text(name: str, placeholder: str = "") -> None:
            value = self._value(name)
            fields[name] = widgets.Text(value="" if value is None else str(value), description=name,
                                        placeholder=placeholder, style=style, layout=layout)

        def choice(name: str, options, default: str) -> None:
            value = self._value(name)
            value = default if value in (None, "") else str(value)
            options = list(options) + ([value] if value not in options else [])
            fields[name] = widgets.Dropdown(options=options, value=value, description=name, style=style,
                                            layout=layout)

        text("num_processes", "all devices (empty)")
        choice("mixed_precision", MIXED_PRECISION, "no")
        text("gradient_accumulation_steps", "1")
        choice("dynamo_backend", _dynamo_backends(), "NO")
        choice("start_method", START_METHODS, "auto")
        text("num_machines")
        text("machine_rank")
        text("main_process_ip", "address of the machine with rank 0")
        text("main_process_port", "a free port (empty)")
        fields["use_cpu"] = widgets.Checkbox(value=bool(self._value("use_cpu")), description="use_cpu",
                                             style=style, layout=layout, indent=True)
        for name, widget in fields.items():
            widget.add_class(f"nbaccel-config-{name}")
        errors = {name: widgets.HTML(value="", layout=widgets.Layout(margin="0 0 0 8px")) for name in fields}
        for name, label in errors.items():
            label.add_class(f"nbaccel-config-error-{name}")
        return fields, errors

    # --- saving ----------------------------------------------------------------------------------------

    def values(self) -> tuple[dict[str, Any], dict[str, str]]:
        """The form's values parsed ({config key: value}) and the parse errors ({key: message})."""
        values: dict[str, Any] = {}
        errors: dict[str, str] = {}
        for name, widget in self.fields.items():
            raw = widget.value
            if name in _INT_FIELDS:
                minimum, optional = _INT_FIELDS[name]
                raw = str(raw).strip()
                if not raw and optional:
                    values[name] = None
                    continue
                try:
                    number = int(raw)
                except ValueError:
                    errors[name] = f"{raw!r} is not a whole number" if raw else "required"
                    continue
                if number < minimum:
                    errors[name] = f"must be at least {minimum}"
                    continue
                values[name] = number
            elif name == "main_process_ip":
                values[name] = str(raw).strip() or None
            elif name == "start_method":
                values[name] = None if raw == "auto" else raw
            else:
                values[name] = raw
        return values, errors

    def save(self) -> Path | None:
        """Validate the form and write the YAML; on a bad value show it next to its field and write nothing."""
        values, errors = self.values()
        candidate = None
        if not errors:
            candidate = self._apply(values)
            for key, message in candidate.validate().items():
                name = "dynamo_backend" if key == "dynamo_config.dynamo_backend" else key
                errors[name if name in self.fields else key] = message
        for name, label in self.errors.items():
            label.value = _message(errors[name], error=True) if name in errors else ""
        if errors:
            others = [f"{key}: {message}" for key, message in errors.items() if key not in self.fields]
            self.status.value = _message("not saved: " + ("; ".join(others) if others else "fix the fields marked"),
                                         error=True)
            return None
        try:
            written = candidate.save(self.target)
        except (ValueError, OSError) as error:
            self.status.value = _message(f"not saved: {error}", error=True)
            return None
        self.config = candidate
        self.status.value = _message(f"saved to {written}")
        return written

    def _apply(self, values: dict[str, Any]):
        config = dataclasses.replace(self.config, extra=dict(self.config.extra),
                                     dynamo_config=dict(self.config.dynamo_config or {}))
        for name, value in values.items():
            if name == "dynamo_backend":
                if value == "NO":
                    config.dynamo_config.pop("dynamo_backend", None)
                else:
                    config.dynamo_config["dynamo_backend"] = value
            elif _is_field(config, name):
                setattr(config, name, value)
            elif value is None:
                config.extra.pop(name, None)
            else:
                config.extra[name] = value
        _follow_process_count(config)
        return config

    # --- display ---------------------------------------------------------------------------------------

    def _repr_mimebundle_(self, **kwargs):
        return self.root._repr_mimebundle_(**kwargs)


_PLAIN_TYPES = ("NO", "MULTI_CPU", "MULTI_GPU")  # what the form's fields decide; FSDP, DeepSpeed, ... are kept


def _follow_process_count(config: Any) -> None:
    """distributed_type as `nbaccel config` would write it for the form's process count and use_cpu: NO for
    one process on one machine, MULTI_CPU with use_cpu or without CUDA, else MULTI_GPU."""
    if enum_value(config.distributed_type) not in _PLAIN_TYPES or config.num_processes is None:
        return
    if config.num_processes <= 1 and (config.num_machines or 1) <= 1:
        config.distributed_type = "NO"
        return
    import torch

    config.distributed_type = "MULTI_CPU" if config.use_cpu or not torch.cuda.is_available() else "MULTI_GPU"


def config_widget(path: str | os.PathLike | None = None) -> ConfigWidget:
    """A form to edit the launch configuration (the file `nbaccel config` writes); display it in a cell."""
    return ConfigWidget(path)


def _is_field(config: Any, name: str) -> bool:
    return name in {f.name for f in dataclasses.fields(config)} and name not in ("extra", "path")


def _dynamo_backends() -> list[str]:
    try:
        from ..utils.dataclasses import DynamoBackend

        return list(DynamoBackend.list())
    except (ImportError, AttributeError):
        return ["NO", "EAGER", "AOT_EAGER", "INDUCTOR"]


def _message(text: str, *, error: bool = False) -> str:
    color = "#cf222e" if error else "#1a7f37"
    return f"<span style='color:{color}'>{html.escape(text)}</span>"
