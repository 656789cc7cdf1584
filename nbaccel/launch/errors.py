"""The errors a launch raises in the kernel, and the per-rank failure record they carry."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class WorkerFailure:
    """What went wrong on one rank: the remote exception, or how the process ended."""

    rank: int
    exc_type: str | None = None
    message: str = ""
    traceback: str = ""
    exitcode: int | None = None
    signal: str | None = None

    def summary(self) -> str:
        """One line: `rank 1: ValueError: boom` or `rank 0: killed by SIGKILL (exit code -9)`."""
        if self.exc_type:
            return f"rank {self.rank}: {self.exc_type}: {self.message}".rstrip(": ")
        if self.signal:
            return f"rank {self.rank}: killed by {self.signal} (exit code {self.exitcode})"
        return f"rank {self.rank}: {self.message or 'exited'} (exit code {self.exitcode})"


class LaunchError(RuntimeError):
    """A launched worker failed (or the launch could not go on); `.failures` maps rank -> WorkerFailure."""

    def __init__(self, message: str, failures: dict[int, WorkerFailure] | None = None) -> None:
        super().__init__(message)
        self.failures: dict[int, WorkerFailure] = dict(failures or {})


class LaunchTimeout(LaunchError, TimeoutError):
    """The run took longer than `timeout`; every worker was stopped."""


class PortInUseError(LaunchError):
    """The port given as `use_port` is taken on this machine (raised before any worker starts)."""


class UnpicklableError(LaunchError, TypeError):
    """The function, its arguments or a value they reference cannot be serialized for the workers."""


def format_failures(failures: dict[int, WorkerFailure], first: int | None = None) -> str:
    """The LaunchError text: which rank(s) failed, how, and the remote traceback of the first."""
    if not failures:
        return "the launch failed"
    order = sorted(failures, key=lambda rank: (rank != first, rank))
    head = failures[order[0]]
    ranks = ", ".join(str(rank) for rank in order)
    plural = "s" if len(order) > 1 else ""
    lines = [f"rank{plural} {ranks} failed; first: {head.summary()}"]
    for rank in order[1:]:
        lines.append(f"  also {failures[rank].summary()}")
    if head.traceback:
        lines.append("")
        lines.append(f"Traceback from rank {head.rank} (remote):")
        lines.append(head.traceback.rstrip())
    return "\n".join(lines)
