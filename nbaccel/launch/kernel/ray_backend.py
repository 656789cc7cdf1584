"""`hosts="ray"`: the ranks on the nodes of a Ray cluster, placed by a Ray placement group.

The kernel attaches to the cluster it can reach (the `ray.init()` already called, else `RAY_ADDRESS`, else
`address="auto"`) and takes its alive nodes (`RayHosts` narrows them down). The launch reserves one placement
group: one bundle per node, pinned to that node by its `ray.io/node-id` label, holding `num_processes` ranks'
resources (CPUs, GPUs, custom resources). On each node a `RaySession` actor (launch/ray_session.py) takes the
node's bundle and runs the host agent, as sshd does for `hosts=[...]`; from there everything is the SSH
placement's (ssh_backend.py): the same probe and import check before any rank starts, the function
cloudpickled as under spawn, the ranks meeting through torch's TCPStore on the first node, `[node rank N]`
output, the same LaunchError. Ray carries the agent's stream: a pump thread per direction turns it into the
local pipes an ssh process would have.

The actors and the placement group belong to the kernel's Ray driver: `close` kills the actors and removes the
group; if the kernel dies, Ray removes what its driver owned, and each agent, its stream ended, stops its
ranks.
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import time
import uuid
import warnings
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from ..channel import close_quietly
from ..host_protocol import AGENT_MODULE
from ..rank_environment import source_checkout_root
from ..ray_session import RaySession
from .hosts import RAY, HostError, HostSet, attach, import_ray
from .ssh_backend import Agent, SshBackend

if TYPE_CHECKING:
    from .plan import LaunchPlan

PLACE_TIMEOUT = float(os.environ.get("NBACCEL_RAY_PLACE_TIMEOUT", "60"))  # seconds to reserve the nodes
READ_WAIT = 1.0  # seconds one `read` of an agent's stream waits on its node
PLACE_POLL = 0.2  # seconds of each wait for the placement group (an interrupt is heard between two)
PLACE_NOTE = 2.0  # seconds of waiting for busy nodes before the launch says that it waits
ALIVE_POLL = 1.0  # seconds between two checks, while the group waits, that its nodes are alive
logger = logging.getLogger(__name__)  # notices: records of nbaccel.launch (utils/notices.py)


def _never_fits(ray: Any, hosts: HostSet, per_rank: dict[str, float], num_processes: int) -> str | None:
    """Why a chosen node can never hold `num_processes` ranks of `per_rank` each (its total resources, busy or
    not, are too few), or None. Ray would keep such a placement group pending for ever: the launch says so at
    once instead of waiting PLACE_TIMEOUT for it."""
    totals = {node["NodeID"]: node.get("Resources", {}) for node in ray.nodes() if node.get("Alive")}
    for node_id, name in zip(hosts.node_ids, hosts.names):
        have = totals.get(node_id, {})
        fit = min((int(have.get(key, 0) / value + 1e-9) for key, value in per_rank.items()), default=num_processes)
        if fit < num_processes:
            has = {key: have.get(key, 0) for key in per_rank}
            advice = f"Pass num_processes={fit} or fewer" if fit else "Ask less of each rank"
            return (f"hosts='ray': node {name!r} has {has} in all, and {num_processes} rank(s) of {per_rank} each "
                    f"need {_times(per_rank, num_processes)} there: Ray can never place them. {advice} "
                    "(num_processes ranks run on each node), or RayHosts(cpus_per_rank=..., resources=...).")
    return None


def _times(per_rank: dict[str, float], count: int) -> dict[str, float]:
    return {key: value * count for key, value in per_rank.items()}


def _dead_nodes(ray: Any, hosts: HostSet) -> list[str]:
    """The chosen nodes Ray no longer lists as alive."""
    alive = {node["NodeID"] for node in ray.nodes() if node.get("Alive")}
    return [name for node_id, name in zip(hosts.node_ids, hosts.names) if node_id not in alive]


def _wait_placed(ray: Any, group: Any, hosts: HostSet, reserve: dict[str, float], timeout: float) -> None:
    """Wait for the placement group; HostError once `timeout` s pass or a chosen node dies meanwhile.

    `group.wait` in short waits: Ray's own wait blocks in C++, where the kernel's interrupt (a user stopping a
    launch that waits for busy nodes) would be heard only when it ends. Nodes busy with other work: Ray's way
    is to wait for them, so the launch waits too, and says so after PLACE_NOTE s, with its bound. A node lost
    shortly before the launch is still listed alive until Ray's health check fails it (about 15 s): its
    bundle can never be placed, so the wait ends when Ray marks it dead, naming it."""
    started = time.monotonic()
    deadline, noted, next_check = started + timeout, False, started + ALIVE_POLL
    while not group.wait(min(PLACE_POLL, max(0.01, deadline - time.monotonic()))):
        now = time.monotonic()
        if now >= next_check:
            next_check = now + ALIVE_POLL
            dead = _dead_nodes(ray, hosts)
            if dead:
                raise HostError(RAY, f"hosts='ray': node(s) {dead} left the Ray cluster while the launch reserved "
                                "them (Ray marked them dead). Launch again: it runs on the nodes alive then.")
        if now >= deadline:
            raise HostError(RAY, f"hosts='ray': Ray could not reserve {reserve} on each of {list(hosts.names)} "
                            f"within {timeout:.0f} s (NBACCEL_RAY_PLACE_TIMEOUT); other work holds them: `ray "
                            "status` shows what is free. Launch when they are free, pass fewer num_processes or "
                            "RayHosts(cpus_per_rank=...), or set NBACCEL_RAY_PLACE_TIMEOUT to wait longer.")
        if not noted and now - started >= PLACE_NOTE:
            noted = True
            logger.warning(f"nbaccel: hosts='ray': waiting for Ray to free {reserve} on each of {list(hosts.names)} "
                           "(held by other work, or on a node just lost; `ray status` shows what is free); giving up "
                           f"after {timeout:.0f} s (NBACCEL_RAY_PLACE_TIMEOUT). Interrupt to stop waiting.")


def _death_cause(exc: BaseException) -> str:
    """Ray's reason for an actor's death in a few words: its "dead because" line (a node that died, a
    `ray.kill`), else the error's kind (ActorUnavailableError: its process or node went away)."""
    because = next((line.strip() for line in str(exc).splitlines() if "dead because" in line), "")
    return because[:300] or type(exc).__name__


