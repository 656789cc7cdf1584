"""The `nbaccel` command: launch (one and two simulated machines), bad input, env, config, test."""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from nbaccel.commands import config as config_cmd
from nbaccel.commands.launch import (
    LaunchOptionError,
    resolve_settings,
    torchrun_arguments,
    worker_environment,
)
from nbaccel.commands.main import build_parser
from nbaccel.utils.config_file import LaunchConfig, load_config
from nbaccel.utils.other import get_free_port

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    return get_free_port("127.0.0.1")  # below the ephemeral range: see get_free_port


def start(args: list[str], env: dict | None = None, cwd: Path = ROOT) -> subprocess.Popen:
    """`python -m nbaccel ARGS` in its own process group (so a timeout can kill the workers too)."""
    return subprocess.Popen(
        [sys.executable, "-m", "nbaccel", *args], cwd=cwd, env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        stdin=subprocess.DEVNULL,
    )


def finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"nbaccel {proc.args[3:]} did not finish within {timeout} s\n{out}\n{err}")
    return proc.returncode, out, err


def nbaccel(*args: str, timeout: float = 60, env: dict | None = None) -> tuple[int, str, str]:
    return finish(start(list(args), env), timeout)


def nbaccel_inprocess(capsys, *args: str) -> tuple[int, str, str]:
    """Run `nbaccel ARGS` in this process (fast: torch is already imported); (exit status, stdout, stderr)."""
    from nbaccel.commands.main import main

    try:
        code = main(list(args))
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


RANK_SCRIPT = """
    import os, sys
    print(f"rank {os.environ['RANK']}/{os.environ['WORLD_SIZE']} mp={os.environ['NBACCEL_MIXED_PRECISION']} "
          f"cpu={os.environ['NBACCEL_USE_CPU']} accel_mp={os.environ['ACCELERATE_MIXED_PRECISION']} args={sys.argv[1:]}",
          flush=True)
"""


def write(path: Path, source: str) -> Path:
    path.write_text(textwrap.dedent(source))
    return path


def test_launch_two_processes(tmp_path):
    script = write(tmp_path / "ranks.py", RANK_SCRIPT)
    code, out, err = nbaccel("launch", "--num_processes", "2", "--cpu", "--mixed_precision", "bf16",
                             str(script), "--lr", "0.1")
    assert code == 0, err
    # torchrun runs workers unbuffered (python -u), so two ranks' writes may interleave within a line:
    # look for each rank's report anywhere in the output, exactly once.
    reports = sorted(re.findall(r"rank \d/2 mp=\S+ cpu=\S+ accel_mp=\S+ args=\['--lr', '0.1'\]", out))
    assert reports == [
        "rank 0/2 mp=bf16 cpu=True accel_mp=bf16 args=['--lr', '0.1']",
        "rank 1/2 mp=bf16 cpu=True accel_mp=bf16 args=['--lr', '0.1']",
    ], out


def test_launch_restarts_then_reports_a_failed_worker(tmp_path):
    script = write(tmp_path / "fail.py", """
        import os, sys
        # one write per line: two ranks share the pipe, and an unbuffered print writes each piece apart
        sys.stdout.write(f"rank {os.environ['RANK']} attempt {os.environ['TORCHELASTIC_RESTART_COUNT']}\\n")
        sys.stdout.flush()
        sys.exit(3 if os.environ["RANK"] == "1" else 0)
    """)
    code, out, err = nbaccel("launch", "--num_processes", "2", "--cpu", "--max_restarts", "1", str(script))
    assert code == 1
    assert "rank 1 attempt 0" in out and "rank 1 attempt 1" in out  # restarted once by the elastic agent
    assert "nbaccel launch: rank 1 failed (exit code 3)" in err


