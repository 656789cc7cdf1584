"""One launch, resolved: `build_plan(request)` validates and defaults everything once, before anything starts.

`LaunchRequest` is what the caller asked (notebook_launcher's or debug_launcher's arguments); `LaunchPlan`
is what will run where: the placement (in this process, local processes, torch elastic, torch_xla, SSH hosts, a
SLURM allocation) apart from the program (a function, a persistent pool, a script), the process
counts, the start method, the address and port or rendezvous, the device, and the environment every worker
shares (built by nbaccel.launch.rank_environment). Every bad-input error is raised here. `plan.ranks()` gives
each local rank's `RankSpec` (its identity); `plan.rank_environ(i)` is local rank i's whole environment and
`plan.agent_environ()` the one torch elastic's agent hands every rank it starts. The launch's private folders
(its FileStore, its large results) are named once, before any process starts, by `with_folders`.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType, SimpleNamespace
from typing import TYPE_CHECKING, Any

from ...utils.constants import (
    INIT_METHOD_ENV,
    LAUNCH_DEVICE_ENV,
    LOOPBACK_RDZV_BACKEND,
    MIXED_PRECISION_CHOICES,
    RANK_GROUPS_ENV,
    RDZV_BACKENDS,
)
from ...utils.process_limits import check_process_count
from ..hang_report import EXIT_HANG_GRACE, exit_hang_grace
from ..rank_environment import RankSpec, WorkerConfig, visible_gpus, worker_environment
from ..shared_tensors import RESULT_DIR_ENV
from ..views import views
from .addresses import bind_address, check_port_free, free_port, is_local_address, is_loopback_address
from .devices import TPU_CORES, import_xmp, local_device_count, tpu_requested
from .forwarded_env import forwarded_environment
from .hosts import RAY, resolve_hosts
from .saved_config import apply_saved_config, default, is_default, plain
from .start_methods import check_start_method, choose_start_method

logger = logging.getLogger(__name__)  # notices: records of nbaccel.launch (utils/notices.py)

if TYPE_CHECKING:
    from .hosts import HostSet

# Accelerate's order in its "Unknown mixed_precision mode" message (PrecisionType's order)
PRECISION_MESSAGE_ORDER = ("no", "fp8", "fp16", "bf16")
POOL_PG_MARGIN = 10.0  # RankPool: the process group's own timeout is the pool's timeout plus this (a backstop)
assert set(PRECISION_MESSAGE_ORDER) == set(MIXED_PRECISION_CHOICES)


class Placement(str, Enum):
    """Where the ranks run: the key of the backend registry (kernel/placements.py), one class each."""

    IN_PROCESS = "in-process"  # one process: the function runs in the kernel, as Accelerate does
    LOCAL = "local"  # processes started here (fork/spawn/forkserver)
    ELASTIC = "elastic"  # torch.distributed.elastic's agent (several nodes, restarts; torchrun for scripts)
    XLA = "xla"  # torch_xla's spawn (TPU; PJRT CPU devices)
    SSH = "ssh"  # several hosts, one agent per host started over SSH (kernel/ssh_backend.py)
    SLURM = "slurm"  # the hosts of a SLURM allocation, one agent per host started by srun
    RAY = "ray"  # the nodes of a Ray cluster, one agent per node in a Ray actor (kernel/ray_backend.py)


class Program(str, Enum):
    """What the ranks run, whatever the placement."""

    FUNCTION = "function"  # notebook_launcher's function: each rank returns its result, then exits
    POOL = "pool"  # RankPool's rank loop (worker/pool_rank.py): each rank serves commands until stopped
    SCRIPT = "script"  # `nbaccel launch`: a script, module or program on each rank (`LaunchPlan.script`)


@dataclass(frozen=True)
class LaunchRequest:
    """The arguments of one `notebook_launcher` (or `debug_launcher`) call, or of one `RankPool` (`program`
    POOL, no function), as given."""

    function: Callable[..., Any] | None
    args: Any = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    num_processes: int | None = None
    mixed_precision: Any = default("no")  # marked defaults: the saved configuration may fill them in
    use_port: int | str | None = None
    master_addr: str = default("127.0.0.1")
    node_rank: int = default(0)
    num_nodes: int = default(1)
    rdzv_backend: str = default("static")
    rdzv_endpoint: str = ""
    rdzv_conf: Mapping[str, Any] | None = None
    rdzv_id: str = "none"
    max_restarts: int = 0
    monitor_interval: float = 0.1
    log_line_prefix_template: str | None = None
    start_method: str | None = None
    timeout: float | None = None
    hosts: Any = None  # several machines: host names as ssh knows them, or "slurm" (kernel/hosts.py)
    env_vars: Any = None  # hosts=: more of the kernel's variables for the ranks (kernel/forwarded_env.py)
    debug_launcher: bool = False  # CPU only, no saved configuration, FORK_LAUNCHED set (Accelerate's debug_launcher)
    program: Program = Program.FUNCTION  # POOL: RankPool's ranks (its `timeout` bounds each collective)
    # Program.SCRIPT (`nbaccel launch`, its options already checked and merged with the config file by
    # commands/launch.py): what each rank runs, and the settings that reach the ranks (their environment)
    script: ScriptTarget | None = None
    worker: WorkerConfig | None = None
    use_cpu: bool = False


@dataclass(frozen=True)
class Rendezvous:
    """torch elastic's settings for this node."""

    backend: str
    endpoint: str
    conf: Mapping[str, Any]
    run_id: str
    max_restarts: int
    monitor_interval: float
    log_line_prefix_template: str | None


