"""The plan of a launch on several hosts (`notebook_launcher(..., hosts=[...])`): the same checks and defaults
as one machine's (plan.py), resolved into a LaunchPlan of mode ssh: `num_processes` ranks on each host, the
shared worker environment, the hosts and how their agents start. What only the hosts can tell (versions,
addresses, the rendezvous port, GPUs) is checked by the SSH backend before any rank starts.
"""

from __future__ import annotations

from ..environment import WorkerConfig, visible_gpus, worker_environment
from .forwarded_env import forwarded_environment
from .hosts import resolve_hosts
from .plan import LaunchPlan, LaunchRequest, Mode, _frozen, _in_notebook, check_request, is_int, parse_port
from .processes import check_start_method, is_loopback_address
from .saved_config import apply_saved_config, is_default


def build_host_plan(request: LaunchRequest) -> LaunchPlan:
    """Resolve a request with `hosts` into a plan of mode ssh; raise every bad-input error; start nothing."""
    hosts = resolve_hosts(request.hosts)
    if not is_default(request.num_nodes) or not is_default(request.node_rank):
        raise ValueError("hosts= sets the machines (num_nodes=len(hosts), node_rank by position): leave num_nodes "
                         "and node_rank out")
    if request.max_restarts:
        raise ValueError("hosts= does not restart ranks (max_restarts must be 0): use nbaccel launch on each "
                         "machine for torch elastic's restarts")
    gpus = visible_gpus()
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
    return LaunchPlan(mode=Mode.SSH, num_processes=num_processes, mixed_precision=precision,
                      start_method=hosts.via, device="cuda:{local_rank}" if gpus else "cpu",
                      environ=_frozen({**forwarded_environment(request.env_vars), **worker_environment(worker)}),
                      num_nodes=len(hosts.names), node_rank=0,
                      master_addr=master_addr, port=parse_port(saved.use_port), timeout=request.timeout,
                      hosts=hosts)

