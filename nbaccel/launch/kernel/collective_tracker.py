"""Which collective each rank of a launch is in, from its `collective` telemetry; deadlocks named early.

Workers report every traced collective (`utils/collective_trace.py`) as `collective` messages: `enter` with
the record (operation, torch call, shapes, call site, sequence number), `exit`, or `error` when an exception
left it. They are batched telemetry (a deque append in the worker, one pipe write per 50 ms), so the trace
costs training next to nothing. The supervisor feeds them here, with which ranks finished or failed, and:
- on each `enter`, the rank's n-th collective is compared with the n-th of every other rank (the kernel
  numbers them per rank, so threads of one process count apart): another operation or other shapes is a
  `divergence`, reported at once, even where gloo lets the pair complete (an all_reduce of [3] against
  one of [4] returns garbage on one rank and hangs the other);
- `check` each round: every running rank has waited GRACE seconds in a collective and the collectives
  differ (operation, sequence number or shapes), or a rank finished while another waits: a deadlock;
- `at_failure` once a rank failed: when the error came out of a collective whose peers had finished or sat
  in another collective (gloo's "Connection closed by peer"), the report says so instead of blaming the
  rank that happened to notice first;
- `where` for a timeout: where each rank was.
The deciding and the wording are shared with RankPool (`launch/hang_report.py`), so both report hangs alike.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..hang_report import Diagnosis, RankProgress, describe_ranks, diagnose, difference
from ..messages import RankState

GRACE = 2.0  # seconds every rank must be stuck before differing collectives count as a deadlock
CHECK_INTERVAL = 0.25  # seconds between checks while some rank is inside a collective
RAW_FRESH = 2.0  # seconds a rank's sample of a raw torch.distributed call stays believed (it samples every 0.5 s)
RAW_SETTLE = 0.5  # seconds after a peer's end from which such a sample counts against that peer
RECORD_FIELDS = ("op", "call", "shapes", "dtypes", "site", "started")
HISTORY = 256  # collectives remembered per rank for the comparison (ranks never drift far apart: they sync)
DEADLOCK_HEAD = "not every rank entered the same collective"  # the report's first line (notebook_launcher, nbaccel launch)
DEADLOCK_EXPLANATION = (
    "A collective returns only when every rank of the process group calls it, with the same operation and "
    "matching shapes; the ranks above could never meet, so every worker was stopped."
)


def _last_left(state: RankCollectives) -> int:
    """The sequence number of the newest collective `state`'s rank has entered and returned from (0: none).
    Not simply the one before its innermost: collectives nest, and a rank inside #5 and #7 has left #6, not
    #5; nor one an exception came out of (its peers may never have entered it)."""
    if state.phase == RankState.FINISHED:  # its end is sent at once, its last exits may still be batched
        return state.entered
    inside = {record["seq"] for record in state.inside}
    if state.failed_in is not None:
        inside.add(state.failed_in["seq"])
    seq = state.entered
    while seq in inside:
        seq -= 1
    return seq


def _still_shows_a_left_one(states: Iterable[RankCollectives], went_through: int) -> bool:
    """Some running rank still shows a collective numbered `went_through` or lower, which another rank has
    returned from: so has it (a collective returns once every rank is in it), its `exit` still batched."""
    return any(state.phase == RankState.RUNNING and state.inside and state.inside[-1]["seq"] <= went_through
               for state in states)


def _from_a_collective(state: RankCollectives) -> bool:
    """Whether `state`'s rank failed with an error out of a collective, traced or raw."""
    return state.failed_in is not None or state.failed_in_raw is not None


def _same_meeting(one: dict[str, Any], other: dict[str, Any]) -> bool:
    """Two records of one sequence number that `hang_report.difference` could find nothing between: the same
    operation, call and shapes. The common case, checked here first: building the pair of RankProgress for
    `difference` made the kernel's work per traced collective 4-7x dearer (benchmarks/collective_tracker.py)."""
    return one["op"] == other["op"] and one["call"] == other["call"] and one["shapes"] == other["shapes"]


@dataclass
class RankCollectives:
    """One rank as the kernel sees it: the collectives it is inside (innermost last) and how it ended."""

    inside: list[dict[str, Any]] = field(default_factory=list)
    failed_in: dict[str, Any] | None = None  # the collective an exception came out of (the innermost)
    phase: RankState = RankState.RUNNING  # RUNNING, FINISHED, FAILED
    error: str = ""
    entered: int = 0  # collectives entered so far: the next one's sequence number is entered + 1
    history: dict[int, dict[str, Any]] = field(default_factory=dict)  # the last HISTORY records, by seq
    raw: dict[str, Any] | None = None  # the raw torch.distributed collective it was last seen blocked in
    failed_in_raw: dict[str, Any] | None = None  # the raw collective its error came out of (its `raw` report)
    finished_at: float = 0.0  # when the kernel heard it finished (time.time())