@dataclass(frozen=True)
class ScriptTarget:
    """What each rank of `nbaccel launch` runs, and torchrun's options for it (Accelerate's names)."""

    script: str  # a file, a module (`module`) or, with `no_python`, a program
    args: tuple[str, ...] = ()
    module: bool = False
    no_python: bool = False
    role: str = "default"
    log_dir: str | None = None  # torchrun's log folder (None: a private one, removed afterwards)
    tee: str | None = None
    quiet: bool = False  # -q: nbaccel launch's own notes left out; torch's agent messages stay, as under accelerate launch -q
    same_network: bool = False  # several machines: torchrun's static master address instead of a rendezvous


@dataclass(frozen=True)
class LaunchPlan:
    """What runs where, with which environment; frozen once built."""

    placement: Placement
    num_processes: int  # ranks on this node (over SSH/SLURM: on each host)
    mixed_precision: str
    start_method: str
    device: str  # "cpu", "xla" or "cuda:{local_rank}" (filled per rank)
    environ: Mapping[str, str]  # shared by every worker of the launch
    num_nodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    port: int | None = None
    rendezvous: Rendezvous | None = None
    start_note: str | None = None  # why the start method was chosen, shown to the user
    xla_count_known: bool = True  # torch_xla: the device count was read (else ranks may not all start)
    # the supervision policy, one meaning per front door: notebook_launcher's `timeout`, the seconds the whole
    # launch may run before every rank is stopped (None: no limit); RankPool: None, a pool lives until it is
    # stopped (its `timeout` bounds each collective of a call: pool/call.py, and sets the process group's
    # timeout in `environ`); `nbaccel launch`: None (torch elastic's own rendezvous and process group timeouts)
    timeout: float | None = None
    script: ScriptTarget | None = None  # Program.SCRIPT: the script every rank runs
    hosts: HostSet | None = None  # Placement.SSH/SLURM/RAY: the hosts, num_processes ranks on each
    program: Program = Program.FUNCTION
    # seconds a rank that finished its work gets to end its process before it is named stuck and stopped
    # (NBACCEL_EXIT_HANG_GRACE, read once here; the supervisor and `nbaccel launch`'s watch use this value)
    exit_grace: float = EXIT_HANG_GRACE

    @property
    def supervised_ranks(self) -> int:
        """The ranks the kernel watches: every rank of every host over SSH, else this node's."""
        return self.world_size if self.hosts is not None else self.num_processes

    @property
    def world_size(self) -> int:
        return self.num_processes * self.num_nodes

    @property
    def first_rank(self) -> int:
        return self.node_rank * self.num_processes

    def rank(self, local_rank: int) -> RankSpec:
        """The identity of local rank `local_rank` of this node."""
        return RankSpec(rank=self.first_rank + local_rank, local_rank=local_rank, world_size=self.world_size,
                        local_world_size=self.num_processes, node_rank=self.node_rank,
                        master_addr=self.master_addr, master_port=self.port or 0,
                        device=self.device.format(local_rank=local_rank))

    def ranks(self) -> list[RankSpec]:
        return [self.rank(i) for i in range(self.num_processes)]

    def rank_environ(self, local_rank: int) -> dict[str, str]:
        """The whole environment of local rank `local_rank`: the launch's variables and the rank's own."""
        return self.rank(local_rank).environ(self.environ)

    def agent_environ(self) -> dict[str, str]:
        """The environment torch elastic's agent gives every rank it starts (it adds RANK, LOCAL_RANK, ...
        itself): the launch's variables and the device, whose `{local_rank}` the rank fills in."""
        return {**self.environ, LAUNCH_DEVICE_ENV: self.device}

    def with_folders(self, store_dir: str | None = None, result_dir: str | None = None,
                     groups_dir: str | None = None) -> LaunchPlan:
        """This plan with its private folders in the workers' environment: the FileStore's folder (the ranks'
        process group meets there, `NBACCEL_INIT_METHOD`), the folder of large results (`NBACCEL_RESULT_DIR`)
        and the folder where each rank registers its process group (`NBACCEL_RANK_GROUPS`, rank_groups.py).
        Called once, by the launcher, before any process starts."""
        environ = dict(self.environ)
        if groups_dir is not None:
            environ[RANK_GROUPS_ENV] = groups_dir
        if store_dir is not None:
            environ[INIT_METHOD_ENV] = "file://" + os.path.join(store_dir, "store")
        if result_dir is not None:
            environ[RESULT_DIR_ENV] = result_dir
        return dataclasses.replace(self, environ=MappingProxyType(environ))

    def restarted(self, attempt: int, max_restarts: int) -> LaunchPlan:
        """This plan for its `attempt`-th restart (0: the first run): the ranks read the count where torch
        elastic puts it (TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS)."""
        if not max_restarts:
            return self
        environ = {**self.environ, "TORCHELASTIC_RESTART_COUNT": str(attempt),
                   "TORCHELASTIC_MAX_RESTARTS": str(max_restarts)}
        return dataclasses.replace(self, environ=MappingProxyType(environ))

    def info(self) -> dict[str, Any]:
        """What the `launch` message and the dashboard are told about this launch, the header's fields."""
        device = self.device.split(":")[0]
        if self.placement is Placement.LOCAL:
            return dict(start_method=self.start_method, world_size=self.world_size,
                        rendezvous=self.rendezvous_text(), device=device)
        if self.placement is Placement.ELASTIC:
            return dict(start_method=self.start_method, world_size=self.world_size, node_rank=self.node_rank,
                        num_nodes=self.num_nodes, rendezvous=self.rendezvous_text(), device=device)
        if self.placement is Placement.XLA:
            return dict(start_method=self.start_method, world_size=self.world_size, device="xla")
        if self.hosts is not None:
            assert self.hosts is not None
            return dict(start_method=self.hosts.via, world_size=self.world_size, hosts=list(self.hosts.names),
                        device=device)
        return dict(start_method="in-process")

    def rendezvous_text(self) -> str:
        """Where the ranks' process group really meets: the private FileStore (`with_folders`; nothing listens
        on the network, MASTER_PORT is only set for code that reads it), torch elastic's store on loopback
        (one node) or its rendezvous endpoint (several nodes), else master_addr:port."""
        if INIT_METHOD_ENV in self.environ:
            return "file store (private)"
        if self.placement is Placement.ELASTIC:
            assert self.rendezvous is not None
            if self.num_nodes == 1:  # kernel/elastic.py: one agent, every store on loopback
                host, colon, port = self.rendezvous.endpoint.rpartition(":")
                return f"loopback store, port {port}" if colon and port.isdigit() else "loopback store"
            return f"{self.rendezvous.backend} at {self.rendezvous.endpoint}"
        return f"{self.master_addr}:{self.port}"


