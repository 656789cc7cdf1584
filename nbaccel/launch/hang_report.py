"""Decide whether ranks are hung in a collective, and say where each rank is.

Shared by both kinds of watch, so they report hangs alike. The pool asks busy ranks for a status snapshot
(see `worker/pool_rank.py snapshot`) while a cell runs longer than
a moment; a launch's supervisor builds the same picture from the `collective` telemetry messages
(`kernel/collective_tracker.py`). From the snapshots and the ranks that are already done, `diagnose` tells:
- a *mismatch*: a rank has waited in a collective for `grace` seconds while another rank cannot join it
  (it finished or failed the cell, does not run the cell, or waits in a different collective: another
  operation, another sequence number, or other shapes);
- a *timeout*: a rank has waited in one collective for `timeout` seconds;
- nothing yet (None).
Collectives nbaccel runs are known exactly (`collective_trace` records name, torch call, shapes, dtypes and
the cell line); raw `torch.distributed` calls are recognised from the main thread's stack.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..utils.collective_trace import UNEVEN_SHAPES, CollectiveRecord
from ..utils.constants import EXIT_HANG_GRACE_ENV, INTERNAL_FRAMES_ENV
from .messages import RankState, rank_label

EXIT_HANG_GRACE = 10.0  # seconds: the default of exit_hang_grace()


def exit_hang_grace() -> float:
    """Seconds a rank that finished (returned its result, or ended its script under `nbaccel launch`) gets to
    end its process; one still running then is stuck tearing down (a destructor that waits forever) and is
    named and stopped, its results standing. NBACCEL_EXIT_HANG_GRACE sets it (a long teardown of your own)."""
    value = os.environ.get(EXIT_HANG_GRACE_ENV, "").strip()
    if not value:
        return EXIT_HANG_GRACE
    try:
        seconds = float(value)
    except ValueError:
        seconds = 0.0
    if not 0 < seconds < float("inf"):
        raise ValueError(f"{EXIT_HANG_GRACE_ENV}={value!r}: give the seconds a finished rank may take to end its "
                         f"process, a positive number (default {EXIT_HANG_GRACE:g}), or unset it")
    return seconds


@dataclass
class RankProgress:
    """What the kernel knows about one rank during a call (a RankPool cell) or a launch."""

    rank: int
    phase: RankState  # RUNNING, FINISHED, FAILED, IDLE (not running this call), DEAD
    error: str = ""  # first line of the error, for FAILED/DEAD
    snapshot: dict[str, Any] | None = None  # the latest status snapshot, for RUNNING
    raw_since: float | None = None  # when the kernel first saw it in the current raw torch.distributed call
    extra: dict[str, Any] = field(default_factory=dict)
    work: str = "the cell"  # what the rank runs, for the report: "the cell" (RankPool), "the function" (launch)
    host: str | None = None  # the host it runs on, with hosts=: the report names it ("rank 3 on gpu-b")

    def __post_init__(self) -> None:
        self.phase = RankState(self.phase)

    def collective(self) -> CollectiveRecord | None:
        data = (self.snapshot or {}).get("collective")
        return CollectiveRecord(**data) if data else None

    def waiting(self, now: float) -> tuple[str, float] | None:
        """(what it waits in, for how many seconds), or None when it is not inside a collective."""
        if self.phase != RankState.RUNNING or not self.snapshot:
            return None
        record = self.collective()
        if record is not None:
            return record.describe(), max(0.0, now - record.started)
        raw = self.snapshot.get("raw_call")
        if raw:
            line, site = self.snapshot.get("line"), self.snapshot.get("site")
            where = f"{raw} at cell line {line}" if line else f"{raw} at {site}" if site else raw
            return where, max(0.0, now - (self.raw_since or now))
        return None

    def signature(self, with_seq: bool = True) -> str | None:
        """Which collective (operation, shapes and, `with_seq`, sequence number; not the call site): ranks in
        different ones can never meet."""
        record = self.collective()
        if record is not None:
            shapes = "" if record.op in UNEVEN_SHAPES else f" {record.shapes}"
            return f"{record.op}/{record.call}{f'#{record.seq}' if with_seq else ''}{shapes}"
        return (self.snapshot or {}).get("raw_call")

    @property
    def name(self) -> str:
        return rank_label(self.rank, self.host)

    def describe(self, now: float) -> str:
        waiting = self.waiting(now)
        if waiting is not None:
            return f"{self.name} waits in {waiting[0]} for {waiting[1]:.1f} s"
        if self.phase == RankState.FINISHED:
            return f"{self.name} finished {self.work}"
        if self.phase == RankState.FAILED:
            return f"{self.name} failed {self.work} ({self.error})"
        if self.phase == RankState.IDLE:
            return f"{self.name} does not run this cell"
        if self.phase == RankState.DEAD:
            return f"{self.name} died ({self.error})"
        if (self.snapshot or {}).get("unanswered"):
            return (f"{self.name} is still running, where is unknown: it answers no status query (one long call "
                    "that holds the GIL, or a stopped process)")
        line = (self.snapshot or {}).get("line")
        return f"{self.name} is still running" + (f" (cell line {line}, not in a collective)" if line else "")


@dataclass
class Diagnosis:
    kind: str  # "mismatch" or "timeout"
    summary: str  # one line: "rank 0 waits in gather(...) at cell line 2 for 2.0 s; rank 1 finished the cell"
    details: str  # stacks of the waiting ranks: the user's frames (every frame with NBACCEL_INTERNAL_FRAMES=1)
    reason: str = ""  # what differs between the waiting ranks' collectives, when they differ
    full_details: str = ""  # the same stacks with nbaccel's and torch's own frames


def diagnose(states: list[RankProgress], now: float, timeout: float, grace: float,
             all_blocked: bool = False) -> Diagnosis | None:
    """A hang to report now, or None to keep waiting.

    `all_blocked` (launches, which see only traced collectives): a mismatch needs every running rank inside
    a collective for at least `grace` seconds, so a rank that left a slow collective a moment before the
    others, or runs code between collectives, is never taken for a deadlock; and sequence numbers count
    (a launch's ranks start together; a pool's ranks can leave a collective on an interrupt, after which
    their counts differ for good)."""
    waits = {state.rank: state.waiting(now) for state in states}
    waiting = [state for state in states if waits[state.rank] is not None]
    if not waiting:
        return None
    durations = [waits[state.rank][1] for state in waiting]  # type: ignore[index]
    kind = None
    if max(durations) >= timeout:
        kind = "timeout"
    elif all_blocked and any(state.phase == RankState.RUNNING and waits[state.rank] is None for state in states):
        kind = None
    elif (min(durations) if all_blocked else max(durations)) >= grace:
        cannot_join = any(state.phase != RankState.RUNNING for state in states)
        signatures = {state.signature(with_seq=all_blocked) for state in waiting}
        if cannot_join or len(signatures) > 1:
            kind = "mismatch"
    if kind is None:
        return None
    return describe_ranks(kind, states, now)


def describe_ranks(kind: str, states: list[RankProgress], now: float) -> Diagnosis:
    """The report of `states` as they are now (also used for a launch's timeout and failures)."""
    summary = "; ".join(state.describe(now) for state in sorted(states, key=lambda s: s.rank))
    waiting = [state for state in states if state.waiting(now) is not None]
    details, full_details, hidden = [], [], 0
    for state in waiting:
        snapshot = state.snapshot or {}
        stack, full = snapshot.get("stack", "").rstrip(), snapshot.get("full_stack", "").rstrip()
        title = f"{state.name}, main thread (most recent call last):"
        if stack:
            details.append(f"{title}\n{stack}")
            full_details.append(f"{title}\n{full or stack}")
            hidden += snapshot.get("hidden_frames", 0)
    shown, everything = "\n".join(details), "\n".join(full_details)
    if os.environ.get(INTERNAL_FRAMES_ENV, "").strip() not in ("", "0"):
        shown = everything
    elif hidden:
        shown += (f"\n({hidden} frame{'s' if hidden > 1 else ''} inside nbaccel and torch hidden: the error's "
                  f".full_stacks has them; set {INTERNAL_FRAMES_ENV}=1 to show them here)")
    return Diagnosis(kind, summary, shown, difference(waiting), full_details=everything)


def difference(waiting: list[RankProgress]) -> str:
    """What differs between the collectives the ranks wait in: the operation, the sequence number (how many
    collectives each rank entered so far) or the shapes; "" when they agree or are unknown."""
    records = [(state.name, state.collective()) for state in waiting]
    records = [(name, record) for name, record in records if record is not None]
    if len(records) < 2:
        return ""

    def listing(value: Callable[[CollectiveRecord], str]) -> str:
        return ", ".join(f"{value(record)} on {name}" for name, record in records)

    if len({(r.op, r.call) for _, r in records}) > 1:
        return "The operations differ: " + listing(lambda r: f"{r.op} ({r.call})" if r.call else r.op) + "."
    if len({r.seq for _, r in records}) > 1:
        return ("The ranks are at different points of the program: "
                + listing(lambda r: f"collective #{r.seq}") + " (a rank skipped or repeated a collective).")
    if records[0][1].op not in UNEVEN_SHAPES and len({str(r.shapes) for _, r in records}) > 1:
        return "The shapes differ: " + listing(lambda r: ", ".join(str(list(s)) for s in r.shapes) or "none") + "."
    return ""


def report_lines(diagnosis: Diagnosis, head: str, explanation: str) -> list[str]:
    """The body of the error: `head:`, where each rank is, what differs, the explanation and the stacks."""
    lines = [f"{head}:", diagnosis.summary]
    if diagnosis.reason:
        lines.append(diagnosis.reason)
    lines += ["", explanation]
    if diagnosis.details:
        lines += ["", diagnosis.details]
    return lines


def explain(diagnosis: Diagnosis, timeout: float, grace: float) -> str:
    """The sentence that follows the summary line in the error."""
    if diagnosis.kind == "mismatch":
        return (f"Not every rank can enter the same collective (detected after {grace:g} s): a collective "
                "returns only when every rank of the process group calls it, with the same operation and "
                "matching shapes.")
    return (f"A collective did not complete within timeout={timeout:g} s. If the ranks are only slow, pass a "
            "larger timeout (RankPool(timeout=...) or %%ranks --timeout S).")
