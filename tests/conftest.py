"""Shared test set-up: subprocesses find this checkout, and no test leaves a process behind."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
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
    """A two-node Ray cluster in a private network namespace (tests/ray_cluster.py), one per session. Its
    processes are not children of this process: nothing to exempt from the per-test check."""
    import ray_cluster as cluster_module

    # a short folder of its own: Ray's Unix sockets live in it, and a socket's path has at most 107 bytes, which
    # pytest's basetemp under a pytest-xdist worker (.../pytest-345/popen-gw0/ray0/...) overran
    folder = Path(tempfile.mkdtemp(prefix="nbaccel-ray-"))
    try:
        yield from _session_service(cluster_module, cluster_module.start_cluster, folder, "a Ray cluster",
                                    lambda cluster: set())
    finally:
        shutil.rmtree(folder, ignore_errors=True)