# ------------------------------------------------------------------------------------------ validation
def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(name: str, value: Any, least: int, wanted: str, below: int | None = None) -> None:
    """TypeError for a value that is no int (Accelerate's launcher fails with one for a str, a float or a numpy
    int), ValueError for an int out of range; both say what is wanted."""
    if not is_int(value):
        raise TypeError(f"{name} must be {wanted}, got {value!r} ({type(value).__name__})")
    if value < least or (below is not None and value >= below):
        raise ValueError(f"{name} must be {wanted}, got {value!r}")


def check_request(request: LaunchRequest, resolved: Any) -> str:
    """Raise ValueError/TypeError naming the bad argument; return the mixed precision normalized.
    `resolved`: the arguments after the saved configuration filled in those left at their defaults
    (num_processes, node_rank, num_nodes, rdzv_backend, mixed_precision)."""
    function, args = request.function, request.args
    num_processes, node_rank, num_nodes = resolved.num_processes, resolved.node_rank, resolved.num_nodes
    if not callable(function):
        raise TypeError(f"function must be callable, got {type(function).__name__}")
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"args must be a tuple of positional arguments, got {type(args).__name__}")
    if not isinstance(request.kwargs, Mapping) or not all(isinstance(name, str) for name in request.kwargs):
        raise TypeError(f"kwargs must be a dict of keyword arguments (name: value), got {request.kwargs!r:.80}")
    if num_processes is not None:
        check_int("num_processes", num_processes, 1, "a positive int, or None for all devices")
        check_process_count(num_processes)  # before anything starts: descriptors, memory, cores
    check_int("num_nodes", num_nodes, 1, "a positive int")
    check_int("node_rank", node_rank, 0, f"an int in [0, num_nodes={num_nodes})", below=num_nodes)
    check_int("max_restarts", request.max_restarts, 0, "an int >= 0")
    interval = request.monitor_interval
    if not isinstance(interval, (int, float)) or isinstance(interval, bool):
        raise TypeError(f"monitor_interval must be a number of seconds, got {interval!r} ({type(interval).__name__})")
    if not 0 < interval <= threading.TIMEOUT_MAX:  # nan and inf too: the agent's time.sleep refuses them later
        raise ValueError(f"monitor_interval must be a number of seconds > 0 (at most {threading.TIMEOUT_MAX:.0f}), "
                         f"got {interval!r}")
    check_rendezvous_backend(resolved.rdzv_backend)
    check_timeout(request.timeout)
    precision = check_precision(resolved.mixed_precision)
    check_call(function, args, request.kwargs)
    return precision


