"""`nbaccel launch`'s deadlock detection: the launching process hears which collective each rank is in.

torchrun's agent starts the ranks; each runs through worker/script_entry.py, which connects to this watch's
Unix socket (NBACCEL_COLLECTIVE_WATCH; in an owner-only folder, so only this user's processes can reach it)
and sends the rank's collectives (batched, as a notebook_launcher worker does) and how its script ended. A
thread here feeds them to a `CollectiveTracker` (collective_tracker.py: notebook_launcher's rules and wording) and
checks a few times a second. When the ranks' n-th collectives differ, or every running rank has waited
GRACE seconds in collectives that cannot meet (or that a finished rank never entered), it keeps the
diagnosis and calls `on_deadlock` (`nbaccel launch` then has the agent stop every worker and prints the
report). After a failure, `after_failure` tells whether a deadlock was behind the ranks' errors.

It also watches the exit: a rank says `finished` after its script and every exit function it registered
ran, and keeps its socket open until its process ends. When every connected rank has finished and one of
them is still running the plan's exit_grace seconds later (10 s, or NBACCEL_EXIT_HANG_GRACE), stuck in a
destructor during the interpreter's teardown, it calls `on_exit_hang` with those ranks: `nbaccel launch`
names them, stops them and exits 0, since every script completed.

The watch never fails a launch by itself: an error inside it ends the watching, not the run.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from ..channel import recv_all
from ..hang_report import EXIT_HANG_GRACE, Diagnosis, report_lines
from ..messages import MessageKind, RankState
from ..private_dirs import SHARED_MEMORY, WATCH_PREFIX, make_user_dir
from .collective_tracker import CHECK_INTERVAL, DEADLOCK_EXPLANATION, DEADLOCK_HEAD, GRACE, CollectiveTracker
from .prompt_relay import PromptRelay

logger = logging.getLogger(__name__)
CLOSE_WAIT = 2.0  # seconds `close` waits for what ranks that are still exiting send last
SOCKET_NAME = "sock"
# where the socket's folder is made, in this order: the temporary folder (None), then two short ones for a
# temporary folder too deep for a socket (a Unix socket's path holds 104-108 bytes: a long TMPDIR, a job's
# scratch folder, a test's tmp_path)
SOCKET_PARENTS = (None, SHARED_MEMORY, "/tmp")


@dataclass(frozen=True)
class ExitHang:
    """Ranks that finished their script but whose processes did not end within `grace` seconds."""

    ranks: tuple[int, ...]
    grace: float

    def summary(self) -> str:
        ranks = ", ".join(map(str, self.ranks))
        return (f"rank(s) {ranks} finished the script but did not exit within {self.grace:g} s (stuck tearing "
                "down the process); stopped them. Every rank completed its script.")


@dataclass
class _Peer:
    """One connected rank process: its rank and attempt, once it said."""

    rank: int | None = None
    attempt: int = 0
    finished_at: float | None = None  # when it said its script ended well (time.monotonic)
    conn: Connection | None = None  # its socket: the answers to its prompts go back through it


class CollectiveWatch:
    """The listening end: start it before the ranks, `close` it after them (see the module docstring)."""

    def __init__(self, on_deadlock: Callable[[Diagnosis], None], grace: float = GRACE,
                 on_exit_hang: Callable[[ExitHang], None] | None = None,
                 exit_grace: float = EXIT_HANG_GRACE) -> None:
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._folder = _listen_in_private_folder(self._server)
        except OSError:
            self._server.close()
            raise
        self.address = os.path.join(self._folder, SOCKET_NAME)
        self.tracker = CollectiveTracker(grace, work="the script")
        self.deadlock: Diagnosis | None = None
        self._on_deadlock = on_deadlock
        self._on_exit_hang = on_exit_hang
        self.exit_hang: ExitHang | None = None
        self._exit_grace = exit_grace  # seconds a rank that finished its script gets to end its process
        self._peers: dict[Connection, _Peer] = {}  # one per rank process connected
        self._attempt = 0  # the newest attempt (TORCHELASTIC_RESTART_COUNT) a rank announced
        self.prompts = PromptRelay()  # a rank's input()/breakpoint()/pdb (prompt_relay.py)
        self._prompts: list[tuple[_Peer, dict[str, Any]]] = []  # prompts read, to serve outside the lock
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake, self._waker = socket.socketpair()  # `close` writes to _waker: the thread stops waiting at once
        self._thread = threading.Thread(target=self._watch, name="nbaccel-collective-watch", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the watching thread
    def _watch(self) -> None:
        try:
            while not self._stop.is_set():
                ready = wait([self._server, self._wake, *self._peers], timeout=CHECK_INTERVAL)
                with self._lock:
                    self._take(ready)
                    prompts, self._prompts = self._prompts, []
                for peer, message in prompts:  # asked outside the lock: `close` never waits for the user
                    self.prompts.serve(f"rank {peer.rank}", message, peer.conn.send)
                with self._lock:
                    found = self._check() if self.deadlock is None else None
                    stuck = self._check_exit() if self.exit_hang is None else None
                if found is not None:
                    self._on_deadlock(found)
                if stuck is not None and self._on_exit_hang is not None:
                    self._on_exit_hang(stuck)
        except Exception:  # never fail the launch: stop watching, the process group's timeout still holds
            logger.debug("nbaccel launch: the collective watch stopped", exc_info=True)

    def _take(self, ready: Iterable[Any]) -> None:
        for item in ready:
            if item is self._wake:
                continue
            if item is self._server:
                with contextlib.suppress(OSError):
                    client, _ = self._server.accept()
                    conn = Connection(client.detach())
                    self._peers[conn] = _Peer(conn=conn)
            else:
                self._read(item)

    def _check(self) -> Diagnosis | None:
        # a rank that failed is torch elastic's to handle (it restarts the ranks or ends the launch): the others
        # waiting for it are no deadlock, and `after_failure` says if one was behind the failure
        alive = [rank for rank, state in self.tracker.ranks.items() if state.phase != RankState.FAILED]
        found = self.tracker.divergence or self.tracker.check(alive, self.prompts.wall())  # time at prompts left out
        if found is not None:
            self.deadlock = found
        return found

    def _check_exit(self) -> ExitHang | None:
        current = [peer for peer in self._peers.values() if peer.rank is not None and peer.attempt == self._attempt]
        if not current or any(peer.finished_at is None for peer in current):
            return None  # some rank is still running its script
        now = time.monotonic()
        stuck = tuple(sorted(peer.rank for peer in current if now - peer.finished_at >= self._exit_grace))
        if stuck:
            self.exit_hang = ExitHang(stuck, self._exit_grace)
        return self.exit_hang

    def _read(self, conn: Connection) -> None:
        peer = self._peers.get(conn)
        if peer is None:
            return
        messages, closed = recv_all(conn)
        for message in messages:
            self._handle(peer, message)
        if closed:
            self._peers.pop(conn, None)
            conn.close()
            if peer.rank is not None and peer.attempt == self._attempt:  # (a rank that reported its end keeps it)
                self.tracker.failed(peer.rank, "the process ended")  # without a word: killed by a signal

    def _handle(self, peer: _Peer, message: dict[str, Any]) -> None:
        kind = message.get("kind")
        if kind == MessageKind.BATCH:
            for inner in message.get("messages", ()):
                self._handle(peer, inner)
            return
        if kind == MessageKind.STATUS and message.get("state") == RankState.RUNNING:  # a rank's first word
            peer.rank, peer.attempt = int(message.get("rank", 0)), int(message.get("restart") or 0)
            if peer.attempt > self._attempt:  # torch elastic started the ranks again: the old attempt is over
                for rank in list(self.tracker.ranks):
                    self.tracker.restarted(rank)
                self._attempt = peer.attempt
            return
        if peer.rank is None or peer.attempt != self._attempt:  # a rank of an earlier attempt, on its way out
            return
        if kind == MessageKind.COLLECTIVE:
            self.tracker.on_message(peer.rank, message)
        elif kind == MessageKind.PROMPT:  # input()/pdb in a rank: asked on this process's terminal, in turn
            self._prompts.append((peer, message))
        elif kind == MessageKind.STATUS and message.get("state") == RankState.FINISHED:
            peer.finished_at = time.monotonic()
            self.tracker.finished(peer.rank)
        elif kind == MessageKind.STATUS and message.get("state") == RankState.FAILED:
            self.tracker.failed(peer.rank, str(message.get("error", "")))

    # ------------------------------------------------------------------ what the launching process asks
    def close(self) -> None:
        """Stop watching (after reading what the ranks sent last) and remove the socket."""
        self._stop.set()
        with contextlib.suppress(OSError):
            self._waker.send(b"x")
        self._thread.join(timeout=0.2 if self.prompts.active else 5)  # a thread at a prompt waits for the user
        with self._lock:
            deadline = time.monotonic() + CLOSE_WAIT
            with contextlib.suppress(Exception):  # the ranks have exited: what they sent waits, then end of file
                while self._peers and (left := deadline - time.monotonic()) > 0:
                    self._take(wait([self._server, *self._peers], timeout=left))
            for conn in self._peers:
                conn.close()
            self._peers.clear()
        for end in (self._server, self._wake, self._waker):
            end.close()
        shutil.rmtree(self._folder, ignore_errors=True)

    def after_failure(self, failed: dict[int, str]) -> Diagnosis | None:
        """The deadlock behind a failed launch, if any (call after `close`): `failed` maps each failed rank to
        what torch elastic says of it, for ranks that could not report themselves (a rank that reported its
        end keeps it: `CollectiveTracker.failed`)."""
        for rank, reason in failed.items():
            self.tracker.failed(rank, reason)
        return self.deadlock or self.tracker.divergence or self.tracker.at_failure(list(self.tracker.ranks),
                                                                                  time.time())


def report(diagnosis: Diagnosis) -> str:
    """The deadlock report `nbaccel launch` prints: notebook_launcher's words."""
    return "\n".join(report_lines(diagnosis, DEADLOCK_HEAD, DEADLOCK_EXPLANATION))


def _listen_in_private_folder(server: socket.socket) -> str:
    """Bind `server` to SOCKET_NAME in a new owner-only folder of the first of SOCKET_PARENTS where that works,
    and listen; return the folder. Raises the last OSError where none does."""
    error: OSError | None = None
    for parent in SOCKET_PARENTS:
        try:
            folder = make_user_dir(WATCH_PREFIX, parent)
        except OSError as exc:  # no such folder, not writable
            error = exc
            continue
        try:
            server.bind(os.path.join(folder, SOCKET_NAME))
            server.listen(64)
        except OSError as exc:  # "AF_UNIX path too long"
            shutil.rmtree(folder, ignore_errors=True)
            error = exc
            continue
        return folder
    assert error is not None
    raise error
