"""The SSH backend: a launch's ranks on several hosts, one agent per host started over SSH (or srun).

The kernel runs `ssh HOST python -m nbaccel.launch.agent.host_agent` per host; the SSH session's stdin and
stdout are the channel (host_protocol.py). Before any rank starts, every agent answers a probe: its
versions (compared with the kernel's), the modules the pickled function refers to by name that it cannot
import, its address and, on the first host, a rendezvous port it can open.
Then each agent starts its host's ranks, which meet through torch's TCPStore on the first host
(`MASTER_ADDR`/`MASTER_PORT`, init_method env://). A relay thread per agent turns the agent's frames back
into local pipes of the usual shape (a channel Connection and two output fds per rank), so the supervisor
watches the ranks of every host exactly as it watches local ones, and labels their lines `[host rank N]`.
An agent that goes away (killed, its host lost) fails its ranks; stopping closes every session, and each
agent stops its ranks when its session ends.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import subprocess
import threading
import time
from collections import deque
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from ...utils.constants import LAUNCH_HOST_ENV
from ..channel import close_quietly
from ..errors import WorkerFailure
from ..host_protocol import STOP, FrameKind, Hello, Probe, Start, versions
from ..messages import Failure
from ..serialize import referenced_modules
from .hosts import HostError, agent_command, check_modules, check_versions, diagnose
from .plan import Mode
from .processes import is_loopback_address
from .supervisor import WorkerHandle

if TYPE_CHECKING:
    from ..serialize import Payload
    from .plan import LaunchPlan

HELLO_TIMEOUT = float(os.environ.get("NBACCEL_HOST_TIMEOUT", "60"))  # seconds for every agent to answer
STOP_WAIT = 10.0  # seconds the agents get to stop their ranks and exit before their sessions are killed
LOST_EXIT = 255  # the exit code given to ranks of an agent that went away without reporting theirs


class Agent:
    """One host's agent: its ssh process, the channel over its session, and its ranks' local pipes."""

    def __init__(self, host: str, index: int, via: str, **transport: Any) -> None:
        self.host = host
        self.index = index
        self.stderr: deque[str] = deque(maxlen=50)
        self._open(via, **transport)
        self.hello: Hello | None = None
        self.first_rank = 0
        self.writers: list[dict[str, Any]] = []  # per local rank: channel/stdout/stderr write ends
        self.exited: set[int] = set()
        self.pids: list[int] = []
        self.started = threading.Event()  # the agent said which pids its ranks have (or why it could not start)
        self.lost: str | None = None
        self._lock = threading.Lock()  # the relay threads and the caller both send
        self.relay: threading.Thread | None = None

    def _open(self, via: str) -> None:
        """Start the agent (ssh or srun); its session's stdin and stdout become `to_agent` and `from_agent`."""
        to_agent_r, to_agent_w = os.pipe()
        from_agent_r, from_agent_w = os.pipe()
        try:
            self.process = subprocess.Popen(agent_command(self.host, via), stdin=to_agent_r, stdout=from_agent_w,
                                            stderr=subprocess.PIPE, start_new_session=True)
        finally:
            close_quietly(to_agent_r, from_agent_w)
        self.to_agent = Connection(to_agent_w, readable=False)
        self.from_agent = Connection(from_agent_r, writable=False)
        self._stderr_thread = threading.Thread(target=self._read_stderr, daemon=True,
                                               name=f"nbaccel-ssh-stderr-{self.host}")
        self._stderr_thread.start()

    def _read_stderr(self) -> None:
        assert self.process.stderr is not None
        for line in iter(self.process.stderr.readline, b""):
            self.stderr.append(line.decode(errors="replace").rstrip())

    def said(self) -> str:
        self._stderr_thread.join(timeout=1.0)
        return "\n".join(self.stderr)

    def send(self, message: Any) -> None:
        with self._lock:
            self.to_agent.send(message)

    def close_session(self) -> None:
        """Say stop and close the session's stdin: the agent stops its ranks and exits."""
        try:
            self.send(STOP)
        except (OSError, ValueError):
            pass
        with self._lock:
            close_quietly(self.to_agent)


