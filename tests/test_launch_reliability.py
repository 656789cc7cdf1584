"""Faults provoked on purpose (issue 15): leaks over many launches, a killed kernel, a busy port."""

from __future__ import annotations

import gc
import os
import socket
import threading
from pathlib import Path

import pytest
import torch  # noqa: F401  (imported here so forked workers inherit it)

from nbaccel.launch import notebook_launcher
from nbaccel.launch.errors import PortInUseError

pytestmark = pytest.mark.timeout(300)


def _open_fds() -> int:
    return len(os.listdir(f"/proc/{os.getpid()}/fd"))


def _one() -> int:
    return 1


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors through /proc (Linux)")
def test_no_descriptor_or_thread_left_after_30_launches():
    notebook_launcher(_one, num_processes=2, dashboard=False)  # first-use costs (imports, helper threads)
    fds, threads = _open_fds(), threading.active_count()
    for _ in range(30):
        assert notebook_launcher(_one, num_processes=2, dashboard=False) == [1, 1]
    # no garbage collection in between: the launcher must close what it opened
    assert (_open_fds(), threading.active_count()) == (fds, threads)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors through /proc (Linux)")
def test_no_descriptor_left_after_elastic_launches():
    notebook_launcher(_one, num_processes=2, dashboard=False, max_restarts=1)
    fds, threads = _open_fds(), threading.active_count()
    gc.disable()  # the launch must close what it opened, not leave it to a collection (it no longer runs one)
    try:
        for _ in range(3):
            assert notebook_launcher(_one, num_processes=2, dashboard=False, max_restarts=1) == [1, 1]
        assert (_open_fds(), threading.active_count()) == (fds, threads)
    finally:
        gc.enable()


def _lan_address() -> str | None:
    import psutil

    for entries in psutil.net_if_addrs().values():
        for entry in entries:
            if entry.family == socket.AF_INET and not entry.address.startswith("127."):
                return entry.address
    return None


def test_a_port_busy_only_on_a_non_loopback_master_addr_is_found_before_workers_start(tmp_path):
    address = _lan_address()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    marker = tmp_path / "ran"

    def touch():
        marker.write_text("ran")

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind((address, 0))  # busy on the LAN address only: 127.0.0.1 with the same port is free
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(PortInUseError, match=f"use_port={port} is already in use on {address}"):
            notebook_launcher(touch, num_processes=2, use_port=port, master_addr=address, dashboard=False)
    assert not marker.exists()  # no worker started


KERNEL = """
import os, sys, time
import torch
from nbaccel.launch import notebook_launcher

def work(folder):
    open(os.path.join(folder, str(os.getpid())), "w").close()
    time.sleep(120)

notebook_launcher(work, (sys.argv[1],), num_processes=2, dashboard=False)
"""


def _gone(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # dead, waiting for init to reap it
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_workers_die_with_a_sigkilled_launcher(tmp_path, start_method):
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "kernel.py"
    script.write_text(KERNEL.replace("dashboard=False", f"dashboard=False, start_method={start_method!r}"))
    folder = tmp_path / "pids"
    folder.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parent.parent),
                                                         os.environ.get("PYTHONPATH", "")]))
    kernel = subprocess.Popen([sys.executable, str(script), str(folder)], env=env)
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 90
        while len(pids) < 2 and time.monotonic() < deadline and kernel.poll() is None:
            time.sleep(0.1)
            pids = [int(name) for name in os.listdir(folder)]
        assert len(pids) == 2, "the workers did not start"
        kernel.send_signal(signal.SIGKILL)
        kernel.wait()
        killed_at = time.monotonic()
        while not all(_gone(pid) for pid in pids) and time.monotonic() - killed_at < 10:
            time.sleep(0.05)
        assert all(_gone(pid) for pid in pids), "a worker outlived its SIGKILLed launcher"
        assert time.monotonic() - killed_at < 2.0
    finally:
        kernel.kill()
        for pid in pids:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)