def test_restarted_ranks_meet_in_a_store_of_their_own(tmp_path):
    """torchrun hands every attempt the same store, where the dead ranks' gloo addresses wait: the restarted
    group then failed with "Gloo connectFullMesh failed ... Connection refused" in 2 of 3 launches here. On one
    machine `nbaccel launch` gives each attempt a new store (as notebook_launcher does), so all 3 restart."""
    script = write(tmp_path / "restart.py", """
        import os, sys, torch
        from nbaccel import PartialState
        from nbaccel.utils import reduce
        state = PartialState()
        total = reduce(torch.ones(1), reduction="sum").item()
        if state.process_index == 1 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
            sys.exit(3)  # after its process group met: its gloo address is in the store
        os.write(1, f"rank {state.process_index} total {total} attempt {os.environ['TORCHELASTIC_RESTART_COUNT']}\\n".encode())
    """)
    for _ in range(3):
        code, out, err = nbaccel("launch", "--num_processes", "2", "--cpu", "--max_restarts", "1", str(script))
        assert code == 0 and "connectFullMesh" not in err, err
        assert "rank 0 total 2.0 attempt 1" in out and "rank 1 total 2.0 attempt 1" in out, out


LISTENING_SCRIPT = """
    import os, psutil
    from nbaccel import PartialState
    state = PartialState()
    state.wait_for_everyone()
    rank = psutil.Process()  # and its parent: the `nbaccel launch` process, where torchrun's agent runs
    addresses = sorted({c.laddr.ip for p in (rank, rank.parent()) for c in p.net_connections(kind="inet")
                        if c.status == psutil.CONN_LISTEN})
    os.write(1, f"LISTEN {state.process_index} {os.environ['MASTER_PORT']} {addresses}\\n".encode())
"""


@pytest.mark.parametrize("restarts", ["0", "1"])
def test_a_single_machine_launch_listens_on_loopback_only(tmp_path, restarts):
    """torch's TCPStore listens on every interface ('[::]'), unauthenticated; one machine's launch keeps its
    rendezvous on 127.0.0.1 (issue 15 item 7), whatever the rendezvous backend. As in Accelerate, a
    --main_process_port that is taken gives a warning and a free port."""
    script = write(tmp_path / "listen.py", LISTENING_SCRIPT)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, out, err = nbaccel("launch", "--num_processes", "2", "--cpu", "--max_restarts", restarts,
                                 "--rdzv_backend", "c10d", "--main_process_port", str(port), str(script))
    assert code == 0, err
    assert f"Port `{port}` is already in use on this machine" in err
    reports = re.findall(r"LISTEN (\d) (\d+) (\[.*\])", out)
    assert sorted(rank for rank, *_ in reports) == ["0", "1"], out
    assert len({used for _, used, _ in reports}) == 1 and reports[0][1] != str(port), out
    for _, _, addresses in reports:
        assert all(a.startswith("127.") or a == "::1" for a in eval(addresses)), addresses


def test_ctrl_c_before_a_launch_starts_is_one_line_and_status_130(capsys, monkeypatch):
    """Ctrl-C in the first second of `nbaccel launch`, while torch imports, printed the import's traceback."""
    import nbaccel.commands.main as command

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(command, "build_parser", interrupted)
    code, out, err = nbaccel_inprocess(capsys, "launch", "job.py")
    assert (code, out, err) == (130, "", "nbaccel: interrupted\n")


INTERRUPTED_IN_NUMPYS_IMPORT = """
import os, signal, sys

class Interrupt:  # Ctrl-C lands while torch's C extension imports numpy (the first import of numpy)
    def find_spec(self, name, path=None, target=None):
        if name == "numpy":
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, Interrupt())
from nbaccel.commands.main import main
sys.exit(main(["config", "update", "--config_file", "none.yaml"]))  # a command that runs imports torch
"""


def test_ctrl_c_while_torch_imports_numpy_is_not_lost():
    """torch's C extension imports numpy and drops what that import raises: an interrupt there was lost and
    the command went on (here: said the file is missing and exited 2). A real SIGINT, sent in that moment."""
    done = subprocess.run([sys.executable, "-c", INTERRUPTED_IN_NUMPYS_IMPORT], capture_output=True, text=True,
                          timeout=120)
    assert (done.returncode, done.stdout, done.stderr) == (130, "", "nbaccel: interrupted\n"), done