class SshBackend:
    """Starts and owns the agents of the plan's hosts and, through them, every rank of the launch."""

    fail_fast = True
    workers_may_not_start = False
    inherits_objects = False  # the function travels cloudpickled to other machines
    preloads_modules = False  # the ranks fork from the agents, which preload there
    freezes_gc = False
    private_store = False  # the ranks meet through torch's TCPStore on the first host
    result_folder = False  # results come back through the channel
    rank_groups = False  # the ranks run on other machines: each host's agent stops its own

    def __init__(self) -> None:
        self.agents: list[Agent] = []
        self._exits: queue.SimpleQueue[tuple[int, int]] = queue.SimpleQueue()
        self._reported: set[int] = set()
        self._stopping = False
        self.world_size = 0

    # ------------------------------------------------------------------ start
    host_mode = Mode.LOCAL  # what each agent runs: a launch's ranks (RankPool's: kernel/ssh_pool_backend.py)

    def start(self, plan: LaunchPlan, payload: Payload) -> list[WorkerHandle]:
        assert payload.data is not None, "the SSH backend sends cloudpickled payloads"
        return self._start(plan, payload.data)

    def _start(self, plan: LaunchPlan, payload: bytes | None) -> list[Any]:
        """Start the agents, check them, have each start its host's ranks; the kernel's ends, by global rank."""
        try:
            self._open_agents(plan)
            first_port = plan.port or 0
            # what the pickled function takes from importable modules is imported there: each host checks
            modules = tuple(referenced_modules(payload)) if payload is not None else ()
            for agent in self.agents:
                agent.send(Probe(port=first_port if agent.index == 0 else None, modules=modules))
            self._wait_hellos(plan)
            master = self._master_address(plan)
            port = self.agents[0].hello.port  # type: ignore[union-attr]
            ends = self._make_ends(plan)
            for agent in self.agents:
                agent.send(Start(self._host_plan(plan, agent, master, port), payload))
                agent.relay = threading.Thread(target=self._relay, args=(agent,), daemon=True,
                                               name=f"nbaccel-ssh-relay-{agent.host}")
                agent.relay.start()
            self._started(ends)
            return ends
        except BaseException:
            self.stop()
            self.close()
            raise

    def _open_agents(self, plan: LaunchPlan) -> None:
        """Start one agent per host, into `self.agents` (kernel/ray_backend.py: in Ray actors instead)."""
        assert plan.hosts is not None
        for index, host in enumerate(plan.hosts.names):
            self.agents.append(Agent(host, index, plan.hosts.via))

    def _started(self, ends: list[Any]) -> None:
        """Called once every agent was told to start (RankPool's backend waits for the ranks' pids)."""

    def _wait_hellos(self, plan: LaunchPlan) -> None:
        deadline = time.monotonic() + HELLO_TIMEOUT
        ours = versions()
        for agent in self.agents:
            try:
                ready = agent.from_agent.poll(max(0.0, deadline - time.monotonic()))
                hello = agent.from_agent.recv() if ready else None
            except (EOFError, OSError):
                agent.process.wait(5)
                raise diagnose(agent.host, agent.said(), agent.process.returncode) from None
            if hello is None:
                raise HostError(agent.host, f"the agent on {agent.host!r} did not answer within {HELLO_TIMEOUT:.0f} s "
                                f"(NBACCEL_HOST_TIMEOUT); ssh said: {agent.said() or 'nothing'}")
            if not isinstance(hello, Hello):
                raise HostError(agent.host, f"the agent on {agent.host!r} answered {hello!r} instead of its hello")
            check_versions(agent.host, hello.versions, ours)
            check_modules(agent.host, hello.missing)
            if hello.port_error:
                raise HostError(agent.host, f"the rendezvous cannot listen on {agent.host!r}: {hello.port_error}. "
                                "Pass another use_port, or None for a free one.")
            if plan.device.startswith("cuda") and hello.gpus < plan.num_processes:
                raise HostError(agent.host, f"host {agent.host!r} has {hello.gpus} GPU(s) for num_processes="
                                f"{plan.num_processes} ranks per host")
            agent.hello = hello

    def _master_address(self, plan: LaunchPlan) -> str:
        """Where the other hosts reach the first host's store: the master_addr the user gave, else the
        first host's address on the kernel's SSH connection, else the host name."""
        if plan.master_addr:
            return plan.master_addr
        hello = self.agents[0].hello
        assert hello is not None
        return hello.address or hello.hostname

    def _host_plan(self, plan: LaunchPlan, agent: Agent, master: str, port: int | None) -> Any:
        environ = dict(plan.environ)
        if is_loopback_address(master) and "GLOO_SOCKET_IFNAME" not in environ:
            environ["GLOO_SOCKET_IFNAME"] = "lo"  # every host is this machine: the ranks talk over loopback
        environ[LAUNCH_HOST_ENV] = agent.host  # the ranks' status messages name their host (the dashboard's column)
        return dataclasses.replace(plan, mode=self.host_mode, node_rank=agent.index,
                                   num_nodes=len(self.agents), master_addr=master, port=port, hosts=None,
                                   environ=environ)

    def _make_ends(self, plan: LaunchPlan) -> list[Any]:
        """Local pipes of the usual shape for every rank: the supervisor reads them, the relay writes them."""
        handles = []
        for agent in self.agents:
            agent.first_rank = agent.index * plan.num_processes
            for i in range(plan.num_processes):
                channel_r, channel_w = Pipe(duplex=False)
                out_r, out_w = os.pipe()
                err_r, err_w = os.pipe()
                agent.writers.append({"channel": channel_w, "stdout": out_w, "stderr": err_w})
                rank = agent.first_rank + i
                # reports_memory: the kernel cannot sample another host's processes (its pids are not ours)
                handles.append(WorkerHandle(rank, rank, channel_r, out_r, err_r, reports_memory=True,
                                            label=f"{agent.host} rank {rank}"))
        self.world_size = len(handles)
        return handles

    # ------------------------------------------------------------------ relaying an agent's frames
    def _relay(self, agent: Agent) -> None:
        try:
            while True:
                try:
                    frame = agent.from_agent.recv()
                except (EOFError, OSError):
                    break
                self._on_frame(agent, frame)
        finally:
            self._agent_ended(agent)

    def _on_frame(self, agent: Agent, frame: tuple) -> None:
        kind = frame[0]
        if kind == FrameKind.MESSAGE:
            self._write(agent, frame[1], frame[2], frame[3])
        elif kind == FrameKind.OUTPUT:
            self._write(agent, frame[1], frame[2], frame[3])
        elif kind == FrameKind.END:
            self._close_writer(agent, frame[1], frame[2])
        elif kind == FrameKind.EXIT:
            self._rank_exited(agent, frame[1], frame[2])
        elif kind == FrameKind.STARTED:
            agent.pids = list(frame[1])
            agent.started.set()
        elif kind == FrameKind.ERROR:
            agent.lost = f"the agent on {agent.host!r} could not start its ranks:\n{frame[1]}"
            agent.started.set()

    def _rank_exited(self, agent: Agent, i: int, code: int) -> None:
        agent.exited.add(i)
        for name in list(agent.writers[i]):
            self._close_writer(agent, i, name)
        self._exits.put((agent.first_rank + i, code))

    def _write(self, agent: Agent, i: int, name: str, data: bytes) -> None:
        target = agent.writers[i].get(name)
        if target is None:
            return
        try:
            if isinstance(target, int):
                view = memoryview(data)
                while view:
                    view = view[os.write(target, view):]
            else:
                target.send_bytes(data)
        except OSError:
            self._close_writer(agent, i, name)

    def _close_writer(self, agent: Agent, i: int, name: str) -> None:
        target = agent.writers[i].pop(name, None)
        if target is not None:
            close_quietly(target)

    def _agent_ended(self, agent: Agent) -> None:
        """The agent's session ended: its ranks that did not report an exit are lost with it."""
        running = [i for i in range(len(agent.writers)) if i not in agent.exited]
        if running and not self._stopping and agent.lost is None:
            try:
                agent.process.wait(2)
            except subprocess.TimeoutExpired:
                pass
            said = agent.said()
            agent.lost = (f"the agent on {agent.host!r} ended (ssh exit code {agent.process.returncode})"
                          + (f": {said}" if said else "") + "; its ranks were lost with it")
        for i in running:
            rank = agent.first_rank + i
            if agent.lost and not self._stopping and "channel" in agent.writers[i]:
                failure = Failure(rank, "HostLost", agent.lost, local_rank=i)
                self._write(agent, i, "channel", _pickled(failure.to_wire()))
            self._rank_exited(agent, i, LOST_EXIT)

    # ------------------------------------------------------------------ the Backend protocol
    def wait_objects(self) -> list[Any]:
        return []

    def poll_exits(self) -> list[tuple[int, int]]:
        exits = []
        while True:
            try:
                rank, code = self._exits.get_nowait()
            except queue.Empty:
                return exits
            if rank not in self._reported:
                self._reported.add(rank)
                exits.append((rank, code))

    def finished(self) -> bool:
        return bool(self.world_size) and len(self._reported) == self.world_size

    def stop(self) -> None:
        """Every agent stops its ranks and exits; a session still open after STOP_WAIT s is killed (its agent
        then sees its stdin end and stops its ranks all the same)."""
        self._stopping = True
        for agent in self.agents:
            agent.close_session()
        deadline = time.monotonic() + STOP_WAIT
        for agent in self.agents:
            try:
                agent.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                agent.process.kill()
                agent.process.wait()

    def exit_failures(self) -> dict[int, WorkerFailure]:
        return {}

    def verdict(self) -> None:
        """Nothing but the supervisor watches these ranks (the agents report every rank's messages to it)."""
        return None

    def lost_reason(self) -> str | None:
        return next((agent.lost for agent in self.agents if agent.lost), None)

    def close(self) -> None:
        """Once the launch is over: no agent, session or relay of this launch is left."""
        self.stop()
        for agent in self.agents:
            if agent.relay is not None:
                agent.relay.join(timeout=5)
            close_quietly(agent.from_agent)
            for writers in agent.writers:
                close_quietly(*writers.values())
            agent._stderr_thread.join(timeout=2)
            if agent.process.stderr is not None:
                agent.process.stderr.close()


def _pickled(message: dict) -> bytes:
    from multiprocessing.reduction import ForkingPickler

    return bytes(ForkingPickler.dumps(message))