def _listening_addresses() -> list[str]:
    """The addresses this rank and the process that started it (the kernel, or the elastic agent's process)
    listen on once the rank's process group exists."""
    import psutil

    from nbaccel import PartialState

    state = PartialState()
    state.wait_for_everyone()
    rank = psutil.Process()
    return sorted({conn.laddr.ip for process in (rank, rank.parent()) for conn in process.net_connections(kind="inet")
                   if conn.status == psutil.CONN_LISTEN})


def _is_loopback(address: str) -> bool:
    return address.startswith("127.") or address == "::1"


@pytest.mark.parametrize("restarts", [0, 1], ids=["local", "elastic"])
def test_a_single_node_launch_listens_on_nothing_beyond_the_machine(monkeypatch, restarts):
    monkeypatch.delenv("NBACCEL_INIT_METHOD", raising=False)
    for addresses in notebook_launcher(_listening_addresses, num_processes=2, dashboard=False,
                                       max_restarts=restarts, rdzv_backend="c10d"):
        # torch's TCP store listened on every interface ('::'), in rank 0 or in the elastic agent; a local
        # launch's group now meets in a private file, an elastic one's in stores on 127.0.0.1, and gloo's own
        # sockets are on the loopback device (GLOO_SOCKET_IFNAME=lo)
        assert all(_is_loopback(address) for address in addresses), addresses


def test_rank_pool_ranks_listen_on_nothing_beyond_the_machine(monkeypatch):
    from nbaccel.launch import RankPool

    monkeypatch.delenv("NBACCEL_INIT_METHOD", raising=False)
    with RankPool(2) as pool:
        for addresses in pool.run(_listening_addresses):
            assert all(_is_loopback(address) for address in addresses), addresses


# the first launch imports PyYAML on first use: held inside yaml/__init__ (yaml.error imported, yaml.tokens not yet)
FIRST_LAUNCH_INTERRUPTED = """
from nbaccel import notebook_launcher
assert "yaml" not in sys.modules, "the launch no longer imports yaml on first use: hold another module"
interrupted_then_again(lambda: notebook_launcher(os.getpid, num_processes=2, dashboard=False),
                       lambda: len(notebook_launcher(os.getpid, num_processes=2, dashboard=False)))
"""


def test_an_interrupt_inside_a_first_use_import_leaves_the_next_launch_working(tmp_path):
    """The launch's first-use imports (PyYAML, psutil, packaging) run in the kernel's main thread; an interrupt
    inside one left the package half made (its submodules kept, the package dropped), and every later launch of
    the kernel failed with "partially initialized module 'yaml' has no attribute 'error'" (found by interrupting
    `hosts="slurm"` launches at random moments). Those orphans are now forgotten, and the import starts afresh."""
    from process_helpers import run_interrupted_in_import

    done = run_interrupted_in_import("yaml.tokens", FIRST_LAUNCH_INTERRUPTED, tmp_path)
    assert done.stdout.split() == ["interrupted", "again", "2"], (done.stdout, done.stderr[-3000:])


def test_forget_orphans_touches_only_what_the_launch_imported():
    import sys
    import types

    from nbaccel.launch.kernel.half_imports import forget_orphans

    names = ["nbaccel_test_gone.sub", "nbaccel_test_gone.sub.deeper", "nbaccel_test_kept", "nbaccel_test_kept.sub",
             "nbaccel_test_old_orphan.sub"]
    sys.modules["nbaccel_test_old_orphan.sub"] = types.ModuleType("nbaccel_test_old_orphan.sub")
    last = next(reversed(sys.modules))
    try:
        for name in names[:4]:
            sys.modules[name] = types.ModuleType(name)
        assert sorted(forget_orphans(last)) == names[:2]
        assert [name in sys.modules for name in names] == [False, False, True, True, True]
    finally:
        for name in names:
            sys.modules.pop(name, None)
