"""notebook_launcher takes the saved launch configuration's values for the arguments left at their defaults."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch  # noqa: F401  (imported here so forked workers inherit it)
from process_helpers import started_children

from nbaccel.launch import notebook_launcher
from nbaccel.launch.kernel import plan as launcher_module
from nbaccel.launch.kernel.saved_config import apply_saved_config, default, is_default
from nbaccel.utils.config_file import ConfigError
from nbaccel.utils.other import get_free_port

ENV_NAMES = ("NBACCEL_MIXED_PRECISION", "ACCELERATE_MIXED_PRECISION", "NBACCEL_GRADIENT_ACCUMULATION_STEPS",
             "ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "NBACCEL_USE_CPU", "MASTER_PORT", "WORLD_SIZE")


@pytest.fixture
def config_file(tmp_path, monkeypatch):
    path = tmp_path / "default_config.yaml"
    monkeypatch.setenv("NBACCEL_CONFIG_FILE", str(path))
    return path


def worker_env():
    return {name: os.environ.get(name) for name in ENV_NAMES}


def free_port() -> int:
    return get_free_port("127.0.0.1")  # below the ephemeral range: see get_free_port


def test_signature_defaults_stay_accelerates():
    import inspect

    params = inspect.signature(notebook_launcher).parameters
    assert params["mixed_precision"].default == "no" and repr(params["mixed_precision"].default) == "'no'"
    assert params["num_nodes"].default == 1 and params["master_addr"].default == "127.0.0.1"
    assert is_default(default("no")) and not is_default("no") and not is_default(0)


def test_config_values_fill_the_defaults(config_file):
    port = free_port()
    config_file.write_text(f"distributed_type: MULTI_CPU\nnum_processes: 2\nmixed_precision: bf16\n"
                           f"gradient_accumulation_steps: 3\nstart_method: fork\nmain_process_port: {port}\n")
    seen = []
    results = notebook_launcher(worker_env, dashboard=False, timeout=60, observers=[seen.append])
    assert len(results) == 2
    for env in results:
        assert env["NBACCEL_MIXED_PRECISION"] == env["ACCELERATE_MIXED_PRECISION"] == "bf16"
        assert env["NBACCEL_GRADIENT_ACCUMULATION_STEPS"] == env["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"] == "3"
        assert env["MASTER_PORT"] == str(port) and env["WORLD_SIZE"] == "2"
    started = [m for m in seen if m["kind"] == "launch" and m["state"] == "started"]
    # the group meets in the launch's private FileStore: the header says so and names no port (MASTER_PORT is
    # still set, above, for code that reads it)
    assert started[0]["start_method"] == "fork" and started[0]["rendezvous"] == "file store (private)"
    assert "port" not in started[0] and str(port) not in str(started[0])


def test_the_header_names_the_rendezvous_each_kind_of_launch_really_uses(config_file):
    from nbaccel.launch.kernel.plan import LaunchRequest, Placement, build_plan

    local = build_plan(LaunchRequest(function=print, num_processes=2, use_port=29511, start_method="spawn"))
    assert local.placement is Placement.LOCAL and local.info()["rendezvous"] == "127.0.0.1:29511"  # before its folders
    assert local.with_folders("/tmp/x-store").info()["rendezvous"] == "file store (private)"
    one_node = build_plan(LaunchRequest(function=print, num_processes=2, use_port=29512, max_restarts=1))
    assert one_node.placement is Placement.ELASTIC and one_node.info()["rendezvous"] == "loopback store, port 29512"
    nodes = build_plan(LaunchRequest(function=print, num_processes=2, num_nodes=2, node_rank=1,
                                     master_addr="10.1.2.3", use_port=29513))
    assert nodes.info()["rendezvous"] == "static at 10.1.2.3:29513" and nodes.info()["num_nodes"] == 2
    c10d = build_plan(LaunchRequest(function=print, num_processes=2, num_nodes=2, rdzv_backend="c10d",
                                    rdzv_endpoint="head:29400"))
    assert c10d.info()["rendezvous"] == "c10d at head:29400"


def test_arguments_given_win_even_when_equal_to_the_default(config_file):
    config_file.write_text("num_processes: 2\nmixed_precision: bf16\ngradient_accumulation_steps: 3\n")
    [env] = notebook_launcher(worker_env, num_processes=1, mixed_precision="no", dashboard=False)
    assert env["NBACCEL_MIXED_PRECISION"] == "no"
    assert env["NBACCEL_GRADIENT_ACCUMULATION_STEPS"] == "3"  # in the kernel: set for the call only
    assert "NBACCEL_GRADIENT_ACCUMULATION_STEPS" not in os.environ


def test_broken_config_names_file_and_key_before_anything_starts(config_file):
    config_file.write_text("num_processes: 2\nmixed_precision: fp13\n")
    with pytest.raises(ConfigError, match=r"default_config\.yaml: mixed_precision: 'fp13' is not one of"):
        notebook_launcher(worker_env, dashboard=False)
    config_file.write_text("start_method: thread\n")
    with pytest.raises(ConfigError, match=r"default_config\.yaml: start_method: 'thread'"):
        notebook_launcher(worker_env, num_processes=2, dashboard=False)
    assert started_children() == []


def test_gpu_config_on_a_cpu_machine_still_launches_on_cpu(config_file, monkeypatch, capsys):
    monkeypatch.setattr(launcher_module, "visible_gpus", lambda: 0)
    config_file.write_text("distributed_type: MULTI_GPU\nnum_processes: 8\ngpu_ids: all\n")
    assert notebook_launcher(lambda: os.getpid(), dashboard=False) == [os.getpid()]  # 1 process, in the kernel
    assert "is for distributed_type MULTI_GPU but no GPU is visible" in capsys.readouterr().err
    results = notebook_launcher(worker_env, num_processes=2, dashboard=False, timeout=60)
    assert [env["NBACCEL_USE_CPU"] for env in results] == ["1", "1"]


def test_use_cpu_in_the_config_keeps_workers_off_the_gpus(config_file, monkeypatch):
    monkeypatch.setattr(launcher_module, "visible_gpus", lambda: 2)  # as if two GPUs were there
    config_file.write_text("use_cpu: true\nnum_processes: 2\n")
    results = notebook_launcher(worker_env, dashboard=False, timeout=60)
    assert [env["NBACCEL_USE_CPU"] for env in results] == ["1", "1"]


def test_multi_node_keys_map_to_the_launcher_arguments(config_file):
    config_file.write_text("num_machines: 2\nmachine_rank: 1\nmain_process_ip: 10.1.2.3\nmain_process_port: 29555\n"
                           "rdzv_backend: c10d\nnum_processes: 4\n")
    defaults = dict(num_processes=None, mixed_precision=default("no"), use_port=None,
                    master_addr=default("127.0.0.1"), node_rank=default(0), num_nodes=default(1),
                    rdzv_backend=default("static"), start_method=None)
    saved = apply_saved_config(SimpleNamespace(**defaults), gpus=0)
    assert (saved.num_nodes, saved.node_rank, saved.master_addr, saved.use_port, saved.rdzv_backend) == (
        2, 1, "10.1.2.3", 29555, "c10d")
    assert saved.num_processes == 2  # Accelerate's file counts all machines' processes; the launcher's per node
    assert type(saved.master_addr) is str and type(saved.node_rank) is int
    given = apply_saved_config(SimpleNamespace(**dict(defaults, num_nodes=1, node_rank=0, num_processes=3)), gpus=0)
    assert (given.num_nodes, given.node_rank, given.num_processes, given.master_addr) == (1, 0, 3, "127.0.0.1")


def test_no_config_file_changes_nothing(config_file):
    saved = apply_saved_config(SimpleNamespace(num_processes=None, mixed_precision=default("no"), use_port=None,
                                               master_addr=default("127.0.0.1"), node_rank=default(0),
                                               num_nodes=default(1), rdzv_backend=default("static"),
                                               start_method=None), gpus=0)
    assert (saved.num_processes, saved.mixed_precision, saved.env, saved.source) == (None, "no", {}, None)
