"""config_widget(): load the current values, validate next to the field, save the YAML `nbaccel config` writes."""

from __future__ import annotations

import pytest
import yaml

config_file = pytest.importorskip(
    "nbaccel.utils.config_file", reason="nbaccel.utils.config_file (branch `config`) is not in this tree yet"
)

from nbaccel.notebook import config_widget  # noqa: E402


@pytest.fixture
def config_path(tmp_path, monkeypatch):
    path = tmp_path / "default_config.yaml"
    monkeypatch.setenv("NBACCEL_CONFIG_FILE", str(path))
    return path


def test_loads_current_values(config_path):
    config_file.LaunchConfig(num_processes=4, mixed_precision="bf16", use_cpu=True,
                             dynamo_config={"dynamo_backend": "INDUCTOR"}).save(config_path)
    form = config_widget()
    assert form.target == config_path
    assert form.fields["num_processes"].value == "4"
    assert form.fields["mixed_precision"].value == "bf16"
    assert form.fields["dynamo_backend"].value == "INDUCTOR"
    assert form.fields["use_cpu"].value is True
    assert form.fields["start_method"].value == "auto"


def test_save_writes_the_config_file_yaml(config_path):
    form = config_widget()
    form.fields["num_processes"].value = "3"
    form.fields["mixed_precision"].value = "fp16"
    form.fields["main_process_port"].value = "29555"
    form.save_button.click()
    data = yaml.safe_load(config_path.read_text())
    assert data["num_processes"] == 3 and data["mixed_precision"] == "fp16" and data["main_process_port"] == 29555
    assert "saved to" in form.status.value
    loaded = config_file.load_config(config_path)  # what `nbaccel launch` reads back
    assert loaded.num_processes == 3 and loaded.mixed_precision == "fp16"


def test_distributed_type_follows_the_process_count(config_path):
    form = config_widget()
    form.fields["num_processes"].value = "2"
    form.fields["use_cpu"].value = True
    form.save_button.click()
    assert yaml.safe_load(config_path.read_text())["distributed_type"] == "MULTI_CPU"
    form.fields["num_processes"].value = "1"
    form.save_button.click()
    assert yaml.safe_load(config_path.read_text())["distributed_type"] == "NO"
    config_file.LaunchConfig(distributed_type="FSDP", num_processes=2).save(config_path)
    form = config_widget()
    form.fields["num_processes"].value = "4"
    form.save_button.click()
    assert yaml.safe_load(config_path.read_text())["distributed_type"] == "FSDP"  # not the form's to change


def test_bad_values_are_shown_next_to_their_field_and_nothing_is_written(config_path):
    form = config_widget()
    form.fields["num_processes"].value = "two"
    form.fields["main_process_port"].value = "70000"
    assert form.save() is None
    assert "not a whole number" in form.errors["num_processes"].value
    assert not config_path.exists()
    form.fields["num_processes"].value = "2"
    assert form.save() is None  # the port fails LaunchConfig.validate()
    assert form.errors["num_processes"].value == ""
    assert "70000" in form.errors["main_process_port"].value and "not saved" in form.status.value
    assert not config_path.exists()
    form.fields["num_machines"].value = "2"
    form.fields["machine_rank"].value = "1"
    form.fields["main_process_port"].value = ""
    assert form.save() is None and "needed when num_machines" in form.errors["main_process_ip"].value
    form.fields["main_process_ip"].value = "10.0.0.1"
    assert form.save() == config_path
    data = yaml.safe_load(config_path.read_text())
    assert data["num_machines"] == 2 and data["machine_rank"] == 1 and data["main_process_ip"] == "10.0.0.1"


def test_invalid_existing_file_is_reported_not_fatal(config_path):
    config_path.write_text("num_processes: [1, 2\n")
    form = config_widget()
    assert "could not read" in form.status.value
    form.fields["num_processes"].value = "2"
    assert form.save() == config_path
    assert yaml.safe_load(config_path.read_text())["num_processes"] == 2


