"""Faults provoked on purpose (issue 15): leaks over many launches, a killed kernel, a busy port."""

from __future__ import annotations

import os
import socket
import threading

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
    for _ in range(3):
        assert notebook_launcher(_one, num_processes=2, dashboard=False, max_restarts=1) == [1, 1]
    assert (_open_fds(), threading.active_count()) == (fds, threads)


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
