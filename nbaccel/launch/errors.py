"""The errors a launch raises in the kernel, and the per-rank failure record they carry.

`LaunchError` is a torch `ChildFailedError` (what Accelerate's notebook_launcher raises when a rank fails, from
torch.distributed.elastic), so `except ChildFailedError` code written for Accelerate catches it; its
`.failures` values answer torch's `ProcessFailure` attributes too (`local_rank`, `pid`, `exitcode`,
`error_file`, `error_file_data`, `timestamp`, `signal_name()`). This module imports torch for that base class.
"""

from __future__ import annotations

import copy
import re
import signal as signals
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from .kernel.process_trees import signal_name
from .messages import rank_label

NOT_AVAILABLE = "<N/A>"  # torch's word for a field it does not know


@dataclass
class WorkerFailure:
    """What went wrong on one rank: the remote exception, or how the process ended.

    `message` is the exception's own message (torch's ProcessFailure puts its error-file record there; that
    record is `error_file_data`, in torch's layout)."""

    rank: int
    exc_type: str | None = None
    message: str = ""
    traceback: str = ""
    exitcode: int | None = None
    signal: str | None = None
    local_rank: int | None = None
    pid: int | None = None
    timestamp: int = field(default_factory=lambda: int(time.time()))
    error_file: str = NOT_AVAILABLE  # nbaccel's workers report over their channel, not through a file
    last_rss: int | None = None  # the rank's resident memory at its last sample, in bytes (None: no sample)
    host: str | None = None  # the host it ran on, with hosts= (stamped by the supervisor, which started it there)

    def __str__(self) -> str:
        """What went wrong, without the rank: `ValueError: boom` or `killed by SIGTERM (exit code -15)` (the
        dashboard's summary shows it next to the rank; a dataclass's repr would show every field). SIGKILL
        adds the out-of-memory hint, with the rank's last memory sample when there is one."""
        if self.exc_type:
            return f"{self.exc_type}: {self.message}".rstrip(": ")
        if self.signal == "SIGKILL":
            return f"killed by SIGKILL (exit code {self.exitcode}; {oom_hint(self.last_rss)})"
        if self.signal:
            return f"killed by {self.signal} (exit code {self.exitcode})"
        if self.exitcode is None:  # no process ended (e.g. a rank that finished without a result)
            return self.message or "exited"
        plain_exit = f"exited with code {self.exitcode}"
        if self.message in ("", plain_exit):  # the message is the exit code already: said once
            return plain_exit
        return f"{self.message} (exit code {self.exitcode})"

    def summary(self) -> str:
        """One line: `rank 1: ValueError: boom`, `rank 3 on gpu-b: exited with code 3`."""
        return f"{rank_label(self.rank, self.host)}: {self}"

    @property
    def error_file_data(self) -> dict[str, Any]:
        """The remote exception in the layout of torch elastic's error file (`record`), as Accelerate's
        ChildFailedError carries it: {"message": {"message": "ValueError: boom", "extraInfo":
        {"py_callstack": traceback, "timestamp": "..."}}}; {"message": "<NONE>"} without an exception."""
        if not self.exc_type:
            return {"message": "<NONE>"}
        return {"message": {"message": f"{self.exc_type}: {self.message}".rstrip(": "),
                            "extraInfo": {"py_callstack": self.traceback, "timestamp": str(self.timestamp)}}}

    def signal_name(self) -> str:
        """The name of the signal that ended the process (torch's ProcessFailure.signal_name), else <N/A>."""
        if self.signal:
            return self.signal
        if self.exitcode is not None and self.exitcode < 0:
            try:
                return signals.Signals(-self.exitcode).name
            except ValueError:
                pass
        return NOT_AVAILABLE

    def timestamp_isoformat(self) -> str:
        return datetime.fromtimestamp(self.timestamp).isoformat(sep="_")


def oom_hint(last_rss: int | None) -> str:
    """Why a rank may have been SIGKILLed: the OOM killer, with its last memory sample when there is one."""
    hint = "out of memory? the OOM killer sends SIGKILL"
    if last_rss:
        hint += f"; its last memory sample: {last_rss / 2**20:.1f} MiB resident"
    return hint


def ended_how(exitcode: int | None, last_rss: int | None = None) -> str:
    """How a process ended, in words: "exited with code 1", "killed by SIGTERM"; a SIGKILL adds `oom_hint`.
    None (no exit status could be read): "exit status unknown"."""
    if exitcode is None:
        return "exit status unknown"
    sig = signal_name(exitcode)
    if sig == "SIGKILL":
        return f"killed by SIGKILL ({oom_hint(last_rss)})"
    return f"killed by {sig}" if sig else f"exited with code {exitcode}"


