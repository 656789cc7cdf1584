"""The command line against Accelerate 1.15 (issue 14, items 4 and 8, and the config-file keys of item 7):
`nbaccel launch` takes every `accelerate launch` option with the same dest, default and nargs; --multi_gpu and
--same_network act as Accelerate's; options that cannot work here are refused with a reason; `config update` and
`estimate-memory` take Accelerate's arguments.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("accelerate", reason="parity tests compare with Accelerate 1.15 (a dev dependency)")

from nbaccel.commands.launch import (  # noqa: E402
    LaunchOptionError,
    _validate_launch_command,
    launch_command_parser,
    resolve_settings,
    torchrun_arguments,
    worker_environment,
)
from nbaccel.commands.launch_options import FROM_CONFIG  # noqa: E402
from nbaccel.utils.config_file import LaunchConfig, load_config  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = "examples/hello_ranks.py"

# Defaults that differ on purpose: None means "not given: the config file's value, else Accelerate's default"
# (Accelerate's launcher never reads these keys from the file). fsdp_version: see below.
DEFAULT_DIFFERENCES = {**FROM_CONFIG, "fsdp_version": "None, so a config file's value applies; a launch without one uses Accelerate's 1"}


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {option: action for action in parser._actions for option in action.option_strings}


def test_launch_takes_every_accelerate_option_with_its_dest_default_and_nargs():
    from accelerate.commands.launch import launch_command_parser as accelerate_parser

    theirs, ours = accelerate_parser(), launch_command_parser()
    ours_by_option = _actions(ours)
    problems = []
    for action in theirs._actions:
        if not action.option_strings or action.dest == "help":
            continue
        missing = [o for o in action.option_strings if o not in ours_by_option]
        if missing:
            problems.append(f"{action.option_strings}: missing {missing}")
            continue
        mine = ours_by_option[action.option_strings[0]]
        if mine.dest != action.dest or mine.nargs != action.nargs:
            problems.append(f"{action.option_strings}: dest/nargs {mine.dest}/{mine.nargs} != "
                            f"{action.dest}/{action.nargs}")
        if type(mine).__name__ != type(action).__name__:
            problems.append(f"{action.option_strings}: {type(mine).__name__} != {type(action).__name__}")
        if mine.default != action.default and action.dest not in DEFAULT_DIFFERENCES:
            problems.append(f"{action.option_strings}: default {mine.default!r} != {action.default!r}")
        if action.choices and mine.choices and not set(action.choices) <= set(mine.choices):
            if action.dest != "dynamo_backend":
                problems.append(f"{action.option_strings}: choices {mine.choices} lack some of {action.choices}")
    # positionals: the script and its arguments
    positionals = {a.dest: a.nargs for a in ours._actions if not a.option_strings}
    assert positionals.get("training_script") is None and positionals.get("training_script_args") == "..."
    assert not problems, "\n".join(problems)
    # the options with a deliberate default differ only in None-means-config, and parse the same values
    both = ["--rdzv_backend", "c10d", "--dynamo_mode", "max-autotune", "x.py"]
    assert vars(theirs.parse_args(both))["rdzv_backend"] == vars(ours.parse_args(both))["rdzv_backend"] == "c10d"


@pytest.mark.parametrize("argv", [
    ["--multi_gpu", "--cpu"],
    ["--multi_gpu", "--use_fsdp"],
    ["--multi_gpu", "--num_processes", "1"],
    ["--use_parallelism_config"],
])
def test_multi_gpu_and_paradigm_checks_refuse_as_accelerate(argv):
    """The same combinations are refused, with Accelerate's message (a ValueError on both sides)."""
    from accelerate.commands.launch import _validate_launch_command as accelerate_validate
    from accelerate.commands.launch import launch_command_parser as accelerate_parser

    with pytest.raises(ValueError) as theirs:
        accelerate_validate(accelerate_parser().parse_args([*argv, SCRIPT]))
    with pytest.raises(LaunchOptionError) as ours:
        resolve_settings(launch_command_parser().parse_args([*argv, SCRIPT]), None)
    assert str(theirs.value).strip() in str(ours.value)


@pytest.mark.parametrize("same_network", [True, False])
def test_machines_meet_as_accelerates_launcher_says(same_network):
    """Several machines: with --same_network torchrun's master address and port, else the rendezvous endpoint
    (Accelerate's prepare_multi_gpu_env fills the torchrun fields; nbaccel's torchrun command line must agree)."""
    from accelerate.commands.launch import launch_command_parser as accelerate_parser
    from accelerate.utils.launch import prepare_multi_gpu_env
    from torch.distributed.run import get_args_parser

    argv = ["--num_machines", "2", "--machine_rank", "1", "--num_processes", "4", "--main_process_ip", "10.1.2.3",
            "--main_process_port", "29555", *(["--same_network"] if same_network else []), SCRIPT]
    theirs = accelerate_parser().parse_args(argv)
    theirs.mixed_precision, theirs.use_cpu, theirs.dynamo_backend = "no", False, "no"  # as its validation fills
    prepare_multi_gpu_env(theirs)
    ours = get_args_parser().parse_args(torchrun_arguments(resolve_settings(launch_command_parser().parse_args(argv),
                                                                            None)))
    fields = ["nnodes", "node_rank", "nproc_per_node", *(["master_addr", "master_port"] if same_network
                                                        else ["rdzv_endpoint"])]
    assert {f: str(getattr(ours, f)) for f in fields} == {f: str(getattr(theirs, f)) for f in fields}
    assert ours.rdzv_backend == theirs.rdzv_backend == "static"


def test_options_reach_the_workers_as_accelerates_environment():
    """dynamo options and --enable_cpu_affinity become the variables Accelerate's launcher sets."""
    from accelerate.commands.launch import launch_command_parser as accelerate_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    argv = ["--num_processes", "2", "--dynamo_backend", "inductor", "--dynamo_mode", "max-autotune",
            "--dynamo_use_fullgraph", "--dynamo_use_dynamic", "--enable_cpu_affinity", "--main_process_port", "0",
            SCRIPT]
    theirs = accelerate_parser().parse_args(argv)
    theirs.mixed_precision, theirs.num_machines, theirs.use_cpu = "no", 1, False
    their_env = prepare_multi_gpu_env(theirs)
    our_env = worker_environment(resolve_settings(launch_command_parser().parse_args(argv), None))
    for name in ("ACCELERATE_DYNAMO_BACKEND", "ACCELERATE_DYNAMO_MODE", "ACCELERATE_DYNAMO_USE_FULLGRAPH",
                 "ACCELERATE_DYNAMO_USE_DYNAMIC", "ACCELERATE_CPU_AFFINITY"):
        assert our_env[name].lower() == their_env[name].lower(), name


