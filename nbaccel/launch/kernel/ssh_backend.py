"""Placements ssh and slurm: ranks on several hosts, one agent per host started over SSH (or srun in a SLURM
allocation), running a launch's function or RankPool's rank loop.

The kernel runs `ssh HOST python -m nbaccel.launch.agent` per host; the SSH session's stdin and
stdout are the channel (host_protocol.py). Before any rank starts, every agent answers a probe: its
versions (compared with the kernel's), the modules the pickled function refers to by name that it cannot
import, its address and, on the first host, a rendezvous port it can open.
Then each agent starts its host's ranks, which meet through torch's TCPStore on the first host
(`MASTER_ADDR`/`MASTER_PORT`, init_method env://), held by that host's agent from its hello on (every rank a
client, TORCHELASTIC_USE_AGENT_STORE), so no rank waits for rank 0 to open it. A relay thread per agent turns
the agent's frames back into local pipes of the usual shape (a channel Connection and two output fds per
rank), so the supervisor watches the ranks of every host exactly as it watches local ones, and labels their
lines `[host rank N]`.
An agent that goes away (killed, its host lost) fails its ranks; stopping closes every session, and each
agent stops its ranks when its session ends.

RankPool's ranks (Program.POOL) get the same `StartedRank`s as local pool ranks, so the pool drives remote
ranks as local ones: `channel` (commands) and `status` are local duplex pipes whose other ends a sender thread
forwards to the agent, `telemetry`, `stdout` and `stderr` local pipes the relay fills. Its exit is what the
agent reports (`StartedRank.expect_exit_report` / `report_exit`: the remote pid, an exit sentinel, the exit
code), and its `signal` goes through the agent (the pool's forwarded interrupts).
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import queue
import subprocess
import threading
import time
from collections import deque
from functools import partial
from multiprocessing import Pipe
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any

from ...utils.constants import LAUNCH_HOST_ENV
from ..channel import close_quietly
from ..host_protocol import STOP, FrameKind, Hello, KernelFrame, Probe, Start, versions
from ..messages import Failure
from ..serialize import referenced_modules
from .addresses import is_loopback_address
from .hosts import HostError, agent_command, check_modules, check_versions, diagnose, slurm_ended
from .placement_base import Backend, StartedRank
from .plan import Placement, Program

if TYPE_CHECKING:
    from ..serialize import Payload
    from .plan import LaunchPlan

HELLO_TIMEOUT = float(os.environ.get("NBACCEL_HOST_TIMEOUT", "60"))  # seconds for every agent to answer
STOP_WAIT = 10.0  # seconds the agents get to stop their ranks and exit before their sessions are killed
LOST_EXIT = 255  # the exit code given to ranks of an agent that went away without reporting theirs
DUPLEX = ("commands", "status")  # a pool rank's pipes the kernel writes too


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
        self.told_to_start = False  # Start was sent (or was being sent): it may have ranks to stop
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

    def vanished(self) -> str | None:
        """Why the agent's transport ended by itself, when it can tell that apart from the launch's own stop
        (a Ray actor that died; an ssh or srun process cannot tell), else None."""
        return None

    def end_unstarted(self) -> None:
        """End an agent that has no rank yet: its session's end is enough (the agent reads its stdin from its
        first line on, so it leaves at once, even while it imports)."""
        self.close_session()

    def close_session(self) -> None:
        """Say stop and close the session's stdin: the agent stops its ranks and exits."""
        try:
            self.send(STOP)
        except (OSError, ValueError):
            pass
        with self._lock:
            close_quietly(self.to_agent)


def _answer(agent: Agent, local_rank: int, message: Any) -> None:
    """The answer to a rank's prompt (kernel/prompt_relay.py): through its agent to the rank's channel."""
    agent.send((KernelFrame.SEND.value, local_rank, "channel", pickle.dumps(message, pickle.HIGHEST_PROTOCOL)))


def _signal(agent: Agent, local_rank: int, signum: int) -> None:
    """Signal a rank on its host, through its agent (the pool's forwarded SIGINT)."""
    try:
        agent.send((KernelFrame.SIGNAL.value, local_rank, signum))
    except (OSError, ValueError):
        pass