def check_rendezvous_backend(rdzv_backend: Any) -> None:
    if rdzv_backend not in RDZV_BACKENDS:
        raise ValueError(f"rdzv_backend must be one of {RDZV_BACKENDS}, got {rdzv_backend!r}")


def check_timeout(timeout: Any) -> None:
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not timeout > 0):
        raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")


def check_seconds(value: Any, name: str) -> float:
    """`value` as a positive number of seconds (RankPool's timeout, of the pool or of one call), else ValueError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    return float(value)


def normalize_precision(mixed_precision: Any) -> Any:
    precision = mixed_precision.lower() if isinstance(mixed_precision, str) else mixed_precision
    return getattr(precision, "value", precision)  # a PrecisionType member


def check_precision(mixed_precision: Any) -> str:
    precision = normalize_precision(mixed_precision)
    if precision not in MIXED_PRECISION_CHOICES:
        raise ValueError(f"Unknown mixed_precision mode: {mixed_precision!r}. "
                         f"Choose between {list(PRECISION_MESSAGE_ORDER)}.")
    return precision


def check_call(function: Callable[..., Any], args: Any, kwargs: Mapping[str, Any]) -> None:
    """Raise TypeError when `function` cannot be called with these arguments (before anything starts)."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return  # builtins without a signature: let the call decide
    try:
        signature.bind(*args, **kwargs)
    except TypeError as exc:
        name = getattr(function, "__qualname__", repr(function))
        raise TypeError(
            f"{name}{signature} cannot be called with args={tuple(args)!r} and kwargs={dict(kwargs)!r}: {exc}"
        ) from None