@pytest.mark.parametrize(("argv", "reason"), [
    (["--tpu"], "notebook_launcher"),
    (["--use_megatron_lm"], "Megatron-LM is not supported"),
    (["--mpirun_hostfile", "hosts"], "not mpirun"),
    (["--use_fsdp", "--fsdp_version", "2", "--use_parallelism_config"], "pass parallelism_config=ParallelismConfig"),
    (["-m", "--no_python"], "--module and --no_python cannot be used together"),
])
def test_options_that_cannot_work_here_are_refused_with_the_reason(argv, reason):
    """Accelerate would start a TPU, Megatron-LM, mpirun or parallelism-config launch, none of which can run on
    this CPU machine; nbaccel refuses each before anything starts, saying why."""
    with pytest.raises(LaunchOptionError, match=reason):
        resolve_settings(launch_command_parser().parse_args([*argv, SCRIPT]), None)


def test_no_python_role_and_quiet_run_through_torchrun():
    echo = shutil.which("echo")
    proc = subprocess.run([sys.executable, "-m", "nbaccel", "launch", "-q", "--cpu", "--num_processes", "2",
                           "--no_python", "--role", "trainer", echo, "hello from a worker"], capture_output=True,
                          text=True, timeout=120, cwd=ROOT, stdin=subprocess.DEVNULL, start_new_session=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("hello from a worker") == 2
    argv = torchrun_arguments(resolve_settings(launch_command_parser().parse_args(
        ["--no_python", "--role", "trainer", echo]), None))
    assert "--no-python" in argv and "--role=trainer" in argv


def test_validate_launch_command_fills_args_like_accelerates(tmp_path):
    config = tmp_path / "multi_cpu.yaml"
    config.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\nnum_processes: 2\n"
                      "mixed_precision: 'no'\nuse_cpu: true\nnum_machines: 1\nmachine_rank: 0\n")
    from accelerate.commands.launch import _validate_launch_command as accelerate_validate
    from accelerate.commands.launch import launch_command_parser as accelerate_parser

    argv = ["--config_file", str(config), SCRIPT]
    theirs, _, their_mp = accelerate_validate(accelerate_parser().parse_args(argv))
    ours, our_config, our_mp = _validate_launch_command(launch_command_parser().parse_args(argv))
    for name in ("num_processes", "num_machines", "mixed_precision", "use_cpu"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert our_mp == their_mp and our_config.num_processes == 2


# --- config keys: used or reported (item 7) -------------------------------------------------------------------
def test_config_keys_are_used_or_reported(tmp_path, capsys):
    """enable_cpu_affinity reaches the workers; TPU-only keys are named as not used; parallelism_config is
    refused. (Accelerate's launcher reads these keys and, off a TPU / without FSDP2, ignores them silently.)"""
    path = tmp_path / "keys.yaml"
    path.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\nnum_processes: 2\n"
                    "use_cpu: true\nenable_cpu_affinity: true\ndowncast_bf16: 'yes'\nmain_training_function: train\n")
    settings = resolve_settings(launch_command_parser().parse_args(["--config_file", str(path), SCRIPT]),
                                load_config(path))
    assert worker_environment(settings)["ACCELERATE_CPU_AFFINITY"] == "1"
    err = capsys.readouterr().err
    assert "not used: downcast_bf16" in err and "main_training_function" in err
    with_parallelism = LaunchConfig(distributed_type="FSDP", parallelism_config={"parallelism_config_tp_size": 2})
    with pytest.raises(LaunchOptionError, match="parallelism_config"):
        resolve_settings(launch_command_parser().parse_args([SCRIPT]), with_parallelism)


# --- config update and estimate-memory (item 8) ----------------------------------------------------------------
def _compare_parsers(theirs: argparse.ArgumentParser, ours: argparse.ArgumentParser, skip=()) -> list[str]:
    ours_by_option = _actions(ours)
    problems = []
    for action in theirs._actions:
        if action.dest == "help" or action.dest in skip:
            continue
        if not action.option_strings:
            mine = next((a for a in ours._actions if not a.option_strings and a.dest == action.dest), None)
        else:
            mine = ours_by_option.get(action.option_strings[0])
        if mine is None:
            problems.append(f"{action.option_strings or action.dest}: missing")
        elif (mine.dest, mine.nargs) != (action.dest, action.nargs) or (
                action.choices and not set(action.choices) <= set(mine.choices or action.choices)):
            problems.append(f"{action.option_strings or action.dest}: {mine} vs {action}")
        elif action.option_strings and mine.default != action.default:
            problems.append(f"{action.option_strings}: default {mine.default!r} != {action.default!r}")
    return problems


def test_estimate_memory_takes_accelerates_arguments():
    from accelerate.commands.estimate import estimate_command_parser as accelerate_parser

    from nbaccel.commands.estimate import estimate_command_parser

    assert not _compare_parsers(accelerate_parser(), estimate_command_parser())