class SshBackend(Backend):
    """Starts and owns the agents of the plan's hosts and, through them, every rank of the launch or pool."""

    programs = frozenset({Program.FUNCTION, Program.POOL})
    via = "ssh"  # how each host's agent starts (hosts.py agent_command)
    # the function travels cloudpickled to other machines; the ranks fork from the agents, which preload there;
    # they meet through torch's TCPStore on the first host; results come back through the channel; each host's
    # agent stops its own ranks' process groups: every capability off

    def __init__(self) -> None:
        self.agents: list[Agent] = []
        self._exits: queue.SimpleQueue[tuple[int, int]] = queue.SimpleQueue()
        # a byte per queued exit: the supervisor's wait wakes on it (wait_objects), not at its next poll, once
        # the relay closed the rank's pipes (the exit comes right after their end of file)
        self._exit_wake = os.pipe()
        for fd in self._exit_wake:
            os.set_blocking(fd, False)
        self._reported: set[int] = set()
        self._stopping = False
        self.world_size = 0
        self.pool = False  # RankPool's ranks: their commands and status go to them (the sender thread)
        self.remote: dict[tuple[int, int], StartedRank] = {}  # (host index, local rank) -> the rank
        self._closing: set[tuple[int, int, str]] = set()  # duplex relay ends the sender thread is to close
        self._lock = threading.Lock()
        self._sending = threading.Event()
        self._sender: threading.Thread | None = None
        self._released = False

    # ------------------------------------------------------------------ start
    def start(self, plan: LaunchPlan, payload: Payload | None) -> list[StartedRank]:
        """Start the agents, check them, have each start its host's ranks; the kernel's ends, by global rank."""
        self.pool = plan.program is Program.POOL
        data = None if self.pool else payload.data if payload is not None else None
        assert self.pool or data is not None, "the SSH backend sends cloudpickled payloads"
        try:
            self._open_agents(plan)
            first_port = plan.port or 0
            # what the pickled function takes from importable modules is imported there: each host checks
            modules = tuple(referenced_modules(data)) if data is not None else ()
            for agent in self.agents:
                try:
                    agent.send(Probe(port=first_port if agent.index == 0 else None, modules=modules,
                                     launch=not self.pool))
                except OSError:  # its session already ended (ssh could not reach the host): the hello wait says why
                    pass
            self._wait_hellos(plan)
            master = self._master_address(plan)
            port = self.agents[0].hello.port  # type: ignore[union-attr]
            ends = self._make_ends(plan)
            for agent in self.agents:
                agent.told_to_start = True
                agent.send(Start(self._host_plan(plan, agent, master, port), data))
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
            self.agents.append(Agent(host, index, self.via))

    def _started(self, ends: list[StartedRank]) -> None:
        """Every agent was told to start: a pool waits for its ranks' pids, then forwards the kernel's commands."""
        if not self.pool:
            return
        deadline = time.monotonic() + HELLO_TIMEOUT
        for agent in self.agents:
            if not agent.started.wait(max(0.0, deadline - time.monotonic())):
                raise HostError(agent.host, f"the agent on {agent.host!r} did not start its ranks within "
                                f"{HELLO_TIMEOUT:.0f} s")
            if agent.lost:
                raise HostError(agent.host, agent.lost)
            for i, pid in enumerate(agent.pids):
                self.remote[(agent.index, i)].pid = pid
        self._sending.set()
        self._sender = threading.Thread(target=self._send_loop, daemon=True, name="nbaccel-ssh-pool-sender")
        self._sender.start()

    def _wait_hellos(self, plan: LaunchPlan) -> None:
        deadline = time.monotonic() + HELLO_TIMEOUT
        ours = versions()
        for agent in self.agents:
            try:
                ready = agent.from_agent.poll(max(0.0, deadline - time.monotonic()))
                hello = agent.from_agent.recv() if ready else None
            except (EOFError, OSError):
                agent.process.wait(5)
                raise diagnose(agent.host, agent.said(), agent.process.returncode, self.via) from None
            if hello is None:
                raise HostError(agent.host, f"the agent on {agent.host!r} did not answer within {HELLO_TIMEOUT:.0f} s "
                                f"(NBACCEL_HOST_TIMEOUT); {self.via} said: {agent.said() or 'nothing'}")
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
        # the host's name as the user gave it, for errors only the rank can word (a module missing there); the
        # kernel stamps it on the rank's messages itself (supervisor.py, pool/rank_processes.py)
        environ[LAUNCH_HOST_ENV] = agent.host
        if self.agents[0].hello is not None and self.agents[0].hello.port is not None:
            # the first host's agent holds the store (host_agent.open_store): every rank is its client
            environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
        # each agent runs its host's ranks as local processes (its LocalBackend), the same program
        return dataclasses.replace(plan, placement=Placement.LOCAL, node_rank=agent.index,
                                   num_nodes=len(self.agents), master_addr=master, port=port, hosts=None, timeout=None,
                                   environ=environ)

    def _make_ends(self, plan: LaunchPlan) -> list[StartedRank]:
        """Local pipes of the usual shape for every rank: the kernel reads (and for a pool writes) them, the
        relay writes (and the sender reads) their other ends."""
        started = []
        for agent in self.agents:
            agent.first_rank = agent.index * plan.num_processes
            for i in range(plan.num_processes):
                started.append(self._pool_ends(agent, i) if self.pool else self._launch_ends(agent, i))
        self.world_size = len(started)
        return started

    def _launch_ends(self, agent: Agent, i: int) -> StartedRank:
        channel_r, channel_w = Pipe(duplex=False)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        agent.writers.append({"channel": channel_w, "stdout": out_w, "stderr": err_w})
        rank = agent.first_rank + i
        # reports_memory: the kernel cannot sample another host's processes (its pids are not ours)
        started = self.remote[(agent.index, i)] = StartedRank(
            rank, rank, channel_r, out_r, err_r, host=agent.host, reports_memory=True, reply=partial(_answer, agent, i))
        started.expect_exit_report()  # its exit code, readable from any thread (a prompt's watch: prompt_relay.py)
        return started

    def _pool_ends(self, agent: Agent, i: int) -> StartedRank:
        commands, relay_commands = Pipe(duplex=True)
        status, relay_status = Pipe(duplex=True)
        telemetry, relay_telemetry = Pipe(duplex=False)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        agent.writers.append({"commands": relay_commands, "status": relay_status, "telemetry": relay_telemetry,
                              "stdout": out_w, "stderr": err_w})
        started = self.remote[(agent.index, i)] = StartedRank(
            agent.first_rank + i, agent.first_rank + i, commands, out_r, err_r, host=agent.host, status=status,
            telemetry=telemetry, reports_memory=True, signal=partial(_signal, agent, i))
        started.expect_exit_report()  # its agent's exit report makes the rank's exit sentinel readable
        return started

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
        if not self._released:  # its fds closed: their numbers may be another file's now
            try:
                os.write(self._exit_wake[1], b"\0")
            except OSError:
                pass  # full: the supervisor has wake-ups enough to read
        self.remote[(agent.index, i)].report_exit(code)

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
        if name in DUPLEX and self._sender is not None:
            with self._lock:
                self._closing.add((agent.index, i, name))  # the sender thread may be waiting on it
            return
        target = agent.writers[i].pop(name, None)
        if target is not None:
            close_quietly(target)

    # ------------------------------------------------------------------ kernel -> ranks
    def _send_loop(self) -> None:
        """Forward what the pool writes to each rank's commands/status pipe; an end of file closes the
        agent's end too (the pool closing a status pipe makes that rank exit)."""
        while self._sending.is_set():
            with self._lock:
                for host, i, name in self._closing:
                    close_quietly(self.agents[host].writers[i].pop(name, None))
                self._closing.clear()
                ends = {conn: (agent, i, name) for agent in self.agents for i, writers in enumerate(agent.writers)
                        for name, conn in writers.items() if name in DUPLEX}
            for conn in wait(list(ends), 0.1) if ends else time.sleep(0.1) or ():
                agent, i, name = ends[conn]
                try:
                    while conn.poll(0):
                        agent.send((KernelFrame.SEND.value, i, name, conn.recv_bytes()))
                except (EOFError, OSError, ValueError):
                    with self._lock:
                        self._closing.add((agent.index, i, name))
                    try:
                        agent.send((KernelFrame.CLOSE.value, i, name))
                    except (OSError, ValueError):
                        pass

    def _agent_ended(self, agent: Agent) -> None:
        """The agent's session ended: its ranks that did not report an exit are lost with it."""
        running = [i for i in range(len(agent.writers)) if i not in agent.exited]
        # lost by itself, even while the launch stops: the others' errors (their collective's peer gone) may
        # have stopped the launch before the loss was seen, and the loss is the cause to name
        vanished = agent.vanished()
        if running and agent.lost is None and vanished:
            agent.lost = vanished
        if running and not self._stopping and agent.lost is None:
            try:
                agent.process.wait(2)
            except subprocess.TimeoutExpired:
                pass
            agent.lost = self._ended(agent, agent.said())
        for i in running:
            rank = agent.first_rank + i
            if agent.lost and (not self._stopping or vanished) and "channel" in agent.writers[i]:
                failure = Failure(rank, "HostLost", agent.lost, local_rank=i)
                self._write(agent, i, "channel", _pickled(failure.to_wire()))
            if agent.lost:  # why, beside its exit (a pool's rank has no channel message to say it)
                self.remote[(agent.index, i)].lost = agent.lost
            self._rank_exited(agent, i, LOST_EXIT)

    def _ended(self, agent: Agent, said: str) -> str:
        """Why an agent's session ended while its ranks ran (`said`: what ssh or srun printed)."""
        return (f"the agent on {agent.host!r} ended ({self.via} exit code {agent.process.returncode})"
                + (f": {said}" if said else "") + "; its ranks were lost with it")

    # ------------------------------------------------------------------ the Backend protocol
    def wait_objects(self) -> list[Any]:
        return [] if self._released else [self._exit_wake[0]]

    def poll_exits(self) -> list[tuple[int, int]]:
        try:
            while not self._released and os.read(self._exit_wake[0], 4096):
                pass
        except OSError:
            pass  # read empty
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
        then sees its stdin end and stops its ranks all the same). An agent never told to start has no rank to
        stop: `end_unstarted` ends it its own quickest way."""
        self._stopping = True
        for agent in self.agents:
            if agent.told_to_start:
                agent.close_session()
            else:
                agent.end_unstarted()
        deadline = time.monotonic() + STOP_WAIT
        for agent in self.agents:
            try:
                agent.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                agent.process.kill()
                agent.process.wait()

    def lost_reason(self) -> str | None:
        return next((agent.lost for agent in self.agents if agent.lost), None)

    def close(self) -> None:
        """Once the launch (or pool) is over: no agent, session, relay or sender of it is left."""
        self.stop()
        if self._released:
            return
        self._released = True
        for agent in self.agents:
            if agent.relay is not None:
                agent.relay.join(timeout=5)
        self._sending.clear()
        if self._sender is not None:
            self._sender.join(timeout=5)
        self._sender = None
        for agent in self.agents:
            close_quietly(agent.from_agent)
            for writers in agent.writers:
                close_quietly(*writers.values())
            agent._stderr_thread.join(timeout=2)
            if agent.process.stderr is not None:
                agent.process.stderr.close()
        for rank in self.remote.values():
            rank.close_exit()  # a rank whose exit was never reported counts as exited (-1)
        close_quietly(*self._exit_wake)


class SlurmBackend(SshBackend):
    """The hosts of a SLURM allocation: the same agents, each started by `srun` on its node."""

    via = "srun"

    def _ended(self, agent: Agent, said: str) -> str:
        """SLURM's own reason when it ended the agent's job step (scancel, the time limit)."""
        return slurm_ended(agent.host, said) or super()._ended(agent, said)


def _pickled(message: dict) -> bytes:
    from multiprocessing.reduction import ForkingPickler

    return bytes(ForkingPickler.dumps(message))