def parse_port(use_port: Any) -> int | None:
    """`use_port` (int or digit string, Accelerate passes "29500") as an int; None stays None."""
    if use_port is None:
        return None
    try:
        port = int(use_port)
    except (TypeError, ValueError):
        port = -1
    if not 0 < port < 65536 or isinstance(use_port, bool):
        raise ValueError(f"use_port must be a port number 1-65535 (or None for a free port), got {use_port!r}")
    return port


# ------------------------------------------------------------------------------------------ the plan
def build_plan(request: LaunchRequest) -> LaunchPlan:
    """Resolve `request` into a frozen plan: saved configuration, device counts, start method, port or
    rendezvous, the placement (this process, local, elastic, XLA, SSH hosts, SLURM) and the program, the
    timeout. Raises every bad-input error; starts nothing. notebook_launcher's (with or without hosts) and
    RankPool's and `nbaccel launch`'s (program script, from its checked settings: commands/launch.py) too."""
    exit_grace = exit_hang_grace()  # a bad NBACCEL_EXIT_HANG_GRACE is refused now, before any rank starts
    if request.program is Program.POOL:
        plan = _pool_plan(request)
    elif request.program is Program.SCRIPT:
        plan = _script_plan(request)
    elif request.hosts is not None:
        plan = _host_plan(request)
    else:
        plan = dataclasses.replace(_resolve(request), timeout=request.timeout)
    return dataclasses.replace(plan, exit_grace=exit_grace)


def _resolve(request: LaunchRequest) -> LaunchPlan:
    if request.debug_launcher:
        return _debug_plan(request)
    gpus = visible_gpus()
    saved = apply_saved_config(request, gpus)
    num_processes, num_nodes, node_rank = saved.num_processes, saved.num_nodes, saved.node_rank
    precision = check_request(request, saved)
    port = parse_port(saved.use_port)
    check_start_method(saved.start_method)
    if saved.use_cpu:
        gpus = 0  # the config says CPU: workers get NBACCEL_USE_CPU
    if tpu_requested():
        return _xla_plan(request, saved, precision)
    if num_processes is None:
        num_processes = gpus or 1
    elif gpus == 1 and num_processes > 1 and num_nodes == 1 and "google.colab" in sys.modules:
        logger.warning("Colab with one GPU: running the function in this process (as Accelerate does).")
        num_processes = 1
    elif gpus and num_processes > gpus:
        raise ValueError(
            f"num_processes={num_processes} but only {gpus} GPU(s) are visible: nbaccel runs one process per "
            f"GPU. Pass num_processes<={gpus} (or hide the GPUs with CUDA_VISIBLE_DEVICES='' to use the CPU)."
        )
    elastic = num_nodes > 1 or request.max_restarts > 0
    master_addr = saved.master_addr
    loopback = not elastic or is_loopback_address(master_addr)
    worker = WorkerConfig.from_saved(saved.config, mixed_precision=precision, use_cpu=not gpus,
                                     loopback=loopback, num_nodes=num_nodes, nproc_per_node=num_processes,
                                     rich_display=_in_notebook())
    environ = worker_environment(worker)
    device = "cuda:{local_rank}" if gpus else "cpu"
    if num_processes == 1 and not elastic:
        return LaunchPlan(placement=Placement.IN_PROCESS, num_processes=1, mixed_precision=precision,
                          start_method="in-process", device="cpu", environ=_frozen(environ))
    method, note = choose_start_method(saved.start_method)
    common = dict(num_processes=num_processes, mixed_precision=precision, start_method=method, device=device,
                  environ=_frozen(environ), num_nodes=num_nodes, node_rank=node_rank, master_addr=master_addr,
                  start_note=note)
    if elastic:
        return LaunchPlan(placement=Placement.ELASTIC, port=port,
                          rendezvous=_rendezvous(request, saved, port), **common)
    if port is None:
        port = free_port(bind_address(master_addr) if is_local_address(master_addr) else "127.0.0.1")
    elif is_local_address(master_addr):
        check_port_free(port, bind_address(master_addr))
    return LaunchPlan(placement=Placement.LOCAL, port=port, **common)


