"""`RankPool`: persistent ranks that keep their process group and variables between cells.

The workers start once (fork where safe, like notebook_launcher), each with `PartialState` ready, and then
run what the kernel sends: `exec(source)` runs a cell's source in each rank's own namespace, `run(fn)` a
cloudpickled function. Results come back per rank (output, value of the last expression, error).

A cell in which not every rank enters the same collective does not freeze the kernel: while a call runs the
pool asks the busy ranks where they are (hang_report.py) and raises `CollectiveMismatchError` or
`RankTimeoutError` with a report of which rank waits in which collective. A rank stuck in a gloo/NCCL
collective cannot be released, so the pool then restarts every rank (their variables are lost) and says so.

No rank outlives the pool: `shutdown()`, the context manager, garbage collection (weakref.finalize) and
interpreter exit stop them, and a rank exits by itself when the kernel process dies (PR_SET_PDEATHSIG on
Linux, and end-of-file on its status pipe everywhere).
"""

from __future__ import annotations

import ast
import atexit
import itertools
import multiprocessing.util
import os
import pickle
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from .channel import close_quietly
from .errors import LaunchError, UnpicklableError, WorkerFailure, format_failures
from .hang_report import Diagnosis, RankState, diagnose, explain
from .output import read_available
from .processes import (
    choose_start_method,
    free_port,
    get_context,
    main_module_hidden,
    resource_tracker_scope,
    signal_name,
    stop_processes,
)
from .serialize import dumps_payload, dumps_value, find_culprit, loads
from .worker import DEVICE_ENV

START_TIMEOUT = 120.0  # seconds for every rank to build its process group
CHECK_INTERVAL = 0.5  # seconds between status checks while a call runs (never for calls shorter than that)
MISMATCH_GRACE = 2.0  # seconds a rank may wait in a collective that another rank cannot join
PG_TIMEOUT_MARGIN = 10.0  # the process group's own timeout: the pool's timeout plus this (a backstop)
PROGRESS_DELAY = 0.5  # seconds a cell runs before on_progress is called (quick cells: never)
PROGRESS_INTERVAL = 0.3  # seconds between on_progress calls
INTERRUPT_GRACE = 3.0  # seconds the ranks get to return after an interrupt before they are restarted


# ---------------------------------------------------------------------------------------------- errors
class RankPoolError(LaunchError):
    """A pool call failed. `.results` holds what each rank returned (partial on a hang), `.restarted` says
    whether the pool restarted its ranks (their variables are then lost)."""

    def __init__(self, message: str, results: list[RankResult] | None = None, restarted: bool = False,
                 failures: dict[int, WorkerFailure] | None = None) -> None:
        super().__init__(message, failures)
        self.results = results or []
        self.restarted = restarted

    def _render_traceback_(self) -> list[str]:  # IPython: show the report, not the pool's own frames
        return [f"{type(self).__name__}: {self}"]


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
    status: str = "finished"  # "finished", "failed", "waiting" (hung, in an error's results), "not run"
    duration: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None and self.status == "finished"

    def __repr__(self) -> str:
        parts = [f"rank={self.rank}"]
        if self.status != "finished":
            parts.append(f"status={self.status!r}")
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
        """Raise RankFailedError when a rank raised, with its remote traceback."""
        failures = {result.rank: result.error for result in self if result.error is not None}
        if failures:
            raise RankFailedError(format_failures(failures), list(self), failures=failures)

    def __repr__(self) -> str:
        from ..notebook.rank_view import render_text

        return render_text(self)

    def _repr_html_(self) -> str:
        from ..notebook.rank_view import render_html

        return render_html(self)


def _one_line(text: str) -> str:
    lines = text.splitlines() or [""]
    return lines[0] + (" ..." if len(lines) > 1 else "")