def test_missing_script_exits_2_with_one_line():
    code, _, err = nbaccel("launch", "--cpu", "no_such_script.py", timeout=30)
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines() == [
        "nbaccel launch: error: training script 'no_such_script.py' not found (see `nbaccel launch --help`)"
    ]


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        (["launch", "--num_processes", "two", "x.py"], "invalid int value: 'two'"),
        (["launch", "--mixed_precision", "fp13", "x.py"], "invalid choice: 'fp13'"),
        (["launch", "--num_processes", "3", "--num_machines", "2", "--main_process_ip", "127.0.0.1",
          "examples/hello_ranks.py"], "must be a multiple of --num_machines"),
        (["launch", "--num_machines", "2", "--num_processes", "2", "examples/hello_ranks.py"],
         "--main_process_ip is needed"),
        (["launch", "--num_processes", "0", "examples/hello_ranks.py"], "--num_processes must be >= 1"),
        (["launch", "--dynamo_backend", "warp", "examples/hello_ranks.py"], "--dynamo_backend must be one of"),
        (["launch", "--main_process_port", "70000", "examples/hello_ranks.py"], "--main_process_port must be"),
        (["launch", "-m", "no_such_module_xyz"], "module 'no_such_module_xyz' not found"),
        (["launch"], "the following arguments are required: training_script"),
        (["launch", "--config_file", "missing.yaml", "examples/hello_ranks.py"], "missing.yaml: no such config file"),
    ],
)
def test_bad_launch_input_exits_2_with_one_line(capsys, monkeypatch, args, reason):
    monkeypatch.chdir(ROOT)
    code, _, err = nbaccel_inprocess(capsys, *args)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("nbaccel launch: error: ") and reason in lines[0], err


def test_invalid_config_file_is_a_usage_error(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    bad = tmp_path / "bad.yaml"
    bad.write_text("mixed_precision: fp13\n")
    code, _, err = nbaccel_inprocess(capsys, "launch", "--config_file", str(bad), "examples/hello_ranks.py")
    assert code == 2 and f"{bad}: mixed_precision: 'fp13' is not one of no, fp16, bf16, fp8" in err


def test_env_command(capsys, tmp_path):
    config = LaunchConfig(num_processes=2, use_cpu=True).save(tmp_path / "c.yaml")
    code, out, _ = nbaccel_inprocess(capsys, "env", "--config_file", str(config))
    assert code == 0
    assert "- PyTorch version:" in out and "- Python version:" in out and "- CPU cores:" in out
    assert f"- Config file: {config}" in out and "num_processes: 2" in out


def test_config_default_writes_once(capsys, tmp_path):
    target = tmp_path / "sub" / "default_config.yaml"
    code, out, _ = nbaccel_inprocess(capsys, "config", "default", "--mixed_precision", "bf16", "--config_file", str(target))
    assert code == 0 and f"saved at {target}" in out
    config = load_config(target)
    assert config.mixed_precision == "bf16" and config.use_cpu is True and config.num_processes == 1
    code, out, _ = nbaccel_inprocess(capsys, "config", "--config_file", str(target), "default")
    assert code == 0 and "will not override" in out and load_config(target).mixed_precision == "bf16"


def test_config_without_terminal_exits_1(tmp_path):
    code, _, err = nbaccel("config", "--config_file", str(tmp_path / "c.yaml"), timeout=30)
    assert code == 1 and "nbaccel config default" in err and not (tmp_path / "c.yaml").exists()


def test_interactive_config_questions(tmp_path, monkeypatch):
    answers = iter([
        "1",        # multi-CPU
        "",         # one machine
        "3",        # processes per machine
        "maybe",    # invalid yes/no -> asked again
        "no",       # no dynamo
        "no",       # no debug
        "fp16",     # mixed precision
    ])
    monkeypatch.setattr("sys.stdin.isatty", lambda: True, raising=False)
    monkeypatch.setattr("builtins.input", lambda prompt="": next(answers))
    args = build_parser().parse_args(["config", "--config_file", str(tmp_path / "c.yaml")])
    assert args.func(args) == 0
    config = load_config(tmp_path / "c.yaml")
    assert (config.distributed_type, config.use_cpu, config.num_processes, config.mixed_precision) == (
        "MULTI_CPU", True, 3, "fp16"
    )


def test_interactive_config_fsdp(monkeypatch):
    answers = iter(["3", "", "2", "", "", "yes", "", "FULL_STATE_DICT", "", "", "", "bf16"])
    config = config_cmd.interactive_config(lambda prompt: next(answers))
    assert config.distributed_type == "FSDP" and config.num_processes == 2
    assert config.fsdp_config == {
        "fsdp_version": 2, "fsdp_reshard_after_forward": True, "fsdp_offload_params": True,
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "fsdp_state_dict_type": "FULL_STATE_DICT",
        "fsdp_activation_checkpointing": False,
    }
    assert config.validate() == {}


def launch_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["launch", *argv])


