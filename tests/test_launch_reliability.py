"""Faults provoked on purpose (issue 15): leaks over many launches, a killed kernel, a busy port."""

from __future__ import annotations

import os
import threading

import pytest
import torch  # noqa: F401  (imported here so forked workers inherit it)

from nbaccel.launch import notebook_launcher

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