def _host_plan(request: LaunchRequest) -> LaunchPlan:
    """Resolve a request with `hosts` into a plan of placement ssh or slurm; raise every bad-input error; start nothing."""
    hosts = resolve_hosts(request.hosts)
    if not is_default(request.num_nodes) or not is_default(request.node_rank):
        raise ValueError("hosts= sets the machines (num_nodes=len(hosts), node_rank by position): leave num_nodes "
                         "and node_rank out")
    if isinstance(request.max_restarts, bool) or not isinstance(request.max_restarts, int) or request.max_restarts < 0:
        raise ValueError(f"max_restarts must be an integer >= 0, got {request.max_restarts!r}")
    gpus = hosts.gpus if hosts.gpus is not None else visible_gpus()  # Ray: the nodes' GPUs, not the kernel's
    saved = apply_saved_config(request, gpus)
    saved.num_nodes, saved.node_rank = 1, 0  # checked as one node; the hosts multiply it
    precision = check_request(request, saved)
    check_start_method(saved.start_method)
    if saved.use_cpu:
        gpus = 0
    num_processes = saved.num_processes if is_int(saved.num_processes) else (gpus or 1)
    worker = WorkerConfig.from_saved(saved.config, mixed_precision=precision, use_cpu=not gpus, loopback=False,
                                     num_nodes=len(hosts.names), nproc_per_node=num_processes,
                                     rich_display=_in_notebook())
    master_addr = saved.master_addr
    # a loopback master_addr (the default) cannot be reached from other hosts: the first host's address then
    master_addr = "" if not master_addr or is_loopback_address(master_addr) else master_addr
    return LaunchPlan(placement=host_placement(hosts), num_processes=num_processes, mixed_precision=precision,
                      start_method=hosts.via, device="cuda:{local_rank}" if gpus else "cpu",
                      environ=_frozen({**forwarded_environment(request.env_vars), **worker_environment(worker)}),
                      num_nodes=len(hosts.names), node_rank=0,
                      master_addr=master_addr, port=parse_port(saved.use_port), timeout=request.timeout,
                      hosts=hosts)