def _clip(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------------------------------------- processes
class _Rank:
    """The kernel's ends of one rank: process, command pipe, status pipe, stdout/stderr pipes."""

    def __init__(self, rank: int, process: Any, commands: Connection, status: Connection, out_fd: int,
                 err_fd: int) -> None:
        self.rank = rank
        self.process = process
        self.commands = commands
        self.status = status
        self.out_fd = out_fd
        self.err_fd = err_fd
        self.out = bytearray()
        self.err = bytearray()
        self.device = "cpu"
        self.pid = process.pid
        self.closed_fds: set[int] = set()

    def drain(self, fd: int) -> None:
        if fd in self.closed_fds:
            return
        data, at_end = read_available(fd)
        (self.out if fd == self.out_fd else self.err).extend(data)
        if at_end:
            self.closed_fds.add(fd)

    def take_output(self) -> tuple[str, str]:
        self.drain(self.out_fd)
        self.drain(self.err_fd)
        out, err = bytes(self.out).decode("utf-8", "replace"), bytes(self.err).decode("utf-8", "replace")
        self.out.clear()
        self.err.clear()
        return out, err


class _Workers:
    """Start and stop the rank processes. Separate from RankPool so finalizers never keep the pool alive."""

    def __init__(self, num_processes: int, start_method: str, env: dict[str, str], device: str) -> None:
        self.ranks: list[_Rank] = []
        self.closed = False
        self.start_method = start_method
        self._tracker = resource_tracker_scope()
        self._tracker.__enter__()
        ctx = get_context(start_method)
        port = free_port()
        kernel_fds: list[int] = []
        death_signal = threading.current_thread() is threading.main_thread()  # PDEATHSIG follows the thread
        try:
            for rank in range(num_processes):
                commands, worker_commands = ctx.Pipe(duplex=True)
                status, worker_status = ctx.Pipe(duplex=True)
                out_read, out_write = os.pipe()
                err_read, err_write = os.pipe()
                kernel_fds += [commands.fileno(), status.fileno(), out_read, err_read]
                rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(num_processes),
                                LOCAL_WORLD_SIZE=str(num_processes), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                                MASTER_PORT=str(port))
                rank_env[DEVICE_ENV] = device.format(local_rank=rank)
                from .pool_worker import pool_worker

                process = ctx.Process(
                    target=pool_worker, name=f"nbaccel-rank-{rank}",
                    args=(worker_commands, worker_status, Connection(out_write, readable=False),
                          Connection(err_write, readable=False), rank_env,
                          list(kernel_fds) if start_method == "fork" else [], death_signal),
                )
                with main_module_hidden(start_method):
                    process.start()
                close_quietly(worker_commands, worker_status, out_write, err_write)
                self.ranks.append(_Rank(rank, process, commands, status, out_read, err_read))
        except BaseException:
            self.close(graceful=False)
            raise
        _LIVE.add(self)

    def wait_ready(self, timeout: float) -> None:
        """Wait until every rank built its process group; on failure stop them all and raise RankStartError."""
        pending = {rank.commands: rank for rank in self.ranks}
        sentinels = {rank.process.sentinel: rank for rank in self.ranks}
        deadline = time.monotonic() + timeout
        problem = None
        while pending and problem is None:
            left = deadline - time.monotonic()
            if left <= 0:
                problem = f"ranks {sorted(r.rank for r in pending.values())} did not start within {timeout:g} s"
                break
            for obj in wait([*pending, *sentinels], left):
                if obj in pending:
                    rank = pending.pop(obj)
                    try:
                        message = obj.recv()
                    except (EOFError, OSError):
                        problem = f"rank {rank.rank} exited while starting"
                        break
                    if message.get("error"):
                        error = message["error"]
                        problem = f"rank {rank.rank} failed to start:\n{error['traceback'].rstrip()}"
                        break
                    rank.device = message.get("device", "cpu")
                elif obj in sentinels and sentinels[obj].commands in pending:
                    rank = sentinels[obj]
                    if not rank.commands.poll(0):
                        problem = f"rank {rank.rank} exited while starting ({_exit_text(rank.process.exitcode)})"
                        break
        if problem is not None:
            output = "\n".join(text for rank in self.ranks for text in rank.take_output() if text.strip())
            self.close(graceful=False)
            raise RankStartError(problem + (f"\n\nOutput of the ranks:\n{output.rstrip()}" if output else ""))

    def close(self, graceful: bool = True) -> None:
        """Stop every rank. Graceful: ask them to leave (they destroy the process group); after a short wait,
        or at once when not graceful, closing the status pipes makes them exit; SIGTERM/SIGKILL last."""
        if self.closed:
            return
        self.closed = True
        _LIVE.discard(self)
        processes = [rank.process for rank in self.ranks]
        if graceful:
            for rank in self.ranks:
                try:
                    rank.commands.send(("stop",))
                except (OSError, ValueError):
                    pass
            deadline = time.monotonic() + 2.0
            for process in processes:
                process.join(max(0.0, deadline - time.monotonic()))
        for rank in self.ranks:
            close_quietly(rank.status)  # end of file: the rank's status thread exits the process
        deadline = time.monotonic() + 1.0
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
        stop_processes(processes)
        for rank in self.ranks:
            close_quietly(rank.commands, rank.out_fd, rank.err_fd)
        try:
            self._tracker.__exit__(None, None, None)
        except Exception:
            pass