class CollectiveTracker:
    """Where every local rank is, collective-wise; see the module docstring."""

    def __init__(self, grace: float = GRACE, work: str = "the function",
                 hosts: Mapping[int, str] | None = None) -> None:
        self.grace = grace
        self.hosts = dict(hosts or {})  # rank -> its host, with hosts=: the reports name it
        self.work = work  # what the ranks run, for the report: "rank 1 finished the function"
        self.ranks: dict[int, RankCollectives] = {}
        self._open = 0  # collectives entered and not left, over all ranks: 0 means nothing to check
        self.divergence: Diagnosis | None = None  # the first n-th collectives that differ between ranks

    def _progress(self, rank: int, *args: Any, **kwargs: Any) -> RankProgress:
        return RankProgress(rank, *args, host=self.hosts.get(rank), **kwargs)

    def _rank(self, rank: int) -> RankCollectives:
        state = self.ranks.get(rank)
        if state is None:
            state = self.ranks[rank] = RankCollectives()
        return state

    # ------------------------------------------------------------------ what the supervisor feeds in
    def on_message(self, rank: int, message: dict[str, Any]) -> None:
        """A `collective` message of `rank`."""
        state = self._rank(rank)
        if message.get("event") == "raw":  # sampled by the rank (worker/raw_calls.py): not numbered, not compared
            if message.get("failed"):  # the rank's error came out of this raw call, sent just before the failure
                state.raw, state.failed_in_raw = None, message
            else:
                state.raw = message if message.get("op") else None
            return
        if message.get("event") == "enter":
            state.entered += 1
            record = {name: message.get(name) for name in RECORD_FIELDS}
            record["seq"] = state.entered
            state.inside.append(record)
            state.failed_in = None
            self._open += 1
            state.history[state.entered] = record
            if len(state.history) > HISTORY:
                del state.history[state.entered - HISTORY]
            if self.divergence is None:
                self._compare(rank, record)
            return
        if state.inside:  # collectives nest: the exit is the innermost one's
            record = state.inside.pop()
            self._open -= 1
            if message.get("event") == "error" and state.failed_in is None:
                state.failed_in = record

    def _compare(self, rank: int, record: dict[str, Any]) -> None:
        """Compare `rank`'s newest collective with the other ranks' collective of the same number."""
        seq = record["seq"]
        for other, state in self.ranks.items():
            theirs = state.history.get(seq) if other != rank else None
            if theirs is None or _same_meeting(theirs, record):
                continue
            pair = sorted([self._progress(rank, RankState.RUNNING, snapshot={"collective": record}, work=self.work),
                           self._progress(other, RankState.RUNNING, snapshot={"collective": theirs}, work=self.work)],
                          key=lambda s: s.rank)
            reason = difference(pair)
            if reason:
                self.divergence = Diagnosis("mismatch", "; ".join(self._describe(s, seq) for s in pair), "", reason)
                return

    def _describe(self, state: RankProgress, seq: int) -> str:
        """RankPool's words for a rank still inside its collective #seq; else which collective it went through."""
        inside = self.ranks[state.rank].inside
        if inside and inside[-1]["seq"] == seq:
            return state.describe(time.time())
        record = state.collective()
        return f"{state.name} went through {record.describe()} (its collective #{seq})"  # type: ignore[union-attr]

    def finished(self, rank: int) -> None:
        """`rank` returned from the function."""
        state = self._rank(rank)
        state.phase, state.finished_at = RankState.FINISHED, time.time()

    def failed(self, rank: int, error: str) -> None:
        """`rank` failed. A rank that finished keeps that: stopped in its teardown (torch elastic stops every
        rank once one failed), it had still gone through all its collectives."""
        state = self._rank(rank)
        if state.phase == RankState.RUNNING:
            state.phase, state.error = RankState.FAILED, error.splitlines()[0] if error else ""

    def restarted(self, rank: int) -> None:
        """torch elastic started `rank` again: what the earlier attempt did no longer counts."""
        state = self.ranks.pop(rank, None)
        if state is not None:
            self._open -= len(state.inside)

    # ------------------------------------------------------------------ what the supervisor asks
    def active(self) -> bool:
        """Some rank is inside a collective (the only time `check` can find anything)."""
        return self._open > 0 or any(state.raw is not None for state in self.ranks.values())

    def states(self, ranks: Iterable[int], failure_view: bool = False) -> list[RankProgress]:
        """hang_report's picture of `ranks`. `failure_view`: a rank whose error came out of a collective is
        shown waiting in it (that is where it was stuck until a peer went away)."""
        states = []
        for rank in ranks:
            state = self.ranks.get(rank) or RankCollectives()
            record = state.inside[-1] if state.inside else None
            if failure_view and record is None and state.phase == RankState.FAILED:
                record = state.failed_in
            raw = None
            if state.phase == RankState.RUNNING and record is None:
                raw = self._raw_wait(state)
            elif failure_view and record is None and state.phase == RankState.FAILED:
                raw = state.failed_in_raw
            if raw is not None:
                states.append(self._progress(rank, RankState.RUNNING, work=self.work, raw_since=raw["started"],
                                           snapshot={"raw_call": raw["op"], "site": raw.get("site"),
                                                     "stack": raw.get("stack", "")}))
            elif state.phase == RankState.RUNNING or (failure_view and record is not None):
                states.append(self._progress(rank, RankState.RUNNING, snapshot={"collective": record}, work=self.work))
            else:
                states.append(self._progress(rank, state.phase, state.error, work=self.work))
        return states

    def _raw_wait(self, state: RankCollectives) -> dict[str, Any] | None:
        """The raw collective `state`'s rank waits in, if its rank saw it there recently and well after every
        other rank's end: a sample older than that may be of a call the rank has left since (the sample
        saying so is still on its way, while a rank's end is sent at once), and a rank of a loaded machine
        may take a moment to return from a collective its peer already left."""
        raw = state.raw
        if raw is None or raw.get("started") is None:
            return None
        seen = float(raw.get("seen") or 0.0)
        last_end = max((other.finished_at for other in self.ranks.values()), default=0.0)
        if seen <= last_end + RAW_SETTLE or seen < time.time() - RAW_FRESH:
            return None
        return raw

    def check(self, ranks: Iterable[int], now: float) -> Diagnosis | None:
        """A deadlock to report now, or None (also for matching collectives that are only slow)."""
        if not self.active():
            return None
        ranks = list(ranks)
        if self._exit_on_its_way(ranks):
            return None
        return diagnose(self.states(ranks), now, math.inf, self.grace, all_blocked=True)

    def _exit_on_its_way(self, ranks: list[int]) -> bool:
        """A rank that finished had entered the collective another rank still shows it is in: they met, and
        the other's `exit` is still on its way (telemetry is batched, a rank's end is not), so this is no
        deadlock. A finished rank that never entered that collective is one."""
        states = [self._rank(rank) for rank in ranks]
        went_through = max((state.entered for state in states if state.phase == RankState.FINISHED), default=0)
        return _still_shows_a_left_one(states, went_through)

    def at_failure(self, ranks: Iterable[int], now: float) -> Diagnosis | None:
        """After a failure: the deadlock behind it, when every failed rank's error came out of a collective
        and the ranks could not have met (one finished, or their collectives differ)."""
        ranks = list(ranks)
        states = [self._rank(rank) for rank in ranks]
        went_through = max(map(_last_left, states), default=0)  # collectives some rank has left
        failed = [state for state in states if state.phase == RankState.FAILED]
        if not failed or any(self._on_its_own(state, went_through) for state in failed):
            return None  # some rank failed on its own: that error is the story
        if _still_shows_a_left_one(states, went_through):
            # a running rank still shows a collective another rank has left: it has left it too (a collective
            # returns once every rank is in it), its `exit` is on its way, and where it is now is unknown. A
            # rank killed by gloo's abort as its peer's telemetry of leaving the rendezvous was still batched
            # was reported waiting with that peer "in PartialState" (tests/test_launch_deadlock.py)
            return None
        states = self.states(ranks, failure_view=True)
        waiting = [state for state in states if state.waiting(now) is not None]
        cannot_join = any(state.phase != RankState.RUNNING for state in states)
        if not waiting or not (cannot_join or len({state.signature() for state in waiting}) > 1):
            return None
        return describe_ranks("mismatch", states, now)

    @staticmethod
    def _on_its_own(state: RankCollectives, went_through: int) -> bool:
        """A failed rank whose error did not come out of a collective. One killed by a signal reports no error,
        and the telemetry it had queued (up to channel.BATCH_INTERVAL's worth) died with it: a collective it still
        shows, which another rank has left, is one it had left too (a collective returns once every rank is in
        it; gloo's abort on a size mismatch kills the rank in its next collective, never reported). An error
        out of a raw collective is not on its own either."""
        if _from_a_collective(state):
            return False
        return not state.inside or state.inside[-1]["seq"] <= went_through

    def root_cause(self, failed: Iterable[int], first: int | None) -> int | None:
        """The rank to name first: one whose error did not come out of a collective (the others' collectives
        broke because it went away), else `first`."""
        failed = list(failed)
        if first is None or not _from_a_collective(self._rank(first)):
            return first
        return next((rank for rank in failed if not _from_a_collective(self._rank(rank))), first)

    def where(self, ranks: Iterable[int], now: float) -> Diagnosis | None:
        """Where each rank is, when some rank is inside a collective (for a timeout); else None."""
        if not self.active():
            return None
        return describe_ranks("timeout", self.states(ranks), now)
