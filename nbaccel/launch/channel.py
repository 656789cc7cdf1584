"""The kernel <-> worker message channel: one local multiprocessing pipe per worker.

Messages are small dicts (see docs/internals.md, "The channel"). Workers send them with `WorkerSink`; the
kernel reads them with `recv_all` from its supervising thread and hands each one to its observers. Pipes
never leave the machine: nothing is unpickled from the network.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext
from typing import Any

Message = dict[str, Any]
Observer = Callable[[Message], None]


def open_channel(ctx: BaseContext, duplex: bool = False) -> tuple[Connection, Connection]:
    """(kernel end, worker end). With duplex=False the kernel only reads (notebook_launcher); persistent
    ranks ask for duplex=True to send commands too."""
    if duplex:
        return ctx.Pipe(duplex=True)
    reader, writer = ctx.Pipe(duplex=False)
    return reader, writer


class WorkerSink:
    """Send messages from any thread of a worker to the kernel: `sink(message)` or `sink.send(kind, ...)`.

    A direct `Connection.send` under a lock: a few microseconds for a small dict, no extra thread. If the
    kernel end is gone the sink goes quiet instead of failing the training.
    """

    def __init__(self, conn: Connection, rank: int, local_rank: int | None = None) -> None:
        self._conn = conn
        self._lock = threading.Lock()
        self.rank = rank
        self.local_rank = rank if local_rank is None else local_rank
        self.closed = False

    def __call__(self, message: Message) -> None:
        if self.closed:
            return
        message.setdefault("local_rank", self.local_rank)
        try:
            with self._lock:
                self._conn.send(message)
        except (BrokenPipeError, ConnectionError, EOFError, OSError):
            self.closed = True

    def send(self, kind: str, **fields: Any) -> None:
        fields.update(kind=kind, rank=self.rank, time=time.time())
        self(fields)

    def close(self) -> None:
        self.closed = True
        try:
            self._conn.close()
        except OSError:
            pass


def recv_all(conn: Connection) -> tuple[list[Message], bool]:
    """Every message waiting on `conn` without blocking; the flag is True when the worker end closed."""
    messages: list[Message] = []
    try:
        while conn.poll(0):
            messages.append(conn.recv())
    except (EOFError, OSError):
        return messages, True
    return messages, False


def close_quietly(*things: Any) -> None:
    for thing in things:
        try:
            if isinstance(thing, int):
                os.close(thing)
            elif thing is not None:
                thing.close()
        except OSError:
            pass