_LIVE: weakref.WeakSet[_Workers] = weakref.WeakSet()


def _close_all() -> None:
    for workers in list(_LIVE):
        try:
            workers.close(graceful=False)
        except Exception:
            pass


atexit.register(_close_all)
# multiprocessing's own exit handler joins non-daemon children: close ours before it does
multiprocessing.util.Finalize(None, _close_all, exitpriority=100)


def _exit_text(exitcode: int | None) -> str:
    name = signal_name(exitcode)
    return f"killed by {name}" if name else f"exit code {exitcode}"


# ---------------------------------------------------------------------------------------------- the pool
class RankPool:
    """Persistent ranks for debugging collectives cell by cell.

    `RankPool(num_processes=2)` starts the ranks with the process group initialized and `PartialState`
    built; `exec(source)` and `run(fn, *args, **kwargs)` run on them and return per-rank results. `timeout`
    (seconds) bounds how long a rank may wait inside one collective before the call fails; a collective
    that another rank cannot join fails after a couple of seconds. Use it as a context manager or call
    `shutdown()`; it is also stopped when garbage-collected and when the interpreter exits.
    """

    def __init__(self, num_processes: int = 2, start_method: str | None = None, mixed_precision: str = "no",
                 timeout: float = 30) -> None:
        if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes < 1:
            raise ValueError(f"num_processes must be a positive integer, got {num_processes!r}")
        self.timeout = _check_timeout(timeout, "timeout")
        from .arguments import MIXED_PRECISION_CHOICES
        from .launcher import _common_env, _visible_gpus

        precision = mixed_precision.lower() if isinstance(mixed_precision, str) else mixed_precision
        precision = getattr(precision, "value", precision)
        if precision not in MIXED_PRECISION_CHOICES:
            raise ValueError(f"mixed_precision must be one of {list(MIXED_PRECISION_CHOICES)}, got {mixed_precision!r}")
        self.start_method, note = choose_start_method(start_method)
        gpus = _visible_gpus()
        if gpus and num_processes > gpus:  # e.g. 2 ranks on a 1-GPU Colab: debugging collectives needs 2
            print(f"nbaccel: {num_processes} ranks but {gpus} GPU(s): the ranks run on the CPU (gloo). Pass "
                  f"num_processes<={gpus} for GPU ranks.", file=sys.stderr)
            gpus = 0
        if note:
            print(note, file=sys.stderr)
        self.num_processes = num_processes
        self.mixed_precision = precision
        self.restarts = 0
        self._env = _common_env(precision, use_cpu=not gpus)
        self._env["NBACCEL_PG_TIMEOUT"] = str(self.timeout + PG_TIMEOUT_MARGIN)
        self._device = "cuda:{local_rank}" if gpus else "cpu"
        self._ids = itertools.count(1)
        self._cells = itertools.count(1)
        self._lock = threading.RLock()
        self._workers: _Workers | None = None
        self._finalizer: weakref.finalize | None = None
        self._start()

    # ------------------------------------------------------------------------------------------ lifecycle
    def _start(self) -> None:
        try:
            self._start_once()
        except RankStartError as exc:
            if "address already in use" not in str(exc).lower():
                raise
            self._start_once()  # the free port was taken by someone else meanwhile: once more, on a new port

    def _start_once(self) -> None:
        workers = _Workers(self.num_processes, self.start_method, self._env, self._device)
        self._finalizer = weakref.finalize(self, workers.close, False)
        self._workers = workers
        try:
            workers.wait_ready(START_TIMEOUT)
        except BaseException:  # a rank failed to start, or the user interrupted: nothing may stay behind
            self._stop(graceful=False)
            raise

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
        return (f"RankPool(num_processes={self.num_processes}, start_method={self.start_method!r}, "
                f"timeout={self.timeout:g}, {state})")

    def status(self) -> list[dict[str, Any]]:
        """Per rank: pid, device, alive."""
        if self._workers is None:
            return []
        return [{"rank": rank.rank, "pid": rank.pid, "device": rank.device, "alive": rank.process.is_alive()}
                for rank in self._workers.ranks]

    # ------------------------------------------------------------------------------------------ calls
    def exec(self, source: str, ranks: Iterable[int] | None = None, timeout: float | None = None,
             on_progress: Callable[[RankResults], None] | None = None) -> RankResults:
        """Run a cell's source on each rank (in its own namespace); return the per-rank results.

        Like IPython, the value of a last expression statement is returned (not when the cell ends with
        `;`). An exception on a rank is in its result (`.error`), not raised; a hang raises
        CollectiveMismatchError / RankTimeoutError (after restarting the ranks). `on_progress(partial)` is
        called with the results so far (output, finished ranks) when a cell that runs longer than
        PROGRESS_DELAY seconds prints something, at most every PROGRESS_INTERVAL seconds (live views).
        """
        if not isinstance(source, str):
            raise TypeError(f"source must be a str of Python code, got {type(source).__name__}")
        filename = f"<rank-cell-{next(self._cells)}>"
        ast.parse(source, filename, "exec")  # a SyntaxError is raised here, before any rank sees the cell
        return self._call(lambda call_id, rank: ("exec", call_id, source, filename), ranks, timeout, on_progress)

    def run(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Call `function(*args, **kwargs)` on every rank (cloudpickled once, like notebook_launcher); return
        the values per rank. An exception on a rank raises RankFailedError with the remote traceback."""
        if not callable(function):
            raise TypeError(f"function must be callable, got {type(function).__name__}")
        payload = dumps_payload(function, args, kwargs)
        results = self._call(lambda call_id, rank: ("run", call_id, payload), None, None)
        results.raise_if_failed()
        return results.values

    def push(self, name: str, value: Any, ranks: Iterable[int] | None = None) -> None:
        """Set variable `name` to `value` (cloudpickled) in the namespace of every rank (or of `ranks`)."""
        _check_name(name)
        try:
            data = dumps_value(value)
        except Exception as exc:
            path = find_culprit(value, name) or name
            raise UnpicklableError(f"cannot send {path} to the ranks: it cannot be pickled "
                                   f"({type(exc).__name__}: {exc})") from exc
        self._call(lambda call_id, rank: ("push", call_id, name, data), ranks, None).raise_if_failed()

    def pull(self, name: str, ranks: Iterable[int] | None = None) -> list[Any]:
        """The value of variable `name` on every rank (or on `ranks`), as a list in rank order."""
        _check_name(name)
        results = self._call(lambda call_id, rank: ("pull", call_id, name), ranks, None)
        results.raise_if_failed()
        return results.values

    # ------------------------------------------------------------------------------------------ the wait
    def _call(self, make: Callable[[int, int], tuple], ranks: Iterable[int] | None,
              timeout: float | None, on_progress: Callable[[RankResults], None] | None = None) -> RankResults:
        timeout = self.timeout if timeout is None else _check_timeout(timeout, "timeout")
        with self._lock:
            if self._workers is None:
                raise RuntimeError("the RankPool is shut down: start a new one (or %ranks start)")
            selected = self._select(ranks)
            call = _Call(self._workers.ranks, selected, next(self._ids), timeout, on_progress)
            try:
                return call.run(make)
            except _Hang as hang:
                error = self._hang_error(hang, call)  # before the restart: it reads the stuck ranks' output
                self._recover(graceful=False)
                raise error from None
            except KeyboardInterrupt:
                if call.pending:
                    self._recover(graceful=False)
                    print(f"nbaccel: ranks {sorted(call.pending)} did not stop after the interrupt; the ranks "
                          "were restarted and their variables are lost.", file=sys.stderr)
                raise
            finally:
                if call.broken and self._workers is not None and not call.pending:
                    self._recover(graceful=False)
                    print(f"nbaccel: the process group failed ({call.broken}); the ranks were restarted and "
                          "their variables are lost: re-run the cells that define them.", file=sys.stderr)

    def _select(self, ranks: Iterable[int] | None) -> list[int]:
        if ranks is None:
            return list(range(self.num_processes))
        if isinstance(ranks, int) and not isinstance(ranks, bool):
            ranks = [ranks]
        try:
            selected = sorted(set(ranks))
        except TypeError:
            raise ValueError(f"ranks must be a list of rank numbers (or one rank), got {ranks!r}") from None
        bad = [rank for rank in selected if isinstance(rank, bool) or not isinstance(rank, int)
               or not 0 <= rank < self.num_processes]
        if bad or not selected:
            raise ValueError(f"ranks must be a non-empty list of ranks in 0..{self.num_processes - 1}, got {ranks!r}")
        return selected

    def _recover(self, graceful: bool) -> None:
        self._stop(graceful=graceful)
        self.restarts += 1
        self._start()

    def _hang_error(self, hang: _Hang, call: _Call) -> RankPoolError:
        diagnosis: Diagnosis = hang.diagnosis
        stuck = [state.rank for state in hang.states if state.waiting(hang.now) is not None]
        head = ("not every rank entered the same collective" if diagnosis.kind == "mismatch"
                else f"a collective did not complete within timeout={call.timeout:g} s")
        lines = [f"{head}:", diagnosis.summary, "",
                 explain(diagnosis, call.timeout, min(MISMATCH_GRACE, call.timeout))]
        if diagnosis.details:
            lines += ["", diagnosis.details]
        lines += ["", f"The ranks were restarted: rank{'s' if len(stuck) > 1 else ''} "
                      f"{', '.join(map(str, stuck))} stayed inside a collective, which cannot be undone. Variables "
                      "defined on the ranks are lost: re-run the cells that define them."]
        cls = CollectiveMismatchError if diagnosis.kind == "mismatch" else RankTimeoutError
        return cls("\n".join(lines), call.partial_results(), restarted=True)


class _Hang(Exception):
    def __init__(self, diagnosis: Diagnosis, states: list[RankState], now: float) -> None:
        super().__init__(diagnosis.summary)
        self.diagnosis = diagnosis
        self.states = states
        self.now = now


class _Call:
    """One command sent to the selected ranks, and the wait for their replies (with hang checks)."""

    def __init__(self, ranks: list[_Rank], selected: list[int], call_id: int, timeout: float,
                 on_progress: Callable[[RankResults], None] | None = None) -> None:
        self.ranks = ranks
        self.selected = selected
        self.call_id = call_id
        self.timeout = timeout
        self.pending: set[int] = set(selected)
        self.replies: dict[int, dict[str, Any]] = {}
        self.outputs: dict[int, tuple[str, str]] = {}
        self.snapshots: dict[int, dict[str, Any]] = {}
        self.raw_seen: dict[int, tuple[Any, float]] = {}
        self.broken: str | None = None
        self.on_progress = on_progress
        self.changed = False
        self.progress_at = time.monotonic() + PROGRESS_DELAY

    def run(self, make: Callable[[int, int], tuple]) -> RankResults:
        for index in self.selected:
            rank = self.ranks[index]
            rank.take_output()  # what a rank wrote between calls (background threads) is not this call's
            _discard_stale(rank.status)
            try:
                rank.commands.send(make(self.call_id, index))
            except (OSError, ValueError):
                self._dead(index)
        check_at = time.monotonic() + CHECK_INTERVAL
        asked: set[int] = set()
        try:
            while self.pending:
                if not asked and time.monotonic() >= check_at:
                    asked = self._ask_status()
                    check_at = time.monotonic() + CHECK_INTERVAL
                objects: dict[Any, tuple[str, int]] = {}
                for index in self.selected:
                    rank = self.ranks[index]
                    for fd in (rank.out_fd, rank.err_fd):
                        if fd not in rank.closed_fds:
                            objects[fd] = ("fd", index)
                    if index in self.pending:
                        objects[rank.commands] = ("reply", index)
                        objects[rank.process.sentinel] = ("exit", index)
                for index in asked:
                    objects[self.ranks[index].status] = ("status", index)
                round_done = False
                wake = min(check_at, self.progress_at) if self.changed and self.on_progress else check_at
                for obj in wait(list(objects), max(0.0, wake - time.monotonic())):
                    what, index = objects[obj]
                    if what == "fd":
                        self.ranks[index].drain(obj)
                        self.changed = True
                    elif what == "reply" and index in self.pending:
                        self._reply(index)
                    elif what == "exit" and index in self.pending and not self.ranks[index].commands.poll(0):
                        self._dead(index)
                    elif what == "status" and index in asked:
                        asked.discard(index)
                        self._status(index)
                        round_done = not asked
                if round_done and self.pending:
                    self._check()
                if self.on_progress and self.changed and self.pending and time.monotonic() >= self.progress_at:
                    self.changed = False
                    self.progress_at = time.monotonic() + PROGRESS_INTERVAL
                    self.on_progress(self.progress())
        except KeyboardInterrupt:
            self._interrupt()
            raise
        return self.results()

    # -------------------------------------------------------------------------------------- messages
    def _reply(self, index: int) -> None:
        rank = self.ranks[index]
        try:
            message = rank.commands.recv()
        except (EOFError, OSError):
            self._dead(index)
            return
        if message.get("kind") != "reply" or message.get("id") != self.call_id:
            return  # a late reply of an interrupted earlier call
        self.replies[index] = message
        self.outputs[index] = rank.take_output()
        self.pending.discard(index)
        if message.get("pg_broken") and message.get("error") and self.broken is None:
            self.broken = f"rank {index}: {message['error']['exc_type']}: {message['error']['message']}".splitlines()[0]

    def _dead(self, index: int) -> None:
        rank = self.ranks[index]
        rank.process.join(1.0)
        self.outputs[index] = rank.take_output()
        how = _exit_text(rank.process.exitcode)
        self.replies[index] = {"error": {"exc_type": "RankDied", "message": f"the rank process ended ({how})",
                                         "traceback": ""}}
        self.pending.discard(index)
        self.broken = f"rank {index} died ({how})"

    def _ask_status(self) -> set[int]:
        asked = set()
        for index in self.pending:
            try:
                self.ranks[index].status.send("status")
                asked.add(index)
            except (OSError, ValueError):
                pass
        return asked

    def _status(self, index: int) -> None:
        try:
            snapshot = self.ranks[index].status.recv()
        except (EOFError, OSError):
            return
        if index not in self.pending or snapshot.get("call_id") != self.call_id:
            return
        self.snapshots[index] = snapshot
        raw = (snapshot.get("raw_call"), snapshot.get("line"), snapshot.get("call_id"))
        if snapshot.get("raw_call") is None:
            self.raw_seen.pop(index, None)
        elif self.raw_seen.get(index, (None,))[0] != raw:
            self.raw_seen[index] = (raw, snapshot.get("time", time.time()))

    def states(self) -> list[RankState]:
        states = []
        for index in range(len(self.ranks)):
            if index not in self.selected:
                states.append(RankState(index, "idle"))
            elif index in self.pending:
                seen = self.raw_seen.get(index)
                states.append(RankState(index, "running", snapshot=self.snapshots.get(index),
                                        raw_since=seen[1] if seen else None))
            else:
                error = self.replies[index].get("error")
                if error is None:
                    states.append(RankState(index, "finished"))
                else:
                    first = f"{error['exc_type']}: {error['message']}".splitlines()[0].rstrip(": ")
                    states.append(RankState(index, "dead" if error["exc_type"] == "RankDied" else "failed", first))
        return states

    def _check(self) -> None:
        states = self.states()
        now = time.time()
        diagnosis = diagnose(states, now, self.timeout, min(MISMATCH_GRACE, self.timeout))
        if diagnosis is not None:
            raise _Hang(diagnosis, states, now)

    def _interrupt(self) -> None:
        """Forward the interrupt to the busy ranks and give them INTERRUPT_GRACE seconds to reply."""
        for index in self.pending:
            try:
                os.kill(self.ranks[index].pid, signal.SIGINT)
            except OSError:
                pass
        deadline = time.monotonic() + INTERRUPT_GRACE
        while self.pending:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            conns = {self.ranks[index].commands: index for index in self.pending}
            for conn in wait(list(conns), left):
                self._reply(conns[conn])

    # -------------------------------------------------------------------------------------- results
    def results(self) -> RankResults:
        return RankResults(self._result(index) for index in self.selected)

    def _result(self, index: int, waiting: bool = False) -> RankResult:
        if waiting:
            out, err = self.ranks[index].take_output()
            return RankResult(index, stdout=out, stderr=err, status="waiting")
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
            result.error = WorkerFailure(index, error["exc_type"], error["message"], error["traceback"])
            result.status = "failed"
        return result

    def progress(self) -> RankResults:
        """The results so far: finished ranks' results, and the output the others printed until now."""
        partial = []
        for index in self.selected:
            if index in self.pending:
                rank = self.ranks[index]
                partial.append(RankResult(index, stdout=bytes(rank.out).decode("utf-8", "replace"),
                                          stderr=bytes(rank.err).decode("utf-8", "replace"), status="running"))
            else:
                partial.append(self._result(index))
        return RankResults(partial)

    def partial_results(self) -> list[RankResult]:
        return [self._result(index, waiting=index in self.pending) for index in self.selected]


def _discard_stale(conn: Connection) -> None:
    """Drop status answers left over from an interrupted call, so each query reads its own answer."""
    try:
        while conn.poll(0):
            conn.recv()
    except (EOFError, OSError):
        pass


def _check_timeout(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    return float(value)


def _check_name(name: Any) -> None:
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"name must be a Python identifier (a variable name), got {name!r}")


def results_equal(values: Sequence[Any]) -> bool:
    """True when every value pickles to the same bytes (what `%ranks pull` uses to return one value)."""
    try:
        first = pickle.dumps(values[0])
        return all(pickle.dumps(value) == first for value in values[1:])
    except Exception:
        return False