def _script_plan(request: LaunchRequest) -> LaunchPlan:
    """`nbaccel launch`: torchrun's agent runs the script on this machine's ranks. On one machine the
    rendezvous port is the loopback store's, opened by the backend (0: a free one)."""
    assert request.script is not None and request.worker is not None, "a script plan needs its script and settings"
    num_nodes, port = request.num_nodes, parse_port(request.use_port)
    if num_nodes > 1:
        port, address = port or 29500, request.master_addr or ""
        backend, endpoint, run_id = request.rdzv_backend, f"{address}:{port}", f"nbaccel-{port}"
    else:
        address = "127.0.0.1"
        backend, endpoint, run_id = LOOPBACK_RDZV_BACKEND, f"127.0.0.1:{port or 0}", "none"
    rendezvous = Rendezvous(backend=backend, endpoint=endpoint, conf=MappingProxyType(dict(request.rdzv_conf or {})),
                            run_id=run_id, max_restarts=request.max_restarts,
                            monitor_interval=request.monitor_interval, log_line_prefix_template=None)
    device = "cuda:{local_rank}" if not request.use_cpu and visible_gpus() else "cpu"
    return LaunchPlan(placement=Placement.ELASTIC, program=Program.SCRIPT, num_processes=request.num_processes,
                      mixed_precision=request.mixed_precision, start_method="subprocess", device=device,
                      environ=_frozen(worker_environment(request.worker)), num_nodes=num_nodes,
                      node_rank=request.node_rank, master_addr=address, port=port, rendezvous=rendezvous,
                      script=request.script)


def _pool_plan(request: LaunchRequest) -> LaunchPlan:
    """RankPool's ranks: `num_processes` on this machine (or on each host), no function, no saved configuration;
    the pool's `timeout` (each collective's limit) sets the process group's timeout (plus a margin)."""
    num_processes = request.num_processes
    if not is_int(num_processes) or num_processes < 1:
        raise ValueError(f"num_processes must be a positive integer, got {num_processes!r}")
    check_process_count(num_processes)  # before anything starts: descriptors, memory, cores
    hosts = resolve_hosts(request.hosts) if request.hosts is not None else None
    if request.env_vars is not None and hosts is None:
        raise ValueError("env_vars= is for hosts= pools: local ranks inherit the kernel's whole environment")
    check_seconds(request.timeout, "timeout")
    precision = check_precision(request.mixed_precision)
    method, note = choose_start_method(request.start_method)
    gpus = hosts.gpus if hosts is not None and hosts.gpus is not None else visible_gpus()
    if gpus and num_processes > gpus:  # e.g. 2 ranks on a 1-GPU Colab: debugging collectives needs 2
        logger.warning(f"nbaccel: {num_processes} ranks but {gpus} GPU(s): the ranks run on the CPU (gloo). Pass "
                       f"num_processes<={gpus} for GPU ranks.")
        gpus = 0
    num_nodes = len(hosts.names) if hosts else 1
    # the pool owns the process group (FORK_LAUNCHED): end_training() in a cell leaves it up
    environ = worker_environment(WorkerConfig(mixed_precision=precision, use_cpu=not gpus,
                                              nproc_per_node=num_processes, fork_launched=True,
                                              pg_timeout=float(request.timeout) + POOL_PG_MARGIN,
                                              loopback=hosts is None, num_nodes=num_nodes))
    if hosts is not None:  # remote ranks get the kernel's documented variables (forwarded_env.py)
        environ = {**forwarded_environment(request.env_vars), **environ}
    common = dict(program=Program.POOL, num_processes=num_processes, mixed_precision=precision,
                  device="cuda:{local_rank}" if gpus else "cpu", environ=_frozen(environ))
    if hosts is not None:  # the first host finds the port; each agent picks its start method
        return LaunchPlan(placement=host_placement(hosts), start_method=hosts.via, num_nodes=num_nodes, master_addr="",
                          hosts=hosts, **common)
    return LaunchPlan(placement=Placement.LOCAL, start_method=method, port=free_port(), start_note=note, **common)


def host_placement(hosts: HostSet) -> Placement:
    """The placement of a launch on several hosts: by how its agents start."""
    return {"srun": Placement.SLURM, RAY: Placement.RAY}.get(hosts.via, Placement.SSH)


def _frozen(environ: dict[str, str]) -> Mapping[str, str]:
    return MappingProxyType(dict(environ))


