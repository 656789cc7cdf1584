"""One worker environment: notebook_launcher, RankPool and `nbaccel launch` build it with the same function
(nbaccel.launch.rank_environment.worker_environment) and give the same variables for the same configuration."""

from __future__ import annotations

import os

import pytest
import torch  # noqa: F401  (imported here so forked workers inherit it)

from nbaccel.commands.launch import resolve_settings
from nbaccel.commands.launch import worker_environment as command_environment
from nbaccel.commands.main import build_parser
from nbaccel.launch import RankPool, notebook_launcher
from nbaccel.launch.kernel.plan import LaunchRequest, Placement, build_plan
from nbaccel.launch.rank_environment import RankSpec, WorkerConfig, worker_environment
from nbaccel.utils.config_file import LaunchConfig, load_config

pytestmark = pytest.mark.timeout(120)

# What the launchers add per rank (torch's names) and the variables worker_environment may set
RANK_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
             "NBACCEL_LAUNCH_DEVICE")


def _spelled_alike(env: dict[str, str]) -> dict[str, str]:
    """On/off switches as one spelling: the command line writes True/False (as `accelerate launch`), the
    notebook launcher 1 for on (docs/internals.md); everything else must be equal as is."""
    return {key: ("True" if value == "1" and key.endswith("USE_CPU") else value) for key, value in env.items()}


def test_notebook_launcher_and_nbaccel_launch_give_the_same_variables_for_one_config(tmp_path, monkeypatch):
    path = tmp_path / "default_config.yaml"
    config = LaunchConfig(num_processes=2, use_cpu=True, mixed_precision="bf16", debug=True, distributed_type="FSDP",
                          gradient_accumulation_steps=4,
                          fsdp_config={"fsdp_version": 1, "fsdp_offload_params": True,
                                       "fsdp_sharding_strategy": "SHARD_GRAD_OP"},
                          # all five keys: for those a config leaves out, nbaccel launch writes Accelerate's
                          # defaults (it always sets them) and notebook_launcher nothing (neither does Accelerate's)
                          dynamo_config={"dynamo_backend": "EAGER", "dynamo_use_fullgraph": True,
                                         "dynamo_mode": "default", "dynamo_use_dynamic": False,
                                         "dynamo_use_regional_compilation": False})
    config.save(path)
    monkeypatch.setenv("NBACCEL_CONFIG_FILE", str(path))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    plan = build_plan(LaunchRequest(function=print))
    assert plan.placement is Placement.LOCAL and plan.num_processes == 2
    script = tmp_path / "script.py"
    script.write_text("")
    settings = resolve_settings(build_parser().parse_args(["launch", str(script)]), load_config(path))
    from_command = command_environment(settings)
    # nbaccel launch writes the shell's OMP_NUM_THREADS, as Accelerate's launcher does; notebook_launcher's ranks
    # inherit it
    assert from_command.pop("OMP_NUM_THREADS") == "1" and "OMP_NUM_THREADS" not in plan.environ
    assert _spelled_alike(dict(plan.environ)) == _spelled_alike(from_command)
    # the saved settings reach notebook_launcher's workers too (they used to reach only nbaccel launch's)
    for name in ("NBACCEL_DYNAMO_BACKEND", "NBACCEL_USE_FSDP", "FSDP_OFFLOAD_PARAMS", "NBACCEL_DEBUG_MODE",
                 "ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "NBACCEL_CONFIG_FILE_USED"):
        assert name in plan.environ, name
    assert plan.environ["NBACCEL_MIXED_PRECISION"] == "bf16" and plan.environ["FSDP_VERSION"] == "1"


def test_rank_spec_adds_only_the_ranks_identity():
    shared = worker_environment(WorkerConfig(mixed_precision="fp16", use_cpu=True, nproc_per_node=2))
    spec = RankSpec(rank=3, local_rank=1, world_size=4, local_world_size=2, node_rank=1, master_addr="10.0.0.1",
                    master_port=29500, device="cpu")
    env = spec.environ(shared)
    assert {k: v for k, v in env.items() if k not in shared} == {
        "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
        "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "NBACCEL_LAUNCH_DEVICE": "cpu"}
    assert all(env[k] == v for k, v in shared.items())


def _launcher_variables(env: dict[str, str], names: set[str]) -> dict[str, str]:
    return {key: env[key] for key in sorted(names) if key in env}


def _report():
    return dict(os.environ)


def test_notebook_launcher_and_rank_pool_workers_get_the_same_variables(monkeypatch, tmp_path):
    monkeypatch.setenv("NBACCEL_CONFIG_FILE", str(tmp_path / "none.yaml"))  # no saved configuration
    expected = worker_environment(WorkerConfig(mixed_precision="fp16", use_cpu=True, nproc_per_node=2))
    names = set(expected) | set(RANK_KEYS)
    launched = notebook_launcher(_report, num_processes=2, mixed_precision="fp16", dashboard=False)
    with RankPool(2, mixed_precision="fp16") as pool:
        pooled = pool.run(_report)
    for rank in (0, 1):
        from_launcher = _launcher_variables(launched[rank], names)
        assert from_launcher == _launcher_variables(pooled[rank], names)
        assert {k: from_launcher[k] for k in expected} == expected
        assert from_launcher["RANK"] == str(rank) and from_launcher["WORLD_SIZE"] == "2"
