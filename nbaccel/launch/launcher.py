"""`notebook_launcher` and `debug_launcher`: run a function on every process of this machine (or node).

Accelerate's arguments keep their names, defaults (except `use_port`: None picks a free port) and meaning.
The function and its arguments are cloudpickled once, here in the kernel; every worker reports over a
private pipe; the supervisor (supervisor.py) forwards output, gathers return values and stops all workers
on the first failure, an interrupt or the timeout.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

from .. import telemetry  # noqa: F401  (loaded here so forked workers inherit it instead of importing it)
from .arguments import check_arguments, parse_port
from .channel import Observer, close_quietly, open_channel
from .errors import LaunchError, LaunchTimeout
from .inprocess import run_in_process
from .observers import check_dashboard, make_dashboard
from .processes import (
    LocalProcesses,
    check_port_free,
    check_start_method,
    choose_start_method,
    free_port,
    gc_frozen,
    get_context,
    is_local_address,
    main_module_hidden,
    resource_tracker_scope,
    stop_processes,
)
from .saved_config import apply_saved_config, default
from .serialize import dumps_payload
from .supervisor import Supervisor, WorkerHandle
from .worker import DEVICE_ENV, elastic_entry, run_worker, xla_entry


def notebook_launcher(
    function: Callable[..., Any],
    args: Sequence[Any] = (),
    num_processes: int | None = None,
    mixed_precision: str = default("no"),
    use_port: int | str | None = None,
    master_addr: str = default("127.0.0.1"),
    node_rank: int = default(0),
    num_nodes: int = default(1),
    rdzv_backend: str = default("static"),
    rdzv_endpoint: str = "",
    rdzv_conf: dict[str, Any] | None = None,
    rdzv_id: str = "none",
    max_restarts: int = 0,
    monitor_interval: float = 0.1,
    log_line_prefix_template: str | None = None,
    *,
    start_method: str | None = None,
    dashboard: Any = "auto",
    kwargs: dict[str, Any] | None = None,
    timeout: float | None = None,
    observers: Sequence[Observer] = (),
) -> list[Any]:
    """Run `function(*args, **kwargs)` on `num_processes` processes of this node; return their results.

    The result is a list indexed by local rank. `num_processes=None` uses every visible GPU (8 TPU cores on
    a Colab/Kaggle TPU), else 1; with one process the function runs right here in the kernel. A failure on
    any rank stops all of them and raises `LaunchError`; interrupting the kernel stops them too. `timeout`
    (seconds) bounds the whole run. `observers` (callables taking a message dict) and the dashboard see
    every status, output line, metric and result message. `num_nodes > 1` or `max_restarts > 0` go
    through torch.distributed.elastic (`rdzv_backend="c10d"` with `rdzv_endpoint="host:port"`).

    Arguments left at their defaults take the saved launch configuration's values (`nbaccel config`,
    `config_widget()`; see docs/launcher.md), as does the workers' gradient accumulation.
    """
    kwargs = dict(kwargs or {})
    check_dashboard(dashboard)
    gpus = _visible_gpus()
    saved = apply_saved_config(num_processes=num_processes, mixed_precision=mixed_precision, use_port=use_port,
                               master_addr=master_addr, node_rank=node_rank, num_nodes=num_nodes,
                               rdzv_backend=rdzv_backend, start_method=start_method, gpus=gpus)
    num_processes, use_port, start_method = saved.num_processes, saved.use_port, saved.start_method
    master_addr, node_rank, num_nodes, rdzv_backend = (saved.master_addr, saved.node_rank, saved.num_nodes,
                                                       saved.rdzv_backend)
    mixed_precision = check_arguments(function, args, kwargs, num_processes, saved.mixed_precision, node_rank,
                                      num_nodes, max_restarts, monitor_interval, rdzv_backend, timeout)
    port = parse_port(use_port)
    check_start_method(start_method)
    if saved.use_cpu:
        gpus = 0  # the config says CPU: workers get NBACCEL_USE_CPU
    from .xla import tpu_requested

    if tpu_requested():
        return _launch_xla(function, tuple(args), kwargs, num_processes, mixed_precision, start_method,
                           dashboard, observers, timeout, saved.env)
    if num_processes is None:
        num_processes = gpus or 1
    elif gpus == 1 and num_processes > 1 and num_nodes == 1 and "google.colab" in sys.modules:
        print("Colab with one GPU: running the function in this process (as Accelerate does).", file=sys.stderr)
        num_processes = 1
    elif gpus and num_processes > gpus:
        raise ValueError(
            f"num_processes={num_processes} but only {gpus} GPU(s) are visible: nbaccel runs one process per "
            f"GPU. Pass num_processes<={gpus} (or hide the GPUs with CUDA_VISIBLE_DEVICES='' to use the CPU)."
        )
    if num_processes == 1 and num_nodes == 1 and max_restarts == 0:
        return run_in_process(function, tuple(args), kwargs, mixed_precision, dashboard, observers, timeout,
                              env=saved.env)
    method, note = choose_start_method(start_method)
    payload = dumps_payload(function, tuple(args), kwargs)  # before any process starts
    env = dict(_common_env(mixed_precision, use_cpu=not gpus), **saved.env)
    device = "cuda:{local_rank}" if gpus else "cpu"
    if note:
        print(note, file=sys.stderr)
    with resource_tracker_scope():
        return _launch_multi(payload, env, device, num_processes, num_nodes, node_rank, port, master_addr,
                             rdzv_backend, rdzv_endpoint, dict(rdzv_conf or {}), rdzv_id, max_restarts,
                             monitor_interval, log_line_prefix_template, method, dashboard, observers, timeout)


def _launch_multi(payload: bytes, env: dict[str, str], device: str, num_processes: int, num_nodes: int,
                  node_rank: int, port: int | None, master_addr: str, rdzv_backend: str, rdzv_endpoint: str,
                  rdzv_conf: dict[str, Any], rdzv_id: str, max_restarts: int, monitor_interval: float,
                  log_line_prefix_template: str | None, method: str, dashboard: Any,
                  observers: Sequence[Observer], timeout: float | None) -> list[Any]:
    if num_nodes > 1 or max_restarts > 0:
        return _launch_elastic(payload, env, device, num_processes, num_nodes, node_rank, port, master_addr,
                               rdzv_backend, rdzv_endpoint, rdzv_conf, rdzv_id, max_restarts,
                               monitor_interval, log_line_prefix_template, method, dashboard, observers,
                               timeout)
    if port is None:
        port = free_port(master_addr if is_local_address(master_addr) else "127.0.0.1")
    elif is_local_address(master_addr):
        check_port_free(port, "127.0.0.1" if master_addr in ("localhost", "0.0.0.0") else master_addr)
    return _launch_local(payload, env, device, num_processes, master_addr, port, method, dashboard,
                         observers, timeout)


def debug_launcher(function: Callable[..., Any], args: Sequence[Any] = (), num_processes: int = 2) -> list[Any]:
    """Run `function(*args)` on `num_processes` CPU processes (gloo), for tests and debugging.

    Same machinery as notebook_launcher (fork where safe, output forwarding, fail-fast), never a GPU, no
    dashboard. Returns the per-rank results.
    """
    mixed_precision = check_arguments(function, args, {}, num_processes, "no", 0, 1, 0, 0.1, "static", None)
    method, note = choose_start_method(None)
    if note:
        print(note, file=sys.stderr)
    payload = dumps_payload(function, tuple(args), {})
    env = dict(_common_env(mixed_precision, use_cpu=True), FORK_LAUNCHED="1")  # as Accelerate's debug_launcher
    with resource_tracker_scope():
        return _launch_local(payload, env, "cpu", num_processes, "127.0.0.1", free_port(), method, False, (),
                             None)


def _visible_gpus() -> int:
    """CUDA/ROCm devices torch sees (without initializing CUDA in the kernel)."""
    import torch

    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


def _in_kernel() -> bool:
    from ..notebook.live_output import in_kernel

    return in_kernel()


def _common_env(mixed_precision: str, use_cpu: bool) -> dict[str, str]:
    env = {"NBACCEL_MIXED_PRECISION": mixed_precision, "ACCELERATE_MIXED_PRECISION": mixed_precision}
    if _in_kernel():  # spawned ranks make a display publisher of their own (rank_display.py)
        env["NBACCEL_RICH_DISPLAY"] = "1"
    if use_cpu:
        env["NBACCEL_USE_CPU"] = env["ACCELERATE_USE_CPU"] = "1"
        if sys.platform.startswith("linux") and "GLOO_SOCKET_IFNAME" not in os.environ:
            env["GLOO_SOCKET_IFNAME"] = "lo"  # hostname-based interface lookup is flaky on VMs
    return env


# ---------------------------------------------------------------------------------------------- paths
class _Pipes:
    """Channel and stdout/stderr pipes of each local rank: kernel ends (read) and worker ends (write)."""

    def __init__(self, ctx: Any, count: int) -> None:
        self.channels: list[Connection] = []
        self.worker_channels: list[Connection] = []
        self.out_fds: list[int] = []
        self.err_fds: list[int] = []
        self.worker_out: list[Connection] = []
        self.worker_err: list[Connection] = []
        for _ in range(count):
            self.add(ctx)

    def add(self, ctx: Any) -> None:
        kernel_end, worker_end = open_channel(ctx)
        self.channels.append(kernel_end)
        self.worker_channels.append(worker_end)
        for fds, ends in ((self.out_fds, self.worker_out), (self.err_fds, self.worker_err)):
            read_fd, write_fd = os.pipe()
            fds.append(read_fd)
            ends.append(Connection(write_fd, readable=False))

    def worker_ends(self, i: int | None = None) -> list[Any]:
        if i is None:
            return [*self.worker_channels, *self.worker_out, *self.worker_err]
        return [self.worker_channels[i], self.worker_out[i], self.worker_err[i]]

    def handles(self, first_rank: int) -> list[WorkerHandle]:
        return [WorkerHandle(i, first_rank + i, self.channels[i], self.out_fds[i], self.err_fds[i])
                for i in range(len(self.channels))]

    def close_all(self) -> None:
        close_quietly(*self.channels, *self.worker_ends(), *self.out_fds, *self.err_fds)


def _launch_local(payload: bytes, env: dict[str, str], device: str, num_processes: int, master_addr: str,
                  port: int, method: str, dashboard: Any, observers: Sequence[Observer],
                  timeout: float | None, node_rank: int = 0, num_nodes: int = 1) -> list[Any]:
    ctx = get_context(method)
    pipes = _Pipes(ctx, 0)  # each rank's pipes are made right before it starts: no rank inherits another's
    processes: list[Any] = []
    world_size = num_processes * num_nodes
    with gc_frozen(method):
        return _start_and_supervise(ctx, pipes, processes, payload, env, device, num_processes, master_addr,
                                    port, method, dashboard, observers, timeout, node_rank, world_size)


def _start_and_supervise(ctx: Any, pipes: _Pipes, processes: list[Any], payload: bytes, env: dict[str, str],
                         device: str, num_processes: int, master_addr: str, port: int, method: str,
                         dashboard: Any, observers: Sequence[Observer], timeout: float | None, node_rank: int,
                         world_size: int) -> list[Any]:
    try:
        for local_rank in range(num_processes):
            rank = node_rank * num_processes + local_rank
            worker_env = dict(env, RANK=str(rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world_size),
                              LOCAL_WORLD_SIZE=str(num_processes), GROUP_RANK=str(node_rank),
                              MASTER_ADDR=master_addr, MASTER_PORT=str(port))
            worker_env[DEVICE_ENV] = device.format(local_rank=local_rank)
            pipes.add(ctx)
            channel, out, err = pipes.worker_ends(local_rank)
            proc = ctx.Process(target=run_worker, args=(payload, channel, out, err, worker_env),
                               name=f"nbaccel-rank-{rank}")
            with main_module_hidden(method):
                proc.start()
            processes.append(proc)
            close_quietly(channel, out, err)  # the worker holds them now; end of stream when it exits
    except BaseException:
        stop_processes(processes)
        pipes.close_all()
        raise
    info = dict(start_method=method, world_size=world_size, port=port, device=device.split(":")[0])
    return _supervise(pipes.handles(node_rank * num_processes), LocalProcesses(processes), num_processes,
                      dashboard, observers, timeout, info)


def _launch_elastic(payload: bytes, env: dict[str, str], device: str, num_processes: int, num_nodes: int,
                    node_rank: int, port: int | None, master_addr: str, rdzv_backend: str, rdzv_endpoint: str,
                    rdzv_conf: dict[str, Any], rdzv_id: str, max_restarts: int, monitor_interval: float,
                    log_line_prefix_template: str | None, method: str, dashboard: Any,
                    observers: Sequence[Observer], timeout: float | None) -> list[Any]:
    from .elastic import ElasticBackend

    if not rdzv_endpoint:
        if port is None:
            if num_nodes > 1:
                raise ValueError(
                    "num_nodes > 1 needs a meeting point every node knows: pass rdzv_endpoint='host:port' "
                    "(with rdzv_backend='c10d') or use_port=... together with master_addr"
                )
            port = free_port()
        elif node_rank == 0 and is_local_address(master_addr) and rdzv_backend == "static":
            check_port_free(port)
        rdzv_endpoint = f"{master_addr}:{port}"
    if rdzv_backend == "static":
        rdzv_conf.setdefault("rank", node_rank)
    env = dict(env)
    env[DEVICE_ENV] = device
    ctx = get_context(method)
    pipes = _Pipes(ctx, num_processes)
    try:
        backend = ElasticBackend(
            entry=elastic_entry, entry_args=(payload, pipes.worker_channels, pipes.worker_out, pipes.worker_err, env),
            worker_ends=pipes.worker_ends(), nproc_per_node=num_processes, num_nodes=num_nodes,
            rdzv_backend=rdzv_backend, rdzv_endpoint=rdzv_endpoint, rdzv_conf=rdzv_conf, rdzv_id=rdzv_id,
            max_restarts=max_restarts, monitor_interval=monitor_interval, start_method=method,
            log_line_prefix_template=log_line_prefix_template,
        )
        backend.start()
    except BaseException:
        pipes.close_all()
        raise
    info = dict(start_method=method, world_size=num_processes * num_nodes, node_rank=node_rank,
                num_nodes=num_nodes, rdzv_backend=rdzv_backend, device=device.split(":")[0])
    return _supervise(pipes.handles(node_rank * num_processes), backend, num_processes, dashboard, observers,
                      timeout, info)


def _launch_xla(function: Callable[..., Any], args: tuple, kwargs: dict, num_processes: int | None,
                mixed_precision: str, start_method: str | None, dashboard: Any,
                observers: Sequence[Observer], timeout: float | None,
                extra_env: dict[str, str] | None = None) -> list[Any]:
    from .xla import TPU_CORES, import_xmp, local_device_count

    import_xmp()  # a clear ImportError before anything else
    count, source = (1, "") if num_processes == 1 else local_device_count()  # 1: in this process, any device count
    if count is not None and num_processes is not None and num_processes != count:
        raise ValueError(
            f"num_processes={num_processes}, but torch_xla runs one process per XLA device and this machine "
            f"has {count} ({source}): pass num_processes=None (or {count}), or 1 to run in this process. "
            "Fewer devices: set TPU_VISIBLE_CHIPS (TPU) or CPU_NUM_DEVICES (PJRT_DEVICE=CPU) before launching."
        )
    nprocs = count or num_processes or TPU_CORES
    if nprocs == 1:
        return run_in_process(function, args, kwargs, mixed_precision, dashboard, observers, timeout,
                              env=extra_env)
    method = start_method or "fork"
    payload = dumps_payload(function, args, kwargs)
    env = dict(_common_env(mixed_precision, use_cpu=False), FORK_LAUNCHED="1", **(extra_env or {}))  # as Accelerate on TPU
    ctx = get_context(method)
    pipes = _Pipes(ctx, nprocs)
    with resource_tracker_scope():
        return _run_xla(pipes, payload, env, nprocs, count is not None, method, dashboard, observers, timeout)


def _run_xla(pipes: _Pipes, payload: bytes, env: dict[str, str], nprocs: int, count_known: bool,
             method: str, dashboard: Any, observers: Sequence[Observer], timeout: float | None) -> list[Any]:
    from .xla import XlaBackend

    try:
        backend = XlaBackend(entry=xla_entry,
                             entry_args=(payload, pipes.worker_channels, pipes.worker_out, pipes.worker_err, env),
                             worker_ends=pipes.worker_ends(), start_method=method, count_known=count_known)
        backend.start()
    except BaseException:
        pipes.close_all()
        raise
    info = dict(start_method=method, world_size=nprocs, device="xla")
    return _supervise(pipes.handles(0), backend, nprocs, dashboard, observers, timeout, info)


def _supervise(handles: list[WorkerHandle], backend: Any, num_processes: int, dashboard: Any,
               observers: Sequence[Observer], timeout: float | None, info: dict[str, Any]) -> list[Any]:
    """Run the supervisor with the dashboard and observers; report the launch's start and end to them."""
    try:
        handle = make_dashboard(dashboard, num_processes, **info)
    except BaseException:
        backend.stop()
        close_quietly(*(h.channel for h in handles), *(h.stdout_fd for h in handles), *(h.stderr_fd for h in handles))
        raise
    listeners = list(observers) + ([handle.observer] if handle else [])
    supervisor = Supervisor(handles, backend, listeners, timeout=timeout)  # streams looked up per write
    if handle:
        handle.start()
    supervisor.notify({"kind": "launch", "state": "started", "rank": None, "time": time.time(),
                       "num_processes": num_processes, **info})
    results: list[Any] | None = None
    state = "failed"
    try:
        results = supervisor.run()
        state = "finished"
        return results
    except LaunchTimeout:
        state = "timeout"
        raise
    except LaunchError:
        raise
    except KeyboardInterrupt:
        state = "interrupted"
        raise
    finally:
        supervisor.notify({"kind": "launch", "state": state, "rank": None, "time": time.time()})
        if handle:
            handle.close(results=results, failures=supervisor.failures or None)