def test_config_values_used_unless_overridden(tmp_path):
    config = LaunchConfig(num_processes=2, use_cpu=True, mixed_precision="fp16", debug=True,
                          distributed_type="FSDP", fsdp_config={"fsdp_version": 1, "fsdp_offload_params": True,
                                                                "fsdp_sharding_strategy": "SHARD_GRAD_OP"},
                          dynamo_config={"dynamo_backend": "EAGER", "dynamo_use_fullgraph": True})
    settings = resolve_settings(launch_args("examples/hello_ranks.py"), config)
    assert (settings.num_processes, settings.use_cpu, settings.mixed_precision) == (2, True, "fp16")
    env = worker_environment(settings)
    assert env["NBACCEL_MIXED_PRECISION"] == "fp16" and env["NBACCEL_DEBUG_MODE"] == "true"
    assert env["NBACCEL_USE_FSDP"] == env["ACCELERATE_USE_FSDP"] == "true"
    assert (env["FSDP_VERSION"], env["FSDP_OFFLOAD_PARAMS"], env["FSDP_SHARDING_STRATEGY"]) == ("1", "true", "SHARD_GRAD_OP")
    assert env["ACCELERATE_DYNAMO_BACKEND"] == "EAGER" and env["ACCELERATE_DYNAMO_USE_FULLGRAPH"] == "True"
    overridden = resolve_settings(
        launch_args("--num_processes", "1", "--mixed_precision", "no", "--dynamo_backend", "inductor",
                    "--gradient_accumulation_steps", "4", "examples/hello_ranks.py"), config)
    env = worker_environment(overridden)
    assert overridden.num_processes == 1 and env["NBACCEL_MIXED_PRECISION"] == "no"
    assert env["NBACCEL_DYNAMO_BACKEND"] == "INDUCTOR"
    # the option reaches the workers only with DeepSpeed, as in Accelerate (see test_parity_cli)
    assert "ACCELERATE_GRADIENT_ACCUMULATION_STEPS" not in env
    config.gradient_accumulation_steps = 8  # the config file's top-level value (nbaccel's key) flows on
    env = worker_environment(resolve_settings(launch_args("examples/hello_ranks.py"), config))
    assert env["NBACCEL_GRADIENT_ACCUMULATION_STEPS"] == env["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"] == "8"
    plain = worker_environment(resolve_settings(launch_args("--use_fsdp", "examples/hello_ranks.py"), None))
    assert plain["FSDP_VERSION"] == "1" and plain["NBACCEL_USE_FSDP"] == "true"  # Accelerate's default version
    # one process: Accelerate's simple launcher starts it without a process group, unless FSDP (its torchrun)
    assert overridden.num_processes == 1 and env.get("NBACCEL_ONE_PROCESS") is None  # (config: FSDP)
    assert worker_environment(resolve_settings(launch_args("--num_processes", "1", "examples/hello_ranks.py"),
                                               None))["NBACCEL_ONE_PROCESS"] == "1"
    assert "NBACCEL_ONE_PROCESS" not in plain and "NBACCEL_ONE_PROCESS" not in worker_environment(settings)


