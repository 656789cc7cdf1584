"""`notebook_launcher` and `debug_launcher`: run a function on every process of this machine (or node).

Accelerate's arguments keep their names, defaults (except `use_port`: None picks a free port) and meaning.
One launch: the arguments become a `LaunchRequest`; `build_plan` (plan.py) resolves and checks it into a
frozen `LaunchPlan` before anything starts; the function is cloudpickled once, here in the kernel; the backend
of the plan's placement (placements.py: local.py, elastic.py, xla_backend.py, ssh_backend.py) starts the workers and
owns them inside a launch session (launch_session.py); the supervisor (supervisor.py) forwards
output, gathers return values and stops all workers on the first failure, an interrupt or the timeout.
With one process the function runs in the kernel (inprocess.py). `nbaccel launch` hands its plan (program script,
kernel/torchrun.py's backend) to the same `run_plan`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from ... import telemetry  # noqa: F401  (loaded here so forked workers inherit it instead of importing it)
from .. import messages
from ..channel import Observer, close_quietly
from ..errors import LaunchError, LaunchTimeout
from ..launch_results import LaunchResults
from ..messages import LaunchState
from ..serialize import make_payload
from ..worker.rank_prompts import post_mortem_on_error
from .half_imports import imports_left_whole
from .inprocess import run_in_process
from .interrupts import interrupts_kept
from .launch_session import LaunchSession
from .observers import Reporting, check_dashboard, make_dashboard
from .placements import Backend, StartedRank, select_backend
from .plan import LaunchPlan, LaunchRequest, Placement, build_plan
from .rank_groups import RankGroups
from .saved_config import default
from .supervisor import Supervisor

logger = logging.getLogger(__name__)  # notices: records of nbaccel.launch (utils/notices.py)

if TYPE_CHECKING:
    from ..serialize import Payload


@imports_left_whole()  # an interrupt in a first use's import leaves nothing half made
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
    hosts: Sequence[str] | str | Any = None,
    env_vars: Sequence[str] | Mapping[str, str] | None = None,
    debug: bool = False,
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

    `hosts=["gpu-a", "gpu-b"]` (names as your ssh knows them) or `hosts="slurm"`: `num_processes` ranks on
    each host, started over SSH (docs/launcher.md, "Several machines"); results by global rank. `hosts="ray"`
    (or `RayHosts(...)`): on the nodes of the Ray cluster this kernel reaches, placed by a Ray placement group
    (docs/launcher.md, "Ray"). With `hosts`, `max_restarts` restarts every rank of every host after a failure.
    The ranks get the kernel's NCCL_*, GLOO_*, CUDA_*, TORCH*, HF_*, WANDB_*, ... variables; `env_vars` names
    more (patterns like "MYAPP_*") or sets values ({"NAME": "value"}) (kernel/forwarded_env.py).

    `debug=True` (nbaccel's addition): a rank whose function raises stops at its exception in pdb's
    post-mortem, asked in the cell, before the launch fails (docs/debugging.md).
    """
    check_dashboard(dashboard)
    if not isinstance(debug, bool):
        raise TypeError(f"debug must be True or False (pdb's post-mortem on a failing rank), got {debug!r}")
    if debug:  # the rank's prompts reach the cell (worker/rank_prompts.py)
        function = partial(post_mortem_on_error, function)
    request = LaunchRequest(
        function=function, args=args, kwargs={} if kwargs is None else kwargs, num_processes=num_processes,
        mixed_precision=mixed_precision, use_port=use_port, master_addr=master_addr, node_rank=node_rank,
        num_nodes=num_nodes, rdzv_backend=rdzv_backend, rdzv_endpoint=rdzv_endpoint, rdzv_conf=rdzv_conf,
        rdzv_id=rdzv_id, max_restarts=max_restarts, monitor_interval=monitor_interval,
        log_line_prefix_template=log_line_prefix_template, start_method=start_method, timeout=timeout,
        hosts=hosts, env_vars=env_vars,
    )
    if env_vars is not None and hosts is None:
        raise ValueError("env_vars= is for hosts= launches: ranks on this machine inherit the kernel's whole "
                         "environment (set os.environ before the launch)")
    plan = build_plan(request)
    return LaunchResults(launch(plan, request, Reporting(dashboard, tuple(observers))))  # a list; no Out: of Nones


@imports_left_whole()
def debug_launcher(function: Callable[..., Any], args: Sequence[Any] = (), num_processes: int = 2) -> list[Any]:
    """Run `function(*args)` on `num_processes` CPU processes (gloo), for tests and debugging.

    Same machinery as notebook_launcher (fork where safe, output forwarding, fail-fast), never a GPU, no
    dashboard. Returns the per-rank results.
    """
    request = LaunchRequest(function=function, args=args, num_processes=num_processes, debug_launcher=True)
    return LaunchResults(launch(build_plan(request), request, Reporting(dashboard=False)))


