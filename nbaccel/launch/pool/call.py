"""One `RankPool` call: send the command to the selected ranks and wait for their replies.

The wait blocks on the ranks' pipes (replies, output, process exits) without polling. Once the call has run
for CHECK_INTERVAL seconds it also asks the busy ranks for a status snapshot every CHECK_INTERVAL seconds
and hands the picture to `hang_report.diagnose`; a hang ends the wait with `Hang`.
"""

from __future__ import annotations

import pickle
import select
import signal
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import TYPE_CHECKING, Any

from ..errors import WorkerFailure, ended_how
from ..hang_report import Diagnosis, RankProgress, diagnose
from ..kernel.prompt_relay import PromptRelay
from ..messages import MessageKind, RankState, rank_label
from ..serialize import loads
from .rank_processes import RankOutput
from .results import RankResult, RankResults

if TYPE_CHECKING:
    from ..kernel.placement_base import StartedRank

CHECK_INTERVAL = 0.5  # seconds between status checks while a call runs (never for calls shorter than that)
MISMATCH_GRACE = 2.0  # seconds a rank may wait in a collective that another rank cannot join
PROGRESS_DELAY = 0.5  # seconds a cell runs before on_progress is called (quick cells: never)
PROGRESS_INTERVAL = 0.3  # seconds between on_progress calls
QUICK_WAIT = 0.005  # seconds to wait on the command pipes alone before the full watch (most calls are quick)
QUICK_POLLS_KEPT = 16  # selections of ranks whose quick-wait poll objects a pool keeps
# the wire strings a call's messages are compared with, looked up once (an Enum member's `.value` costs ~0.2 us)
_SHOWN = frozenset({MessageKind.DISPLAY.value, MessageKind.CLEAR_OUTPUT.value})
_REPLY = MessageKind.REPLY.value
_PROMPT = MessageKind.PROMPT.value
INTERRUPT_GRACE = 3.0  # seconds the ranks get to return after an interrupt before they are restarted
# seconds the other ranks get to return once a rank died or broke the process group: the pool restarts every rank
# after such a call, so waiting for a rank that computes (or sleeps) on would only delay the report
BROKEN_GRACE = 2.0


class Hang(Exception):
    def __init__(self, diagnosis: Diagnosis, states: list[RankProgress], now: float) -> None:
        super().__init__(diagnosis.summary)
        self.diagnosis = diagnosis
        self.states = states
        self.now = now


