"""Ray's stand-in for an SSH session: a Ray actor that runs one command on its node and carries the command's
stdin and stdout as bytes through its methods (`write`, `read`).

`hosts="ray"` (kernel/ray_backend.py) places one such actor on each node, in the launch's placement group,
and runs the host agent in it (`python -m nbaccel.launch.agent`), exactly as sshd runs it for
`hosts=[...]`. The actor holds the node's share of the group (its CPUs; its GPUs, for which Ray sets
CUDA_VISIBLE_DEVICES, and the command inherits it). Ray's own channel carries the bytes; nothing here opens a
port. The command is this node's Python (`sys.executable` of the Ray worker) running a module.

When the actor goes (`ray.kill`, the kernel's Ray driver gone, the node lost), the command's stdin ends and
it dies with the actor process (PR_SET_PDEATHSIG): the host agent stops its ranks then, as when an SSH session
closes. Only the standard library is imported here, so the actor starts without torch.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import subprocess
import sys
import threading
from collections import deque

READ_SIZE = 1 << 20
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # in the command's process, before it runs (Linux; elsewhere stdin's end)
    try:
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


class RaySession:
    """One command on this node and its byte streams (the kernel makes this class a Ray actor)."""

    def __init__(self, module: str, pythonpath: str | None = None) -> None:
        environ = dict(os.environ)
        if pythonpath:  # the kernel runs nbaccel from a checkout: the same path here (a shared filesystem)
            environ["PYTHONPATH"] = os.pathsep.join(filter(None, [pythonpath, environ.get("PYTHONPATH")]))
        self.process = subprocess.Popen([sys.executable, "-m", module], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=environ,
                                        preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
        self._said: deque[str] = deque(maxlen=50)
        self._write_lock = threading.Lock()
        threading.Thread(target=self._read_stderr, daemon=True, name="nbaccel-ray-session-stderr").start()

    def node(self) -> dict[str, str]:
        """Where this session runs: Ray's node id and the node's address."""
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(), "address": ray.util.get_node_ip_address()}

    def write(self, data: bytes) -> bool:
        """Put the kernel's bytes on the command's stdin; False once the command is gone."""
        with self._write_lock:
            try:
                assert self.process.stdin is not None
                self.process.stdin.write(data)
                self.process.stdin.flush()
                return True
            except (OSError, ValueError):
                return False

    def close_stdin(self) -> None:
        """The kernel ended its side: the command sees the end of its stdin."""
        with self._write_lock:
            try:
                assert self.process.stdin is not None
                self.process.stdin.close()
            except OSError:
                pass

    def read(self, wait: float = 1.0) -> bytes | None:
        """What the command wrote since the last call (b"" when nothing came within `wait` s); None at its end."""
        assert self.process.stdout is not None
        fd = self.process.stdout.fileno()
        ready, _, _ = select.select([fd], [], [], wait)
        if not ready:
            return b""
        return os.read(fd, READ_SIZE) or None

    def exit_info(self, wait: float = 0.0) -> tuple[int | None, str]:
        """The command's exit code (None while it runs, after up to `wait` s) and the last lines it said on
        stderr."""
        try:
            code = self.process.wait(wait) if wait else self.process.poll()
        except subprocess.TimeoutExpired:
            code = None
        return code, "\n".join(self._said)

    def _read_stderr(self) -> None:
        assert self.process.stderr is not None
        for line in iter(self.process.stderr.readline, b""):
            self._said.append(line.decode(errors="replace").rstrip())