class ActorProcess:
    """What the SSH placement asks of an agent's `ssh` process, for the agent's RaySession actor."""

    pid = None
    stderr = None

    def __init__(self, ray: Any, actor: Any, ended: threading.Event) -> None:
        self._ray = ray
        self.actor = actor
        self._ended = ended  # the agent's stdout reached its end
        self.returncode: int | None = None
        self.said = ""
        self.killed = False  # the launch killed the actor (its stop, its close)
        self.died: str | None = None  # why Ray says the actor died, when the launch did not kill it

    def wait(self, timeout: float | None = None) -> int | None:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired("ray session", timeout or 0)
        if self.returncode is None:
            try:
                code, self.said = self._ray.get(self.actor.exit_info.remote(2.0), timeout=5)
            except Exception:  # the actor is gone (killed, its node lost): the agent with it
                code = None
            self.returncode = code if code is not None else 255
        return self.returncode

    def kill(self) -> None:
        self.killed = True
        try:
            self._ray.kill(self.actor, no_restart=True)
        except Exception:
            pass
        self._ended.set()


class RayAgent(Agent):
    """A node's agent, run by a RaySession actor; its stream pumped through Ray into local pipes."""

    def _open(self, via: str, actor: Any = None) -> None:
        self._ray = import_ray()
        to_agent_r, to_agent_w = os.pipe()
        from_agent_r, from_agent_w = os.pipe()
        self.to_agent = Connection(to_agent_w, readable=False)
        self.from_agent = Connection(from_agent_r, writable=False)
        self._ended = threading.Event()
        self.process = ActorProcess(self._ray, actor, self._ended)
        self._stderr_thread = threading.Thread(target=self._pump_out, args=(actor, from_agent_w), daemon=True,
                                               name=f"nbaccel-ray-out-{self.host}")
        self._stderr_thread.start()
        self._pump_in_thread = threading.Thread(target=self._pump_in, args=(actor, to_agent_r), daemon=True,
                                                name=f"nbaccel-ray-in-{self.host}")
        self._pump_in_thread.start()

    def _pump_in(self, actor: Any, fd: int) -> None:
        """The kernel's frames to the agent, in order; at their end, the agent's stdin ends."""
        try:
            while True:
                data = os.read(fd, 1 << 20)
                if not data:
                    self._ray.get(actor.close_stdin.remote(), timeout=30)
                    return
                if not self._ray.get(actor.write.remote(data), timeout=60):
                    return
        except Exception:
            return  # the actor is gone: the relay learns it from the agent's stream
        finally:
            close_quietly(fd)

    def _pump_out(self, actor: Any, fd: int) -> None:
        """The agent's frames to the kernel's relay; its end (or the actor's) ends the local pipe."""
        try:
            while True:
                data = self._ray.get(actor.read.remote(READ_WAIT), timeout=READ_WAIT + 60)
                if data is None:
                    return
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
        except OSError:  # the kernel closed its end (the launch's close), or Ray's get timed out
            return
        except Exception as exc:
            if not self.process.killed:  # not the launch's kill: its node was lost, or someone killed it
                self.process.died = _death_cause(exc)
            return
        finally:
            close_quietly(fd)
            self._ended.set()

    def end_unstarted(self) -> None:
        """Kill the actor: what the session's end would say reaches the agent only once Ray has made the actor
        and the actor its agent (2-3 s on a busy machine, after the user interrupted the launch). Killing it
        cancels an actor still being made; an agent already running dies with its actor (PDEATHSIG)."""
        self.process.kill()

    def vanished(self) -> str | None:
        if self.process.died is None:
            return None
        return (f"node {self.host!r} lost: the Ray actor of its agent died ({self.process.died}); its ranks were "
                "lost with it")

    def said(self) -> str:
        if not self.process.said:
            try:
                self.process.said = self._ray.get(self.process.actor.exit_info.remote(0.5), timeout=5)[1]
            except Exception:
                pass
        return self.process.said


