"""The rendezvous store of a single-machine `nbaccel launch`, listening on the loopback interface only.

torch's TCPStore server listens on every interface (`[::]`) whatever address it is given, and it has no
authentication: on a shared host anyone on the network could read or write a launch's rendezvous. When all
ranks run on this machine, the launching process opens the listening socket itself on 127.0.0.1 and hands it
to a multi-tenant TCPStore. torchrun's static rendezvous then asks for a multi-tenant store on the same port in
the same process and gets this server, so the agent and its workers (TORCHELASTIC_USE_AGENT_STORE) meet on
loopback. Multi-machine launches keep torch's store (README, "What a launch exposes").
"""

from __future__ import annotations

import contextlib
import errno
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from ...utils.constants import LOOPBACK_RDZV_BACKEND

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


# the loopback stores of the `nbaccel launch` runs in progress, with the handlers torch elastic built on each
_agent_stores: dict[int, tuple[LoopbackStore, list[AttemptStores]]] = {}


@contextlib.contextmanager
def loopback_rendezvous(agent_store: LoopbackStore) -> Iterator[list[AttemptStores]]:
    """Let torchrun's agent meet as notebook_launcher's does (`AttemptStores` on `agent_store`): inside the
    block, `--rdzv-backend=nbaccel-loopback --rdzv-endpoint=127.0.0.1:<agent_store.port>` builds it. Yields
    the handlers built (shutting one down keeps the agent from starting another attempt)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(LOOPBACK_RDZV_BACKEND, _attempt_stores_for)  # the same creator: idempotent
    handlers: list[AttemptStores] = []
    _agent_stores[agent_store.port] = (agent_store, handlers)
    try:
        yield handlers
    finally:
        _agent_stores.pop(agent_store.port, None)


def _attempt_stores_for(params: Any) -> AttemptStores:
    """torch elastic's handler creator for LOOPBACK_RDZV_BACKEND (`params`: its RendezvousParameters)."""
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    _, port = parse_rendezvous_endpoint(params.endpoint, default_port=-1)
    if port not in _agent_stores:
        raise ValueError(f"{LOOPBACK_RDZV_BACKEND}: no nbaccel launch serves a store on 127.0.0.1:{port}")
    store, handlers = _agent_stores[port]
    handler = AttemptStores(store, params.run_id, params.get_as_int("timeout", 900))
    handlers.append(handler)
    return handler


class AttemptStores:
    """A rendezvous handler (torch elastic's interface) for one node: torch's static rendezvous on the
    launch's loopback store, and for each attempt's workers a new, empty loopback store on a port the OS
    picks, instead of the agent's store that every attempt shares."""

    def __init__(self, agent_store: LoopbackStore, run_id: str, timeout: int) -> None:
        from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous

        self.agent_store = agent_store  # the static rendezvous's multi-tenant TCPStore finds this server
        self.inner = StaticTCPRendezvous(LOOPBACK, agent_store.port, rank=0, world_size=1, run_id=run_id,
                                         timeout=timeout)
        self.attempt_store: LoopbackStore | None = None  # the previous attempt's closes when replaced
        self.closed = False  # shut down: no further attempt

    def next_rendezvous(self) -> Any:
        from torch.distributed.elastic.rendezvous.api import (
            RendezvousClosedError,
            RendezvousInfo,
            RendezvousStoreInfo,
        )

        if self.closed:  # the launch is stopping its ranks: the agent must not start them again
            raise RendezvousClosedError()
        info = self.inner.next_rendezvous()
        self.attempt_store = None
        self.attempt_store = open_loopback_store(0)
        return RendezvousInfo(info.store, info.rank, info.world_size,
                              RendezvousStoreInfo(LOOPBACK, self.attempt_store.port))

    def get_backend(self) -> str:
        return LOOPBACK_RDZV_BACKEND  # torch elastic checks that a registered backend's handler says its name

    @property
    def use_agent_store(self) -> bool:
        return True  # the workers are clients of the attempt's store

    def shutdown(self) -> bool:
        self.closed = True
        self.attempt_store = None
        return self.inner.shutdown()

    def __getattr__(self, name: str) -> Any:  # get_backend, is_closed, set_closed, num_nodes_waiting, ...
        return getattr(self.inner, name)