def _rendezvous(request: LaunchRequest, saved: Any, port: int | None) -> Rendezvous:
    """torch elastic's meeting point: `rdzv_endpoint`, else master_addr:port (a free port on one node)."""
    endpoint, backend = request.rdzv_endpoint, saved.rdzv_backend
    conf = dict(request.rdzv_conf or {})
    if not endpoint:
        if port is None:
            if saved.num_nodes > 1:
                raise ValueError(
                    "num_nodes > 1 needs a meeting point every node knows: pass rdzv_endpoint='host:port' "
                    "(with rdzv_backend='c10d') or use_port=... together with master_addr"
                )
            port = free_port()
        elif saved.num_nodes == 1:  # one node: its rendezvous listens on loopback (kernel/loopback_store.py)
            check_port_free(port, "127.0.0.1")
        elif saved.node_rank == 0 and is_local_address(saved.master_addr) and backend == "static":
            check_port_free(port, bind_address(saved.master_addr))
        endpoint = f"{saved.master_addr}:{port}"
    if backend == "static":
        conf.setdefault("rank", saved.node_rank)
    return Rendezvous(backend=backend, endpoint=endpoint, conf=MappingProxyType(conf), run_id=request.rdzv_id,
                      max_restarts=request.max_restarts, monitor_interval=request.monitor_interval,
                      log_line_prefix_template=request.log_line_prefix_template)


def _xla_plan(request: LaunchRequest, saved: Any, precision: str) -> LaunchPlan:
    """torch_xla runs one replica per XLA device: check num_processes against the device count."""
    import_xmp()  # a clear ImportError before anything else
    num_processes = saved.num_processes
    count, source = (1, "") if num_processes == 1 else local_device_count()  # 1: in this process
    if count is not None and num_processes is not None and num_processes != count:
        raise ValueError(
            f"num_processes={num_processes}, but torch_xla runs one process per XLA device and this machine "
            f"has {count} ({source}): pass num_processes=None (or {count}), or 1 to run in this process. "
            "Fewer devices: set TPU_VISIBLE_CHIPS (TPU) or CPU_NUM_DEVICES (PJRT_DEVICE=CPU) before launching."
        )
    nprocs = count or num_processes or TPU_CORES
    worker = WorkerConfig.from_saved(saved.config, mixed_precision=precision, use_cpu=False, nproc_per_node=nprocs,
                                     rich_display=_in_notebook(), fork_launched=nprocs != 1)  # as Accelerate on TPU
    environ = worker_environment(worker)
    if nprocs == 1:
        return LaunchPlan(placement=Placement.IN_PROCESS, num_processes=1, mixed_precision=precision,
                          start_method="in-process", device="cpu", environ=_frozen(environ))
    return LaunchPlan(placement=Placement.XLA, num_processes=nprocs, mixed_precision=precision,
                      start_method=saved.start_method or "fork", device="xla", environ=_frozen(environ),
                      xla_count_known=count is not None)


def _in_notebook() -> bool:
    """Whether this launch runs in a Jupyter kernel (its ranks' display() output then goes to the cell)."""
    return views().in_kernel()


def _debug_plan(request: LaunchRequest) -> LaunchPlan:
    """debug_launcher: CPU processes with gloo, fork where safe, no saved configuration."""
    num_processes = plain(request.num_processes)
    precision = check_request(request, SimpleNamespace(num_processes=num_processes, node_rank=0, num_nodes=1,
                                                       rdzv_backend="static", mixed_precision="no"))
    method, note = choose_start_method(None)
    environ = worker_environment(WorkerConfig(mixed_precision=precision, use_cpu=True, nproc_per_node=num_processes,
                                              rich_display=_in_notebook(), fork_launched=True))  # as Accelerate's
    return LaunchPlan(placement=Placement.LOCAL, num_processes=num_processes, mixed_precision=precision, start_method=method,
                      device="cpu", environ=_frozen(environ), port=free_port(), start_note=note)
