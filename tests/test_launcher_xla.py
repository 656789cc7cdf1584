"""notebook_launcher's TPU path (torch_xla's xmp.spawn) against a stand-in laid out as torch_xla 2.x lays
replicas out: several ranks as threads of one process (TPU v2/v3, the CPU device) or one rank per process
(TPU v4+). scripts/test-xla runs the same path on real torch_xla."""

from __future__ import annotations

import os
import sys
import threading
import time

import fake_torch_xla
import pytest
from process_helpers import live_children

from nbaccel.launch import LaunchError, notebook_launcher


def launch(function, args=(), **options):
    options.setdefault("dashboard", False)
    options.setdefault("timeout", 60)
    return notebook_launcher(function, args, **options)


def where(scale):
    import torch_xla.runtime as xr

    from nbaccel import telemetry

    rank = xr.global_ordinal()
    time.sleep(0.05 * (xr.world_size() - rank))  # the last rank finishes first: results still in rank order
    print(f"replica {rank} of {xr.world_size()} in pid {os.getpid()}")
    print(f"replica {rank} warns", file=sys.stderr)
    telemetry.log_metrics({"loss": 10.0 + rank}, step=1)
    return rank * scale, os.environ["NBACCEL_MIXED_PRECISION"], threading.current_thread().name


@pytest.mark.parametrize("processes, threads", [(1, 2), (2, 1)], ids=["threads-in-one-process", "process-per-rank"])
def test_results_output_and_metrics_per_rank(monkeypatch, capsys, processes, threads):
    fake_torch_xla.install(monkeypatch, processes, threads)
    messages = []
    results = launch(where, (10,), mixed_precision="bf16", observers=[messages.append])
    assert [r[:2] for r in results] == [(0, "bf16"), (10, "bf16")]
    assert fake_torch_xla.spawn_calls == [(None, "fork")]  # torch_xla 2.x refuses any nprocs but None and 1
    out, err = capsys.readouterr()
    pids = set()
    for rank in range(2):  # each rank's lines on its own stream, once, whichever thread wrote them
        [line] = [line for line in out.splitlines() if line.startswith(f"[rank {rank}] replica {rank} of 2")]
        pids.add(line.split()[-1])
        assert err.splitlines().count(f"[rank {rank}] replica {rank} warns") == 1
    assert len(pids) == processes
    logged = {(m["rank"], m["values"]["loss"]) for m in messages if m["kind"] == "metrics"}
    assert logged == {(0, 10.0), (1, 11.0)}
    assert live_children() == []


def test_a_failing_thread_rank_is_named_and_the_others_are_stopped(monkeypatch):
    fake_torch_xla.install(monkeypatch, 1, 2)

    def broken():
        import torch_xla.runtime as xr

        if xr.global_ordinal() == 1:
            raise ValueError("ordinal one fails")
        time.sleep(60)

    began = time.monotonic()
    with pytest.raises(LaunchError, match="rank 1: ValueError: ordinal one fails") as caught:
        launch(broken)
    assert time.monotonic() - began < 10
    assert set(caught.value.failures) == {1}
    assert live_children() == []
    assert [r[0] for r in launch(where, (1,))] == [0, 1]  # the next launch works at once


def test_num_processes_must_match_the_devices(monkeypatch):
    fake_torch_xla.install(monkeypatch, 1, 2)
    with pytest.raises(ValueError, match=r"num_processes=8, but .* has 2 \(TPU devices on this machine\)"):
        launch(where, (1,), num_processes=8)
    assert fake_torch_xla.spawn_calls == []  # refused before anything started
    assert [r[0] for r in launch(where, (1,), num_processes=2)] == [0, 1]


def test_one_process_runs_in_the_kernel(monkeypatch):
    fake_torch_xla.install(monkeypatch, 1, 2)
    assert launch(lambda: os.getpid(), num_processes=1) == [os.getpid()]
    assert fake_torch_xla.spawn_calls == []


def test_cpu_device_count_comes_from_cpu_num_devices(monkeypatch):
    from nbaccel.launch.kernel.devices import local_device_count

    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    monkeypatch.setenv("CPU_NUM_DEVICES", "3")
    assert local_device_count() == (3, "CPU_NUM_DEVICES=3")
    monkeypatch.delenv("CPU_NUM_DEVICES")
    assert local_device_count() == (1, "CPU_NUM_DEVICES=1")  # torch_xla's default
    monkeypatch.setenv("CPU_NUM_DEVICES", "two")
    with pytest.raises(ValueError, match=r"CPU_NUM_DEVICES='two': set it to the number of XLA CPU devices"):
        local_device_count()
    monkeypatch.setenv("CPU_NUM_DEVICES", "0")
    with pytest.raises(ValueError, match="CPU_NUM_DEVICES='0'"):
        local_device_count()
    monkeypatch.setenv("PJRT_DEVICE", "CUDA")
    assert local_device_count()[0] is None