class Call:
    """One command sent to the selected ranks, and the wait for their replies (with hang checks)."""

    def __init__(self, ranks: list[StartedRank], streams: list[RankOutput], selected: list[int], call_id: int,
                 timeout: float, on_progress: Callable[[RankResults], None] | None = None,
                 on_display: Callable[[int, dict[str, Any]], None] | None = None,
                 quick_polls: dict[tuple[int, ...], Any] | None = None) -> None:
        self.ranks = ranks
        self.streams = streams  # by rank: its output pipes and what was read of them (rank_processes.py)
        self.selected = selected
        self.call_id = call_id
        self.timeout = timeout
        self.pending: set[int] = set(selected)
        self.replies: dict[int, dict[str, Any]] = {}
        self.outputs: dict[int, tuple[str, str]] = {}
        self.snapshots: dict[int, dict[str, Any]] = {}
        self.raw_seen: dict[int, tuple[Any, float]] = {}
        self.broken: str | None = None
        self.broken_at: float | None = None  # when `broken` was set (monotonic): BROKEN_GRACE counts from there
        self.interrupted = False  # the user interrupted the call: the ranks' prompts are no longer asked
        self.on_progress = on_progress
        self.on_display = on_display  # a rank's display() / clear_output while the call runs
        self.changed = False
        self.progress_at = time.monotonic() + PROGRESS_DELAY
        self._prompts: PromptRelay | None = None  # made at a rank's first input()/pdb prompt (`prompts`)
        self._direct: set[int] = set()  # selected ranks of this machine (`_quick_poller`)
        self._fds: dict[int, int] = {}
        self._poller: Any = None
        self.quick_polls = {} if quick_polls is None else quick_polls  # `_quick_poller`'s, by selection

    @property
    def prompts(self) -> PromptRelay:
        """The relay of the ranks' input()/pdb prompts; time at prompts is not counted by the hang checks."""
        if self._prompts is None:
            self._prompts = PromptRelay()
        return self._prompts

    def run(self, make: Callable[[int], tuple], values_only: bool = False) -> RankResults | list[Any]:
        """Send `make(call_id)` to the selected ranks (pickled once for all of them: a pushed value or a
        function's payload is copied once, not once per rank) and wait for their replies. Plain `pickle`:
        commands hold only plain values, and `Connection.send`'s pickler copies copyreg's table at each
        call (2.3 us of a 3 us message). `values_only`: when every rank replied with a value, the plain list of
        values (`RankPool.run`: no per-rank results to build); otherwise, as always, the results."""
        command = pickle.dumps(make(self.call_id), pickle.HIGHEST_PROTOCOL)
        poller = self._quick_poller()
        if poller is not None:  # what a rank wrote between calls (background threads) is not this call's
            self._drain_ready(poller.poll(0))
            self.changed = False
        for index in self.selected:
            rank = self.ranks[index]
            self.streams[index].take(poll=index not in self._direct)
            if rank.status_unanswered:
                _discard_stale(rank)
            try:
                rank.channel.send_bytes(command)
            except (OSError, ValueError):
                self._dead(index)
        asked: set[int] = set()
        try:  # the quick replies too: a rank's first prompt can come (and be interrupted) there
            if poller is not None:
                self._quick_replies(poller)
            check_at = time.monotonic() + CHECK_INTERVAL
            while self.pending:
                if time.monotonic() >= check_at:
                    if asked:  # a rank left a whole round unanswered: check the others without it
                        self._unanswered(asked)
                        self._check()
                    asked |= self._ask_status(asked)
                    check_at = time.monotonic() + CHECK_INTERVAL
                objects: dict[Any, tuple[str, int]] = {}
                for index in self.selected:
                    rank = self.ranks[index]
                    for fd in self.streams[index].open_fds():
                        objects[fd] = ("fd", index)
                    if index in self.pending:
                        objects[rank.channel] = ("reply", index)
                        objects[rank.exit_sentinel] = ("exit", index)
                for index in asked:
                    objects[self.ranks[index].status] = ("status", index)
                round_done = False
                wake = min(check_at, self.progress_at) if self.changed and self.on_progress else check_at
                if self.broken_at is not None:
                    wake = min(wake, self.broken_at + BROKEN_GRACE)
                for obj in wait(list(objects), max(0.0, wake - time.monotonic())):
                    what, index = objects[obj]
                    if what == "fd":
                        self.streams[index].drain(obj)
                        self.changed = True
                    elif what == "reply" and index in self.pending:
                        self._reply(index)
                    elif what == "exit" and index in self.pending and not self.ranks[index].channel.poll(0):
                        self._dead(index)
                    elif what == "status" and index in asked:
                        asked.discard(index)
                        self._status(index)
                        round_done = not asked
                if self.broken_at is not None and self.pending and time.monotonic() >= self.broken_at + BROKEN_GRACE:
                    self._stop_waiting()
                    break
                if round_done and self.pending:
                    self._check()
                if self.on_progress and self.changed and self.pending and time.monotonic() >= self.progress_at:
                    self.changed = False
                    self.progress_at = time.monotonic() + PROGRESS_INTERVAL
                    self.on_progress(self.progress())
        except KeyboardInterrupt:
            self._interrupt()
            raise
        if values_only:
            values = self._values()
            if values is not None:
                return values
        return self.results()

    def _quick_poller(self) -> Any:
        """One poll object for the quick wait (None where `select.poll` is missing): the selected ranks' command
        pipes, then the output pipes of those that run on this machine (`_direct`), in that order; made once
        per selection of ranks and kept with the ranks (`quick_polls`).

        The order is what lets a reply come without reading the rank's output pipes again: a rank writes its
        output (flushed) before its reply, and one poll pass checks the descriptors in the order registered,
        so when the pass that finds a reply checks that rank's output pipes, whatever it printed is there. A
        trivial call then costs two `poll` calls less per rank (a quarter of its kernel side). A rank on
        another host is excluded: its output and its reply reach the kernel through different relays."""
        if not hasattr(select, "poll"):
            return None
        key = tuple(self.selected)
        kept = self.quick_polls.get(key)
        if kept is None:
            poller, fds, direct = select.poll(), {}, set()
            for index in self.selected:
                fd = self.ranks[index].channel.fileno()
                poller.register(fd, select.POLLIN)
                fds[fd] = index
            for index in self.selected:
                if self.ranks[index].host is None:
                    direct.add(index)
                    for fd in self.streams[index].open_fds():
                        poller.register(fd, select.POLLIN)
                        fds[fd] = -1 - index  # an output pipe: negative
            if len(self.quick_polls) >= QUICK_POLLS_KEPT:
                self.quick_polls.clear()
            kept = self.quick_polls[key] = (poller, fds, direct)
        self._poller, self._fds, self._direct = kept
        return self._poller

    def _drain_ready(self, events: list[tuple[int, int]]) -> list[int]:
        """Read the ready output pipes of `events` (one poll's answer); return the ranks whose command pipe is
        ready, in the order polled."""
        replies = []
        for fd, _ in events:
            index = self._fds.get(fd)
            if index is None:
                continue
            if index >= 0:
                replies.append(index)
                continue
            output = self.streams[-1 - index]
            output.drain(fd)
            self.changed = True  # live views (on_progress) show it
            if fd in output.closed_fds:  # end of file: the rank exited (its command pipe says so too)
                self._poller.unregister(fd)
                self._fds.pop(fd, None)
        return replies

    def _quick_replies(self, poller: Any) -> None:
        """Read the replies that come within QUICK_WAIT, with one poll object instead of a selector over every
        pipe and sentinel (`_quick_poller`). The full loop in `run` then takes over (output, exits, hang
        checks), also as soon as a rank that already replied sends more; a rank that died reads as EOF."""
        deadline = time.monotonic() + QUICK_WAIT
        while self.pending:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            for index in self._drain_ready(poller.poll(left * 1000)):
                if index not in self.pending:
                    return
                self._reply(index, output_read=index in self._direct)

    # -------------------------------------------------------------------------------------- messages
    def _reply(self, index: int, output_read: bool = False) -> None:
        """Read one message of rank `index`. `output_read`: its output pipes were read after the message came
        (`_quick_poller`), so a reply takes what was read without reading them again."""
        rank = self.ranks[index]
        try:
            message = rank.channel.recv()
        except (EOFError, OSError):
            self._dead(index)
            return
        kind = message.get("kind")
        if kind == _PROMPT:
            self._serve_prompt(index, message)
            return
        if kind in _SHOWN:
            if self.on_display is not None:
                self.on_display(index, message)
            return
        if kind != _REPLY or message.get("id") != self.call_id:
            return  # a late reply of an interrupted earlier call
        self.replies[index] = message
        self.outputs[index] = self.streams[index].take(poll=not output_read)
        self.pending.discard(index)
        if message.get("pg_broken") and message.get("error") and self.broken is None:
            error = message["error"]
            self.broken = f"{rank_label(index, rank.host)}: {error['exc_type']}: {error['message']}".splitlines()[0]
            self.broken_at = time.monotonic()

    def _serve_prompt(self, index: int, message: dict[str, Any]) -> None:
        """Show what the rank printed so far (pdb's listing), labelled, then ask the user (prompt_relay.py).
        That output is shown here instead of in the cell's results, so it comes once, before its prompt."""
        rank = self.ranks[index]
        label = f"{rank.host} rank {index}" if rank.host else f"rank {index}"  # as a launch labels its lines
        output = self.streams[index]
        for fd in output.open_fds():
            while fd not in output.closed_fds and wait([fd], 0):
                output.drain(fd)
        for text, stream in zip(output.take(), (sys.stdout, sys.stderr)):
            for line in text.splitlines():
                stream.write(f"[{label}] {line}\n")
            stream.flush()
        if self.interrupted:  # pdb answers the forwarded SIGINT with a new prompt: end of input ends it (quit)
            self.prompts.decline(message, rank.channel.send)
        else:
            self.prompts.serve(label, message, rank.channel.send, moot=self._prompt_moot)

    def _prompt_moot(self) -> str | None:
        """Why a prompt needs no answer any more: a rank of the call died (a pool's ranks never exit while they
        work); else None. Called from the prompt's watch thread, so it reads exit codes only."""
        for index in self.selected:
            rank = self.ranks[index]
            code = rank.exit_code()
            if code is not None:
                return f"{rank_label(index, rank.host)} ended ({ended_how(code)})"
        return None

    def _dead(self, index: int) -> None:
        rank = self.ranks[index]
        code = rank.wait_exit(1.0)
        self.outputs[index] = self.streams[index].take()
        how = ended_how(code)
        if rank.lost is not None:  # its host's agent ended: the exit code is the agent's session's, not the rank's
            error = {"exc_type": "HostLost", "message": rank.lost, "traceback": ""}
            self.broken = f"{rank_label(index, rank.host)} was lost ({rank.lost})"
        else:
            error = {"exc_type": "RankDied", "message": f"the rank process ended ({how})", "traceback": ""}
            self.broken = f"{rank_label(index, rank.host)} died ({how})"
        if self.broken_at is None:
            self.broken_at = time.monotonic()
        self.replies[index] = {"error": error}
        self.pending.discard(index)

    def _stop_waiting(self) -> None:
        """Give up on the ranks still busy BROKEN_GRACE seconds after a rank died or broke the process group:
        the pool restarts every rank after this call anyway. Each gets an error that names the cause (marked as
        the group's consequence, so the cause heads the report) and the output it printed."""
        for index in sorted(self.pending):
            self.outputs[index] = self.streams[index].take()
            error = {"exc_type": "RankStopped", "traceback": "",
                     "message": f"stopped before it finished, because {self.broken}; the pool restarts every rank"}
            self.replies[index] = {"error": error, "pg_broken": True}
        self.pending.clear()

    def _ask_status(self, outstanding: set[int]) -> set[int]:
        """Ask the busy ranks for a snapshot, except those whose answer to an earlier query is `outstanding`."""
        asked = set()
        for index in self.pending - outstanding:
            try:
                self.ranks[index].status.send(MessageKind.STATUS.value)
                self.ranks[index].status_unanswered += 1
                asked.add(index)
            except (OSError, ValueError):
                pass
        return asked

    def _status(self, index: int) -> None:
        rank = self.ranks[index]
        try:
            snapshot = rank.status.recv()
        except (EOFError, OSError):
            return
        rank.status_unanswered -= 1
        if index not in self.pending or snapshot.get("call_id") != self.call_id:
            return
        self.snapshots[index] = snapshot
        raw = (snapshot.get("raw_call"), snapshot.get("line"), snapshot.get("call_id"))
        if snapshot.get("raw_call") is None:
            self.raw_seen.pop(index, None)
        elif self.raw_seen.get(index, (None,))[0] != raw:
            self.raw_seen[index] = (raw, snapshot.get("time", time.time()))

    def _unanswered(self, indices: set[int]) -> None:
        """Ranks that left a round of status queries unanswered for CHECK_INTERVAL: their status thread cannot
        run (one long C call holds the GIL, or the process is stopped), so where they are is unknown. They
        count as busy: the others' checks go on (a rank waiting in a collective meanwhile is stopped at the
        timeout, as beside any busy rank), and an old snapshot, of a collective the rank may have left since,
        is never compared with the others'. Without this, one silent rank stopped every check of the call."""
        for index in indices:
            self.snapshots[index] = {"unanswered": True}
            self.raw_seen.pop(index, None)

    def states(self) -> list[RankProgress]:
        return [self._progress(index) for index in range(len(self.ranks))]

    def _progress(self, index: int) -> RankProgress:
        """Where rank `index` is in this call (named with its host on a pool over several hosts)."""
        host = self.ranks[index].host
        if index not in self.selected:
            return RankProgress(index, RankState.IDLE, host=host)
        if index in self.pending:
            seen = self.raw_seen.get(index)
            return RankProgress(index, RankState.RUNNING, snapshot=self.snapshots.get(index),
                                raw_since=seen[1] if seen else None, host=host)
        error = self.replies[index].get("error")
        if error is None:
            return RankProgress(index, RankState.FINISHED, host=host)
        first = f"{error['exc_type']}: {error['message']}".splitlines()[0].rstrip(": ")
        dead = error["exc_type"] in ("RankDied", "HostLost")
        return RankProgress(index, RankState.DEAD if dead else RankState.FAILED, first, host=host)

    def _check(self) -> None:
        states = self.states()
        now = self._prompts.wall() if self._prompts is not None else time.time()
        diagnosis = diagnose(states, now, self.timeout, min(MISMATCH_GRACE, self.timeout))
        if diagnosis is not None:
            raise Hang(diagnosis, states, now)

    def _interrupt(self) -> None:
        """Forward the interrupt to the busy ranks and give them INTERRUPT_GRACE seconds to reply. A rank at a
        prompt gets the end of input in answer to any prompt from now on: its input() raises, its pdb quits."""
        self.interrupted = True
        for index in self.pending:
            try:
                self.ranks[index].send_signal(signal.SIGINT)
            except OSError:
                pass
        deadline = time.monotonic() + INTERRUPT_GRACE
        while self.pending:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            conns = {self.ranks[index].channel: index for index in self.pending}
            for conn in wait(list(conns), left):
                self._reply(conns[conn])

    def interrupt_report(self, restart_failed: str | None = None) -> str:
        """What the interrupt did to each selected rank, in one line (the message of the KeyboardInterrupt the
        pool raises): which stopped, which had already returned, which did not stop (and so were restarted, or,
        when `restart_failed` says why not, left the pool shut down)."""
        groups: dict[str, list[int]] = {}
        for index in self.selected:
            error = self.replies.get(index, {}).get("error") or {}
            if index in self.pending:
                what = (f"did not stop within {INTERRUPT_GRACE:g} s (inside a collective, which cannot be interrupted, "
                        "or going on after the KeyboardInterrupt)")
            elif error.get("exc_type") == "KeyboardInterrupt":
                what = "stopped"
            else:
                what = "had failed" if error else "had finished"
            groups.setdefault(what, []).append(index)
        parts = [f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} {what}"
                 for what, ranks in groups.items()]
        if restart_failed is not None:
            after = f"the ranks did not start again, so the RankPool is shut down ({restart_failed})"
        elif self.pending:
            after = "every rank was restarted: the ranks' variables are lost, re-run the cells that define them"
        else:
            after = "the ranks keep their variables"
        return f"interrupted: {'; '.join(parts)}; {after}"

    # -------------------------------------------------------------------------------------- results
    def _values(self) -> list[Any] | None:
        """The selected ranks' values, or None when a rank failed or a value cannot be loaded here (the results
        then say what happened)."""
        values = []
        for index in self.selected:
            reply = self.replies[index]
            if "error" in reply or "value_error" in reply:
                return None
            data = reply.get("value")
            try:
                values.append(None if data is None else loads(data))
            except Exception:
                return None
        return values

    def results(self) -> RankResults:
        return RankResults(self._result(index) for index in self.selected)

    def _result(self, index: int, waiting: bool = False) -> RankResult:
        if waiting:
            out, err = self.streams[index].take()
            return RankResult(index, stdout=out, stderr=err, status=RankState.WAITING)
        reply = self.replies.get(index, {})
        out, err = self.outputs.get(index, ("", ""))
        result = RankResult(index, stdout=out, stderr=err, text=reply.get("text"), meta=reply.get("meta") or {},
                            duration=reply.get("duration", 0.0))
        data = reply.get("value")
        if data is not None:
            try:
                result.value = loads(data)
            except Exception as exc:  # e.g. a class the kernel cannot import
                result.meta["value_error"] = f"{type(exc).__name__}: {exc}"
        if reply.get("value_error"):
            result.meta["value_error"] = reply["value_error"]
        error = reply.get("error")
        if error is not None:
            result.error = WorkerFailure(index, error["exc_type"], error["message"], error["traceback"],
                                         host=self.ranks[index].host)
            result.status = RankState.FAILED
            result.group_broken = bool(reply.get("pg_broken"))
        return result

    def progress(self) -> RankResults:
        """The results so far: finished ranks' results, and the output the others printed until now."""
        partial = []
        for index in self.selected:
            if index in self.pending:
                output = self.streams[index]
                partial.append(RankResult(index, stdout=bytes(output.out).decode("utf-8", "replace"),
                                          stderr=bytes(output.err).decode("utf-8", "replace"),
                                          status=RankState.RUNNING))
            else:
                partial.append(self._result(index))
        return RankResults(partial)

    def partial_results(self) -> list[RankResult]:
        return [self._result(index, waiting=index in self.pending) for index in self.selected]


def _discard_stale(rank: StartedRank) -> None:
    """Drop status answers left over from an interrupted call, so each query reads its own answer. Called
    only when a query is unanswered: `Connection.poll` builds a selector, a fifth of a trivial call's cost."""
    try:
        while rank.status.poll(0):
            rank.status.recv()
            rank.status_unanswered -= 1
    except (EOFError, OSError):
        rank.status_unanswered = 0