def test_gradient_accumulation_and_start_method_round_trip(config_path):
    import warnings

    form = config_widget()
    form.fields["gradient_accumulation_steps"].value = "4"
    form.fields["start_method"].value = "spawn"
    form.fields["dynamo_backend"].value = "EAGER"
    assert form.save() == config_path
    data = yaml.safe_load(config_path.read_text())
    assert data["gradient_accumulation_steps"] == 4 and data["start_method"] == "spawn"
    assert data["dynamo_config"] == {"dynamo_backend": "EAGER"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # both are LaunchConfig fields: no "unknown key" warning
        again = config_widget()
    assert again.config.extra == {} and again.config.gradient_accumulation_steps == 4
    assert again.fields["gradient_accumulation_steps"].value == "4"
    assert again.fields["start_method"].value == "spawn"
    form.fields["gradient_accumulation_steps"].value = "0"
    assert form.save() is None and "must be at least 1" in form.errors["gradient_accumulation_steps"].value


def test_explicit_path_not_there_yet_starts_from_defaults(tmp_path):
    target = tmp_path / "sub" / "mine.yaml"
    form = config_widget(target)
    assert form.status.value == "" and form.target == target
    form.fields["num_processes"].value = "2"
    assert form.save() == target and yaml.safe_load(target.read_text())["num_processes"] == 2


def test_placeholders_help_and_a_warning_for_what_this_machine_cannot_run(config_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    form = config_widget()
    assert form.fields["main_process_ip"].placeholder == "e.g. 10.0.0.1"  # short enough to show whole
    assert all(form.fields[name].tooltip for name in form.fields)
    assert "machine with rank 0" in form.root.children[8].children[1].value  # the help beside the field
    form.fields["mixed_precision"].value = "bf16"
    assert form.save() == config_path  # saved (the file may be meant for another machine), with warnings
    assert "warning: this machine has no CUDA GPU" in form.status.value
    assert "mixed_precision=bf16 on the CPU" in form.status.value
    form.fields["use_cpu"].value = True
    form.fields["mixed_precision"].value = "no"
    form.save()
    assert "warning" not in form.status.value


def test_readable_fallback_for_a_notebook_shown_without_the_kernel(config_path):
    config_file.LaunchConfig(num_processes=2, use_cpu=True).save(config_path)
    bundle = config_widget()._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert "VBox(" not in bundle["text/plain"] and "num_processes: 2" in bundle["text/plain"]
    page = bundle["text/html"]
    assert "<td style='padding:2px 8px;border-bottom:1px solid #ddd;text-align:left;font-family:monospace'>2</td>" in page
    assert "Run this cell to edit" in page and str(config_path) in page


def test_displayed_as_the_form_and_a_table_kept_for_a_reopened_notebook(config_path):
    """The second output: the table, hidden by an inline style (kept by an untrusted notebook's sanitizer),
    and the stylesheet that shows it only in place of ipywidgets' error box (tests/test_browser.py)."""
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output

    config_file.LaunchConfig(num_processes=2, use_cpu=True).save(config_path)
    form = config_widget()
    shell = InteractiveShell.instance()
    try:
        with capture_output() as captured:
            shell.display_formatter.format(form)  # what a cell ending with config_widget() does
    finally:
        InteractiveShell.clear_instance()
    first, second = [output.data for output in captured.outputs]
    assert "application/vnd.jupyter.widget-view+json" in first and "nbaccel-config-fallback" in first["text/html"]
    assert set(second) == {"text/html"}
    page = second["text/html"]
    assert "<div class='nbaccel-config-saved' style='display:none'>" in page and "num_processes" in page
    assert page.startswith("<style>") and ".jp-OutputArea-output.jupyter-widgets" in page


def test_a_save_updates_what_the_notebook_keeps(config_path):
    """Both outputs carry display ids; a save updates them, so the saved notebook shows the saved values."""
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output

    config_file.LaunchConfig(num_processes=4, use_cpu=False).save(config_path)
    form = config_widget()
    shell = InteractiveShell.instance()
    try:
        with capture_output() as captured:
            shell.display_formatter.format(form)
            form.fields["num_processes"].value = "2"
            form.fields["use_cpu"].value = True
            assert form.save() == config_path
    finally:
        InteractiveShell.clear_instance()
    shown, updates = captured.outputs[:2], captured.outputs[2:]
    assert [output.update for output in shown] == [False, False] and [o.update for o in updates] == [True, True]
    ids = [output.transient["display_id"] for output in shown]
    assert [output.transient["display_id"] for output in updates] == ids
    assert "num_processes: 4" in shown[0].data["text/plain"]
    assert "num_processes: 2" in updates[0].data["text/plain"] and "use_cpu: True" in updates[0].data["text/plain"]
    assert "application/vnd.jupyter.widget-view+json" in updates[0].data  # the live form stays a widget
    assert ">2</td>" in updates[1].data["text/html"]
