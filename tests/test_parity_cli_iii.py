"""The command-line differences Accelerate's own unit tests (test_cli.py, renamed) found (issue 33): each runs the
same call on Accelerate 1.15 and on nbaccel and compares. Config files are written here, with the keys
Accelerate's test configs have."""

from __future__ import annotations

import contextlib
import io
import logging
from pathlib import Path

import pytest

pytest.importorskip("accelerate", reason="parity tests compare with Accelerate 1.15 (a dev dependency)")
pytestmark = pytest.mark.timeout(300)

LIBRARIES = ("accelerate", "nbaccel")


def _module(lib: str, name: str):
    import importlib

    return importlib.import_module(f"{lib}.{name}")


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


INVALID_KEYS = """compute_environment: LOCAL_MACHINE
distributed_type: 'NO'
mixed_precision: 'no'
num_processes: 1
use_cpu: true
invalid_key: "invalid_value"
another_invalid_key: "another_invalid_value"
"""

SAGEMAKER_0_30 = """compute_environment: AMAZON_SAGEMAKER
debug: false
distributed_type: NO
mixed_precision: fp16
use_cpu: false
ec2_instance_type: MY_TYPE
iam_role_name: MY_ROLE
"""

VALIDATE = """compute_environment: LOCAL_MACHINE
debug: true
num_processes: 1
distributed_type: 'NO'
fsdp_config:
  fsdp_sync_module_states: false
deepspeed_config:
  deepspeed_config_file: path/to/be/ignored
"""

TPU = """compute_environment: LOCAL_MACHINE
distributed_type: 'NO'
mixed_precision: 'no'
use_cpu: false
tpu_name: test-tpu
tpu_zone: us-central1-a
commands:
- echo "hello world"
"""


@pytest.mark.parametrize("lib", LIBRARIES)
def test_launch_refuses_a_config_with_unknown_keys(lib, tmp_path):
    launch = _module(lib, "commands.launch")
    config = _write(tmp_path / "invalid_keys.yaml", INVALID_KEYS)
    args = launch.launch_command_parser().parse_args(["--config_file", config, "script_never_written.py"])
    with pytest.raises(ValueError, match=r"had unknown keys \(.*another_invalid_key.*invalid_key") as caught:
        launch.launch_command(args)
    assert type(caught.value).__name__ in ("ValueError", "UnknownConfigKeys")
    loader = _module(lib, "commands.config.config_args").load_config_from_file
    with pytest.raises(ValueError, match="had unknown keys"):
        loader(config)


def test_the_nbaccel_command_line_says_it_in_one_line(tmp_path, capsys):
    from nbaccel.commands.main import main

    config = _write(tmp_path / "invalid_keys.yaml", INVALID_KEYS)
    with pytest.raises(SystemExit) as exited:
        main(["launch", "--config_file", config, "script.py"])
    assert exited.value.code == 2
    assert "had unknown keys ('another_invalid_key', 'invalid_key')" in capsys.readouterr().err


@pytest.mark.parametrize("lib", LIBRARIES)
def test_validate_launch_command_checks_options_only(lib, tmp_path):
    """The script need not exist yet; the config's fsdp_config and deepspeed_config keys fill the options, a
    command-line value wins."""
    launch = _module(lib, "commands.launch")
    args = launch.launch_command_parser().parse_args(
        ["--num-processes", "2", "--deepspeed_config_file", "path/to/be/accepted",
         "--config-file", _write(tmp_path / "validate.yaml", VALIDATE), "test_not_written_yet.py"])
    assert not args.debug and args.fsdp_sync_module_states in (True, "true")
    launch._validate_launch_command(args)
    assert args.debug is True and args.num_processes == 2
    assert args.fsdp_sync_module_states is False
    assert args.deepspeed_config_file == "path/to/be/accepted"


def test_a_launch_still_refuses_a_missing_script(tmp_path):
    from nbaccel.commands.launch import (
        LaunchOptionError,
        _run,
        _validate_launch_command,
        launch_command_parser,
    )

    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(["--cpu", str(tmp_path / "no.py")]))
    with pytest.raises(LaunchOptionError, match="not found"):
        _run(args)


@pytest.mark.parametrize("lib", LIBRARIES)
def test_the_sagemaker_config_of_0_30_loads(lib, tmp_path):
    """`distributed_type: NO` unquoted is YAML's false; Accelerate reads the file, and so does nbaccel."""
    config_args = _module(lib, "commands.config.config_args")
    config = config_args.load_config_from_file(_write(tmp_path / "0_30_0_sagemaker.yaml", SAGEMAKER_0_30))
    assert type(config).__name__ == "SageMakerConfig"
    assert (config.ec2_instance_type, config.iam_role_name, config.mixed_precision) == ("MY_TYPE", "MY_ROLE", "fp16")


@pytest.mark.parametrize("lib", LIBRARIES)
def test_a_loaded_config_writes_itself_with_to_yaml_file(lib, tmp_path):
    config_args = _module(lib, "commands.config.config_args")
    source = _write(tmp_path / "multi_cpu.yaml", "compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\n"
                    "num_processes: 2\nmixed_precision: 'no'\nuse_cpu: true\nnum_machines: 1\nmachine_rank: 0\n")
    config = config_args.load_config_from_file(source)
    config.to_yaml_file(str(tmp_path / "copy.yaml"))
    again = config_args.load_config_from_file(str(tmp_path / "copy.yaml"))
    assert (again.num_processes, str(again.distributed_type).split(".")[-1], again.use_cpu) == (2, "MULTI_CPU", True)


def _tpu_output(lib: str, argv: list[str]) -> str:
    tpu = _module(lib, "commands.tpu")
    args = tpu.tpu_command_parser().parse_args(argv)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        tpu.tpu_command_launcher(args)
    return out.getvalue().replace(lib, "LIBRARY")


@pytest.mark.parametrize("version", [None, "12.0.0"])
def test_tpu_config_installs_the_package_with_accelerates_command(tmp_path, version):
    config = _write(tmp_path / "tpu.yaml", TPU)
    argv = ["--config_file", config, "--install_accelerate", "--debug"]
    argv += ["--accelerate_version", version] if version else []
    theirs, ours = (_tpu_output(lib, argv) for lib in LIBRARIES)
    expected = "pip install LIBRARY -U" if version is None else "pip install LIBRARY==12.0.0"
    assert expected in theirs
    assert expected in ours


@pytest.mark.parametrize("lib", LIBRARIES)
def test_to_fsdp2_on_a_config_already_at_fsdp2(lib, tmp_path, caplog):
    to_fsdp2 = _module(lib, "commands.to_fsdp2")
    config = tmp_path / "fsdp2.yaml"
    config.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n")
    args = to_fsdp2.to_fsdp2_command_parser().parse_args(
        ["--config_file", str(config), "--output_file", str(tmp_path / "out.yaml")])
    with caplog.at_level(logging.WARNING):
        to_fsdp2.to_fsdp2_command(args)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings and warnings[0] == "Config already specifies FSDP2, skipping conversion..."
