"""RankPool's ranks on several hosts: the SSH backend (ssh_backend.py) with each agent running persistent ranks
(PersistentBackend there, worker/pool_rank.py's loop) instead of a launch's.

`start(plan)` returns the same `RankEnds` as the local PersistentBackend, so RankPool's code (pool/processes.py,
pool/call.py) drives remote ranks as local ones: `commands` and `status` are local duplex pipes whose other ends
the relay forwards both ways over the agent's SSH session, `telemetry`, `stdout` and `stderr` local pipes the
relay fills, and `process` a `RemoteRank` (the remote pid, a sentinel that becomes readable when the agent
reports the rank's exit, `join`, `exitcode`, and `send_signal` for the pool's forwarded interrupts).
"""

from __future__ import annotations

import os
import threading
import time
from multiprocessing import Pipe
from multiprocessing.connection import wait
from typing import TYPE_CHECKING, Any

from ..channel import close_quietly
from ..host_protocol import KernelFrame
from .hosts import HostError
from .persistent import RankEnds
from .plan import Mode
from .ssh_backend import HELLO_TIMEOUT, Agent, SshBackend

if TYPE_CHECKING:
    from .plan import LaunchPlan

DUPLEX = ("commands", "status")  # the pipes the kernel writes too


class RemoteRank:
    """A rank on another host, answering what RankPool asks of a multiprocessing.Process."""

    def __init__(self, agent: Agent, local_rank: int) -> None:
        self.agent = agent
        self.local_rank = local_rank
        self.pid: int | None = None  # on its host
        self.exitcode: int | None = None
        self.sentinel, self._exit_fd = os.pipe()  # readable (end of file) once the rank exited
        self._done = threading.Event()

    def exited(self, code: int) -> None:
        if not self._done.is_set():
            self.exitcode = code
            self._done.set()
            close_quietly(self._exit_fd)

    def is_alive(self) -> bool:
        return not self._done.is_set()

    def join(self, timeout: float | None = None) -> None:
        self._done.wait(timeout)

    def send_signal(self, signum: int) -> None:
        """Signal the rank on its host (the pool's forwarded SIGINT)."""
        try:
            self.agent.send((KernelFrame.SIGNAL.value, self.local_rank, signum))
        except (OSError, ValueError):
            pass

    def close(self) -> None:
        close_quietly(self.sentinel, self._exit_fd)


class SshPoolBackend(SshBackend):
    """Starts RankPool's ranks on the plan's hosts, one agent each; relays their pipes both ways."""

    host_mode = Mode.PERSISTENT

    def __init__(self) -> None:
        super().__init__()
        self.remote: dict[tuple[int, int], RemoteRank] = {}  # (host index, local rank) -> the rank
        self._closing: set[tuple[int, int, str]] = set()  # duplex relay ends the sender thread is to close
        self._lock = threading.Lock()
        self._sending = threading.Event()
        self._sender: threading.Thread | None = None
        self._released = False

    def start(self, plan: LaunchPlan, payload: Any = None) -> list[RankEnds]:  # type: ignore[override]
        return self._start(plan, None)

    def _make_ends(self, plan: LaunchPlan) -> list[Any]:
        ends = []
        for agent in self.agents:
            agent.first_rank = agent.index * plan.num_processes
            for i in range(plan.num_processes):
                commands, relay_commands = Pipe(duplex=True)
                status, relay_status = Pipe(duplex=True)
                telemetry, relay_telemetry = Pipe(duplex=False)
                out_r, out_w = os.pipe()
                err_r, err_w = os.pipe()
                agent.writers.append({"commands": relay_commands, "status": relay_status,
                                      "telemetry": relay_telemetry, "stdout": out_w, "stderr": err_w})
                process = self.remote[(agent.index, i)] = RemoteRank(agent, i)
                ends.append(RankEnds(agent.first_rank + i, process, commands, status, telemetry, out_r, err_r))
        self.world_size = len(ends)
        return ends

    def _started(self, ends: list[Any]) -> None:
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

    def _close_writer(self, agent: Agent, i: int, name: str) -> None:
        if name in DUPLEX and self._sender is not None:
            with self._lock:
                self._closing.add((agent.index, i, name))  # the sender thread may be waiting on it
            return
        super()._close_writer(agent, i, name)

    def _rank_exited(self, agent: Agent, i: int, code: int) -> None:
        super()._rank_exited(agent, i, code)
        self.remote[(agent.index, i)].exited(code)

    # ------------------------------------------------------------------ the end
    def stop(self) -> None:
        """Every agent stops its ranks and exits; then nothing of the pool's relay is left either (the pool
        calls only stop)."""
        super().stop()
        self._release()

    def close(self) -> None:
        self.stop()

    def _release(self) -> None:
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
        SshBackend.close(self)
        for rank in self.remote.values():
            rank.exited(rank.exitcode if rank.exitcode is not None else -1)
            rank.close()