def test_torchrun_arguments():
    multi = resolve_settings(launch_args(
        "--num_machines", "2", "--machine_rank", "1", "--num_processes", "8", "--rdzv_backend", "c10d",
        "--main_process_ip", "10.1.2.3", "--main_process_port", "29555", "--max_restarts", "2",
        "examples/hello_ranks.py", "--x"), None)
    argv = torchrun_arguments(multi)
    assert "--nnodes=2" in argv and "--nproc-per-node=4" in argv and "--max-restarts=2" in argv
    assert "--rdzv-backend=c10d" in argv and "--rdzv-endpoint=10.1.2.3:29555" in argv
    assert argv[-2:] == ["examples/hello_ranks.py", "--x"]
    static = torchrun_arguments(resolve_settings(launch_args(
        "--num_machines", "2", "--machine_rank", "1", "--num_processes", "2", "--main_process_ip", "10.1.2.3",
        "--same_network", "examples/hello_ranks.py"), None))
    assert "--node-rank=1" in static and "--master-addr=10.1.2.3" in static and "--master-port=29500" in static
    # without --same_network the machines meet at a rendezvous endpoint, as in Accelerate (issue 14 item 4)
    endpoint = torchrun_arguments(resolve_settings(launch_args(
        "--num_machines", "2", "--machine_rank", "1", "--num_processes", "2", "--main_process_ip", "10.1.2.3",
        "examples/hello_ranks.py"), None))
    assert "--node-rank=1" in endpoint and "--rdzv-endpoint=10.1.2.3:29500" in endpoint
    module = torchrun_arguments(resolve_settings(launch_args("-m", "json.tool", "--help"), None))
    assert module[-3:] == ["--module", "json.tool", "--help"]
    with pytest.raises(LaunchOptionError, match="--machine_rank must be between 0 and 1"):
        resolve_settings(launch_args("--num_machines", "2", "--machine_rank", "2", "--num_processes", "2",
                                     "--main_process_ip", "h", "examples/hello_ranks.py"), None)


