"""What a `RankPool` call gives back: per-rank results, shown side by side, and the errors it raises."""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import LaunchError, WorkerFailure, format_failures
from ..messages import RankState


# ---------------------------------------------------------------------------------------------- errors
class RankPoolError(LaunchError):
    """A pool call failed. `.results` holds what each rank returned (partial on a hang), `.restarted` says
    whether the pool restarted its ranks (their variables are then lost). A hang's `.full_stacks`: the
    waiting ranks' stacks with nbaccel's and torch's frames, which the message leaves out."""

    full_stacks: str = ""

    def __init__(self, message: str, results: list[RankResult] | None = None, restarted: bool = False,
                 failures: dict[int, WorkerFailure] | None = None) -> None:
        super().__init__(message, failures)
        self.results = results or []
        self.restarted = restarted


class RankFailedError(RankPoolError):
    """A rank raised an exception (the remote traceback is in the message and in `.failures`)."""


class CollectiveMismatchError(RankPoolError):
    """Not every rank entered the same collective; the message says which rank waits where."""


class RankTimeoutError(RankPoolError, TimeoutError):
    """A collective did not complete within the pool's timeout."""


class RankStartError(RankPoolError):
    """The ranks could not start (the message has the failing rank's traceback)."""


# ---------------------------------------------------------------------------------------------- results
@dataclass
class RankResult:
    """What one rank did with a call: its output, the value (of the cell's last expression), its error.

    `text` is the value's short description made on the rank (for tensors: torch's repr, with `meta` holding
    shape, dtype and device), so it can be shown even when the value itself cannot be pickled.
    """

    rank: int
    stdout: str = ""
    stderr: str = ""
    value: Any = None
    text: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    error: WorkerFailure | None = None
    status: RankState = RankState.FINISHED  # FINISHED, FAILED, WAITING (hung, in an error's results), NOT_RUN
    duration: float = 0.0
    group_broken: bool = False  # its error came from the process group (a peer gone, a timeout), mostly a consequence

    @property
    def ok(self) -> bool:
        return self.error is None and self.status == RankState.FINISHED

    def __repr__(self) -> str:
        parts = [f"rank={self.rank}"]
        if self.status != RankState.FINISHED:
            parts.append(f"status={str(self.status)!r}")
        if self.text is not None:
            parts.append(f"value={_one_line(self.text)}")
        if self.stdout:
            parts.append(f"stdout={_clip(self.stdout)!r}")
        if self.stderr:
            parts.append(f"stderr={_clip(self.stderr)!r}")
        if self.error is not None:
            parts.append(f"error={self.error.exc_type}: {_clip(self.error.message)}")
        return f"RankResult({', '.join(parts)})"


class RankResults(list):
    """The per-rank results of one call (a list indexed by position in the selected ranks), shown side by
    side in a notebook."""

    @property
    def values(self) -> list[Any]:
        return [result.value for result in self]

    @property
    def failed(self) -> list[RankResult]:
        return [result for result in self if result.error is not None]

    def raise_if_failed(self) -> None:
        """Raise RankFailedError when a rank raised, headed by the first cause: the lowest rank that died or
        raised an error of its own, before the ranks whose collective failed with the group it broke (gloo's
        "Connection closed by peer"), whose traceback says less about what went wrong."""
        failures = {result.rank: result.error for result in self if result.error is not None}
        if failures:
            causes = [result.rank for result in self if result.error is not None and not result.group_broken]
            first = min(causes, default=None)
            raise RankFailedError(format_failures(failures, first), list(self), failures=failures)

    def __repr__(self) -> str:
        from .rank_view import render_text

        return render_text(self)

    def _repr_html_(self) -> str:
        from .rank_view import render_html

        return render_html(self)


def _one_line(text: str) -> str:
    lines = text.splitlines() or [""]
    return lines[0] + (" ..." if len(lines) > 1 else "")


def _clip(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def results_equal(values: Sequence[Any]) -> bool:
    """True when every value pickles to the same bytes (what `%ranks pull` uses to return one value)."""
    try:
        first = pickle.dumps(values[0])
        return all(pickle.dumps(value) == first for value in values[1:])
    except Exception:
        return False
