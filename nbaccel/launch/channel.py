"""The kernel <-> worker message channel: one local multiprocessing pipe per worker.

Messages are small dicts (see docs/internals.md, "The channel"). Workers send them with `WorkerSink`; the
kernel reads them with `recv_all` from its supervising thread and hands each one to its observers. Pipes
never leave the machine: nothing is unpickled from the network.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext
from typing import Any

from .messages import MessageKind

Message = dict[str, Any]
Observer = Callable[[Message], None]


def open_channel(ctx: BaseContext, duplex: bool = False) -> tuple[Connection, Connection]:
    """(kernel end, worker end). With duplex=False the kernel only reads (notebook_launcher); persistent
    ranks ask for duplex=True to send commands too."""
    if duplex:
        return ctx.Pipe(duplex=True)
    reader, writer = ctx.Pipe(duplex=False)
    return reader, writer


BATCHED_KINDS = frozenset(kind.value for kind in (MessageKind.METRICS, MessageKind.STEP, MessageKind.TOTAL,
                                                  MessageKind.MEMORY, MessageKind.COLLECTIVE))
BATCH_INTERVAL = 0.05  # seconds: telemetry reaches the kernel at most this late


class WorkerSink:
    """Send messages from any thread of a worker to the kernel: `sink(message)` or `sink.send(kind, ...)`.

    Telemetry (BATCHED_KINDS) is queued and sent as one `batch` message every BATCH_INTERVAL seconds by a
    sender thread (started at the first telemetry message, so a launch pays no thread start), so a training step pays for a deque append, not a pickle and a system call; the kernel
    unpacks batches before observers see them. Every other message (status, result, error, ...) first
    flushes the queue, then goes out at once, so the order is kept. If the kernel end is gone the sink goes
    quiet instead of failing the training. `defer((build, *args))` queues a telemetry message that is made
    (`build(*args)`) only when the queue is sent, in the sender thread: the collective trace's way, which
    runs around every collective.
    """

    def __init__(self, conn: Connection, rank: int, local_rank: int | None = None,
                 interval: float = BATCH_INTERVAL) -> None:
        self._conn = conn
        self._lock = threading.Lock()
        self._pending: collections.deque[Message | tuple[Any, ...]] = collections.deque()  # tuples: `defer`
        self._interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.rank = rank
        self.local_rank = rank if local_rank is None else local_rank
        self._closed = False
        # `defer`: this method, or while the sender thread runs and the sink is open, the queue's own append
        # (no Python call: the collective trace defers twice per collective)
        self.defer: Callable[[tuple[Any, ...]], None] = self._defer
        self.ticker: Callable[[], None] | None = None  # called by the sender thread every tick_interval
        self.tick_interval = 1.0
        self.ticked = False  # the ticker ran at least once
        self._sender_started = False  # a sender thread was started at least once
        self._ticks_wait = False  # started early (`start_sender_early`): no ticks before the first telemetry

    def __call__(self, message: Message) -> None:
        if self.closed:
            return
        message.setdefault("local_rank", self.local_rank)
        if self._interval > 0 and message.get("kind") in BATCHED_KINDS:
            self._pending.append(message)
            if self._thread is None:
                self._start_sender()
            return
        with self._lock:
            self._flush_locked(message)

    @property
    def closed(self) -> bool:
        """True once the sink sends nothing more (closed, the kernel end gone, or a forked child's copy)."""
        return self._closed

    @closed.setter
    def closed(self, value: bool) -> None:
        self._closed = value
        if value:
            self.defer = self._defer

    def _defer(self, item: tuple[Any, ...]) -> None:
        """`defer(item)`: queue the telemetry message `item[0](*item[1:])`, made when the queue is sent."""
        if self._closed:
            return
        if self._interval <= 0:  # no batching: made and sent now
            self(item[0](*item[1:]))
            return
        self._pending.append(item)
        if self._thread is None:
            self._start_sender()

    def queue(self, message: Message) -> None:
        """Hold `message` until the next send or flush (e.g. a status that need not wake the kernel alone)."""
        message.setdefault("local_rank", self.local_rank)
        self._pending.append(message)

    def send(self, kind: str, **fields: Any) -> None:
        fields.update(kind=kind, rank=self.rank, time=time.time())
        self(fields)

    def flush(self) -> None:
        """Send what is queued now."""
        with self._lock:
            self._flush_locked()

    def close(self) -> None:
        self.defer = self._defer
        self._stop.set()
        self.flush()
        self.closed = True
        try:
            self._conn.close()
        except OSError:
            pass

    def start_sender_early(self) -> None:
        """Start the sender thread now, from a thread other than the one that reports (a launched rank's watch
        thread): the rank's first telemetry message (PartialState's first traced collective) then pays no
        thread start on its way. Its ticks (memory samples) still wait for that first telemetry message, so a
        rank that never reports is sampled by the kernel. Nothing happens once a sender was ever started
        (e.g. stopped since by `stop_sender`) or the sink is closed."""
        with self._lock:
            if self._sender_started or self._closed:
                return
            self._ticks_wait = True
        self._start_sender()

    def _start_sender(self) -> None:
        with self._lock:
            if self._thread is None:
                self._sender_started = True
                self._thread = threading.Thread(target=self._sender, args=(self._stop,), name="nbaccel-telemetry",
                                                daemon=True)
                self._thread.start()
                if not self._closed:
                    self.defer = self._pending.append  # the thread sends what is appended

    def stop_sender(self) -> None:
        """Send what is queued and end the sender thread (the next telemetry message starts a new one)."""
        with self._lock:
            thread, self._thread = self._thread, None
            stop, self._stop = self._stop, threading.Event()
            self.defer = self._defer  # the next deferred message starts a new thread
        stop.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)
        self.flush()

    def _sender(self, stop: threading.Event) -> None:
        next_tick = 0.0
        while not stop.wait(self._interval):
            ticker = self.ticker
            if ticker is not None and not self._ticks_wait and time.monotonic() >= next_tick:
                next_tick = time.monotonic() + self.tick_interval
                self.ticked = True
                try:
                    ticker()
                except Exception:  # a failed sample must never disturb the training
                    pass
            if self._pending:
                self.flush()

    def _flush_locked(self, last: Message | None = None) -> None:
        """Send the queue (and `last` after it) in one write."""
        batch = []
        while True:
            try:
                message = self._pending.popleft()
            except IndexError:
                break
            if type(message) is tuple:  # deferred (`defer`): made now
                message = message[0](*message[1:])
                message["local_rank"] = self.local_rank
                self._ticks_wait = False  # telemetry: the ticks may start
            elif self._ticks_wait and message.get("kind") in BATCHED_KINDS:
                self._ticks_wait = False
            batch.append(message)
        if last is not None:
            if not batch:
                self._send_locked(last)
                return
            batch.append(last)
        if batch:
            if len(batch) > 1:  # runs of logs as one message each (telemetry.coalesce_metrics)
                from .. import telemetry

                batch = telemetry.coalesce_metrics(batch)
            self._send_locked({"kind": MessageKind.BATCH.value, "rank": self.rank, "messages": batch})

    def _send_locked(self, message: Message) -> None:
        if self.closed:
            return
        try:
            self._conn.send(message)
        except (BrokenPipeError, ConnectionError, EOFError, OSError):
            self.closed = True


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