def launch(plan: LaunchPlan, request: LaunchRequest, reporting: Reporting) -> list[Any]:
    """Run a resolved plan: in this process, or through the backend of its placement under the supervisor."""
    if plan.placement is Placement.IN_PROCESS:
        return run_in_process(plan, request, reporting)
    backend = select_backend(plan)
    # under fork the workers inherit the objects; else cloudpickled here, unpicklable ones named before any
    # process starts
    inherit = plan.start_method == "fork" and backend.inherits_objects
    payload = make_payload(request.function, tuple(request.args), dict(request.kwargs), inherit)
    # several hosts: a failure restarts the whole world, as torch elastic does on one machine (which restarts
    # through its own agent: plan.rendezvous)
    restarts = request.max_restarts if plan.hosts is not None else 0
    earlier: list[dict[int, Any]] = []
    for attempt in range(restarts + 1):
        try:
            return run_plan(plan.restarted(attempt, restarts), backend, payload, reporting)
        except LaunchTimeout:
            raise  # the whole launch's time is up
        except LaunchError as exc:
            exc.name = exc.name or function_name(request.function)  # ChildFailedError's name: the entry point's
            if attempt == restarts:
                # the supervisor saw the rank's restart count but not the earlier attempts' failures: ours
                exc.attempts = earlier + [failures for failures in exc.attempts if failures]
                raise
            earlier.append(dict(exc.failures))
            logger.warning(f"nbaccel: {first_failure(exc)}; restarting every rank ({attempt + 1} of max_restarts="
                           f"{restarts})")
            backend = select_backend(plan)
    raise AssertionError("unreachable")


def first_failure(error: LaunchError) -> str:
    """`rank 3: ValueError: boom`, or the error's first line when no rank failed."""
    if error.failures:
        rank, failure = error.get_first_failure()
        return failure.summary() if hasattr(failure, "summary") else f"rank {rank}: {failure}"
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def run_plan(plan: LaunchPlan, backend: Backend, payload: Payload | None, reporting: Reporting) -> list[Any]:
    """Start the plan's ranks through `backend` in a launch session (launch_session.py: preload, private
    folders, rank groups, close), supervise them until the end and release everything: the path of
    notebook_launcher's launches and of `nbaccel launch` (RankPool's ranks open the same session,
    pool/rank_processes.py). Returns the results by local rank (none for a script)."""
    if plan.start_note:
        logger.warning(plan.start_note)
    with interrupts_kept(), LaunchSession(plan, backend) as session:
        ranks = session.start(payload)
        try:
            return supervise(session.plan, ranks, backend, reporting, session.groups)
        except BaseException:
            # e.g. an interrupt after the start, before the supervisor watched (the dashboard's start, the first
            # message): no rank may stay (spawn ranks not yet leading their groups were left, and closing the
            # resource tracker then waited for them forever)
            backend.stop()
            raise


def function_name(function: Callable[..., Any]) -> str:
    return getattr(function, "__name__", None) or type(function).__name__


def supervise(plan: LaunchPlan, handles: list[StartedRank], backend: Backend, reporting: Reporting,
              groups: RankGroups | None = None) -> list[Any]:
    """Run the supervisor with the dashboard and observers; report the launch's start and end to them."""
    info = plan.info()
    try:
        handle = make_dashboard(reporting.dashboard, plan.supervised_ranks, **info)
    except BaseException:
        backend.stop()
        close_quietly(*(h.channel for h in handles), *(h.stdout_fd for h in handles), *(h.stderr_fd for h in handles))
        raise
    listeners = list(reporting.observers) + ([handle.observer] if handle else [])
    supervisor = Supervisor(handles, backend, listeners, timeout=plan.timeout, groups=groups,  # streams: per write
                            exit_grace=plan.exit_grace)
    if handle:
        handle.start()
    supervisor.notify(messages.launch(LaunchState.STARTED, num_processes=plan.supervised_ranks, **info))
    results: list[Any] | None = None
    failures: dict[int, Any] = {}
    state = LaunchState.FAILED
    try:
        results = supervisor.run()
        state = LaunchState.FINISHED
        return results
    except LaunchTimeout:
        state = LaunchState.TIMEOUT
        raise
    except LaunchError as error:
        failures = error.failures  # a deadlock's also names the ranks stopped while they waited
        raise
    except KeyboardInterrupt:
        state = LaunchState.INTERRUPTED
        raise
    finally:
        supervisor.notify(messages.launch(state))
        if handle:
            handle.close(results=results, failures=failures or supervisor.failures or None)
