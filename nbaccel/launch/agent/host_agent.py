"""The host agent: `python -m nbaccel.launch.agent` (agent/__main__.py), started by the kernel on each host over
SSH.

It answers the kernel's probe (versions, address, on the first host the rendezvous port of the store it opens
for the ranks, and which of the modules the pickled function names by reference this host's Python cannot
find), imports what the ranks will inherit while the kernel checks every host's answer, starts this host's
ranks with the backend of the plan it is sent (a launch's: LocalBackend, each rank runs worker/entry.py's run_worker;
RankPool's: PersistentBackend, each rank runs worker/pool_rank.py's loop), and relays their pipes, output and
exits to the kernel over its stdin/stdout (host_protocol.py), and the kernel's messages to them. It
stops its ranks and exits when the kernel says stop or the SSH session closes (stdin ends), so a kernel that
dies leaves nothing running; its ranks die with it (PR_SET_PDEATHSIG) if it is killed itself. A launch's
agent also leaves on its own once every rank's exit is reported (a restart starts new agents: launcher.py),
so its end overlaps the kernel's handling of the last exit instead of waiting for the kernel's stop.

Order: everything goes to the kernel on one stream (this process's stdout), and a rank's output that came
before one of its messages goes before it. A rank flushes its stdout/stderr before it sends a message (a
RankPool reply, a launch's result), so once the message can be read here, the output written before it is in
the rank's output pipes: `_read_pipe` reads those pipes empty (they are non-blocking: reading never waits)
and only then forwards the message. The kernel's relay writes the frames into its local pipes in the order
they came, so the kernel holds a cell's output once it holds the cell's reply.

The SSH session's ends and the thread that reads the kernel's frames are session.py's: they are opened before
this module (and torch) is imported, so a stop while the agent imports ends it at once.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import os
import signal
import socket
import time
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any

from ..channel import close_quietly
from ..host_protocol import STOP, FrameKind, Hello, KernelFrame, Probe, Start, versions
from ..serialize import Payload, missing_modules
from .session import (
    FORWARDED_SIGNALS,
    KernelReader,
    at_leave,
    forward_signals_to,
    hold_in_session,
    leave,
    terminated,
)

if TYPE_CHECKING:
    from ..kernel.rank_groups import RankGroups

DRAIN = 2.0  # seconds to read what a rank left in its pipes after it exited (or was stopped)
READ_SIZE = 65536
READ_LIMIT = 1 << 20  # bytes of one output pipe forwarded at a time (a rank that prints without pause)
STORE_TIMEOUT = 300.0  # seconds the rendezvous store's own client waits (it is not used: the ranks have theirs)
STORE_END_WAIT = 2.0  # seconds the store's process has to end once the agent leaves (then it is killed)
LISTEN_BACKLOG = 1024  # ranks connecting to the store before it serves wait here (torch's own server's backlog)


def connection_address() -> str | None:
    """This host's address on the kernel's SSH connection (SSH_CONNECTION's server address), which the other
    hosts can most likely reach too."""
    parts = os.environ.get("SSH_CONNECTION", "").split()
    return parts[2] if len(parts) == 4 else None


def listen_port(port: int | None) -> tuple[socket.socket | None, str | None]:
    """(a socket listening on `port` (0: a free one) for the rendezvous here, None) or (None, why not); (None,
    None) when `port` is None (not the first host). Listening from now on, the port stays ours until the store
    takes the socket over, and a rank that connects early waits in its backlog instead of backing off."""
    if port is None:
        return None, None
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's store: a port in TIME_WAIT is free
    try:
        sock.bind(("", port))
        sock.listen(LISTEN_BACKLOG)
    except OSError as exc:
        sock.close()
        return None, f"port {port} cannot be opened on {socket.gethostname()} ({exc.strerror})"
    return sock, None


def open_store(port: int | None) -> tuple[int | None, str | None]:
    """On the first host (`port` not None; 0: a free one): open the ranks' rendezvous store, torch's TCPStore
    server, in a process of its own that lives as long as this agent; the ranks connect to it as clients
    (TORCHELASTIC_USE_AGENT_STORE, as under torchrun's agent). Opened by rank 0 instead, it would be up only
    once that rank runs, and a rank of another host that came first would back off ~0.5 s before it tried
    again. Not in this process: the ranks fork from here, and a fork copies no thread (the store's server is
    one) but whatever lock such a thread held. The socket listens here first and the store serves it
    (`master_listen_fd`): the port is held from the probe on (no window between a probe and the store's own
    bind), and a rank that connects early waits in the backlog. The hello waits for torch's answer, so a store
    that cannot open stops the launch before any rank of any host starts. (the port, None), or (port, why
    not) when the rendezvous cannot listen on it here."""
    sock, error = listen_port(port)
    if sock is None:
        return port, error
    listening = sock.getsockname()[1]
    ready_r, ready_w = os.pipe()
    alive_r, alive_w = os.pipe()  # the agent holds its write end: its end of file ends the store's process
    store_pid = os.fork()
    if store_pid == 0:  # pragma: no cover (the store's process: measured through the launches that use it)
        os.close(ready_r)
        os.close(alive_w)
        _serve_store(sock.fileno(), listening, ready_w, alive_r)
    sock.close()  # the store's process holds it: no rank forked later inherits it
    os.close(ready_w)
    os.close(alive_r)
    hold_in_session(alive_w)  # the ranks forked later do not keep the store alive
    at_leave(functools.partial(_end_store, store_pid, alive_w))
    with os.fdopen(ready_r, "rb") as ready:
        answer = ready.read().decode(errors="replace")
    if not answer.isdigit():  # torch refused the socket
        return listening, (f"the store could not open on port {listening} of {socket.gethostname()} "
                           f"({answer or 'its process ended'})")
    return listening, None


def _end_store(pid: int, alive_w: int) -> None:
    """End the store's process (its lifeline closed) and reap it, before the agent leaves: nothing of the agent
    outlives it. Under SLURM (proctrack/pgid) a process left in the agent's group held `srun`, and so the
    kernel's stop, ~3 s after the agent had gone."""
    close_quietly(alive_w)
    deadline = time.monotonic() + STORE_END_WAIT
    try:
        while os.waitpid(pid, os.WNOHANG)[0] == 0:
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return
            time.sleep(0.002)
    except ChildProcessError:
        pass  # reaped already


def _serve_store(listen_fd: int, port: int, ready_w: int, alive_r: int) -> None:
    """The store's process: open the store on the socket, say its port (or why not), hold it until the agent
    ends."""
    from datetime import timedelta

    import torch.distributed as dist

    from ..worker.parent_death import die_with_parent

    die_with_parent()
    # in the agent's process group, which `scancel` (--signal) signals: it ends with the agent (at_leave), not
    # while the ranks save a checkpoint
    for signum in (*FORWARDED_SIGNALS, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # not the SSH session's stderr: the session ends with the agent, not with this
        os.dup2(devnull, fd)
    try:  # it listens on every interface, as rank 0's store would (README: what a launch exposes)
        store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=STORE_TIMEOUT), master_listen_fd=listen_fd)
        os.write(ready_w, str(store.port).encode())
    except BaseException as exc:
        os.write(ready_w, str(exc).encode(errors="replace")[:2000])
        os._exit(1)
    os.close(ready_w)
    try:
        while os.read(alive_r, 4096):
            pass
    finally:
        os._exit(0)


def hello(probe: Probe) -> Hello:
    import torch

    port, error = open_store(probe.port)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return Hello(hostname=socket.gethostname(), pid=os.getpid(), versions=versions(),
                 address=connection_address(), gpus=gpus, port=port, port_error=error,
                 missing=tuple(missing_modules(probe.modules)))


class Relay:
    """This host's ranks, relayed to the kernel until the kernel says stop or goes away."""

    def __init__(self, kernel: Connection, reader: KernelReader) -> None:
        self.kernel = kernel
        self.reader = reader
        reader.ranks_may_start(self._stuck)
        self.backend: Any = None
        self.groups: RankGroups | None = None  # this host's registry of the ranks' process groups, and its keeper
        self.fds: dict[int, tuple[int, str]] = {}  # output fd -> (local rank, stream)
        self.pipes: dict[tuple[int, str], Connection] = {}  # (local rank, pipe name) -> the agent's end, open
        self.leaves_when_done = False  # a launch's ranks: nothing is left to relay once every one exited

    def start(self, start: Start) -> None:
        from ..kernel.module_preload import preload_worker_modules
        from ..kernel.placements import select_backend
        from ..kernel.plan import Program
        from ..kernel.rank_groups import RankGroups
        from ..kernel.start_methods import choose_start_method

        method, _ = choose_start_method(None)
        # the ranks register the groups they lead and pass the folder down to what they start: stopped with the
        # launch here, also a process that left its rank's group (setsid), as on the kernel's machine
        self.groups = RankGroups()
        plan = dataclasses.replace(start.plan, start_method=method).with_folders(groups_dir=self.groups.folder)
        self.leaves_when_done = plan.program is Program.FUNCTION
        preload_worker_modules(method, launch=plan.program is Program.FUNCTION)
        self.backend = select_backend(plan)
        if plan.program is Program.POOL:  # RankPool's ranks: commands and status both ways, telemetry
            for i, ends in enumerate(self.backend.start(plan, None)):
                self._add(i, ends.stdout_fd, ends.stderr_fd, commands=ends.channel, status=ends.status,
                          telemetry=ends.telemetry)
        else:
            for i, handle in enumerate(self.backend.start(plan, Payload(data=start.payload))):
                self._add(i, handle.stdout_fd, handle.stderr_fd, channel=handle.channel)
        forward_signals_to([proc.pid for proc in self.backend.processes])
        self.send(FrameKind.STARTED, [proc.pid for proc in self.backend.processes])

    def _add(self, i: int, out_fd: int, err_fd: int, **pipes: Connection) -> None:
        for fd, stream in ((out_fd, "stdout"), (err_fd, "stderr")):
            os.set_blocking(fd, False)  # a read never waits, also one of a pipe already read empty
            self.fds[fd] = (i, stream)
        for name, conn in pipes.items():
            self.pipes[(i, name)] = conn

    def send(self, kind: FrameKind, *fields: Any) -> None:
        self.kernel.send((kind.value, *fields))

    def serve(self) -> None:
        """Relay until the kernel says stop or goes away; stop the ranks then."""
        wake = self.reader.wake_fd
        try:
            while True:
                readers = {id(conn): key for key, conn in self.pipes.items()}
                objects: list[Any] = [wake, *self.pipes.values(), *self.fds]
                objects += self.backend.wait_objects()
                for obj in wait(objects, timeout=1.0):
                    if obj == wake:
                        if not self._from_kernel():
                            return
                    elif isinstance(obj, int):
                        if obj in self.fds:
                            self._read_fd(obj)
                    elif id(obj) in readers and readers[id(obj)] in self.pipes:
                        self._read_pipe(readers[id(obj)])
                self._report_exits()
                if (self.leaves_when_done or terminated()) and self.backend.finished():
                    return
        finally:
            self.backend.stop()
            try:
                self._report_exits(limit=0.5)
            except OSError:
                pass  # the kernel is gone: nobody to tell
            self.close()

    def close(self) -> None:
        """Stop what any rank left running (its registered group, or the launch's folder in its environment),
        then release the backend, the pipes and the registry (the ranks are stopped)."""
        try:
            if self.groups is not None:
                self.groups.end()
        finally:
            if self.backend is not None:
                self.backend.close()
            self.reader.done.set()
            close_quietly(*self.pipes.values(), *self.fds)
            if self.groups is not None:
                self.groups.close()

    def _from_kernel(self) -> bool:
        """Handle what the kernel sent; False when it says stop or the SSH session closed."""
        for frame in self.reader.take():
            if frame == STOP:
                return False
            self._kernel_frame(frame)
        return True

    def _stuck(self) -> None:
        """The session ended and the relay loop did not stop the ranks in time: kill them (and whatever they
        started, in their process groups) and leave."""
        from ..kernel.process_trees import signal_groups

        pids = [proc.pid for proc in getattr(self.backend, "processes", []) if proc.pid is not None]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        signal_groups(pids, signal.SIGKILL)
        leave(1)

    def _kernel_frame(self, frame: tuple) -> None:
        kind, i = frame[0], frame[1]
        if kind == KernelFrame.SEND:
            conn = self.pipes.get((i, frame[2]))
            if conn is not None:
                try:
                    conn.send_bytes(frame[3])
                except OSError:
                    pass  # the rank is gone: its exit is reported
        elif kind == KernelFrame.CLOSE:
            conn = self.pipes.pop((i, frame[2]), None)
            close_quietly(conn)
        elif kind == KernelFrame.SIGNAL:
            process = self.backend.processes[i]
            if process.is_alive():
                os.kill(process.pid, frame[2])

    def _read_fd(self, fd: int, limit: int = READ_LIMIT) -> None:
        """Forward what the output pipe holds now (up to `limit` bytes), without waiting; at its end, END."""
        if fd not in self.fds:
            return  # read to its end already (a stale readiness from the same wait)
        i, stream = self.fds[fd]
        chunks: list[bytes] = []
        size = 0
        at_end = False
        while size < limit:
            try:
                data = os.read(fd, READ_SIZE)
            except BlockingIOError:
                break
            except OSError:
                data = b""
            if not data:
                at_end = True
                break
            chunks.append(data)
            size += len(data)
        if chunks:
            self.send(FrameKind.OUTPUT, i, stream, b"".join(chunks))
        if at_end:
            del self.fds[fd]
            close_quietly(fd)
            self.send(FrameKind.END, i, stream)

    def _drain_output(self, i: int) -> None:
        """Forward everything rank i's output pipes hold now (before a message of the rank): up to READ_LIMIT,
        more than a pipe holds, so all the rank wrote before the message, whatever it writes meanwhile."""
        for fd in [fd for fd, (rank, _) in self.fds.items() if rank == i]:
            self._read_fd(fd)

    def _read_pipe(self, key: tuple[int, str]) -> None:
        conn = self.pipes[key]
        try:
            while conn.poll(0):
                message = conn.recv_bytes()
                # the rank flushed its output before it sent this: all of that output is in its pipes now,
                # and goes to the kernel first (a cell's printed lines before the cell's reply)
                self._drain_output(key[0])
                self.send(FrameKind.MESSAGE, key[0], key[1], message)
        except (EOFError, OSError):
            del self.pipes[key]
            close_quietly(conn)
            if not terminated():  # else the kernel's end stays open for the loss it writes there (ssh_backend)
                self.send(FrameKind.END, key[0], key[1])

    def _report_exits(self, limit: float = DRAIN) -> None:
        """Each rank that exited: what it left in its pipes first, then its exit code."""
        for i, code in self.backend.poll_exits():
            deadline = time.monotonic() + limit
            while time.monotonic() < deadline:
                for key in [key for key in self.pipes if key[0] == i]:
                    self._read_pipe(key)
                mine = [fd for fd, (rank, _) in self.fds.items() if rank == i]
                if not mine:
                    break
                for fd in wait(mine, timeout=max(0.0, min(0.05, deadline - time.monotonic()))):
                    self._read_fd(fd)
            if not terminated():  # else the kernel counts the ranks as lost with this agent (session._terminate)
                self.send(FrameKind.EXIT, i, code)


def main(kernel: Connection, reader: KernelReader) -> int:
    """The agent's life, on the session `agent/__main__.py` opened; its exit code."""
    probe = reader.next_frame()
    if probe == STOP:
        return 0
    kernel.send(hello(probe))
    # while the kernel checks every host's hello (one round trip, and the slowest host's login and imports),
    # import what the ranks will inherit: then the Start message finds the agent ready to fork
    preload(probe.launch)
    # collections on again (agent/__main__.py turned them off for the imports), the imported heap frozen: no
    # collection here or in a rank forked from here walks torch's objects again (local.py's ranks inherit the
    # same frozen heap from the kernel: start_methods.gc_frozen)
    gc.freeze()
    gc.enable()
    start = reader.next_frame()
    if not isinstance(start, Start):
        return 0  # STOP before anything started (another host failed its checks)
    relay = Relay(kernel, reader)
    try:
        relay.start(start)
    except BaseException as exc:  # say why, then leave: the kernel stops every other host
        import traceback

        try:
            relay.send(FrameKind.ERROR, "".join(traceback.format_exception(exc)))
        except OSError:
            pass
        if relay.backend is not None:
            relay.backend.stop()
        relay.close()
        return 1
    relay.serve()
    return 128 + signal.SIGTERM if terminated() else 0


def preload(launch: bool) -> None:
    """Import what this host's ranks import before their function runs (they fork from here and inherit it)."""
    from ..kernel.module_preload import preload_worker_modules
    from ..kernel.placements import select_backend  # noqa: F401  (Relay.start's imports, paid now)
    from ..kernel.rank_groups import RankGroups  # noqa: F401
    from ..kernel.start_methods import choose_start_method

    try:
        preload_worker_modules(choose_start_method(None)[0], launch=launch)
    except Exception:
        pass  # Relay.start imports them again, and reports to the kernel what fails
