"""`RankPool`: persistent ranks that keep their process group and variables between cells.

The workers start once (fork where safe, like notebook_launcher), each with `PartialState` ready, and then
run what the kernel sends: `exec(source)` runs a cell's source in each rank's own namespace, `run(fn)` a
cloudpickled function. Results come back per rank (output, value of the last expression, error).

A cell in which not every rank enters the same collective does not freeze the kernel: while a call runs the
pool asks the busy ranks where they are (launch/hang_report.py) and raises `CollectiveMismatchError` or
`RankTimeoutError` with a report of which rank waits in which collective. A rank stuck in a gloo/NCCL
collective cannot be released, so the pool then restarts every rank (their variables are lost) and says so.

No rank outlives the pool: `shutdown()`, the context manager, garbage collection (weakref.finalize) and
interpreter exit stop them, and a rank exits by itself when the kernel process dies (PR_SET_PDEATHSIG on
Linux, and end-of-file on its status pipe everywhere).
"""


from __future__ import annotations

import ast
import dataclasses
import functools
import itertools
import logging
import os
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from ...utils.tracebacks import PACKAGE_DIR, release_frames
from ..errors import UnpicklableError, WorkerFailure
from ..hang_report import Diagnosis, explain, report_lines
from ..kernel.addresses import free_port
from ..kernel.half_imports import imports_left_whole
from ..kernel.plan import LaunchPlan, LaunchRequest, Program, build_plan, check_seconds
from ..messages import MessageKind, PoolCommand, RankState
from ..serialize import dumps_payload, dumps_value, find_culprit
from ..views import views
from .call import MISMATCH_GRACE, Call, Hang
from .rank_processes import START_TIMEOUT, RankProcesses
from .results import (
    CollectiveMismatchError,
    RankFailedError,
    RankPoolError,
    RankResult,
    RankResults,
    RankStartError,
    RankTimeoutError,
    results_equal,
)
from .telemetry_reader import OutputLines, TelemetryReader, observer_of, status_message

logger = logging.getLogger(__name__)  # notices: records of nbaccel.launch (utils/notices.py)

__all__ = [
    "CollectiveMismatchError", "RankFailedError", "RankPool", "RankPoolError", "RankResult", "RankResults",
    "RankStartError", "RankTimeoutError", "results_equal",
]

CELL_NAMES_KEPT = 256  # distinct cell sources whose name the pool remembers (the ranks keep their compiled code)
_Method = TypeVar("_Method", bound=Callable[..., Any])
_PACKAGE = PACKAGE_DIR + os.sep  # nbaccel/


