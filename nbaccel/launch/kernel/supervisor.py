"""Watch every worker from the kernel: messages, output, exits; stop all on the first failure.

The supervisor runs in the thread that called the launcher (in Jupyter: the cell's thread), so forwarded
output lands in the calling cell and a kernel interrupt (KeyboardInterrupt) arrives right here. One
`multiprocessing.connection.wait` watches the channels, the output pipes and the process sentinels.
The ranks' `collective` messages go to a `CollectiveTracker` (collective_tracker.py): ranks deadlocked in
collectives that cannot meet are stopped within seconds and named with their operations and source lines.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from multiprocessing.connection import wait
from typing import TYPE_CHECKING, Any, TextIO

from ... import telemetry
from ...utils.constants import MEMORY_INTERVAL_ENV
from .. import messages, serialize
from ..channel import Message, Observer, close_quietly, recv_all
from ..errors import LaunchError, LaunchTimeout, WorkerFailure, cause_first, ended_how, format_failures
from ..hang_report import EXIT_HANG_GRACE, Diagnosis, report_lines
from ..messages import Failure, LaunchState, MessageKind, RankState, Status
from ..output import LineForwarder, read_available
from ..screen import DisplayOrder
from ..views import views
from .collective_tracker import CHECK_INTERVAL, DEADLOCK_EXPLANATION, DEADLOCK_HEAD, CollectiveTracker
from .interrupts import raise_if_swallowed
from .module_preload import learn_rank_imports
from .placement_base import Backend, StartedRank
from .process_trees import signal_name
from .prompt_relay import PromptRelay

logger = logging.getLogger(__name__)  # notices: records of nbaccel.launch (utils/notices.py)

if TYPE_CHECKING:
    from .collective_watch import ExitHang
    from .rank_groups import RankGroups

POLL = 0.1  # seconds between checks of the deadline when nothing happens
DRAIN = 2.0  # seconds to wait for the last output after every worker has exited
MARK_WAIT = 1.0  # seconds to wait for a display message whose marker the rank's stdout already shows
EXIT_GRACE = 1.0  # seconds a rank that reported its exception gets to exit by itself before the others are stopped


def _cell_output() -> Any:
    return views().cell_output()


def _memory_interval() -> float:
    try:
        return float(os.environ.get(MEMORY_INTERVAL_ENV, "1"))
    except ValueError:
        return 1.0


class Supervisor:
    """Run the loop until every worker is done, one failed, the deadline passed or the kernel interrupted."""

    def __init__(
        self,
        workers: Sequence[StartedRank],
        backend: Backend,
        observers: Sequence[Observer] = (),
        stdout: TextIO | None = None,
        stderr: TextIO | None = None,
        timeout: float | None = None,
        world_rank_of: Callable[[int], int] | None = None,
        cell: Any = None,
        groups: RankGroups | None = None,
        exit_grace: float = EXIT_HANG_GRACE,
    ) -> None:
        self.workers = list(workers)
        self.backend = backend
        self.groups = groups  # the ranks' process groups: an ended rank's is stopped at once (rank_groups.py)
        self.observers = list(observers)
        # None: look sys.stdout/sys.stderr up at each write, so a dashboard started after this object
        # (rich's Live redirects them) still gets the worker lines above its table.
        self._stdout = stdout
        self._stderr = stderr
        self.timeout = timeout
        self.cell = cell if cell is not None else _cell_output()  # live rows, displays (notebook/live_output.py)
        self._displays = DisplayOrder(self._show_display)
        self.failures: dict[int, WorkerFailure] = {}
        self.first_failure: int | None = None
        self.attempts: list[dict[int, WorkerFailure]] = []  # failures of earlier attempts (elastic restarts)
        self.generation = 0
        self._stopping = False  # exits after we stopped the workers are not failures
        self._all_returned_at: float | None = None  # when the last rank returned its result
        self._exit_grace = exit_grace  # then the seconds every rank's process gets to exit (the plan's)
        # rank -> the host it was started on (hosts=): stamped on its messages and named in every error and report
        self.hosts = {w.rank: w.host for w in self.workers if w.host}
        self.collectives = CollectiveTracker(hosts=self.hosts)
        # a rank's input()/pdb, asked in the cell; its time at prompts is left out of the timeout and hang watch
        self.prompts = PromptRelay(lambda: self.stderr)
        self.deadlock: Diagnosis | None = None
        self.exit_hang: ExitHang | None = None  # the backend's watch found ranks stuck after their work
        self._next_check = 0.0
        self._memory_interval = _memory_interval()
        self._next_sample = time.monotonic() + self._memory_interval
        self._by_channel = {id(w.channel): w for w in self.workers}
        self._by_fd: dict[int, tuple[StartedRank, str, LineForwarder]] = {}
        for w in self.workers:
            self._by_fd[w.stdout_fd] = (w, "stdout", self._forwarder(w, "stdout"))
            self._by_fd[w.stderr_fd] = (w, "stderr", self._forwarder(w, "stderr"))

    # ------------------------------------------------------------------ observers and output
    @property
    def stdout(self) -> TextIO:
        return self._stdout if self._stdout is not None else sys.stdout

    @property
    def stderr(self) -> TextIO:
        return self._stderr if self._stderr is not None else sys.stderr

    def notify(self, message: Message) -> None:
        host = self.hosts.get(message.get("rank")) if self.hosts else None  # type: ignore[arg-type]
        if host is not None:  # the supervisor started the rank there: no rank needs to say where it runs
            message["host"] = host
        for observer in list(self.observers):
            try:
                observer(message)
            except Exception as exc:  # a broken observer must not break the launch
                self.observers.remove(observer)
                warnings.warn(f"nbaccel: launch observer {observer!r} failed and was removed: {exc!r}",
                              stacklevel=2)

    def _forwarder(self, worker: StartedRank, stream: str) -> LineForwarder:
        redrawing = [False]  # the stream has live rows: the line it ends now is a progress bar's final state

        def deliver(line: str) -> None:
            # A finished progress bar (tqdm writes to stderr) is shown as it was while live, not as an error.
            target = self.stdout if stream == "stdout" or redrawing[0] else self.stderr
            try:
                target.write(f"[{worker.line_label}] {line}\n")
            except Exception:
                pass
            self.notify(messages.output(worker.rank, worker.local_rank, stream, line))

        def live(rows: list[str]) -> None:
            redrawing[0] = bool(rows)
            self.cell.live(worker.rank, stream, rows)
            self.notify(messages.live(worker.rank, worker.local_rank, stream, rows))

        if stream == "stderr":
            return LineForwarder(deliver, live)
        return LineForwarder(deliver, live, lambda mark: self._mark_reached(worker, mark))

    def _mark_reached(self, worker: StartedRank, mark: str) -> None:
        """A rank's stdout reached a display marker. The rank sent the display message before it wrote the
        marker, so read its channel first (briefly): the display then lands before the text that follows."""
        deadline = time.monotonic() + MARK_WAIT
        while worker.channel_open and not self._displays.has_waiting(worker.local_rank, mark):
            left = deadline - time.monotonic()
            try:
                ready = left > 0 and worker.channel.poll(min(0.05, left))
            except (EOFError, OSError):
                ready = True  # recv_all sees the closed end and says so
            if ready:
                self._read_channel(worker)
            elif left <= 0:
                break
        self._displays.marked(worker.local_rank, mark)

    def _show_display(self, local_rank: int, message: Message) -> None:
        self._flush()
        rank = self.workers[local_rank].rank
        if message.get("kind") == MessageKind.DISPLAY:
            self.cell.display(rank, message)
        else:
            self.cell.clear_output(rank, bool(message.get("wait")))

    def _flush(self) -> None:
        for target in (self.stdout, self.stderr):
            try:
                target.flush()
            except Exception:
                pass

    # ------------------------------------------------------------------ reading
    def _read_fd(self, fd: int) -> None:
        worker, _, forwarder = self._by_fd[fd]
        data, at_end = read_available(fd)
        if data:
            forwarder.feed(data)
        if at_end:
            forwarder.finish()
            worker.open_fds.discard(fd)
            close_quietly(fd)

    def _read_channel(self, worker: StartedRank) -> None:
        messages, closed = recv_all(worker.channel)
        for message in messages:
            self._handle(worker, message)
        if closed:
            worker.channel_open = False

    def _handle(self, worker: StartedRank, message: Message) -> None:
        worker.seen = True
        kind = message.get("kind")
        if kind == MessageKind.BATCH:  # telemetry the worker queued (channel.WorkerSink)
            for inner in message.get("messages", ()):
                self._handle(worker, inner)
            return
        if kind == MessageKind.MEMORY:
            worker.reports_memory = True
            worker.last_rss = message.get("rss") or worker.last_rss
        elif kind == MessageKind.COLLECTIVE:
            self.collectives.on_message(worker.rank, message)
        if kind == MessageKind.STATUS and message.get("state") == RankState.STARTING:
            status = Status.from_wire(message)
            worker.rank = int(worker.rank if status.rank is None else status.rank)  # elastic assigns global ranks
            worker.pid = worker.pid if status.pid is None else status.pid
            restart = int(status.restart or 0)
            if restart > self.generation:  # elastic restarted the workers: before any rank's record is reset
                self._attempt_ended(restart)
            if restart > worker.generation:
                worker.generation = restart
                worker.has_result = False
                self.collectives.restarted(worker.rank)
        elif kind == MessageKind.RESULT:
            try:
                worker.result = serialize.loads(message.pop("value"))
                worker.has_result = True
                self.collectives.finished(worker.rank)
                learn_rank_imports(message.pop("imported", ()))
                message["value"] = worker.result
            except Exception as exc:
                self._fail(WorkerFailure(worker.rank, type(exc).__name__,
                                         f"the result of rank {worker.rank} cannot be unpickled in the kernel: {exc}"))
        elif kind in (MessageKind.DISPLAY, MessageKind.CLEAR_OUTPUT):
            self._displays.arrived(worker.local_rank, message)
        elif kind == MessageKind.ERROR:
            failure = Failure.from_wire(message)
            self._fail(WorkerFailure(worker.rank, failure.exc_type, failure.message, failure.traceback))
        elif kind == MessageKind.PROMPT:  # debugger: the rank waits for a line from the user
            self._serve_prompt(worker, message)
        self.notify(message)

    def _serve_prompt(self, worker: StartedRank, message: Message) -> None:
        """Show what the rank printed before it asked (pdb's listing), then ask the user (prompt_relay.py).
        Once the ranks are being stopped (a failure, an interrupt), a prompt read from what they left is not
        asked: the rank is on its way out, and the user, who may have just interrupted, is asked nothing."""
        if self._stopping:
            return
        for fd in list(worker.open_fds):
            while fd in worker.open_fds and wait([fd], 0):
                self._read_fd(fd)
        self._flush()
        self.prompts.serve(worker.line_label, message, worker.reply or worker.channel.send,
                           moot=lambda: self._prompt_moot(worker))

    def _prompt_moot(self, asking: StartedRank) -> str | None:
        """Why the prompt of `asking` needs no answer any more: it ended, or (where one failure stops the launch)
        another rank failed, or the backend says (an elastic restart); else None. Called from the prompt's watch thread while this loop waits for the
        user, so it reads exit codes only (safe from another thread; the ranks' messages are the loop's)."""
        code = asking.exit_code()
        if code is not None:
            return f"{asking.label} ended ({ended_how(code)})"
        if self.backend.fail_fast:
            for worker in self.workers:
                code = worker.exit_code()
                if worker is not asking and code not in (None, 0):
                    return f"{worker.label} failed ({ended_how(code)}), which stops the launch"
        return self.backend.prompt_moot()

    def _attempt_ended(self, restart: int) -> None:
        """Elastic restarted the workers: say how the attempt failed, the root cause first (what the ranks
        reported, and how their processes ended, which only the agent saw: a rank killed by a signal reports
        nothing), keep it for the final error, and start the next attempt's record."""
        self.generation = restart
        for failure in self.backend.restarted_failures().values():
            self._record(failure)
        first = self.collectives.root_cause(self.failures, self.first_failure)
        ended = cause_first(self.failures, first)
        cause = "; ".join(failure.summary() for failure in ended.values()) or "a worker failed"
        logger.warning(f"[nbaccel] {cause}: restarting the workers (restart {restart})")
        self.attempts.append(ended)  # the final error names them
        self.attempts += [{} for _ in range(restart - len(self.attempts))]  # attempts that never reported
        self.failures = {}
        self.first_failure = None

    def _fail(self, failure: WorkerFailure) -> None:
        if self._record(failure):
            self.collectives.failed(failure.rank, failure.summary().split(": ", 1)[-1])
            if self.first_failure is None:
                self.first_failure = failure.rank

    def _record(self, failure: WorkerFailure) -> bool:
        """Keep `failure` (False: the rank had failed already; its reported exception stays, with the exit
        details added)."""
        known = self.failures.get(failure.rank)
        if known is not None:
            known.exitcode = failure.exitcode if failure.exitcode is not None else known.exitcode
            known.signal = failure.signal or known.signal
            known.last_rss = failure.last_rss or known.last_rss
            return False
        worker = next((w for w in self.workers if w.rank == failure.rank), None)
        if worker is not None:  # what torch's ProcessFailure says about the process
            failure.host = failure.host or worker.host
            failure.local_rank = worker.local_rank if failure.local_rank is None else failure.local_rank
            failure.pid = worker.pid if failure.pid is None else failure.pid
            failure.last_rss = failure.last_rss or worker.last_rss
        self.failures[failure.rank] = failure
        return True

    def _on_exit(self, local_rank: int, exitcode: int) -> None:
        worker = self.workers[local_rank]
        if worker.channel_open:
            self._read_channel(worker)  # the error/result it sent before exiting
        worker.exited, worker.exitcode = True, exitcode
        if self._stopping and worker.rank not in self.failures:
            if exitcode != 0 or not worker.has_result:
                self.notify(messages.status(worker.rank, local_rank, RankState.STOPPED))
            return
        if exitcode != 0:
            message = ended_how(exitcode, worker.last_rss)
            reported = worker.rank in self.failures
            self._fail(WorkerFailure(worker.rank, None, message, "", exitcode, signal_name(exitcode),
                                     last_rss=worker.last_rss))
            if not reported:
                self.notify(messages.status(worker.rank, local_rank, RankState.FAILED, error=message))
        elif not worker.has_result:
            self._fail(WorkerFailure(worker.rank, None, "exited without returning a result", "", exitcode))

    # ------------------------------------------------------------------ the loop
    def pump(self, timeout: float) -> None:
        """One round: wait up to `timeout` s for anything to read, then handle messages, output lines and
        exits (and the periodic memory samples). Persistent ranks drive the supervisor with this."""
        objects: list[Any] = [w.channel for w in self.workers if w.channel_open]
        for w in self.workers:
            objects += list(w.open_fds)
        objects += self.backend.wait_objects()
        ready = wait(objects, timeout=timeout) if objects else time.sleep(timeout) or []
        for obj in ready:
            if isinstance(obj, int) and obj in self._by_fd:
                self._read_fd(obj)
            elif id(obj) in self._by_channel:
                self._read_channel(self._by_channel[id(obj)])
        self._flush()
        self.cell.tick()
        for local_rank, exitcode in self.backend.poll_exits():
            self._on_exit(local_rank, exitcode)
        if self.groups is not None:  # e.g. a rank torch elastic restarts: what it started goes now
            self.groups.stop_orphans()
        if self._memory_interval > 0 and time.monotonic() >= self._next_sample:
            self._next_sample = time.monotonic() + self._memory_interval
            self._sample_memory()

    def run(self) -> list[Any]:
        """Supervise until the end; return results by local rank or raise LaunchError/KeyboardInterrupt."""
        deadline = None if self.timeout is None else self.prompts.clock() + self.timeout  # time at prompts not counted
        outcome = LaunchState.FINISHED
        deadlock = stuck = False
        try:
            while True:
                wait_for = POLL if deadline is None else max(0.0, min(POLL, deadline - self.prompts.clock()))
                self.pump(wait_for)
                raise_if_swallowed()  # an interrupt whose KeyboardInterrupt a finalizer dropped
                if self.failures and self.backend.fail_fast:
                    outcome = LaunchState.FAILED
                    break
                if self._deadlocked():
                    outcome, deadlock = LaunchState.FAILED, True
                    break
                verdict = self.backend.verdict()
                if isinstance(verdict, Diagnosis):  # the backend's own watch saw the deadlock
                    self.deadlock, outcome, deadlock = verdict, LaunchState.FAILED, True
                    break
                if verdict is not None:  # its ranks ended their work but their processes do not end
                    self.exit_hang, stuck = verdict, True
                    break
                if self.backend.finished():
                    break
                if self._stuck_after_returning():
                    stuck = True
                    break
                if deadline is not None and self.prompts.clock() >= deadline:
                    outcome = LaunchState.TIMEOUT
                    break
        except KeyboardInterrupt:
            self._shutdown(LaunchState.INTERRUPTED)
            raise
        except BaseException:
            self._shutdown(LaunchState.FAILED)
            raise
        if stuck:
            self._stop_stuck_ranks()
        if outcome is LaunchState.FAILED and not deadlock:
            self._let_failed_ranks_exit()
        if outcome is not LaunchState.FINISHED:
            self._shutdown(outcome)
        else:
            self._drain()
            for failure in self.backend.exit_failures().values():
                self._fail(failure)
            if self.backend.workers_may_not_start:  # torch_xla picks how many run
                self.workers = [w for w in self.workers if w.seen]
            # A rank without a result failed. Where the backend stops the group itself (torch elastic, which
            # is not fail-fast: it stops every rank when one fails, then restarts or gives up), the ranks it
            # stopped because another failed are no failures of their own, as in a fail-fast launch.
            if self.backend.fail_fast or not self.failures:
                # (the backend's reason when it knows one, e.g. torch_xla's process died under its threads)
                reason = self.backend.lost_reason() or "finished without returning a result"
                for worker in self.workers:
                    if not worker.has_result and worker.rank not in self.failures:
                        self._fail(WorkerFailure(worker.rank, None, reason))
        self._close()
        if outcome is LaunchState.TIMEOUT:
            raise self._timeout_error()
        if deadlock or self.failures:
            raise self._failure_error()
        return [w.result for w in self.workers]

    # ------------------------------------------------------------------ collectives that cannot meet
    def _deadlocked(self) -> bool:
        """Every running rank waits in a collective the others cannot join (checked a few times a second)."""
        if self.collectives.divergence is not None:
            self.deadlock = self.collectives.divergence
            return True
        now = time.monotonic()
        if not self.collectives.active() or now < self._next_check:
            return False
        self._next_check = now + CHECK_INTERVAL
        self.deadlock = self.collectives.check([w.rank for w in self.workers], self.prompts.wall())
        return self.deadlock is not None

    def _failure_error(self) -> LaunchError:
        """LaunchError: the deadlock first when there was one (seen live, or behind the ranks' errors),
        then each rank's failure; else the failures, the root cause first."""
        ranks = [w.rank for w in self.workers]
        diagnosis = (self.deadlock or self.collectives.divergence
                     or self.collectives.at_failure(ranks, time.time()))
        failures = dict(self.failures)
        if diagnosis is None:
            first = self.collectives.root_cause(failures, self.first_failure)
            return LaunchError(format_failures(failures, first, self.attempts), failures, first_rank=first,
                               attempts=self.attempts)
        exitcodes = {w.rank: w.exitcode for w in self.workers}
        for state in self.collectives.states(ranks, failure_view=True):
            waiting = state.waiting(time.time())
            if waiting is not None and state.rank not in failures:
                failures[state.rank] = WorkerFailure(state.rank, None, f"stopped while waiting in {waiting[0]}",
                                                     exitcode=exitcodes.get(state.rank), host=state.host)
        lines = report_lines(diagnosis, DEADLOCK_HEAD, DEADLOCK_EXPLANATION)
        if self.failures and self.deadlock is None:  # errors raised because a peer went away; else none
            lines += ["", "What the ranks reported:", format_failures(self.failures, self.first_failure)]
        return LaunchError("\n".join(lines), failures, first_rank=self.first_failure, attempts=self.attempts)

    def _timeout_error(self) -> LaunchTimeout:
        running = [w.rank for w in self.workers
                   if w.seen and not w.has_result and w.rank not in self.failures]
        if not any(w.seen for w in self.workers):
            state = "no worker had started yet (for several nodes: is every node up?)"
        else:
            state = f"ranks still running: {running or 'none'}"
        text = f"the launch did not finish within timeout={self.timeout} s; stopped every worker ({state})"
        where = self.collectives.where([w.rank for w in self.workers], time.time())
        if where is not None:
            text += "\nwhere the ranks were: " + where.summary + (f"\n{where.reason}" if where.reason else "")
        return LaunchTimeout(text, self.failures, first_rank=self.first_failure, attempts=self.attempts)

    def _stuck_after_returning(self) -> bool:
        """True once every rank has returned its result and the exit grace passed without all of
        their processes exiting."""
        if not self.workers or not all(w.has_result for w in self.workers):
            return False
        if self._all_returned_at is None:
            self._all_returned_at = time.monotonic()
        return time.monotonic() - self._all_returned_at >= self._exit_grace

    def _stop_stuck_ranks(self) -> None:
        """Name the ranks whose processes outlived their results, and stop them (their results stand)."""
        stuck = [w.rank for w in self.workers if not w.exited]
        self._stopping = True
        self.backend.stop()
        if self.exit_hang is not None:  # the backend's watch found them, and its front door names them
            return
        logger.warning(f"nbaccel: rank(s) {', '.join(map(str, stuck))} returned a result but did not exit within "
              f"{self._exit_grace:g} s (stuck tearing down the process); stopped them. The results are "
              "complete.")

    def _let_failed_ranks_exit(self) -> None:
        """A rank that reported its exception is on its way out (exit code 1): let it get there before every
        worker is stopped, as torch elastic (Accelerate) sees it, instead of cutting its teardown short."""
        deadline = time.monotonic() + EXIT_GRACE
        while time.monotonic() < deadline:
            if not [w for w in self.workers
                    if not w.exited and w.rank in self.failures and self.failures[w.rank].exc_type]:
                return
            self.pump(max(0.0, min(0.05, deadline - time.monotonic())))

    def _sample_memory(self) -> None:
        """Host memory of workers that do not report it themselves (they never sent telemetry)."""
        for worker in self.workers:
            if worker.reports_memory or worker.pid is None or worker.exited:
                continue
            sample = telemetry.process_memory(worker.pid)
            if sample is None or sample["rss"] is None:
                continue
            worker.rss_peak = max(worker.rss_peak, sample["rss"])
            worker.last_rss = sample["rss"]
            sample["rss_peak"] = worker.rss_peak
            self.notify(messages.memory(worker.rank, worker.local_rank, sample, source="kernel"))

    def _shutdown(self, outcome: LaunchState) -> None:
        """Stop every worker (even if interrupted again meanwhile), then read what they left."""
        self._stopping = True
        try:
            self.backend.stop()
        finally:
            try:
                self._drain(0.5 if outcome is LaunchState.INTERRUPTED else DRAIN)
            finally:
                self._close()

    def _drain(self, limit: float = DRAIN) -> None:
        """Read every message and every line left in the pipes (until end of stream or `limit` seconds)."""
        deadline = time.monotonic() + limit
        for worker in self.workers:
            if worker.channel_open:
                self._read_channel(worker)
        while time.monotonic() < deadline:
            fds = [fd for w in self.workers for fd in w.open_fds]
            if not fds:
                break
            for fd in wait(fds, timeout=max(0.0, min(0.05, deadline - time.monotonic()))):
                self._read_fd(fd)
            for local_rank, exitcode in self.backend.poll_exits():
                self._on_exit(local_rank, exitcode)
            if self.groups is not None:  # a dead rank's child holding its output pipe: stopped, not waited for
                self.groups.stop_orphans()
        for worker in self.workers:
            if worker.channel_open:
                self._read_channel(worker)
        self._flush()

    def _close(self) -> None:
        for worker in self.workers:
            for fd in list(worker.open_fds):
                self._by_fd[fd][2].finish()
                close_quietly(fd)
            worker.open_fds.clear()
            close_quietly(worker.channel)
            worker.channel_open = False
        self._displays.flush()
        self._flush()
        self.cell.close()