def test_two_machines_meet_through_c10d(tmp_path):
    """Two `nbaccel launch` agents on this machine play two machines of 2 processes: 4 ranks in one gather."""
    script = write(tmp_path / "gather.py", """
        import os
        import torch.distributed as dist
        dist.init_process_group("gloo")
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (dist.get_rank(), os.environ["GROUP_RANK"], os.environ["LOCAL_RANK"],
                                          os.environ["MACHINE_TAG"]))
        # one write per report: torchrun's workers are unbuffered (-u), so print's pieces are separate
        # writes that another rank's can split; one write to a pipe (< PIPE_BUF bytes) is never split
        os.write(1, f"GATHER {dist.get_rank()} {sorted(everyone)}\\n".encode())
        dist.destroy_process_group()
    """)
    port = str(free_port())
    common = ["launch", "--num_machines", "2", "--num_processes", "4", "--rdzv_backend", "c10d",
              "--main_process_ip", "127.0.0.1", "--main_process_port", port, "--cpu",
              "--num_cpu_threads_per_process", "1"]
    procs = [start([*common, "--machine_rank", str(rank), str(script)], env={"MACHINE_TAG": f"m{rank}"})
             for rank in (0, 1)]
    try:
        results = [finish(proc, timeout=120) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
    for code, _, err in results:
        assert code == 0, err
    # Each report is one write, but it may start right after another rank's partial line: search the output.
    reports = [match for _, out, _ in results for match in re.findall(r"GATHER (\d) (\[[^\]]*\])", out)]
    assert sorted(rank for rank, _ in reports) == ["0", "1", "2", "3"], results
    gathered = {gathered for _, gathered in reports}
    assert len(gathered) == 1  # every rank saw the same gather
    everyone = eval(reports[0][1])
    assert [r for r, *_ in everyone] == [0, 1, 2, 3]
    assert {(g, tag) for _, g, _, tag in everyone} == {("0", "m0"), ("1", "m1")} or \
        {(g, tag) for _, g, _, tag in everyone} == {("0", "m1"), ("1", "m0")}
    assert sorted(tag for *_, tag in everyone) == ["m0", "m0", "m1", "m1"]
    for rank_info in everyone:  # ranks 0-1 on one node, 2-3 on the other, local ranks 0 and 1 on each
        rank, group, local, _ = rank_info
        assert int(group) == rank // 2 and int(local) == rank % 2


def test_nbaccel_test_command(tmp_path):
    from nbaccel.commands.test import CHECK_SCRIPT

    code, out, err = nbaccel("test", "--num_processes", "2", "--cpu", timeout=120)
    if CHECK_SCRIPT.is_file():
        assert code == 0, err
        assert "Test is a success" in out
    else:  # the ops branch has not landed the bundled script yet
        assert code == 2 and "bundled check script is missing" in err


def test_python_dash_m_and_discovered_commands():
    code, out, _ = nbaccel(timeout=30)
    assert code == 1 and "usage: nbaccel" in out
    choices = build_parser()._subparsers._group_actions[0].choices
    assert {"config", "env", "launch", "test"} <= set(choices)


def test_help_and_bad_options_load_no_torch():
    """`nbaccel --help`, `nbaccel launch --help` and a bad option answer without importing torch (2 s here;
    Accelerate's CLI imports it first); a command that runs imports it (with Ctrl-C held, test above)."""
    probe = textwrap.dedent("""
        import contextlib, io, sys
        from nbaccel.commands.main import main
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            for argv in (["--help"], ["launch", "--help"], ["launch", "--num_processes", "two", "x.py"]):
                try:
                    main(argv)
                except SystemExit:
                    pass
        print("torch" in sys.modules)
        from nbaccel.commands.config.default import write_basic_config  # Accelerate's name, still there
        print(callable(write_basic_config) and "torch" in sys.modules)
    """)
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.stdout.split() == ["False", "True"], done.stdout + done.stderr


def test_unsupported_config_is_refused_before_start():
    with pytest.raises(LaunchOptionError, match="distributed_type XLA: TPU processes are started by notebook_launcher"):
        resolve_settings(launch_args("examples/hello_ranks.py"), LaunchConfig(distributed_type="XLA"))
    with pytest.raises(LaunchOptionError, match="AMAZON_SAGEMAKER"):
        resolve_settings(launch_args("examples/hello_ranks.py"), LaunchConfig(compute_environment="AMAZON_SAGEMAKER"))


def test_config_update_rewrites_old_format(capsys, tmp_path):
    old = tmp_path / "old.yaml"
    old.write_text("distributed_type: MULTI_CPU\nfp16: true\nnum_processes: 2\n")
    code, out, _ = nbaccel_inprocess(capsys, "config", "update", "--config_file", str(old))
    assert code == 0 and "updated" in out
    text = old.read_text()
    assert "fp16: true" not in text and "mixed_precision: fp16" in text
    code, _, err = nbaccel_inprocess(capsys, "config", "update", "--config_file", str(tmp_path / "none.yaml"))
    assert code == 2 and "no such config file" in err


def test_bundled_example_runs_like_run_sh_demo():
    code, out, err = nbaccel("launch", "--num_processes", "2", "--cpu", "examples/hello_ranks.py")
    assert code == 0, err
    for rank in (0, 1):
        assert f"rank {rank}/2 on cpu: all_reduce(sum of rank+1) = 3 ok; gathered ['0@" in out
    assert out.count("Hello from 2 process(es)") == 1  # printed by the main process only