def test_estimate_memory_of_a_hub_name_offline_says_so(tmp_path):
    """A Hub model name needs the network on both sides; offline, nbaccel says that in one line (Accelerate
    reports the repository as gated)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)}
    theirs = subprocess.run([sys.executable, "-c", "from accelerate.commands.estimate import main; main()",
                             "bert-base-cased"], capture_output=True, text=True, timeout=120, env=env)
    ours = subprocess.run([sys.executable, "-m", "nbaccel", "estimate-memory", "bert-base-cased"],
                          capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert theirs.returncode != 0 and ours.returncode == 2
    assert "Hub cannot be reached" in ours.stderr and "HF_HUB_OFFLINE" in ours.stderr


def test_config_update_takes_accelerates_arguments_and_keeps_the_values(tmp_path):
    from accelerate.commands.config import get_config_parser as accelerate_config_parser
    from accelerate.commands.config.config_args import load_config_from_file as accelerate_load
    from accelerate.commands.config.update import update_config as accelerate_update

    from nbaccel.commands.config import get_config_parser
    from nbaccel.commands.config.update import update_config

    def update_parser(parser):
        return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["update"]

    problems = _compare_parsers(update_parser(accelerate_config_parser()), update_parser(get_config_parser()),
                                skip=("config_file",))
    assert not problems
    assert "--config_file" in _actions(update_parser(get_config_parser()))
    written = (ROOT / "tests" / "compat" / "fixtures" / "accelerate_multi_cpu_config.yaml").read_text()
    for side, update in (("theirs", accelerate_update), ("ours", update_config)):
        (tmp_path / f"{side}.yaml").write_text(written)
        update(argparse.Namespace(config_file=str(tmp_path / f"{side}.yaml")))
    theirs = accelerate_load(str(tmp_path / "theirs.yaml")).to_dict()
    ours = accelerate_load(str(tmp_path / "ours.yaml")).to_dict()
    assert {k: ours.get(k) for k in theirs} == theirs
    with pytest.raises(ValueError):
        accelerate_update(argparse.Namespace(config_file=str(tmp_path / "none.yaml")))
    with pytest.raises(ValueError, match="no such config file"):
        update_config(argparse.Namespace(config_file=str(tmp_path / "none.yaml")))


def test_options_given_that_change_nothing_are_named(capsys):
    """Accelerate accepts these and, in a launch like this one, does nothing with them; nbaccel does the same
    but says so in one line, so that no option is ignored silently."""
    from nbaccel.commands.main import build_parser

    args = build_parser().parse_args(["launch", "--cpu", "--num_processes", "1", "--downcast_bf16",
                                      "--fsdp_sharding_strategy", "NO_SHARD", "--zero_stage", "2", SCRIPT])
    resolve_settings(args, None)
    err = capsys.readouterr().err
    assert "not used: --downcast_bf16" in err and "--fsdp_sharding_strategy (they need --use_fsdp)" in err
    assert "--zero_stage (they need --use_deepspeed)" in err
    resolve_settings(build_parser().parse_args(["launch", "--cpu", SCRIPT]), None)
    assert "not used" not in capsys.readouterr().err


# --- Accelerate's test_cli.py / test_sagemaker.py, side by side (the commands' Python API) ---------------------


def test_env_command_returns_its_report_with_the_command_location(monkeypatch, capsys):
    """`env_command(args)` returns the report as a dict, as Accelerate's does, with where the command lives
    ("Not found" when it is not on PATH); the `nbaccel env` command still exits 0."""
    import accelerate.commands.env as theirs

    import nbaccel.commands.env as ours
    from nbaccel.commands.main import main as nbaccel_main

    for module, command in ((theirs, "accelerate"), (ours, "nbaccel")):
        monkeypatch.setattr(module, "which", lambda name: None)
        info = module.env_command(module.env_command_parser().parse_args([]))
        assert info[f"`{command}` bash location"] == "Not found"
        monkeypatch.setattr(module, "which", lambda name, command=command: f"/opt/bin/{name}")
        assert module.env_command(module.env_command_parser().parse_args([]))[f"`{command}` bash location"] == \
            f"/opt/bin/{command}"
    assert "- `nbaccel` bash location: /opt/bin/nbaccel" in capsys.readouterr().out
    assert nbaccel_main(["env"]) == 0


def test_a_one_process_cpu_launch_sets_intel_openmp_variables_as_accelerate(monkeypatch):
    """`accelerate launch --cpu` sets KMP_AFFINITY/KMP_BLOCKTIME; without --cpu neither is set."""
    from accelerate.commands.launch import _validate_launch_command as their_validate
    from accelerate.commands.launch import launch_command_parser as their_parser
    from accelerate.utils.launch import prepare_simple_launcher_cmd_env as their_env

    from nbaccel.utils.launch import prepare_simple_launcher_cmd_env as our_env

    monkeypatch.delenv("KMP_AFFINITY", raising=False)
    monkeypatch.delenv("KMP_BLOCKTIME", raising=False)
    for argv in (["--cpu", SCRIPT], [SCRIPT]):
        theirs = their_env(their_validate(their_parser().parse_args(argv))[0])[1]
        ours = our_env(_validate_launch_command(launch_command_parser().parse_args(argv))[0])[1]
        workers = worker_environment(resolve_settings(launch_command_parser().parse_args(argv), None))
        for name in ("KMP_AFFINITY", "KMP_BLOCKTIME"):
            assert theirs.get(name) == ours.get(name) == workers.get(name), (argv, name)
        assert ("KMP_AFFINITY" in theirs) == ("--cpu" in argv)
    # several CPU processes go through Accelerate's torchrun path, which does not set them either
    assert "KMP_AFFINITY" not in worker_environment(
        resolve_settings(launch_command_parser().parse_args(["--cpu", "--num_processes", "2", SCRIPT]), None))


def test_launch_help_lists_each_option_once_as_accelerate(capsys):
    """Options are accepted with hyphens or underscores but listed once, with underscores (Accelerate's
    test_duplicate_entities); both spellings still parse."""
    from accelerate.commands.launch import launch_command_parser as their_parser

    for parser in (launch_command_parser(), their_parser()):
        help_text = parser.format_help()
        for dest in vars(parser.parse_args([SCRIPT])):
            hyphenated = f"--{dest.replace('_', '-')}"
            if "_" in dest:
                assert help_text.count(hyphenated) == (1 if dest == "num_processes" else 0), (parser.prog, dest)
    parsed = launch_command_parser().parse_args(["--num-processes", "3", "--main_process_port", "0", SCRIPT])
    assert parsed.num_processes == 3 and parsed.main_process_port == 0


def test_estimate_command_raises_for_a_gated_model_and_the_command_reports_it(monkeypatch, capsys):
    """`estimate_command(args)` raises (OSError) for a gated Hub model, as Accelerate's does; `nbaccel
    estimate-memory` turns it into one line and exit status 2. `gather_data(args)` takes the parsed
    arguments, as Accelerate's does."""
    import accelerate.commands.estimate as theirs

    import nbaccel.commands.estimate as ours
    from nbaccel.commands.main import main as nbaccel_main

    for module in (theirs, ours):
        monkeypatch.setattr(module, "verify_on_hub", lambda *a, **k: "gated")
        monkeypatch.setenv("HF_HUB_DISABLE_IMPLICIT_TOKEN", "1")
        with pytest.raises(OSError):
            module.estimate_command(module.estimate_command_parser().parse_args(["meta-llama/Llama-2-7b-hf"]))
    capsys.readouterr()
    assert nbaccel_main(["estimate-memory", "meta-llama/Llama-2-7b-hf"]) == 2
    assert "gated" in capsys.readouterr().err
    args = ours.estimate_command_parser().parse_args(["torch.nn:Linear", "--model_kwargs", '{"in_features": 4, '
                                                      '"out_features": 2}', "--dtypes", "float32", "int8"])
    rows = ours.gather_data(args)
    assert [row[0] for row in rows] == ["float32", "int8"] and rows[0][2] == (4 * 2 + 2) * 4


def test_sagemaker_config_reads_and_writes_but_does_not_launch(tmp_path, capsys):
    """SageMakerConfig is built and read as in Accelerate (its test_sagemaker_config); `nbaccel launch`
    refuses it, saying why, before anything starts."""
    from accelerate.commands.config.config_args import SageMakerConfig as TheirConfig
    from accelerate.commands.config.config_args import load_config_from_file as their_load

    from nbaccel.commands.config.config_args import SageMakerConfig, load_config_from_file
    from nbaccel.commands.main import main as nbaccel_main

    # DATA_PARALLEL: Accelerate cannot read back a SageMaker file with distributed_type NO (its reader adds
    # num_processes, which its SageMakerConfig then rejects)
    fields = dict(compute_environment="AMAZON_SAGEMAKER", distributed_type="DATA_PARALLEL", mixed_precision="fp16",
                  debug=False, use_cpu=False, ec2_instance_type="MY_TYPE", iam_role_name="MY_ROLE")
    ours, theirs = SageMakerConfig(**fields), TheirConfig(**fields)
    for name in ("compute_environment", "ec2_instance_type", "iam_role_name", "region", "base_job_name",
                 "pytorch_version", "transformers_version", "py_version", "image_uri", "profile"):
        assert getattr(ours, name) == getattr(theirs, name), name
    path = ours.save(tmp_path / "sagemaker.yaml")
    read, their_read = load_config_from_file(str(path)), their_load(str(path))
    assert type(read).__name__ == type(their_read).__name__ == "SageMakerConfig"
    assert read.ec2_instance_type == their_read.ec2_instance_type == "MY_TYPE"
    (tmp_path / "partial.yaml").write_text("compute_environment: AMAZON_SAGEMAKER\nec2_instance_type: x\n")
    with pytest.raises(ValueError, match="iam_role_name"):
        load_config_from_file(str(tmp_path / "partial.yaml"))
    (tmp_path / "broken.yaml").write_text("compute_environment: [AMAZON_SAGEMAKER\n")
    with pytest.raises(ValueError, match="not valid YAML"):  # ConfigError, as for any config file
        load_config_from_file(str(tmp_path / "broken.yaml"))
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        nbaccel_main(["launch", "--config_file", str(path), SCRIPT])
    assert exited.value.code == 2 and "AMAZON_SAGEMAKER: nbaccel launch runs on this machine only" in \
        capsys.readouterr().err


@pytest.mark.parametrize("nargs", [
    ["--model_name_or_path", "bert", "--do_train", "False", "--epochs", "3", "--learning_rate", "5e-5",
     "--max_steps", "50.5"],
    ["--warm-up", "1e3", "--name", "x", "--flag", "True"],
    [],
    ["--model_name_or_path", "bert", "--do_train", "--epochs", "3"],
    ["--epochs", "3", "--do_predict"],
])
def test_sagemaker_hyperparameters_convert_as_accelerate(nargs):
    from accelerate.utils.launch import _convert_nargs_to_dict as theirs

    from nbaccel.utils.launch import _convert_nargs_to_dict as ours

    try:
        expected = theirs(nargs)
    except ValueError:
        with pytest.raises(ValueError, match="no value"):
            ours(nargs)
        return
    converted = ours(nargs)
    assert converted == expected and [type(v) for v in converted.values()] == [type(v) for v in expected.values()]


def test_the_launch_check_script_runs_without_a_config(tmp_path):
    """Accelerate's test_no_config: `launch test_utils/scripts/test_cli.py` with no config file anywhere."""
    from nbaccel.test_utils.testing import path_in_accelerate_package

    script = path_in_accelerate_package("test_utils", "scripts", "test_cli.py")
    env = {**os.environ, "HF_HOME": str(tmp_path), "NBACCEL_CONFIG_FILE": str(tmp_path / "none.yaml"),
           "XDG_CACHE_HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "nbaccel.commands.main", "launch", "--monitor_interval", "0.1",
                           str(script)], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "Successfully ran on 0 GPUs" in done.stdout


def _isolated_env(tmp_path: Path) -> dict[str, str]:
    """No config file anywhere: a throwaway HOME, cache and config location."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "NBACCEL_"))}
    return {**env, "HOME": str(tmp_path), "HF_HOME": str(tmp_path / "hf"), "XDG_CACHE_HOME": str(tmp_path / "cache"),
            "NBACCEL_CONFIG_FILE": str(tmp_path / "none.yaml"), "PYTHONPATH": str(ROOT)}


# the command modules Accelerate lets you run with `python -m` (their `if __name__ == "__main__"`)
RUNNABLE_MODULES = ["commands.launch", "commands.env", "commands.test", "commands.merge", "commands.estimate",
                    "commands.config.config", "commands.accelerate_cli"]


@pytest.mark.parametrize("module", RUNNABLE_MODULES)
def test_command_modules_run_with_python_m_as_accelerates(module, tmp_path):
    """`python -m accelerate.commands.launch --help` prints the usage; nbaccel's module used to do nothing, exit 0."""
    done = {}
    for lib in ("accelerate", "nbaccel"):
        done[lib] = subprocess.run([sys.executable, "-m", f"{lib}.{module}", "--help"], capture_output=True, text=True,
                                   timeout=120, cwd=tmp_path, env=_isolated_env(tmp_path), stdin=subprocess.DEVNULL)
    for lib, proc in done.items():
        assert proc.returncode == 0 and "usage:" in proc.stdout, (lib, proc.stdout, proc.stderr)


def test_python_m_launch_runs_the_script_as_the_launch_command(tmp_path):
    (tmp_path / "s.py").write_text("import os, sys\nprint('RAN', sys.argv[1:])\n")
    for lib in ("accelerate", "nbaccel"):
        proc = subprocess.run([sys.executable, "-m", f"{lib}.commands.launch", "--cpu", "s.py", "a"],
                              capture_output=True, text=True, timeout=120, cwd=tmp_path, env=_isolated_env(tmp_path),
                              stdin=subprocess.DEVNULL)
        assert proc.returncode == 0 and "RAN ['a']" in proc.stdout, (lib, proc.stdout, proc.stderr)


def test_console_scripts_match_accelerates_extra_ones():
    """accelerate-launch, accelerate-config, ... have nbaccel-launch, nbaccel-config, ... calling the same command."""
    import importlib
    import importlib.metadata

    import tomllib

    theirs = {e.name: e.value for e in importlib.metadata.distribution("accelerate").entry_points
              if e.group == "console_scripts"}
    ours = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    expected = {name.replace("accelerate", "nbaccel", 1): value.replace("accelerate.", "nbaccel.", 1)
                for name, value in theirs.items() if name != "accelerate"}
    assert {name: ours.get(name) for name in expected} == expected
    for value in expected.values():
        module, _, func = value.partition(":")
        assert callable(getattr(importlib.import_module(module), func))


def test_config_default_and_update_write_json_to_a_json_path_as_accelerate(tmp_path, capsys):
    """A .json config file is JSON (Accelerate reads it with json.load); any other name is YAML."""
    import json

    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.config.default import write_basic_config as accelerates_write_basic_config

    from nbaccel.commands.main import main

    ours = tmp_path / "nb.json"
    assert main(["config", "default", "--config_file", str(ours)]) == 0
    assert json.loads(ours.read_text())["distributed_type"] == "NO"
    assert load_config_from_file(str(ours)).distributed_type == "NO"

    theirs = tmp_path / "acc.json"
    accelerates_write_basic_config(save_location=str(theirs))
    assert main(["config", "update", "--config_file", str(theirs)]) == 0
    assert json.loads(theirs.read_text())["mixed_precision"] == "no"
    assert load_config_from_file(str(theirs)).mixed_precision == "no"

    yaml_file = tmp_path / "nb.yaml"
    assert main(["config", "default", "--config_file", str(yaml_file)]) == 0
    assert yaml_file.read_text().startswith("compute_environment: LOCAL_MACHINE")


@pytest.mark.parametrize("argv", [["--cpu"], ["--multi_gpu", "--num_processes", "2"]])
def test_gradient_accumulation_steps_reaches_the_script_only_with_deepspeed_as_accelerate(argv, tmp_path):
    """Accelerate exports --gradient_accumulation_steps only on its DeepSpeed path: the script's Accelerator keeps 1.
    Each rank writes what it sees to a file of its own (printed, Accelerate's two ranks' lines were lost or run
    together now and then)."""
    (tmp_path / "s.py").write_text(
        "import importlib, os, sys\nlib = importlib.import_module(sys.argv[1])\n"
        "acc = lib.Accelerator(cpu=True)\n"
        "with open(f'{sys.argv[1]}-ga-{acc.process_index}', 'w') as f:\n"
        "    f.write(f'GA {acc.process_index} {acc.gradient_accumulation_steps}')\n"
        "acc.end_training() if hasattr(acc, 'end_training') else None\n")
    seen = {}
    for lib in ("accelerate", "nbaccel"):
        proc = subprocess.run([sys.executable, "-m", f"{lib}.commands.launch", *argv, "--gradient_accumulation_steps", "4",
                               "s.py", lib], capture_output=True, text=True, timeout=180, cwd=tmp_path,
                              env=_isolated_env(tmp_path), stdin=subprocess.DEVNULL)
        assert proc.returncode == 0, (lib, proc.stdout, proc.stderr)
        seen[lib] = sorted(path.read_text() for path in tmp_path.glob(f"{lib}-ga-*"))
    assert seen["nbaccel"] == seen["accelerate"] and seen["nbaccel"] and all(s.endswith(" 1") for s in seen["nbaccel"])


def test_dynamo_variables_left_in_the_shell_do_not_reach_the_script_as_accelerate(tmp_path):
    """`accelerate launch` always writes the five ACCELERATE_DYNAMO_* variables (backend NO when no flag names one)."""
    (tmp_path / "s.py").write_text(
        "import importlib, os, sys\nlib = importlib.import_module(sys.argv[1])\nacc = lib.Accelerator(cpu=True)\n"
        "print('DYN', acc.state.dynamo_plugin.backend, flush=True)\n"
        "print('ENV', {k: os.environ[k] for k in sorted(os.environ) if k.startswith(('ACCELERATE_DYNAMO_', 'ACCELERATE_USE_CPU'))})\n")
    leftovers = {"ACCELERATE_DYNAMO_BACKEND": "EAGER", "ACCELERATE_DYNAMO_MODE": "max-autotune",
                 "ACCELERATE_DYNAMO_USE_FULLGRAPH": "true", "ACCELERATE_DYNAMO_USE_DYNAMIC": "true",
                 "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION": "true"}
    seen = {}
    for lib in ("accelerate", "nbaccel"):
        env = {**_isolated_env(tmp_path), **leftovers}
        proc = subprocess.run([sys.executable, "-m", f"{lib}.commands.launch", "--cpu", "s.py", lib], capture_output=True,
                              text=True, timeout=180, cwd=tmp_path, env=env, stdin=subprocess.DEVNULL)
        assert proc.returncode == 0, (lib, proc.stdout, proc.stderr)
        seen[lib] = [line for line in proc.stdout.splitlines() if line.startswith(("DYN", "ENV"))]
    assert seen["nbaccel"] == seen["accelerate"] and seen["nbaccel"][0] == "DYN NO"


def _subcommand_parsers(root: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in root._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@pytest.mark.parametrize("command", ["to-fsdp2", "merge-weights", "tpu-config", "estimate-memory", "env", "launch",
                                     "test", "config"])
def test_every_subcommand_takes_both_spellings_of_its_options_as_accelerate(command):
    """Under the `accelerate` command every subcommand's parser answers to `--config-file` for `--config_file`."""
    from accelerate.commands import accelerate_cli
    from accelerate.commands.utils import CustomArgumentParser

    from nbaccel.commands.main import build_parser

    theirs_root = CustomArgumentParser("accelerate", allow_abbrev=False)
    subparsers = theirs_root.add_subparsers()
    for name in ("get_config_parser", "estimate_command_parser", "env_command_parser", "launch_command_parser",
                 "merge_command_parser", "tpu_command_parser", "test_command_parser", "to_fsdp2_command_parser"):
        getattr(accelerate_cli, name)(subparsers=subparsers)
    theirs, ours = _subcommand_parsers(theirs_root)[command], _subcommand_parsers(build_parser())[command]
    ours_options = set(_actions(ours))
    missing = sorted(o for o in _actions(theirs) if o.startswith("--") and o not in ours_options
                     and o.replace("-", "_")[2:] in {p.replace("-", "_")[2:] for p in ours_options})
    assert not missing, missing


def test_to_fsdp2_takes_hyphenated_options_as_accelerate(tmp_path):
    from nbaccel.commands.main import main

    source = tmp_path / "fsdp1.yaml"
    source.write_text("distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 1\n  fsdp_sharding_strategy: FULL_SHARD\n")
    assert main(["to-fsdp2", "--config-file", str(source), "--output-file", str(tmp_path / "out.yaml")]) == 0
    assert "fsdp_version: 2" in (tmp_path / "out.yaml").read_text()


@pytest.mark.parametrize("kind", ["directory", "zip"])
def test_a_directory_or_zip_with_main_runs_as_the_training_script_as_accelerate(kind, tmp_path):
    """`python pkg` runs pkg/__main__.py (a zip app the same): `accelerate launch pkg` does, nbaccel refused a folder,
    then gave the script a relative sys.path[0] (and a zip's `__file__`) where Python gives absolute ones."""
    import json
    import zipfile

    probe = ("import json, os, sys\nprint('PROBE', json.dumps({'argv': sys.argv, 'name': __name__, "
             "'file': __file__, 'path0': sys.path[0]}), flush=True)\n")  # as they are: no abspath
    if kind == "directory":
        (tmp_path / "pkg").mkdir()
        (tmp_path / "pkg" / "__main__.py").write_text(probe)
        target = "pkg"
    else:
        target = "app.zip"
        with zipfile.ZipFile(tmp_path / target, "w") as archive:
            archive.writestr("__main__.py", probe)
    seen = {}
    for lib in ("accelerate", "nbaccel"):
        proc = subprocess.run([sys.executable, "-m", f"{lib}.commands.launch", "--cpu", target, "x"],
                              capture_output=True, text=True, timeout=180, cwd=tmp_path, env=_isolated_env(tmp_path),
                              stdin=subprocess.DEVNULL)
        assert proc.returncode == 0, (lib, proc.stdout, proc.stderr)
        seen[lib] = [json.loads(line[6:]) for line in proc.stdout.splitlines() if line.startswith("PROBE ")]
    assert seen["nbaccel"] == seen["accelerate"]
    assert seen["nbaccel"] == [{"argv": [target, "x"], "name": "__main__", "file": str(tmp_path / target / "__main__.py"),
                                "path0": str(tmp_path / target)}]


def test_a_directory_without_main_is_refused_before_the_launch(tmp_path):
    from nbaccel.commands.launch import LaunchOptionError, check_script

    (tmp_path / "empty").mkdir()
    settings = resolve_settings(launch_command_parser().parse_args(["--cpu", str(tmp_path / "empty")]), None)
    with pytest.raises(LaunchOptionError, match="directory without a __main__.py"):
        check_script(settings)


# --- launch: OMP_NUM_THREADS, downcast_bf16, --gpu_ids with --cpu, -q, restarts ---------------------------------
MULTI_CPU_CONFIG = ("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\nnum_processes: 2\nuse_cpu: true\n"
                    "mixed_precision: 'no'\nnum_machines: 1\nmachine_rank: 0\n")
ONE_PROCESS_CONFIG = ("compute_environment: LOCAL_MACHINE\ndistributed_type: 'NO'\nnum_processes: 1\nuse_cpu: false\n"
                      "mixed_precision: 'no'\nnum_machines: 1\nmachine_rank: 0\n")


@pytest.mark.parametrize("physical_cores", [2, 8])
def test_omp_num_threads_defaults_as_accelerates(physical_cores, monkeypatch, tmp_path):
    """Without --num_cpu_threads_per_process Accelerate sets OMP_NUM_THREADS to the shell's value, else 1, except
    a CPU launch (the config's use_cpu, else --cpu) with a process count given, which shares the physical cores
    out; nbaccel gave every launch logical cores // local processes (2 where Accelerate gives 1 here)."""
    import psutil
    from accelerate.commands import launch as theirs

    monkeypatch.setattr(psutil, "cpu_count", lambda logical=True: physical_cores * (2 if logical else 1))
    monkeypatch.setattr(theirs, "default_config_file", str(tmp_path / "none.yaml"))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    multi_cpu, one = (str(tmp_path / "multi_cpu.yaml"), str(tmp_path / "one.yaml"))
    Path(multi_cpu).write_text(MULTI_CPU_CONFIG)
    Path(one).write_text(ONE_PROCESS_CONFIG)
    cases = [["--cpu"], ["--cpu", "--num_processes", "1"], ["--cpu", "--num_processes", "2"], ["--num_processes", "1"],
             ["--num_processes", "2"], ["--config_file", multi_cpu], ["--config_file", one, "--cpu"],
             ["--cpu", "--num_processes", "4", "--num_machines", "2", "--main_process_ip", "10.0.0.1"],
             ["--cpu", "--num_processes", "2", "--num_cpu_threads_per_process", "3"]]
    for omp in (None, "3", "0"):  # "0": passed on as Accelerate does (nbaccel refused it as an option's value)
        if omp is not None:
            monkeypatch.setenv("OMP_NUM_THREADS", omp)
        for argv in cases:
            expected = theirs._validate_launch_command(theirs.launch_command_parser().parse_args([*argv, SCRIPT]))[0]
            args = launch_command_parser().parse_args([*argv, SCRIPT])
            config = load_config(args.config_file) if args.config_file else None
            seen = worker_environment(resolve_settings(args, config))["OMP_NUM_THREADS"]
            assert seen == str(expected.num_cpu_threads_per_process), (omp, argv)


def test_a_one_process_cpu_launch_runs_with_accelerates_thread_count(tmp_path):
    (tmp_path / "s.py").write_text("import os, torch\nprint('THREADS', os.environ.get('OMP_NUM_THREADS'), "
                                   "torch.get_num_threads(), flush=True)\n")
    seen = {}
    for lib in ("accelerate", "nbaccel"):
        env = {k: v for k, v in _isolated_env(tmp_path).items() if k != "OMP_NUM_THREADS"}
        proc = subprocess.run([sys.executable, "-m", f"{lib}.commands.launch", "--cpu", "s.py"], capture_output=True,
                              text=True, timeout=120, cwd=tmp_path, env=env, stdin=subprocess.DEVNULL)
        assert proc.returncode == 0, (lib, proc.stdout, proc.stderr)
        seen[lib] = [line for line in proc.stdout.splitlines() if line.startswith("THREADS")]
    assert seen["nbaccel"] == seen["accelerate"] and len(seen["nbaccel"]) == 1


def test_config_default_writes_downcast_bf16_as_accelerate(tmp_path):
    """`accelerate config default` writes `downcast_bf16: false` (its ClusterConfig's bool); nbaccel wrote 'no'.
    Both forms (Accelerate's interactive `config` writes "no") are written back as read, and no launch passes
    a DOWNCAST variable to a CPU script (Accelerate sets XLA_DOWNCAST_BF16 for TPU launches only)."""
    import json

    import yaml
    from accelerate.commands.config.default import write_basic_config as accelerates_write_basic_config
    from accelerate.commands.config.update import update_config as accelerates_update
    from accelerate.utils.launch import prepare_simple_launcher_cmd_env as their_env

    from nbaccel.commands.config.update import update_config
    from nbaccel.commands.main import main

    accelerates_write_basic_config(save_location=str(tmp_path / "theirs.yaml"))
    assert main(["config", "default", "--config_file", str(tmp_path / "ours.yaml")]) == 0
    theirs = json.loads((tmp_path / "theirs.yaml").read_text())  # Accelerate writes JSON whatever the name
    ours = yaml.safe_load((tmp_path / "ours.yaml").read_text())
    assert ours["downcast_bf16"] is theirs["downcast_bf16"] is False
    assert ours == theirs
    for value in ("false", "true", "'no'", "'yes'"):
        for side, update in (("theirs", accelerates_update), ("ours", update_config)):
            (tmp_path / f"{side}.yaml").write_text(f"{ONE_PROCESS_CONFIG}downcast_bf16: {value}\n")
            update(argparse.Namespace(config_file=str(tmp_path / f"{side}.yaml")))
        theirs = yaml.safe_load((tmp_path / "theirs.yaml").read_text())
        ours = yaml.safe_load((tmp_path / "ours.yaml").read_text())
        assert ours["downcast_bf16"] == theirs["downcast_bf16"] == yaml.safe_load(value), value
    from accelerate.commands.launch import _validate_launch_command as their_validate
    from accelerate.commands.launch import launch_command_parser as their_parser

    argv = ["--cpu", "--downcast_bf16", "--mixed_precision", "bf16", SCRIPT]
    downcast = {k: v for k, v in their_env(their_validate(their_parser().parse_args(argv))[0])[1].items()
                if "DOWNCAST" in k}
    assert downcast == {} == {k: v for k, v in worker_environment(
        resolve_settings(launch_command_parser().parse_args(argv), None)).items() if "DOWNCAST" in k}


def test_gpu_ids_with_cpu_set_cuda_visible_devices_as_accelerate(monkeypatch, tmp_path):
    """`accelerate launch --cpu --gpu_ids 1` neither refuses nor ignores the ids: the script sees
    CUDA_VISIBLE_DEVICES=1 (and the CPU). nbaccel dropped the ids under --cpu, silently."""
    from accelerate.commands import launch as theirs
    from accelerate.utils.launch import prepare_simple_launcher_cmd_env as their_env

    monkeypatch.setattr(theirs, "default_config_file", str(tmp_path / "none.yaml"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    multi_cpu = tmp_path / "multi_cpu.yaml"
    multi_cpu.write_text(f"{MULTI_CPU_CONFIG}gpu_ids: '0'\n")
    for argv in (["--cpu", "--gpu_ids", "1"], ["--cpu", "--gpu_ids", "0,1", "--num_processes", "2"],
                 ["--cpu", "--gpu_ids", "all"], ["--cpu"], ["--config_file", str(multi_cpu)],
                 ["--config_file", str(multi_cpu), "--gpu_ids", "1"]):
        expected = their_env(theirs._validate_launch_command(theirs.launch_command_parser().parse_args([*argv, SCRIPT]))[0])[1]
        args = launch_command_parser().parse_args([*argv, SCRIPT])
        ours = worker_environment(resolve_settings(args, load_config(args.config_file) if args.config_file else None))
        assert ours.get("CUDA_VISIBLE_DEVICES") == expected.get("CUDA_VISIBLE_DEVICES"), argv
    (tmp_path / "s.py").write_text("import os\nprint('CVD', os.environ.get('CUDA_VISIBLE_DEVICES'), flush=True)\n")
    seen = {}
    for lib in ("accelerate", "nbaccel"):
        env = {k: v for k, v in _isolated_env(tmp_path).items() if k != "CUDA_VISIBLE_DEVICES"}
        proc = subprocess.run([sys.executable, "-m", f"{lib}.commands.launch", "--cpu", "--gpu_ids", "1", "s.py"],
                              capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env,
                              stdin=subprocess.DEVNULL)
        assert proc.returncode == 0, (lib, proc.stdout, proc.stderr)
        seen[lib] = [line for line in proc.stdout.splitlines() if line.startswith("CVD")]
    assert seen["nbaccel"] == seen["accelerate"] == ["CVD 1"]


def test_quiet_leaves_torchs_agent_messages_as_accelerate(tmp_path):
    """`accelerate launch -q` on several processes silences none of torch elastic's messages (its -q only drops a
    single process's CalledProcessError traceback); nbaccel's -q silenced some (`Using nproc_per_node=2.`) and let
    the others through. With torch's LOGLEVEL=INFO nbaccel now logs from every place Accelerate does."""
    import re

    (tmp_path / "s.py").write_text("print('SCRIPT', flush=True)\n")
    sources = {}
    for lib in ("accelerate", "nbaccel"):
        env = {**_isolated_env(tmp_path), "LOGLEVEL": "INFO"}
        proc = subprocess.run([sys.executable, "-m", f"{lib}.commands.launch", "-q", "--multi_gpu", "--num_processes",
                               "2", "s.py"], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env,
                              stdin=subprocess.DEVNULL)
        assert proc.returncode == 0 and proc.stdout.count("SCRIPT") == 2, (lib, proc.stdout, proc.stderr)
        sources[lib] = set(re.findall(r"torch/distributed/[\w/]+\.py:\d+\]", proc.stderr))
    assert sources["accelerate"] <= sources["nbaccel"], sources["accelerate"] - sources["nbaccel"]  # none silenced
    assert any("launcher/api.py" in s for s in sources["nbaccel"]) and any("run.py" in s for s in sources["nbaccel"])


RESTARTED_ONCE = """import os, sys
marker = os.path.join(sys.argv[1], f"failed-{os.environ.get('RANK', '-')}")
with open(os.path.join(sys.argv[1], f"seen-{os.environ.get('RANK', '-')}"), "a") as seen:
    seen.write(f"{os.environ.get('TORCHELASTIC_RESTART_COUNT')}\\n")
if os.environ.get("RANK", "0") == str(int(os.environ.get("WORLD_SIZE", "1")) - 1) and not os.path.exists(marker):
    open(marker, "w").close()
    sys.exit(3)
"""


def _restarted_once(tmp_path: Path, lib: str, argv: list[str], env: dict[str, str]) -> tuple[subprocess.CompletedProcess, dict]:
    (tmp_path / "once.py").write_text(RESTARTED_ONCE)
    folder = tmp_path / lib
    folder.mkdir()
    proc = subprocess.run([sys.executable, "-m", f"{lib}.commands.launch", *argv, "once.py", str(folder)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env, stdin=subprocess.DEVNULL)
    return proc, {p.name: p.read_text().split() for p in sorted(folder.glob("seen-*"))}


def test_a_restart_shows_as_under_accelerate(tmp_path):
    """Neither `accelerate launch` nor torchrun prints a restart line of its own at torch's default LOGLEVEL: the
    failed attempt's `failed (exitcode: 3) local_rank: 1` line (ERROR) and the ranks' TORCHELASTIC_RESTART_COUNT
    tell; LOGLEVEL=INFO adds torch's `1/1 attempts left; will restart worker group`. nbaccel's launch the same."""
    argv = ["--multi_gpu", "--num_processes", "2", "--max_restarts", "1"]
    seen = {}
    for lib in ("accelerate", "nbaccel"):
        proc, attempts = _restarted_once(tmp_path, lib, argv, {**_isolated_env(tmp_path), "LOGLEVEL": "INFO"})
        assert proc.returncode == 0, (lib, proc.stderr)
        assert "failed (exitcode: 3) local_rank: 1" in proc.stderr, (lib, proc.stderr)
        assert "1/1 attempts left; will restart worker group" in proc.stderr, (lib, proc.stderr)
        # (torch's other lines depend on timing: "closing signal SIGTERM" only when rank 0 was still running)
        seen[lib] = attempts
    assert seen["nbaccel"] == seen["accelerate"] == {"seen-0": ["0", "1"], "seen-1": ["0", "1"]}


def test_one_process_restarts_under_nbaccel_only(tmp_path):
    """A listed difference (docs/compat.md): Accelerate runs one process without torchrun's agent and ignores
    --max_restarts (the launch fails with CalledProcessError, exit 1); nbaccel runs it under the agent, which
    restarts it."""
    runs = {lib: _restarted_once(tmp_path, lib, ["--cpu", "--max_restarts", "1"], _isolated_env(tmp_path))
            for lib in ("accelerate", "nbaccel")}
    (theirs, their_attempts), (ours, our_attempts) = runs["accelerate"], runs["nbaccel"]
    assert theirs.returncode == 1 and "CalledProcessError" in theirs.stderr and their_attempts == {"seen--": ["None"]}
    assert ours.returncode == 0 and our_attempts == {"seen-0": ["0", "1"]}
    assert "failed (exitcode: 3) local_rank: 0" in ours.stderr


@pytest.mark.parametrize("given", [False, True])
def test_cpu_launch_skips_the_default_config_file_as_accelerate(given, tmp_path):
    """`accelerate launch --cpu` reads no default config file, only one named with --config_file: a default file's
    bf16 does not reach the script. nbaccel read it. (Its 2 processes: Accelerate starts one process for a CPU
    launch without mpirun, nbaccel the processes asked for; docs/compat.md.)"""
    (tmp_path / "s.py").write_text("import os\nprint('SEEN', os.environ.get('ACCELERATE_MIXED_PRECISION'), flush=True)\n")
    config = tmp_path / "hf" / "accelerate" / "default_config.yaml"  # Accelerate's default location under HF_HOME
    config.parent.mkdir(parents=True)
    config.write_text(MULTI_CPU_CONFIG.replace("mixed_precision: 'no'", "mixed_precision: bf16"))
    seen = {}
    for lib in ("accelerate", "nbaccel"):
        env = {**_isolated_env(tmp_path), "NBACCEL_CONFIG_FILE": str(config)}  # nbaccel's default: the same file
        options = ["--config_file", str(config)] if given else []
        proc = subprocess.run([sys.executable, "-m", f"{lib}.commands.launch", "--cpu", *options, "s.py"],
                              capture_output=True, text=True, timeout=180, cwd=tmp_path, env=env, stdin=subprocess.DEVNULL)
        assert proc.returncode == 0, (lib, proc.stdout, proc.stderr)
        seen[lib] = [line for line in proc.stdout.splitlines() if line.startswith("SEEN")]
    expected = "SEEN bf16" if given else "SEEN no"
    assert seen["accelerate"] == [expected], seen
    assert seen["nbaccel"] == [expected] * (2 if given else 1), seen