class RayBackend(SshBackend):
    """The nodes of a Ray cluster: the SSH placement's agents, each run by a RaySession actor that holds its
    node's bundle of the launch's placement group (a launch's ranks and RankPool's alike)."""

    via = RAY

    def _open_agents(self, plan: LaunchPlan) -> None:
        hosts = plan.hosts
        assert hosts is not None and hosts.ray is not None
        ray = attach(hosts.ray.address)
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        per_rank = {"CPU": hosts.ray.cpus_per_rank, "GPU": hosts.ray.gpus_per_rank, **hosts.ray.resources}
        per_rank = {key: value for key, value in per_rank.items() if value}
        never = _never_fits(ray, hosts, per_rank, plan.num_processes)
        if never:
            raise HostError(RAY, never)
        reserve = _times(per_rank, plan.num_processes)
        self.group_name = f"nbaccel-{uuid.uuid4().hex[:8]}"
        self.group = ray.util.placement_group(  # each node's bundle on that node (its Ray label)
            [dict(reserve) or {"CPU": 0.001} for _ in hosts.node_ids], strategy="STRICT_SPREAD",
            name=self.group_name, bundle_label_selector=[{"ray.io/node-id": node} for node in hosts.node_ids])
        _wait_placed(ray, self.group, hosts, reserve, PLACE_TIMEOUT)
        session = ray.remote(RaySession)
        for index, host in enumerate(hosts.names):
            with warnings.catch_warnings():  # Ray's note on num_gpus=0 (it hides the GPUs then, as wanted)
                warnings.simplefilter("ignore", FutureWarning)
                actor = session.options(
                    name=f"{self.group_name}-node-{index}", namespace="nbaccel",  # found in `ray list actors`
                    num_cpus=reserve.get("CPU", 0), num_gpus=reserve.get("GPU", 0),
                    resources={key: value for key, value in reserve.items() if key not in ("CPU", "GPU")},
                    max_concurrency=4, scheduling_strategy=PlacementGroupSchedulingStrategy(
                        self.group, placement_group_bundle_index=index),
                ).remote(AGENT_MODULE, source_checkout_root())
            self.agents.append(RayAgent(host, index, RAY, actor=actor))
        self._nodes = [self._node_of(agent) for agent in self.agents]

    def _node_of(self, agent: Agent) -> dict[str, str]:
        """Where the agent's actor runs, once it started (HostError if it could not)."""
        try:
            # a future's wait, not ray.get: Ray looks for the kernel's interrupt only once a second while it gets
            return agent.process.actor.node.remote().future().result(timeout=PLACE_TIMEOUT)
        except Exception as exc:
            raise HostError(agent.host, f"the Ray actor for the agent on node {agent.host!r} did not start: "
                            f"{exc}") from None

    def _master_address(self, plan: LaunchPlan) -> str:
        """The first node's address in the Ray cluster (the master_addr the user gave wins)."""
        return plan.master_addr or self._nodes[0]["address"]

    def close(self) -> None:
        """The SSH placement's close, then no actor or placement group of this launch is left."""
        try:
            super().close()
        finally:
            ray = import_ray()
            for agent in self.agents:
                agent.process.kill()
            group, self.group = getattr(self, "group", None), None
            if group is not None and ray.is_initialized():
                try:
                    ray.util.remove_placement_group(group)
                except Exception:
                    pass