class LaunchError(ChildFailedError, RuntimeError):
    """A launched worker failed (or the launch could not go on); `.failures` maps rank -> WorkerFailure.

    A torch `ChildFailedError` as Accelerate raises: `.name` is the function's name, `get_first_failure()`
    the first rank that failed, `format_msg()` torch's report. `.attempts` holds the failures of earlier
    attempts that `max_restarts` restarted, oldest first (the message names them too)."""

    def __init__(self, message: str, failures: dict[int, WorkerFailure] | None = None, *, name: str = "",
                 first_rank: int | None = None, attempts: Sequence[dict[int, WorkerFailure]] = ()) -> None:
        RuntimeError.__init__(self, message)  # not ChildFailedError's: it refuses an empty map, writes its own text
        self.name = name
        self.failures: dict[int, WorkerFailure] = dict(failures or {})
        self.first_rank = first_rank
        self.attempts: list[dict[int, WorkerFailure]] = [dict(earlier) for earlier in attempts]

    def get_first_failure(self) -> tuple[int, Any]:
        """(rank, failure) of the first failure the launcher saw."""
        if self.first_rank in self.failures:
            return self.first_rank, self.failures[self.first_rank]
        return super().get_first_failure()

    def _render_traceback_(self) -> list[str]:
        """What IPython shows for it: the message, which holds the ranks' own tracebacks, without the kernel's
        frames between the cell and the raise (the plan, the backend, the supervisor's loop: nothing there is
        the user's to fix). Plain Python and pytest show the whole traceback as ever."""
        return [f"{type(self).__name__}: {self}"]

    def _format_failure(self, idx: int, rank: int, failure: Any) -> tuple[str, int]:
        # torch's report shows the remote traceback when `message` is an error-file record
        if isinstance(failure, WorkerFailure):
            failure = copy.copy(failure)
            failure.message = failure.error_file_data["message"] if failure.exc_type else failure.summary()
        return super()._format_failure(idx, rank, failure)


class LaunchTimeout(LaunchError, TimeoutError):
    """The run took longer than `timeout`; every worker was stopped."""


class PortInUseError(LaunchError):
    """The port given as `use_port` is taken on this machine (raised before any worker starts)."""


class UnpicklableError(LaunchError, TypeError):
    """The function, its arguments or a value they reference cannot be serialized for the workers."""


def cause_first(failures: dict[int, WorkerFailure], first: int | None) -> dict[int, WorkerFailure]:
    """`failures` with rank `first` first, then by rank: the order every report names them in."""
    return {rank: failures[rank] for rank in sorted(failures, key=lambda rank: (rank != first, rank))}


def format_failures(failures: dict[int, WorkerFailure], first: int | None = None,
                    attempts: Sequence[dict[int, WorkerFailure]] = ()) -> str:
    """The LaunchError text: which rank(s) failed, how, the failures of earlier (restarted) attempts, and
    the remote traceback of the first."""
    if not failures:
        return "the launch failed"
    order = list(cause_first(failures, first))
    head = failures[order[0]]
    ranks = ", ".join(rank_label(rank, failures[rank].host).removeprefix("rank ") for rank in order)
    plural = "s" if len(order) > 1 else ""
    attempt = f" (attempt {len(attempts)}, the last)" if attempts else ""
    lines = [f"rank{plural} {ranks} failed{attempt}; first: {head.summary()}"]
    for rank in order[1:]:
        lines.append(f"  also {failures[rank].summary()}")
    for number, earlier in enumerate(attempts):
        what = "; ".join(failure.summary() for failure in earlier.values()) or "a worker ended without a report"
        lines.append(f"attempt {number} (restarted): {what}")
    if head.traceback:
        lines.append("")
        lines.append(f"Traceback from {rank_label(head.rank, head.host)} (remote):")
        lines.append(cells_named(head.traceback.rstrip()))
    return "\n".join(lines)


_FRAME_FILE = re.compile(r'^(\s*)File "([^"]+)", line (\d+)', re.MULTILINE)


def cells_named(traceback: str) -> str:
    """`traceback` with the kernel's notebook cells named as IPython names them in its own tracebacks
    ("Cell In[3], line 4") instead of by the temporary file each cell is compiled as; as is outside IPython.
    The ranks run the cells' code (inherited, or sent with its name under spawn and to other hosts), so their
    frames carry those file names."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    name_of = getattr(getattr(shell, "compile", None), "format_code_name", None)
    if name_of is None:
        return traceback

    def named(frame: re.Match) -> str:
        label = name_of(frame.group(2))
        return f"{frame.group(1)}{label[0]} {label[1]}, line {frame.group(3)}" if label else frame.group(0)

    return _FRAME_FILE.sub(named, traceback)
