"""What a placement's backend is and gives back: the base class `Backend` (capability attributes, the programs it
runs, the methods the supervisor and the launch session call) and `StartedRank`, the one type of a started rank.
The registry that picks a class by the plan's placement is placements.py; docs/internals.md, "Adding a placement".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, ClassVar

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
    `process` answers what the pool asks of a process (`sentinel`, `join`, `exitcode`, `pid`; on another host
    its agent's stand-in, ssh_backend.RemoteRank)."""

    local_rank: int
    rank: int
    channel: Connection
    stdout_fd: int
    stderr_fd: int
    host: str | None = None  # the host it runs on, as the user named it (None: this machine)
    process: Any = None
    status: Connection | None = None
    telemetry: Connection | None = None
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

    def __post_init__(self) -> None:
        self.open_fds = {self.stdout_fd, self.stderr_fd}
        if self.pid is None and self.process is not None:
            self.pid = self.process.pid

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
        """A new backend for `plan` (placement elastic hands a script to torchrun's agent: torchrun.py)."""
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

    def lost_reason(self) -> str | None:
        """Why ranks ended without a word, when the backend knows (e.g. torch_xla's spawn raised)."""
        return None

    def verdict(self) -> Diagnosis | ExitHang | None:
        """Why the ranks must be stopped though none failed, when the backend watches them itself (`nbaccel
        launch`'s collective watch): a deadlock, or ranks stuck in their teardown after their work ended."""
        return None

    def close(self) -> None:
        """Release what the backend holds (process objects, pipes, sessions) once the ranks are stopped."""
