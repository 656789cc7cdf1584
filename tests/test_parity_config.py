"""Config-file semantics against Accelerate 1.15 (issue 14, items 5 and 6): where the file applies, port 0.

Each test runs the same thing on Accelerate and on nbaccel (each side in its own subprocess, so neither sees
the other's singletons) and compares.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("accelerate", reason="parity tests compare with Accelerate 1.15 (a dev dependency)")

ROOT = Path(__file__).resolve().parent.parent


def run_python(source: str, env: dict[str, str], timeout: float = 120) -> dict:
    """Run `source` in a fresh interpreter with `env` added; it prints one JSON line last, returned here."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(source)], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    return {"value": json.loads(proc.stdout.strip().splitlines()[-1]), "stderr": proc.stderr}


def accelerate_home(tmp_path: Path, config: str) -> dict[str, str]:
    """An environment where Accelerate's own default_config.yaml holds `config` and nbaccel has no file of its
    own (so nbaccel falls back to Accelerate's file, as it does for a user moving from Accelerate)."""
    hf_home = tmp_path / "hf"
    (hf_home / "accelerate").mkdir(parents=True)
    (hf_home / "accelerate" / "default_config.yaml").write_text(config)
    return {"HF_HOME": str(hf_home), "XDG_CACHE_HOME": str(tmp_path / "cache"), "NBACCEL_CONFIG_FILE": ""}


BF16_CONFIG = ("compute_environment: LOCAL_MACHINE\ndistributed_type: 'NO'\nmixed_precision: bf16\nuse_cpu: true\n"
               "dynamo_config:\n  dynamo_backend: INDUCTOR\nnum_processes: 1\n")


@pytest.mark.parametrize("package", ["accelerate", "nbaccel"])
def test_plain_accelerator_takes_nothing_from_the_config_file(tmp_path, package):
    """Accelerate applies its config file only through its launcher: a plain Accelerator() in a process no
    launcher started keeps mixed_precision 'no', no torch.compile backend, and the device it would pick anyway.
    (nbaccel used to read mixed_precision, use_cpu and dynamo_backend from the file here.)"""
    env = accelerate_home(tmp_path, BF16_CONFIG)
    source = f"""
        import json
        from {package} import Accelerator
        accelerator = Accelerator()
        print(json.dumps([accelerator.mixed_precision, str(accelerator.state.dynamo_plugin.backend).split(".")[-1],
                          accelerator.device.type]))
    """
    assert run_python(source, env)["value"] == ["no", "NO", "cpu"]


def test_notebook_launcher_names_the_file_and_the_values_it_took(tmp_path, capfd, monkeypatch):
    """nbaccel's addition (Accelerate's notebook_launcher reads no file): the values taken from a saved config
    are announced in one line; arguments passed are not reported, and no line appears without a file."""
    from nbaccel import notebook_launcher

    path = tmp_path / "default_config.yaml"
    monkeypatch.setenv("NBACCEL_CONFIG_FILE", str(path))
    path.write_text("num_processes: 1\nmixed_precision: bf16\ngradient_accumulation_steps: 3\n")

    def precision():
        from nbaccel import Accelerator
        from nbaccel.state import AcceleratorState

        try:
            return Accelerator().mixed_precision
        finally:
            AcceleratorState._reset_state(True)

    assert notebook_launcher(precision, dashboard=False) == ["bf16"]
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if "takes from" in line]
    assert len(lines) == 1, err
    assert str(path.name) in lines[0] and "mixed_precision='bf16'" in lines[0] and "num_processes=1" in lines[0]
    assert "gradient_accumulation_steps=3" in lines[0]

    assert notebook_launcher(precision, num_processes=1, mixed_precision="no", dashboard=False) == ["no"]
    lines = [line for line in capfd.readouterr().err.splitlines() if "takes from" in line]
    assert len(lines) == 1 and "mixed_precision" not in lines[0] and "num_processes" not in lines[0]

    path.write_text("num_processes: 1\ndebug: true\ndynamo_config:\n  dynamo_backend: INDUCTOR\n")
    notebook_launcher(precision, num_processes=1, dashboard=False)
    lines = [line for line in capfd.readouterr().err.splitlines() if "takes from" in line]
    assert len(lines) == 1 and "not used by notebook_launcher" in lines[0]  # read, so reported: debug, dynamo
    assert "debug" in lines[0] and "dynamo_config" in lines[0]

    path.unlink()
    assert notebook_launcher(precision, num_processes=1, dashboard=False) == ["no"]
    assert "takes from" not in capfd.readouterr().err


PORT_CONFIG = ("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\nmain_process_port: 0\n"
               "num_processes: 2\nuse_cpu: true\nmixed_precision: 'no'\nnum_machines: 1\nmachine_rank: 0\n")


def test_port_zero_in_the_config_file_means_a_free_port(tmp_path):
    """`main_process_port: 0` loads in both (nbaccel refused it), and their launchers turn 0 into a free port."""
    config = tmp_path / "port0.yaml"
    config.write_text(PORT_CONFIG)
    accelerate_side = run_python(f"""
        import json
        from accelerate.commands.config.config_args import load_config_from_file
        from accelerate.commands.launch import launch_command_parser, _validate_launch_command
        from accelerate.utils.launch import prepare_multi_gpu_env
        print(load_config_from_file({str(config)!r}).main_process_port, flush=True)
        args = launch_command_parser().parse_args(["--config_file", {str(config)!r}, "train.py"])
        args, _, _ = _validate_launch_command(args)
        prepare_multi_gpu_env(args)
        print(json.dumps(args.main_process_port))
    """, {})
    nbaccel_side = run_python(f"""
        import json
        from nbaccel.commands.config.config_args import load_config_from_file
        from nbaccel.commands.launch import launch_command_parser, resolve_settings
        from nbaccel.utils.config_file import load_config
        print(load_config_from_file({str(config)!r}).main_process_port, flush=True)
        args = launch_command_parser().parse_args(["--config_file", {str(config)!r}, "examples/hello_ranks.py"])
        print(json.dumps(resolve_settings(args, load_config({str(config)!r})).main_process_port))
    """, {})
    for side in (accelerate_side, nbaccel_side):
        assert 1024 <= side["value"] < 65536  # a real port, chosen when asked for 0


def test_launch_with_port_zero_runs_on_a_free_port(tmp_path):
    script = tmp_path / "port.py"
    # torchrun's agents meet in a store on MASTER_PORT before any worker starts, so workers that start and see
    # the port prove it was a usable one (no process group here: gloo's own connections are not the point)
    # one write per line: torchrun's workers are unbuffered, and print's pieces from two ranks can interleave
    script.write_text("import os\nos.write(1, f\"PORT {os.environ['MASTER_PORT']} {os.environ['WORLD_SIZE']}\\n\".encode())\n")
    proc = subprocess.run([sys.executable, "-m", "nbaccel", "launch", "--cpu", "--num_processes", "2",
                           "--main_process_port", "0", str(script)], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, stdin=subprocess.DEVNULL, start_new_session=True)
    assert proc.returncode == 0, proc.stderr
    ports = {line.split()[1] for line in proc.stdout.splitlines() if line.startswith("PORT")}
    assert len(ports) == 1 and int(ports.pop()) > 0
    assert proc.stdout.count("PORT") == 2
