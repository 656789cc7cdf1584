"""The launch config file: location, round trip, Accelerate's files, validation errors naming file and key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from nbaccel.utils import config_file as cf
from nbaccel.utils.config_file import (
    ConfigError,
    LaunchConfig,
    default_config_file,
    find_config_file,
    load_config,
)
from nbaccel.utils.other import write_basic_config


@pytest.fixture
def home(tmp_path, monkeypatch):
    """An empty home: no NBACCEL_CONFIG_FILE, caches under tmp_path."""
    monkeypatch.delenv("NBACCEL_CONFIG_FILE", raising=False)
    monkeypatch.delenv("HF_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    return tmp_path


def test_default_location_honours_env(home, monkeypatch):
    assert default_config_file() == home / "home" / ".cache" / "nbaccel" / "default_config.yaml"
    monkeypatch.setenv("XDG_CACHE_HOME", str(home / "xdg"))
    assert default_config_file() == home / "xdg" / "nbaccel" / "default_config.yaml"
    monkeypatch.setenv("NBACCEL_CONFIG_FILE", str(home / "mine.yaml"))
    assert default_config_file() == home / "mine.yaml"


def test_no_config_means_none(home):
    assert find_config_file() is None and load_config() is None


def test_round_trip(home):
    config = LaunchConfig(num_processes=4, num_machines=2, machine_rank=1, main_process_ip="10.0.0.1",
                          main_process_port=1234, mixed_precision="bf16", rdzv_backend="c10d",
                          fsdp_config={"fsdp_version": 2, "fsdp_state_dict_type": "FULL_STATE_DICT"},
                          dynamo_config={"dynamo_backend": "INDUCTOR"})
    path = config.save()
    assert path == default_config_file() and path.is_file()
    loaded = load_config()
    assert loaded == config and loaded.path == path
    assert yaml.safe_load(path.read_text())["main_process_ip"] == "10.0.0.1"


def test_reads_a_file_written_by_accelerate(home, monkeypatch):
    accelerate_default = pytest.importorskip("accelerate.commands.config.default")
    target = home / "accelerate.yaml"
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert accelerate_default.write_basic_config(mixed_precision="fp16", save_location=str(target))
    config = load_config(target)
    assert (config.mixed_precision, config.num_processes, config.use_cpu, config.distributed_type) == (
        "fp16", 1, True, "NO"
    )


def test_reads_hand_written_accelerate_multi_node_keys(home):
    path = home / "accel.yaml"
    path.write_text(
        "compute_environment: LOCAL_MACHINE\ndebug: false\ndistributed_type: MULTI_GPU\ndowncast_bf16: 'no'\n"
        "enable_cpu_affinity: false\ngpu_ids: all\nmachine_rank: 0\nmain_process_ip: 192.168.1.2\n"
        "main_process_port: 29500\nmain_training_function: main\nmixed_precision: bf16\nnum_machines: 2\n"
        "num_processes: 16\nrdzv_backend: c10d\nsame_network: false\ntpu_env: []\ntpu_use_cluster: false\n"
        "tpu_use_sudo: false\nuse_cpu: false\n"
        "fsdp_config:\n  fsdp_version: 2\n  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n"
        "  fsdp_state_dict_type: SHARDED_STATE_DICT\n"
        "dynamo_config:\n  dynamo_backend: INDUCTOR\n  dynamo_mode: default\n"
    )
    config = load_config(path)
    assert (config.num_processes, config.num_machines, config.rdzv_backend, config.same_network) == (16, 2, "c10d", False)
    assert config.fsdp_config["fsdp_version"] == 2 and config.dynamo_config["dynamo_backend"] == "INDUCTOR"


def test_old_accelerate_format_keys(home):
    path = home / "old.yaml"
    path.write_text("distributed_type: 'NO'\nfp16: true\ndynamo_backend: EAGER\n")
    config = load_config(path)
    assert config.mixed_precision == "fp16" and config.dynamo_config == {"dynamo_backend": "EAGER"}


def test_accelerate_location_is_the_fallback(home, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(home / "hf"))
    theirs = home / "hf" / "accelerate" / "default_config.yaml"
    theirs.parent.mkdir(parents=True)
    theirs.write_text(json.dumps({"distributed_type": "MULTI_CPU", "num_processes": 3, "use_cpu": True}))
    assert find_config_file() == theirs and load_config().num_processes == 3
    LaunchConfig(num_processes=2).save()  # nbaccel's own file wins once it exists
    assert find_config_file() == default_config_file() and load_config().num_processes == 2


def test_explicit_env_file_disables_fallback(home, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(home / "hf"))
    theirs = home / "hf" / "accelerate" / "default_config.yaml"
    theirs.parent.mkdir(parents=True)
    theirs.write_text("distributed_type: 'NO'\n")
    monkeypatch.setenv("NBACCEL_CONFIG_FILE", str(home / "absent.yaml"))
    assert load_config() is None


def test_invalid_value_names_file_and_key(home):
    path = Path(home) / "home" / ".cache" / "nbaccel" / "default_config.yaml"
    path.parent.mkdir(parents=True)
    path.write_text("distributed_type: 'NO'\nmixed_precision: fp13\nnum_processes: 2\n")
    with pytest.raises(ConfigError) as info:
        load_config()
    assert str(info.value) == (
        "~/.cache/nbaccel/default_config.yaml: mixed_precision: 'fp13' is not one of no, fp16, bf16, fp8"
    )


def test_several_errors_and_broken_yaml(home):
    path = home / "bad.yaml"
    path.write_text("num_processes: zero\nmain_process_port: 70000\nrdzv_backend: carrier-pigeon\n"
                    "fsdp_config:\n  fsdp_state_dict_type: HALF\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    for key in ("num_processes", "main_process_port", "rdzv_backend", "fsdp_config.fsdp_state_dict_type"):
        assert f"bad.yaml: {key}: " in message
    path.write_text("num_processes: [1\n")
    with pytest.raises(ConfigError, match="bad.yaml: not valid YAML"):
        load_config(path)
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(home / "missing.yaml")


def test_unknown_keys_warn_and_are_kept(home):
    path = home / "extra.yaml"
    path.write_text("distributed_type: 'NO'\nnum_processes: 1\nsome_future_key: 3\n")
    with pytest.warns(UserWarning, match="ignoring unknown key.*some_future_key"):
        config = load_config(path)
    config.save()
    assert yaml.safe_load(config.path.read_text())["some_future_key"] == 3


def test_validate_for_widgets():
    assert LaunchConfig().validate() == {}
    errors = LaunchConfig(num_machines=2, machine_rank=1, num_processes=0, gpu_ids="0,x").validate()
    assert set(errors) == {"num_processes", "main_process_ip", "gpu_ids"}
    with pytest.raises(ConfigError, match="machine_rank: 3 must be below num_machines"):
        LaunchConfig(machine_rank=3).save("/nonexistent/never-written.yaml")


def test_write_basic_config(home, capsys):
    path = write_basic_config(mixed_precision="bf16")
    assert path == default_config_file()
    config = load_config()
    assert config.mixed_precision == "bf16" and config.num_processes >= 1
    assert write_basic_config() is False and "will not override" in capsys.readouterr().out
    with pytest.raises(ValueError, match="`mixed_precision` must be one of no, fp16, bf16, fp8"):
        write_basic_config(mixed_precision="fp64", save_location=home / "x.yaml")


def test_display_path_uses_tilde(home):
    assert cf.display_path(Path.home() / "a" / "b.yaml") == "~/a/b.yaml"


def test_accelerate_unset_process_count(home):
    path = home / "slurm.yaml"
    path.write_text("distributed_type: MULTI_GPU\nnum_processes: -1\n")
    assert load_config(path).num_processes is None


def test_gradient_accumulation_steps_and_start_method_are_fields(home):
    import warnings

    path = home / "nb.yaml"
    path.write_text("distributed_type: 'NO'\ngradient_accumulation_steps: 4\nstart_method: spawn\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "ignoring unknown key(s)"
        config = load_config(path)
    assert (config.gradient_accumulation_steps, config.start_method, config.extra) == (4, "spawn", {})
    config.save()
    assert yaml.safe_load(path.read_text())["gradient_accumulation_steps"] == 4
    unset = LaunchConfig()
    assert unset.gradient_accumulation_steps is None and unset.start_method is None
    assert "start_method" not in unset.to_dict() and "gradient_accumulation_steps" not in unset.to_dict()
    errors = LaunchConfig(gradient_accumulation_steps=0, start_method="thread").validate()
    assert errors["gradient_accumulation_steps"] == "0 is not an integer >= 1"
    assert errors["start_method"] == "'thread' is not one of fork, spawn, forkserver (or unset)"
    path.write_text("gradient_accumulation_steps: two\n")
    with pytest.raises(ConfigError, match="nb.yaml: gradient_accumulation_steps: 'two' is not an integer >= 1"):
        load_config(path)
