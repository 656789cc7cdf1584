"""The rendezvous store of a single-machine `nbaccel launch`, listening on the loopback interface only.

torch's TCPStore server listens on every interface (`[::]`) whatever address it is given, and it has no
authentication: on a shared host anyone on the network could read or write a launch's rendezvous. When all
ranks run on this machine, the launching process opens the listening socket itself on 127.0.0.1 and hands it
to a multi-tenant TCPStore. torchrun's static rendezvous then asks for a multi-tenant store on the same port in
the same process and gets this server, so the agent and its workers (TORCHELASTIC_USE_AGENT_STORE) meet on
loopback. Multi-machine launches keep torch's store (README, "What a launch exposes").
"""

from __future__ import annotations

import errno
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

LOOPBACK = "127.0.0.1"


class StorePortBusy(OSError):
    """The port asked for the rendezvous is already taken on this machine's loopback interface."""


@dataclass
class LoopbackStore:
    """A TCPStore server on 127.0.0.1:`port`; keep it referenced for as long as the launch runs."""

    port: int
    store: Any  # torch.distributed.TCPStore


def open_loopback_store(port: int = 0, timeout: timedelta = timedelta(minutes=15)) -> LoopbackStore:
    """Listen on 127.0.0.1:`port` (0: a free port the OS picks, with no race) and serve a TCPStore there."""
    from torch.distributed import TCPStore

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((LOOPBACK, port))
        listener.listen(socket.SOMAXCONN)
    except OSError as exc:
        listener.close()
        if exc.errno == errno.EADDRINUSE:
            raise StorePortBusy(exc.errno, f"port {port} is already in use on {LOOPBACK}") from None
        raise
    port = listener.getsockname()[1]
    try:
        store = TCPStore(LOOPBACK, port, None, True, timeout, wait_for_workers=False, multi_tenant=True,
                         master_listen_fd=listener.fileno())
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store's server owns the descriptor now (it closes it when it stops)
    return LoopbackStore(port=port, store=store)
