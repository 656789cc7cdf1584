"""What a placement's backend is and gives back: the base class `Backend` (capability attributes, the programs it
runs, the methods the supervisor and the launch session call) and `StartedRank`, the one type of a started rank.
The registry that picks a class by the plan's placement is placements.py; docs/internals.md, "Adding a placement".
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any, ClassVar

from ..channel import close_quietly
from ..messages import rank_label
from .plan import Program

if TYPE_CHECKING:
    from ..hang_report import Diagnosis
    from ..serialize import Payload
    from .collective_watch import ExitHang
    from .plan import LaunchPlan


@dataclass
class StartedRank:
    """One started rank, as the kernel holds it, whatever its placement and program: its identity (rank,
    local rank, the host it runs on), the kernel's ends of its pipes, and what the supervisor learns of it.

    `channel` carries a function's or a script's messages to the kernel; for RankPool's loop it is the duplex
    command pipe, with `status` (status queries, answered while the rank is busy) and `telemetry` beside it.
    What the pool asks of a rank's process is its exit (`exit_sentinel`, `exit_code`, `wait_exit`) and a signal
    (`send_signal`). A rank of this machine's: its `process` (multiprocessing) answers. A rank on another host:
    its backend calls `expect_exit_report` when it starts it and `report_exit` when its agent says it exited, and
    sets `signal` to what signals it there (the agent)."""

    local_rank: int
    rank: int
    channel: Connection
    stdout_fd: int
    stderr_fd: int
    host: str | None = None  # the host it runs on, as the user named it (None: this machine)
    process: Any = None
    status: Connection | None = None
    status_unanswered: int = 0  # RankPool: status queries sent whose answers were not read (an interrupted call)
    telemetry: Connection | None = None
    device: str = "cpu"  # RankPool: the device the rank said it uses once it started
    # what the supervisor learns while it watches the rank
    channel_open: bool = True
    open_fds: set[int] = field(default_factory=set)
    has_result: bool = False
    result: Any = None
    exited: bool = False
    exitcode: int | None = None
    generation: int = 0
    seen: bool = False  # sent at least one message
    pid: int | None = None
    reports_memory: bool = False  # the rank sends its own `memory` messages
    rss_peak: int = 0
    last_rss: int | None = None  # resident memory at the last sample (its own report or the kernel's)
    reply: Any = None  # sends the answer to its prompts (prompt_relay.py); None: `channel.send` (over SSH: its agent)
    signal: Callable[[int], None] | None = None  # signals the rank where os.kill cannot (another host: its agent)
    lost: str | None = None  # another host's rank that ended with its agent: why (set before `report_exit`)
    exit_sentinel: int | None = None  # readable once the rank exited (its process's sentinel, or `report_exit`'s)
    _exit_report: int | None = field(default=None, init=False, repr=False)  # the write end `report_exit` closes

    def __post_init__(self) -> None:
        self.open_fds = {self.stdout_fd, self.stderr_fd}
        if self.process is not None:
            if self.pid is None:
                self.pid = self.process.pid
            self.exit_sentinel = self.process.sentinel

    # ------------------------------------------------------------------ its exit, as the pool waits for it
    def expect_exit_report(self) -> None:
        """A rank this machine cannot wait on (another host's): its exit sentinel becomes readable on
        `report_exit`, which its backend calls when the rank's agent reports the exit (or the agent is gone)."""
        self.exit_sentinel, self._exit_report = os.pipe()

    def report_exit(self, code: int) -> None:
        """The rank exited with `code` (the first report counts); its exit sentinel becomes readable."""
        if self._exit_report is not None:
            if self.exitcode is None:
                self.exitcode = code
            close_quietly(self._exit_report)
            self._exit_report = None

    def exit_code(self) -> int | None:
        """Its exit code, None while it runs."""
        return self.process.exitcode if self.process is not None else self.exitcode

    def is_alive(self) -> bool:
        return self.exit_code() is None

    def wait_exit(self, timeout: float) -> int | None:
        """Wait up to `timeout` seconds for the rank to exit; its exit code (None: still running)."""
        if self.process is not None:
            self.process.join(timeout)
        elif self.exit_sentinel is not None and self.exitcode is None:
            wait([self.exit_sentinel], timeout)
        return self.exit_code()

    def send_signal(self, signum: int) -> None:
        """Signal the rank's process (a rank on another host: through its agent)."""
        if self.signal is not None:
            self.signal(signum)
        elif self.pid is not None:
            os.kill(self.pid, signum)

    def close_exit(self) -> None:
        """Release the exit report's pipe (a rank on another host); a local process's sentinel is its own."""
        if self.process is None and self.exit_sentinel is not None:
            self.report_exit(-1)
            close_quietly(self.exit_sentinel)
            self.exit_sentinel = None

    @property
    def label(self) -> str:
        """How errors and reports name it: `rank 3`, or `rank 3 on gpu-b`."""
        return rank_label(self.rank, self.host)

    @property
    def line_label(self) -> str:
        """How its output lines are labelled: `rank 3`, or `gpu-b rank 3`."""
        return f"{self.host} rank {self.rank}" if self.host else f"rank {self.rank}"


class Backend:
    """One placement: starts the ranks of a plan, owns them until `close`, answers the supervisor.

    Subclasses set the capability attributes (module docstring) and `programs`, and implement the methods."""

    programs: ClassVar[frozenset[Program]] = frozenset()  # what its ranks can run
    fail_fast: ClassVar[bool] = True  # stop every rank at the first failure (elastic: no, it restarts them)
    workers_may_not_start: ClassVar[bool] = False  # some prepared ranks may never start (torch_xla)
    inherits_objects: ClassVar[bool] = False
    preloads_modules: ClassVar[bool] = False
    freezes_gc: ClassVar[bool] = False
    private_store: ClassVar[bool] = False
    result_folder: ClassVar[bool] = False
    rank_groups: ClassVar[bool] = False

    @classmethod
    def for_plan(cls, plan: LaunchPlan) -> Backend:
        """A new backend for `plan` (a class that composes parts per program picks them here: elastic.py)."""
        return cls()

    def start(self, plan: LaunchPlan, payload: Payload | None) -> list[StartedRank]:
        """Start the plan's ranks running `plan.program`; return the ranks the kernel watches."""
        raise NotImplementedError

    def wait_objects(self) -> list[Any]:
        """Objects (process sentinels) whose readiness means a rank may have exited."""
        return []

    def poll_exits(self) -> list[tuple[int, int]]:
        """(local rank, exit code) of the ranks that exited since the last call."""
        raise NotImplementedError

    def finished(self) -> bool:
        """Every rank is done (and none can start any more)."""
        raise NotImplementedError

    def stop(self) -> None:
        """Stop every rank; nothing started by this backend is left."""
        raise NotImplementedError

    def exit_failures(self) -> dict[int, Any]:
        """Failures only the backend knows of, by rank (read once the run finished)."""
        return {}

    def restarted_failures(self) -> dict[int, Any]:
        """How the ranks of the attempts the backend restarted since the last call ended, by rank, when only
        the backend saw it (torch elastic's agent: a rank killed by a signal reports nothing itself)."""
        return {}

    def prompt_moot(self) -> str | None:
        """Why a rank's prompt needs no answer any more where only the backend can tell (torch elastic's agent
        is restarting the ranks), else None. Called from the prompt's watch thread (prompt_relay.py) while the
        supervisor waits for the user: it reads only what the backend's own threads write."""
        return None

    def lost_reason(self) -> str | None:
        """Why ranks ended without a word, when the backend knows (e.g. torch_xla's spawn raised)."""
        return None

    def verdict(self) -> Diagnosis | ExitHang | None:
        """Why the ranks must be stopped though none failed, when the backend watches them itself (`nbaccel
        launch`'s collective watch): a deadlock, or ranks stuck in their teardown after their work ended."""
        return None

    def close(self) -> None:
        """Release what the backend holds (process objects, pipes, sessions) once the ranks are stopped."""
