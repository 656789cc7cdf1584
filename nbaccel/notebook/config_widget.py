"""`config_widget()`: edit and save the launch configuration from a notebook.

A form (ipywidgets) over the fields of `nbaccel.utils.config_file.LaunchConfig`, loaded from the config
file in use; Save validates with `LaunchConfig.validate()` and writes the same YAML as `nbaccel config`
(through `LaunchConfig.save`). A bad value is shown next to its field and nothing is written; a setting this
machine cannot run (a GPU setting without a GPU) is saved with a warning.

Displayed, the form also carries a text/html and a text/plain form of the configuration: a notebook
reopened without the running kernel (nbconvert's HTML, GitHub, VS Code, JupyterLab untrusted) shows the
values as a table and says to run the cell to edit them, instead of ipywidgets' `VBox(children=...)` repr.
Trusted JupyterLab always picks the widget view, and with no widget state saved (its default) ipywidgets
(jupyterlab_widgets 3.0) draws "Error displaying widget: model not found" instead of falling back. So a
second output follows the form: the same table, hidden by an inline style, and a stylesheet that hides the
form's output and shows the table only when the form's output is ipywidgets' error box (see `SAVED_VIEW_CSS`).
"""

from __future__ import annotations

import dataclasses
import html
import os
from pathlib import Path
from typing import Any

try:
    import ipywidgets as widgets
except ImportError as error:  # the form is a widget: without the extra there is nothing to edit with
    raise ImportError("config_widget() needs ipywidgets: pip install nbaccel[notebook] "
                      "(or edit the file with `nbaccel config`)") from error

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


HELP = {  # one line per field, shown beside it
    "num_processes": "processes per machine; empty: one per GPU (or 1 on CPU)",
    "mixed_precision": "no, fp16, bf16, or fp8 (recent GPUs with torchao)",
    "gradient_accumulation_steps": "batches per optimizer step; empty: 1",
    "dynamo_backend": "torch.compile backend; NO: not compiled",
    "start_method": "how notebook_launcher starts ranks; auto: fork in a notebook",
    "num_machines": "machines taking part in the run",
    "machine_rank": "this machine's index, 0 to num_machines - 1",
    "main_process_ip": "the machine with rank 0 (several machines only)",
    "main_process_port": "its port; empty: a free one",
    "use_cpu": "run on the CPU even where a GPU is present",
}
PLACEHOLDERS = {
    "num_processes": "one per device",
    "gradient_accumulation_steps": "1",
    "main_process_ip": "e.g. 10.0.0.1",
    "main_process_port": "a free port",
}


