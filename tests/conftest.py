"""Shared test set-up: subprocesses find this checkout, and no test leaves a process behind."""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("OMP_NUM_THREADS", "1")  # 2-core machines: keep each rank from oversubscribing
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
os.environ.setdefault("NBACCEL_CONFIG_FILE", str(ROOT / "test-output" / "no-config.yaml"))
sys.path.insert(0, str(ROOT / "tests"))
# the SIGINT handler of a Jupyter kernel and an interactive Python, which the interrupt tests rely on: a run
# started in the background by a non-interactive shell inherits SIGINT ignored (POSIX), Python then keeps it
# ignored, and so do pytest-xdist's workers
signal.signal(signal.SIGINT, signal.default_int_handler)

from process_helpers import kill_and_reap, live_children  # noqa: E402  (needs the path above)

# Files that start the same session service (a fixture started once per pytest-xdist worker): one worker takes
# them together as one work unit, so the service starts once (a two-node Ray cluster takes 15-35 s), and stops it
# when it leaves the unit (UNIT_SERVICES) instead of at the end of the session: an idle Ray cluster takes ~12% of
# a core, a minute of a 2-core run.
SHARED_SERVICE = {"tests/test_ray_launch.py": "ray cluster", "tests/test_ray_faults.py": "ray cluster"}
SERVICE_FIXTURES = {"ray_cluster": "ray cluster"}
UNIT_SERVICES: dict[str, Callable[[], None]] = {}  # unit -> stop of the service it started


def _work_unit(nodeid: str) -> str:
    """What one worker runs as a whole: a file (run.sh's --dist loadfile), or the files of a shared service."""
    path = nodeid.split("::", 1)[0]
    return SHARED_SERVICE.get(path, path)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Heaviest work unit first, each file's tests in their own order: with the longest files started last (as
    xdist's default order, by number of tests, had them) one worker ran alone for the last minute or two.
    tests/file_seconds.json holds each file's seconds in a full run (scripts/test_file_seconds.py); a file
    not in it counts as a median one."""
    for item in items:
        for fixture, unit in SERVICE_FIXTURES.items():
            if fixture in getattr(item, "fixturenames", ()) and _work_unit(item.nodeid) != unit:
                raise pytest.UsageError(f"{item.nodeid} uses {fixture}: add its file to SHARED_SERVICE as {unit!r}")
    seconds = json.loads((ROOT / "tests" / "file_seconds.json").read_text())
    unknown = statistics.median(seconds.values())
    units: dict[str, float] = {}
    for path, value in seconds.items():
        units[_work_unit(path)] = units.get(_work_unit(path), 0.0) + value
    position = {id(item): index for index, item in enumerate(items)}
    items.sort(key=lambda item: (-units.get(_work_unit(item.nodeid), unknown), _work_unit(item.nodeid),
                                 position[id(item)]))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """run.sh's `--dist loadfile`, with the work units above taken in the order of collection."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedServiceScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _work_unit(nodeid)

    config.option.loadscopereorder = False  # xdist's own order (by number of tests) would undo the one above
    return SharedServiceScheduling(config, log)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    """Stop a unit's service after its last test here (the order above keeps a unit's tests together)."""
    result = yield
    unit = _work_unit(item.nodeid)
    if unit in UNIT_SERVICES and (nextitem is None or _work_unit(nextitem.nodeid) != unit):
        UNIT_SERVICES.pop(unit)()
    return result


@pytest.fixture(autouse=True)
def environment_restored():
    """Give every test the environment the one before it started with. Some code under test sets variables
    in this process on purpose, as Accelerate does (`enable_fsdp_ram_efficient_loading` sets
    ACCELERATE_USE_FSDP, the FSDP plugin FSDP_CPU_RAM_EFFICIENT_LOADING); left set, they turned a later
    test's plain `accelerate.Accelerator()` into an FSDP one."""
    saved = dict(os.environ)
    yield
    if dict(os.environ) != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(autouse=True)
def no_process_left_behind():
    """Fail a test that leaves a child process running (after a 10 s grace), and kill what it left."""
    yield
    deadline = time.monotonic() + 10
    children = live_children()
    while children and time.monotonic() < deadline:
        time.sleep(0.1)
        children = live_children()
    if children:
        described = [f"pid {c.pid}: {' '.join(c.cmdline()[:4])}" for c in children]
        kill_and_reap(children)
        pytest.fail("test left processes running: " + "; ".join(described))


def _session_service(module, start, folder: Path, what: str, pids):
    """A service the tests start once per session (tests/ssh_server.py, tests/slurm_cluster.py): skipped, with
    the reason, where it cannot run; its processes (`pids(service)`) are not counted as left behind by a test."""
    from process_helpers import SESSION_HELPERS

    reason = module.missing_reason()
    if reason:
        pytest.skip(reason)
    try:
        service = start(folder)
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"cannot start {what}: {exc}")
    helpers = pids(service)
    SESSION_HELPERS.update(helpers)
    yield service
    service.stop()
    SESSION_HELPERS.difference_update(helpers)


@pytest.fixture(scope="session")
def ssh_server(tmp_path_factory):
    """A real sshd on a free port of 127.0.0.1 (tests/ssh_server.py), one per session, and the SSH config with
    two aliases of this machine."""
    import ssh_server as server_module

    yield from _session_service(server_module, server_module.start_server, tmp_path_factory.mktemp("sshd"), "sshd",
                                lambda server: {server.process.pid})


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A one-node SLURM cluster on this machine (tests/slurm_cluster.py), one per session."""
    import psutil
    import slurm_cluster as cluster_module

    def daemons(cluster) -> set[int]:
        pids = {process.pid for process in cluster.processes}
        return pids | {child.pid for pid in pids for child in psutil.Process(pid).children()}  # slurmscriptd

    yield from _session_service(cluster_module, cluster_module.start_cluster, tmp_path_factory.mktemp("slurm"),
                                "a SLURM cluster", daemons)


@pytest.fixture(scope="session")
def ray_cluster():
    """A two-node Ray cluster in a private network namespace (tests/ray_cluster.py), one per session, stopped
    after the last test of its work unit. Its processes are not children of this process: nothing to exempt
    from the per-test check."""
    import ray_cluster as cluster_module

    # a short folder of its own: Ray's Unix sockets live in it, and a socket's path has at most 107 bytes, which
    # pytest's basetemp under a pytest-xdist worker (.../pytest-345/popen-gw0/ray0/...) overran
    folder = Path(tempfile.mkdtemp(prefix="nbaccel-ray-"))
    unit = SERVICE_FIXTURES["ray_cluster"]
    service = _session_service(cluster_module, cluster_module.start_cluster, folder, "a Ray cluster",
                               lambda cluster: set())

    def stop() -> None:
        try:
            next(service, None)  # the code after its yield: the cluster's stop
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    try:
        cluster = next(service)  # a skip, saying why, where no cluster can start
    except BaseException:
        stop()
        raise
    UNIT_SERVICES[unit] = stop
    try:
        yield cluster
    finally:
        UNIT_SERVICES.pop(unit, lambda: None)()
