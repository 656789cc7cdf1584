"""One plan: every input a backend reads (the timeout, each rank's whole environment, the launch's folders) is
in the frozen `LaunchPlan`; the registry is keyed by the plan's placement, one backend class per placement, which
says what it supports (capabilities, programs) as class attributes."""

from __future__ import annotations

import pytest

from nbaccel.launch.kernel import placements
from nbaccel.launch.kernel.plan import LaunchPlan, LaunchRequest, Placement, Program, build_plan
from nbaccel.launch.rank_environment import WorkerConfig, worker_environment
from nbaccel.launch.shared_tensors import RESULT_DIR_ENV
from nbaccel.utils.constants import INIT_METHOD_ENV, LAUNCH_DEVICE_ENV

pytestmark = pytest.mark.timeout(120)


def _plan(**fields) -> LaunchPlan:
    values = dict(placement=Placement.LOCAL, num_processes=2, mixed_precision="no", start_method="spawn", device="cpu",
                  environ={"A": "1"}, port=29500)
    values.update(fields)
    return LaunchPlan(**values)


def test_the_plan_carries_the_timeout_and_the_debug_launchers_fork_flag(monkeypatch):
    monkeypatch.delenv("NBACCEL_CONFIG_FILE", raising=False)
    plan = build_plan(LaunchRequest(function=print, num_processes=2, timeout=12.5, debug_launcher=True))
    assert plan.timeout == 12.5 and plan.placement is Placement.LOCAL and plan.program is Program.FUNCTION
    assert plan.rank_environ(1)["FORK_LAUNCHED"] == "1" and plan.rank_environ(1)["LOCAL_RANK"] == "1"
    assert build_plan(LaunchRequest(function=print, num_processes=2, debug_launcher=True)).timeout is None


def test_the_plan_carries_the_exit_grace_read_once(monkeypatch):
    # NBACCEL_EXIT_HANG_GRACE is read when the plan is built; the supervisor and the script launch's watch get
    # the plan's value (a change of the variable after that does not reach a launch under way)
    monkeypatch.delenv("NBACCEL_CONFIG_FILE", raising=False)
    monkeypatch.delenv("NBACCEL_EXIT_HANG_GRACE", raising=False)
    assert build_plan(LaunchRequest(function=print, num_processes=2)).exit_grace == 10.0
    monkeypatch.setenv("NBACCEL_EXIT_HANG_GRACE", "2.5")
    assert build_plan(LaunchRequest(function=print, num_processes=2)).exit_grace == 2.5


def test_worker_config_writes_fork_launched_and_the_process_group_timeout():
    env = worker_environment(WorkerConfig(use_cpu=True, nproc_per_node=2, fork_launched=True, pg_timeout=40.0))
    assert env["FORK_LAUNCHED"] == "1" and env["NBACCEL_PG_TIMEOUT"] == "40.0"
    plain = worker_environment(WorkerConfig(use_cpu=True, nproc_per_node=2))
    assert "FORK_LAUNCHED" not in plain and "NBACCEL_PG_TIMEOUT" not in plain


def test_with_folders_completes_every_ranks_environment_and_leaves_the_plan_frozen():
    plan = _plan()
    final = plan.with_folders("/tmp/x-store", "/dev/shm/x-results")
    assert INIT_METHOD_ENV not in plan.environ  # a new plan: the first is unchanged
    for local_rank in range(2):
        env = final.rank_environ(local_rank)
        assert env[INIT_METHOD_ENV] == "file:///tmp/x-store/store" and env[RESULT_DIR_ENV] == "/dev/shm/x-results"
        assert env["RANK"] == str(local_rank) and env["A"] == "1"
    assert RESULT_DIR_ENV not in plan.with_folders("/tmp/s").environ
    with pytest.raises(TypeError):
        final.environ["B"] = "2"  # type: ignore[index]


def test_the_agents_environment_names_the_device_template():
    plan = _plan(placement=Placement.ELASTIC, device="cuda:{local_rank}")
    assert plan.agent_environ() == {"A": "1", LAUNCH_DEVICE_ENV: "cuda:{local_rank}"}


@pytest.mark.parametrize(("placement", "inherits", "result_folder", "private_store", "programs"), [
    (Placement.LOCAL, True, True, True, {Program.FUNCTION, Program.POOL}),
    (Placement.ELASTIC, True, False, False, {Program.FUNCTION, Program.SCRIPT}),
    (Placement.XLA, False, False, False, {Program.FUNCTION}),
    (Placement.SSH, False, False, False, {Program.FUNCTION, Program.POOL}),
    (Placement.SLURM, False, False, False, {Program.FUNCTION, Program.POOL}),
])
def test_each_placements_backend_says_what_it_supports(placement, inherits, result_folder, private_store, programs):
    backend = placements.backend_type(_plan(placement=placement))
    assert (backend.inherits_objects, backend.result_folder, backend.private_store) == (
        inherits, result_folder, private_store)
    assert backend.preloads_modules is (placement in (Placement.LOCAL, Placement.ELASTIC))
    assert backend.programs == programs and issubclass(backend, placements.Backend)


def test_in_process_plans_have_no_backend_and_a_placement_refuses_a_program_it_cannot_run():
    with pytest.raises(ValueError, match="in-process"):
        placements.backend_type(_plan(placement=Placement.IN_PROCESS, num_processes=1))
    with pytest.raises(ValueError, match="placement 'xla' runs function, not a pool"):
        placements.backend_type(_plan(placement=Placement.XLA, program=Program.POOL))


def test_every_placement_but_this_process_has_one_registered_class():
    assert set(placements.PLACEMENTS) == set(Placement) - {Placement.IN_PROCESS}
    assert placements.backend_type(_plan(placement=Placement.SLURM)).via == "srun"