def _keeps_no_pool(method: _Method) -> _Method:
    """A public call whose errors hold no frame that holds the pool. IPython keeps the last error and its
    traceback (sys.last_traceback) until the next error: a frame in it holding `self` would keep the pool, and
    its ranks, alive after `del pool` (weakref.finalize stops them once the pool is collected). The frames stay
    in the traceback, their lines shown as before; only their variables go."""

    @functools.wraps(method)
    def call(self: RankPool, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except BaseException as error:
            del self  # this frame is in the traceback too
            release_frames(error, under=_PACKAGE)  # nbaccel's frames: an error the user's code handled keeps its own
            raise

    return call  # type: ignore[return-value]


class RankPool:
    """Persistent ranks for debugging collectives cell by cell.

    `RankPool(num_processes=2)` starts the ranks with the process group initialized and `PartialState`
    built; `exec(source)` and `run(fn, *args, **kwargs)` run on them and return per-rank results. `timeout`
    (seconds) bounds how long a rank may wait inside one collective before the call fails; a collective
    that another rank cannot join fails after a couple of seconds. Use it as a context manager or call
    `shutdown()`; it is also stopped when garbage-collected and when the interpreter exits. `replacing`: a pool
    to stop once these arguments are checked, before the new ranks start (`%ranks start` passes the running
    one): arguments that fail leave it running.
    """

    @imports_left_whole()  # an interrupt in a first use's import leaves nothing half made
    def __init__(self, num_processes: int = 2, start_method: str | None = None, mixed_precision: str = "no",
                 timeout: float = 30, observers: Iterable[Any] = (), hosts: Sequence[str] | str | None = None,
                 env_vars: Sequence[str] | Mapping[str, str] | None = None, *, replacing: RankPool | None = None) -> None:
        # every check and default once, in plan.py (the same builder as notebook_launcher's): bad input fails here
        self._plan_built = build_plan(LaunchRequest(function=None, program=Program.POOL, num_processes=num_processes,
                                                    start_method=start_method, mixed_precision=mixed_precision,
                                                    timeout=timeout, hosts=hosts, env_vars=env_vars))
        if replacing is not None:  # stopped once the arguments passed, before the new ranks take the devices
            replacing.shutdown()
        plan = self._plan_built
        if plan.start_note:
            logger.warning(plan.start_note)
        # several machines: num_processes ranks on each host, started over SSH (docs/ranks.md)
        self.hosts = plan.hosts
        self.timeout = float(timeout)  # the limit of each collective of a call (the plan has no overall timeout)
        self.num_processes = num_processes  # ranks on this machine, or on each host (as notebook_launcher's)
        self.start_method = plan.start_method  # with hosts=: how the agents start ("ssh", "srun")
        self.mixed_precision = plan.mixed_precision
        self.restarts = 0
        self._ids = itertools.count(1)
        self._cells = itertools.count(1)
        self._cell_names: dict[tuple[str, str | None], tuple[str, bool]] = {}  # (source, name) -> _cell_name's answer
        self._failed_ranks: list[int] = []  # the ranks the last exec/run failed on (`debug`)
        self._failures_lost = False  # a restart ended the processes of the last failure (`nothing_to_debug`)
        self._lock = threading.RLock()
        self._workers: RankProcesses | None = None
        self._finalizer: weakref.finalize | None = None
        self._observers: list[tuple[Any, Callable[[dict], None]]] = [(o, observer_of(o)) for o in observers]
        self._reader: TelemetryReader | None = None
        self._every_rank = list(range(self.world_size))  # the selection of a call on every rank
        self._start()

    # ------------------------------------------------------------------------------------------ lifecycle
    def _start(self) -> None:
        try:
            self._start_once()
        except RankStartError as exc:
            if "address already in use" not in str(exc).lower():
                raise
            self._start_once()  # the free port was taken by someone else meanwhile: once more, on a new port

    def _plan(self) -> LaunchPlan:
        """The pool's plan (built once by plan.py), on a free port: a restart takes a new one; on several
        hosts, the first host finds the port."""
        if self.hosts is not None:
            return self._plan_built
        return dataclasses.replace(self._plan_built, port=free_port())

    @property
    def world_size(self) -> int:
        """Every rank of the pool: `num_processes` times the number of hosts."""
        return self._plan_built.world_size

    def _start_once(self) -> None:
        workers = RankProcesses(self._plan())
        self._finalizer = weakref.finalize(self, workers.close, False)
        self._workers = workers
        try:
            workers.wait_ready(START_TIMEOUT)
            if self._observers:
                self._telemetry_on()
        except BaseException:  # a rank failed to start, or the user interrupted: nothing may stay behind
            self._stop(graceful=False)
            raise

    # ------------------------------------------------------------------------------------------ observers
    @_keeps_no_pool
    def attach(self, observer: Any) -> None:
        """Send the ranks' channel messages (status, output lines, metrics, steps, memory, collectives) to
        `observer`: a `Dashboard` (its `.observe`) or a callable taking a message dict (see
        docs/internals.md, "The channel"). The ranks report telemetry only while something is attached."""
        function = observer_of(observer)
        with self._lock:
            self._observers.append((observer, function))
            if self._workers is None:
                return
            if self._reader is None:
                self._telemetry_on()
            else:
                for rank in self._workers.ranks:
                    self._deliver_to(function, status_message(rank.rank, RankState.RUNNING, rank.device, pid=rank.pid,
                                                              host=rank.host))

    def detach(self, observer: Any) -> None:
        """Stop sending messages to `observer` (the ranks stop reporting once nothing is attached)."""
        with self._lock:
            self._observers = [(o, f) for o, f in self._observers if not (o is observer or o == observer)]
            if not self._observers and self._reader is not None and self._workers is not None:
                self._telemetry_off()

    @property
    def observers(self) -> list[Any]:
        return [o for o, _ in self._observers]

    def _telemetry_on(self) -> None:
        workers = self._workers
        for rank, output in zip(workers.ranks, workers.outputs):
            output.on_output = OutputLines(rank.rank, self._notify)
        self._reader = TelemetryReader([rank.telemetry for rank in workers.ranks], self._notify)
        self._call(lambda call_id: (PoolCommand.TELEMETRY.value, call_id, True), None, None).raise_if_failed()
        for rank in workers.ranks:
            self._notify(status_message(rank.rank, RankState.RUNNING, rank.device, pid=rank.pid, host=rank.host))

    def _telemetry_off(self) -> None:
        self._call(lambda call_id: (PoolCommand.TELEMETRY.value, call_id, False), None, None)
        self._stop_reader()

    def _stop_reader(self) -> None:
        if self._reader is not None:
            self._reader.stop()
            self._reader = None
        for output in self._workers.outputs if self._workers is not None else ():
            output.on_output = None

    def _notify(self, message: dict) -> None:
        for _, function in list(self._observers):
            self._deliver_to(function, message)

    def _deliver_to(self, function: Callable[[dict], None], message: dict) -> None:
        try:
            function(dict(message))
        except Exception as exc:  # a broken observer must not break the pool
            self._observers = [(o, f) for o, f in self._observers if f is not function]
            warnings.warn(f"nbaccel: RankPool observer {function!r} failed and was removed: {exc!r}", stacklevel=2)

    @_keeps_no_pool
    def restart(self) -> None:
        """Stop every rank and start fresh ones (new process group, empty namespaces)."""
        with self._lock:
            self._stop(graceful=True)
            self.restarts += 1
            self._start()

    def shutdown(self) -> None:
        """Stop every rank; no process is left. Calling it again does nothing."""
        with self._lock:
            self._stop(graceful=True)

    close = shutdown

    def _stop(self, graceful: bool) -> None:
        self._failures_lost = self._failures_lost or bool(self._failed_ranks)
        self._failed_ranks = []  # their processes end here: a post-mortem would open a new rank
        self._stop_reader()  # before the pipes it reads are closed
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if self._workers is not None:
            self._workers.close(graceful=graceful)
            self._workers = None

    @property
    def running(self) -> bool:
        return self._workers is not None and not self._workers.closed

    @property
    def pids(self) -> list[int]:
        return [rank.pid for rank in self._workers.ranks] if self._workers else []

    @property
    def devices(self) -> list[str]:
        return [rank.device for rank in self._workers.ranks] if self._workers else []

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        where = f"hosts={list(self.hosts.names)!r}, world_size={self.world_size}, " if self.hosts else ""
        return (f"RankPool(num_processes={self.num_processes}, {where}start_method={self.start_method!r}, "
                f"timeout={self.timeout:g}, {state})")

    def status(self) -> list[dict[str, Any]]:
        """Per rank: pid, device, alive."""
        if self._workers is None:
            return []
        return [{"rank": rank.rank, "pid": rank.pid, "device": rank.device, "alive": rank.is_alive()}
                for rank in self._workers.ranks]

    # ------------------------------------------------------------------------------------------ calls
    @_keeps_no_pool
    def exec(self, source: str, ranks: Iterable[int] | None = None, timeout: float | None = None,
             on_progress: Callable[[RankResults], None] | None = None, name: str | None = None) -> RankResults:
        """Run a cell's source on each rank (in its own namespace); return the per-rank results.

        Like IPython, the value of a last expression statement is returned (not when the cell ends with
        `;`). An exception on a rank is in its result (`.error`), not raised; a hang raises
        CollectiveMismatchError / RankTimeoutError (after restarting the ranks). `on_progress(partial)` is
        called with the results so far (output, finished ranks) when a cell that runs longer than
        PROGRESS_DELAY seconds prints something, at most every PROGRESS_INTERVAL seconds (live views).
        `name`: the cell's name in tracebacks and hang reports (%%ranks passes IPython's, `Cell In[7]`);
        by default `<rank-cell-N>`.
        """
        if not isinstance(source, str):
            raise TypeError(f"source must be a str of Python code, got {type(source).__name__}")
        if name is not None and (not isinstance(name, str) or not name.strip()):
            raise ValueError(f"name must be a non-empty str naming the cell in tracebacks, got {name!r}")
        filename, ends_with_expression = self._cell_name(source, name)
        return self._call(lambda call_id: (PoolCommand.EXEC.value, call_id, source, filename, ends_with_expression), ranks,
                          timeout, on_progress, report=True)

    def _cell_name(self, source: str, given: str | None = None) -> tuple[str, bool]:
        """The cell's file name in tracebacks (`given`, else `<rank-cell-N>`), and whether it ends with an
        expression (whose value the ranks return). A SyntaxError is raised here, before any rank sees the
        cell. A source run again under the same given name keeps its name, so neither the kernel nor a rank
        parses and compiles it twice (a third of a trivial cell's time: a loop of `pool.exec("step()")`
        pays it once)."""
        key = (source, given)
        known = self._cell_names.get(key)
        if known is None:
            name = given or f"<rank-cell-{next(self._cells)}>"
            tree = ast.parse(source, name, "exec")
            known = (name, bool(tree.body) and isinstance(tree.body[-1], ast.Expr))
            if len(self._cell_names) >= CELL_NAMES_KEPT:
                del self._cell_names[next(iter(self._cell_names))]  # the oldest
            self._cell_names[key] = known
        return known

    @_keeps_no_pool
    def run(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Call `function(*args, **kwargs)` on every rank (cloudpickled once, like notebook_launcher); return
        the values per rank. An exception on a rank raises RankFailedError with the remote traceback."""
        if not callable(function):
            raise TypeError(f"function must be callable, got {type(function).__name__}")
        payload = dumps_payload(function, args, kwargs)
        results = self._call(lambda call_id: (PoolCommand.RUN.value, call_id, payload), None, None, report=True,
                             values_only=True)
        if not isinstance(results, RankResults):  # every rank returned: its values, no results built
            return results
        _values_loaded(results).raise_if_failed()
        return results.values

    @_keeps_no_pool
    def push(self, name: str, value: Any, ranks: Iterable[int] | None = None) -> None:
        """Set variable `name` to `value` (cloudpickled) in the namespace of every rank (or of `ranks`)."""
        _check_name(name)
        try:
            data = dumps_value(value)
        except Exception as exc:
            path = find_culprit(value, name) or name
            raise UnpicklableError(f"cannot send {path} to the ranks: it cannot be pickled "
                                   f"({type(exc).__name__}: {exc})") from exc
        self._call(lambda call_id: (PoolCommand.PUSH.value, call_id, name, data), ranks, None).raise_if_failed()

    @_keeps_no_pool
    def pull(self, name: str, ranks: Iterable[int] | None = None) -> list[Any]:
        """The value of variable `name` on every rank (or on `ranks`), as a list in rank order."""
        _check_name(name)
        results = self._call(lambda call_id: (PoolCommand.PULL.value, call_id, name), ranks, None)
        _values_loaded(results).raise_if_failed()
        return results.values

    @_keeps_no_pool
    def debug(self, rank: int | None = None) -> None:
        """pdb's post-mortem on `rank`, at the exception of its last failed cell or function (default: the
        first rank that failed in the last `exec`/`run`); pdb's prompts come to the cell, labelled with the
        rank (`%ranks debug [RANK]`). The rank stays alive: its namespace and frames are those of the failure."""
        if rank is None:
            if not self._failed_ranks:
                raise RuntimeError(self.nothing_to_debug("pool.debug(1)"))
            rank = self._failed_ranks[0]
        self._call(lambda call_id: (PoolCommand.DEBUG.value, call_id), [rank], None).raise_if_failed()

    @property
    def failed_ranks(self) -> list[int]:
        """The ranks on which the last cell or function call failed, whose post-mortem `debug` opens (empty once
        the ranks were restarted: the frames of the failure went with the processes)."""
        return list(self._failed_ranks)

    def nothing_to_debug(self, naming: str) -> str:
        """Why `debug()` has no failed rank to open (when `failed_ranks` is empty); `naming`: how to name a rank."""
        if self._failures_lost:
            return ("the ranks were restarted after the last failure, and its frames went with the old processes: "
                    "run the failing cell again, then debug it")
        return f"no rank failed in the last cell or function call; name the rank: {naming}"

    # ------------------------------------------------------------------------------------------ the wait
    def _call(self, make: Callable[[int], tuple], ranks: Iterable[int] | None,
              timeout: float | None, on_progress: Callable[[RankResults], None] | None = None,
              report: bool = False, values_only: bool = False) -> RankResults | list[Any]:
        """Run one call (pool/call.py) and handle what it ends with (a hang, an interrupt, a broken process
        group). `values_only` (with nothing attached to report to): a plain list of values when every rank
        returned one."""
        timeout = self.timeout if timeout is None else check_seconds(timeout, "timeout")
        with self._lock:
            if self._workers is None:
                raise RuntimeError("the RankPool is shut down: start a new one (or %ranks start)")
            selected = self._select(ranks)
            call = Call(self._workers.ranks, self._workers.outputs, selected, next(self._ids), timeout, on_progress,
                        _DisplayTarget(), self._workers.quick_polls)
            runs_code = report  # exec and run ask for a report
            report = report and bool(self._observers)  # status messages for a cell / function call
            if report:
                for index in selected:
                    worker = self._workers.ranks[index]
                    self._notify(status_message(index, RankState.RUNNING, worker.device, host=worker.host))
            try:
                results = call.run(make, values_only and not report)
                if not isinstance(results, RankResults):
                    self._failed_ranks, self._failures_lost = [], False
                    return results
                if runs_code:  # exec/run: the ranks that failed are what `debug` opens
                    self._failed_ranks = [result.rank for result in results if result.error is not None]
                    self._failures_lost = False
                if report:
                    self._report_results(results)
                return results
            except Hang as hang:
                partial = call.partial_results()  # before the restart: it reads the stuck ranks' output
                failed = self._recover(graceful=False)
                raise self._hang_error(hang, call, partial, failed) from failed
            except KeyboardInterrupt:
                failed = self._recover(graceful=False) if call.pending else None
                raise _interrupted(call.interrupt_report(_first_line(failed))) from failed
            finally:
                if call.broken and self._workers is not None and not call.pending:
                    self._after_broken_group(call)

    def _report_results(self, results: RankResults) -> None:
        for result in results:
            worker = self._workers.ranks[result.rank] if self._workers is not None else None
            device, host = (worker.device, worker.host) if worker is not None else ("cpu", None)
            if result.error is None:
                self._notify(status_message(result.rank, RankState.FINISHED, device, host=host))
            else:
                error = result.error
                first = (f"{error.exc_type}: {error.message}" if error.exc_type else error.summary()).splitlines()[0]
                self._notify(status_message(result.rank, RankState.FAILED, device, error=first, host=host))

    def _select(self, ranks: Iterable[int] | None) -> list[int]:
        if ranks is None:
            return self._every_rank  # a call reads its selection, never changes it
        if isinstance(ranks, int) and not isinstance(ranks, bool):
            ranks = [ranks]
        try:
            selected = sorted(set(ranks))
        except TypeError:
            raise ValueError(f"ranks must be a list of rank numbers (or one rank), got {ranks!r}") from None
        bad = [rank for rank in selected if isinstance(rank, bool) or not isinstance(rank, int)
               or not 0 <= rank < self.world_size]
        if bad or not selected:
            raise ValueError(f"ranks must be a non-empty list of ranks in 0..{self.world_size - 1}, got {ranks!r}")
        return selected

    def _recover(self, graceful: bool) -> Exception | None:
        """Restart every rank after a call that could not end cleanly. Returns why the new ranks did not start
        (the pool is then shut down), so that the error the user gets names the first cause and this one."""
        self._stop(graceful=graceful)
        self.restarts += 1
        try:
            self._start()
        except Exception as failed:  # _start_once left nothing running
            return failed
        return None

    def _after_broken_group(self, call: Call) -> None:
        failed = self._recover(graceful=False)
        if failed is None:
            logger.warning(f"nbaccel: the process group failed ({call.broken}); the ranks were restarted and "
                           "their variables are lost: re-run the cells that define them.")
            return
        raise RankStartError(f"the process group failed ({call.broken}) and the ranks did not start again: "
                             f"{_SHUT_DOWN}.\n{type(failed).__name__}: {failed}", call.partial_results()) from failed

    def _hang_error(self, hang: Hang, call: Call, partial: list[RankResult], failed: Exception | None) -> RankPoolError:
        diagnosis: Diagnosis = hang.diagnosis
        stuck = [state.rank for state in hang.states if state.waiting(hang.now) is not None]
        head = ("not every rank entered the same collective" if diagnosis.kind == "mismatch"
                else f"a collective did not complete within timeout={call.timeout:g} s")
        lines = report_lines(diagnosis, head, explain(diagnosis, call.timeout, min(MISMATCH_GRACE, call.timeout)))
        why = (f"rank{'s' if len(stuck) > 1 else ''} {', '.join(map(str, stuck))} stayed inside a collective, which "
               "cannot be undone")
        if failed is None:
            lines += ["", f"The ranks were restarted: {why}. Variables defined on the ranks are lost: re-run the "
                          "cells that define them."]
        else:
            lines += ["", f"The ranks had to be restarted ({why}), but they did not start again: {_SHUT_DOWN}.",
                      f"{type(failed).__name__}: {failed}"]
        cls = CollectiveMismatchError if diagnosis.kind == "mismatch" else RankTimeoutError
        error = cls("\n".join(lines), partial, restarted=failed is None)
        error.full_stacks = diagnosis.full_details
        return error


class _DisplayTarget:
    """Where the ranks' display() output of one call goes: the cell running it (notebook/live_output.py)."""

    def __init__(self) -> None:
        self._cell: Any = None

    def __call__(self, rank: int, message: dict) -> None:
        if self._cell is None:
            self._cell = views().cell_output()
        if message.get("kind") == MessageKind.DISPLAY:
            self._cell.display(rank, message)
        else:
            self._cell.clear_output(rank, bool(message.get("wait")))


def _values_loaded(results: RankResults) -> RankResults:
    """`results` where a value that the kernel could not unpickle (a class of a module only the rank can import)
    is the rank's error: `run` and `pull` return values, and a None in its place would pass for the rank's own.
    (`exec` keeps its results as they are: the rank's description of the value is shown instead.)"""
    for result in results:
        problem = result.meta.get("value_error")
        if problem and result.error is None:
            exc_type, _, detail = problem.partition(": ")
            result.error = WorkerFailure(result.rank, exc_type, f"the value of rank {result.rank} cannot be unpickled "
                                         f"in the kernel: {detail or exc_type}", "")
            result.status = RankState.FAILED
    return results


_SHUT_DOWN = "the RankPool is shut down, start a new one (or `%ranks start`)"


def _first_line(error: Exception | None) -> str | None:
    return None if error is None else f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"


def _interrupted(report: str) -> KeyboardInterrupt:
    """The interrupt, saying what it did to each rank. IPython shows it as that one line (`_render_traceback_`,
    as the pool's errors): the frames of the pool's wait, where the kernel happened to be, say nothing to the
    user. Still a plain KeyboardInterrupt, so `except KeyboardInterrupt` and "Run all" treat it as one."""
    interrupt = KeyboardInterrupt(report)
    interrupt._render_traceback_ = lambda: [f"KeyboardInterrupt: {report}"]  # type: ignore[attr-defined]
    return interrupt


def _check_name(name: Any) -> None:
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"name must be a Python identifier (a variable name), got {name!r}")