# For the second output (`ConfigWidget.saved_view_html`), applied where a stylesheet in an output is (trusted
# JupyterLab, nbconvert's HTML). ipywidgets' renderer adds the class `jupyter-widgets` to the output node only
# when it cannot draw the widget (a live view is a child node of its own): then that output is hidden and the
# table below it shown; otherwise the table's output row is hidden too, leaving no empty row under the form.
SAVED_VIEW_CSS = (
    ".jp-OutputArea-child:has(> .jp-OutputArea-output.jupyter-widgets)"
    ":has(+ .jp-OutputArea-child .nbaccel-config-saved) {display: none}"
    ".jp-OutputArea-child:has(> .jp-OutputArea-output.jupyter-widgets) + .jp-OutputArea-child"
    " .nbaccel-config-saved {display: block !important}"
    ".jp-OutputArea-child:not(:has(> .jp-OutputArea-output.jupyter-widgets)) + .jp-OutputArea-child"
    ":has(.nbaccel-config-saved) {display: none}"
)


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
        self._handles: list[tuple[Any, Any]] = []  # (form, saved table) display handles, one pair per display
        self.status = widgets.HTML()
        self.save_button = widgets.Button(description="Save", button_style="primary", icon="save")
        self.save_button.on_click(lambda _button: self.save())
        rows = [widgets.HBox([widget, _help_label(name), self.errors[name]]) for name, widget in self.fields.items()]
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
        layout = widgets.Layout(width="400px")
        fields: dict[str, widgets.Widget] = {}

        def text(name: str) -> None:
            value = self._value(name)
            fields[name] = widgets.Text(value="" if value is None else str(value), description=name,
                                        placeholder=PLACEHOLDERS.get(name, ""), style=style, layout=layout,
                                        tooltip=HELP[name])

        def choice(name: str, options, default: str) -> None:
            value = self._value(name)
            value = default if value in (None, "") else str(value)
            options = list(options) + ([value] if value not in options else [])
            fields[name] = widgets.Dropdown(options=options, value=value, description=name, style=style,
                                            layout=layout, tooltip=HELP[name])

        text("num_processes")
        choice("mixed_precision", MIXED_PRECISION, "no")
        text("gradient_accumulation_steps")
        choice("dynamo_backend", _dynamo_backends(), "NO")
        choice("start_method", START_METHODS, "auto")
        text("num_machines")
        text("machine_rank")
        text("main_process_ip")
        text("main_process_port")
        fields["use_cpu"] = widgets.Checkbox(value=bool(self._value("use_cpu")), description="use_cpu",
                                             style=style, layout=layout, indent=True, tooltip=HELP["use_cpu"])
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
        cautions = machine_warnings(candidate)
        self.status.value = _message(f"saved to {written}") + "".join(
            "<br>" + _message(f"warning: {caution}", warning=True) for caution in cautions)
        self._show_saved()
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
        data = self.root._repr_mimebundle_(**kwargs)
        data = dict(data[0] if isinstance(data, tuple) else data)
        data["text/html"] = self.fallback_html()
        data["text/plain"] = self.fallback_text()
        return data

    def _ipython_display_(self) -> None:
        """Two outputs: the form (with its fallbacks), then the table that replaces ipywidgets' error box in
        a trusted notebook reopened without widget state (module docstring)."""
        from IPython.display import display

        # display ids: a save updates both outputs, so the saved notebook shows what was saved last
        self._handles.append((display(self._repr_mimebundle_(), raw=True, display_id=True),
                              display({"text/html": self.saved_view_html()}, raw=True, display_id=True)))

    def _show_saved(self) -> None:
        """After a save: every place this form is displayed shows the saved values in its static forms."""
        for form, saved in self._handles:
            form.update(self._repr_mimebundle_(), raw=True)
            saved.update({"text/html": self.saved_view_html()}, raw=True)

    def saved_view_html(self) -> str:
        """The second output: hidden unless `SAVED_VIEW_CSS` finds the form's output to be an error box."""
        return (f"<style>{SAVED_VIEW_CSS}</style><div class='nbaccel-config-saved' style='display:none'>"
                f"{self.fallback_html(css_class='nbaccel-config-saved-table')}</div>")

    def shown_values(self) -> list[tuple[str, str]]:
        """(field, value as the form shows it) for every field; empty fields say what they mean."""
        shown = []
        for name, widget in self.fields.items():
            value = widget.value
            text = str(value) if value not in (None, "") else f"({PLACEHOLDERS.get(name, 'not set')})"
            shown.append((name, text))
        return shown

    def fallback_html(self, css_class: str = "nbaccel-config-fallback") -> str:
        """The configuration as a table, for a notebook shown without the running kernel."""
        cell = "padding:2px 8px;border-bottom:1px solid #ddd;text-align:left"
        rows = "".join(f"<tr><td style='{cell};font-weight:600'>{html.escape(name)}</td>"
                       f"<td style='{cell};font-family:monospace'>{html.escape(value)}</td></tr>"
                       for name, value in self.shown_values())
        return (f"<div class='{css_class}'><b>nbaccel launch configuration</b> · "
                f"<code>{html.escape(str(self.target))}</code><table style='border-collapse:collapse'>{rows}</table>"
                "<i>Run this cell to edit and save it (the form needs the running kernel).</i></div>")

    def fallback_text(self) -> str:
        lines = [f"nbaccel launch configuration ({self.target})"]
        lines += [f"  {name}: {value}" for name, value in self.shown_values()]
        lines.append("Run this cell to edit and save it (the form needs the running kernel).")
        return "\n".join(lines)


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


def machine_warnings(config: Any) -> list[str]:
    """Settings in `config` that this machine cannot run as they are (saved anyway: the file may be meant
    for another machine)."""
    import torch

    found = []
    precision = str(enum_value(config.mixed_precision) or "no")
    on_cpu = config.use_cpu or not torch.cuda.is_available()
    if not config.use_cpu and not torch.cuda.is_available():
        found.append("this machine has no CUDA GPU: the ranks will run on the CPU here (tick use_cpu to say so)")
    if on_cpu and precision == "fp8":
        found.append("mixed_precision=fp8 needs a recent GPU: it cannot run on the CPU")
    elif on_cpu and precision != "no":
        found.append(f"mixed_precision={precision} on the CPU runs under CPU autocast, often slower than no")
    return found


def _help_label(name: str) -> widgets.HTML:
    label = widgets.HTML(f"<span style='color:#666;font-size:12px'>{html.escape(HELP[name])}</span>",
                         layout=widgets.Layout(margin="0 0 0 8px"))
    label.add_class(f"nbaccel-config-help-{name}")
    return label


def _message(text: str, *, error: bool = False, warning: bool = False) -> str:
    color = "#cf222e" if error else "#9a6700" if warning else "#1a7f37"
    return f"<span style='color:{color}'>{html.escape(text)}</span>"
