"""A stand-in for the parts of torch_xla 2.x (PJRT) that notebook_launcher's TPU path uses, for CI.

It lays replicas out as torch_xla does: `xmp.spawn` accepts only nprocs None or 1, starts its processes
with a ProcessPoolExecutor, and runs one thread per device in each, calling `fn(global_ordinal, *args)`.
`install(monkeypatch, processes, threads)` gives TPU v2/v3 and the CPU device (1 x N threads) or TPU v4+
(N x 1). The real thing is exercised by scripts/test-xla.
"""

from __future__ import annotations

import concurrent.futures
import functools
import multiprocessing
import os
import sys
import threading
import types

PROCESSES_ENV, THREADS_ENV = "FAKE_XLA_PROCESSES", "FAKE_XLA_THREADS"
_replica = threading.local()  # `ordinal`: set in each replica thread
spawn_calls: list[tuple] = []


def _processes() -> int:
    return int(os.environ[PROCESSES_ENV])


def _threads() -> int:
    return int(os.environ[THREADS_ENV])


def spawn(fn, args=(), nprocs=None, start_method="spawn"):
    spawn_calls.append((nprocs, start_method))
    if nprocs == 1:
        return fn(0, *args)
    if nprocs is not None:
        raise ValueError(f"Unsupported nprocs ({nprocs}). Please use nprocs=1 or None (default).")
    context = multiprocessing.get_context(start_method)
    with concurrent.futures.ProcessPoolExecutor(max_workers=_processes(), mp_context=context) as executor:
        list(executor.map(functools.partial(_run_process, fn=fn, args=args), range(_processes())))


def _run_process(process: int, fn, args) -> None:
    os.environ["PJRT_LOCAL_PROCESS_RANK"] = str(process)

    def replica(ordinal: int) -> None:
        _replica.ordinal = ordinal
        fn(ordinal, *args)

    first = process * _threads()
    with concurrent.futures.ThreadPoolExecutor(max_workers=_threads()) as threads:
        list(threads.map(replica, range(first, first + _threads())))


def _ordinal() -> int:
    return _replica.ordinal


def install(monkeypatch, processes: int, threads: int) -> None:
    """Make `import torch_xla...` find this stand-in (inherited by forked children) on a 'TPU' machine."""
    monkeypatch.setenv(PROCESSES_ENV, str(processes))
    monkeypatch.setenv(THREADS_ENV, str(threads))
    monkeypatch.setenv("PJRT_DEVICE", "TPU")
    spawn_calls.clear()
    package = types.ModuleType("torch_xla")
    package.__path__ = []
    package._XLAC = types.SimpleNamespace(_xla_runtime_is_initialized=lambda: False,
                                          _xla_get_replication_devices_count=lambda: 0)
    distributed = types.ModuleType("torch_xla.distributed")
    xmp = types.ModuleType("torch_xla.distributed.xla_multiprocessing")
    xmp.spawn = spawn
    runtime = types.ModuleType("torch_xla.runtime")
    runtime.addressable_device_count = _threads
    runtime.global_ordinal = _ordinal
    runtime.local_ordinal = _ordinal  # one host
    runtime.world_size = lambda: processes * threads
    internal = types.ModuleType("torch_xla._internal")
    tpu = types.ModuleType("torch_xla._internal.tpu")
    tpu.num_available_devices = lambda: processes * threads
    package.distributed, package.runtime, package._internal = distributed, runtime, internal
    distributed.xla_multiprocessing, internal.tpu = xmp, tpu
    for name, module in [("torch_xla", package), ("torch_xla.distributed", distributed),
                         ("torch_xla.distributed.xla_multiprocessing", xmp), ("torch_xla.runtime", runtime),
                         ("torch_xla._internal", internal), ("torch_xla._internal.tpu", tpu)]:
        monkeypatch.setitem(sys.modules, name, module)
