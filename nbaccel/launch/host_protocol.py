"""What the kernel and a host agent (launch/agent/host_agent.py) say to each other over the SSH session.

The channel is the session's stdin (kernel -> agent) and stdout (agent -> kernel), framed by
multiprocessing's `Connection` (length-prefixed pickles): no port is opened on the kernel's machine. Both ends
are processes of the same user, authenticated by SSH; nothing is unpickled from anyone else.

Kernel -> agent: `Probe` (what the kernel needs to know first), then `Start` (the host's plan and the
cloudpickled function, none for RankPool's ranks), then frames `(kind, ...)` of KernelFrame, then `STOP` (or
just the end of the session: the agent stops its ranks and exits).
Agent -> kernel: one `Hello`, then frames `(kind, ...)` of FrameKind.

A rank's pipes are named: a launch's rank has "channel" (to the kernel), "stdout" and "stderr"; a RankPool
rank has "commands" and "status" (both ways), "telemetry", "stdout" and "stderr".
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from enum import Enum
from typing import Any

AGENT_MODULE = "nbaccel.launch.agent"  # its __main__.py
STOP = "stop"


class FrameKind(str, Enum):
    """The agent's frames after its hello; `i` is the rank's local rank on that host."""

    MESSAGE = "msg"  # (kind, i, pipe name, one message's pickled bytes, as the rank sent them)
    OUTPUT = "out"  # (kind, i, "stdout" | "stderr", bytes)
    END = "end"  # (kind, i, pipe name): that pipe of the rank reached its end
    EXIT = "exit"  # (kind, i, exit code)
    STARTED = "started"  # (kind, [pid of each rank])
    ERROR = "error"  # (kind, text): the agent could not start the ranks


class KernelFrame(str, Enum):
    """The kernel's frames to a started agent (RankPool's ranks; for a launch's rank, the answers to its prompts)."""

    SEND = "send"  # (kind, i, pipe name, one message's pickled bytes): for the rank's end of that pipe
    CLOSE = "close"  # (kind, i, pipe name): close the agent's end of that pipe (the rank sees its end)
    SIGNAL = "signal"  # (kind, i, signal number): e.g. SIGINT, a kernel interrupt forwarded to a busy rank


@dataclass(frozen=True)
class Probe:
    """The kernel's first message: `port` is the rendezvous port whose store this host's agent opens (the
    first host only; 0: a free one; host_agent.open_store), None on the other hosts; `modules`, the modules
    the pickled function refers to by name (serialize.referenced_modules), to check that this host can import
    them."""

    port: int | None = None
    modules: tuple[str, ...] = ()
    launch: bool = True  # a launch's function (False: RankPool's ranks): what the agent preloads for them


@dataclass(frozen=True)
class Hello:
    """The agent's first answer: what the kernel checks before anything starts."""

    hostname: str
    pid: int
    versions: dict[str, str]
    address: str | None  # this host's address as the kernel's SSH connection reached it
    gpus: int
    port: int | None = None  # the rendezvous port, its store open on this host (answer to Probe.port)
    port_error: str | None = None  # why the asked port cannot be opened here
    missing: tuple[tuple[str, str], ...] = ()  # (module, why) for each of Probe.modules this host cannot import


@dataclass(frozen=True)
class Start:
    """Start this host's ranks: `plan` is a LaunchPlan of mode local for this host (node_rank = the host's
    index, master address and port of the first host), `payload` the cloudpickled (function, args, kwargs)."""

    plan: Any
    payload: bytes | None


def versions() -> dict[str, str]:
    """The versions that must agree between the kernel and every host for the pickled function to load."""
    import cloudpickle
    import torch

    from .. import __version__

    return {"Python": ".".join(map(str, sys.version_info[:3])), "nbaccel": __version__,
            "torch": torch.__version__, "cloudpickle": cloudpickle.__version__}
