"""The worker entry: what runs in each launched process.

`run_worker` is the multiprocessing target of notebook_launcher (and of persistent ranks): it points the
process's stdout/stderr at the kernel's pipes, sets the launcher environment (docs/internals.md), plugs a
telemetry sink into the channel, runs the function and reports its return value or exception.
`elastic_entry` and `xla_entry` adapt it to torch elastic and torch_xla, which start processes themselves.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from functools import partial
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from ...utils.constants import LAUNCH_DEVICE_ENV as DEVICE_ENV
from ...utils.constants import MEMORY_INTERVAL_ENV, RANK_GROUPS_ENV
from ...utils.process_group_exit import end_process_groups
from .. import messages
from ..channel import WorkerSink, close_quietly
from ..messages import PRELOADABLE_MODULES, Failure, MessageKind, RankState, Result, Status
from ..output import flush_std, redirect_std_fds, show_fatal_signals
from . import rank_display, rank_prompts
from .parent_death import die_with_parent, lead_own_group
from .raw_calls import watch_raw_collectives

if TYPE_CHECKING:
    from ..serialize import Payload


def run_worker(
    payload: Payload,
    channel: Connection,
    stdout: Connection,
    stderr: Connection,
    env: dict[str, str],
) -> None:
    """Run the pickled `(function, args, kwargs)` with `env` set; exit code 1 after reporting a failure."""
    die_with_parent()  # even a SIGKILLed kernel leaves no rank running
    lead_own_group(env.get(RANK_GROUPS_ENV))  # what it starts is stopped with it, dead or alive (kernel/rank_groups.py)
    redirect_std_fds(stdout.fileno(), stderr.fileno())
    close_quietly(stdout, stderr)
    show_fatal_signals()  # a rank killed by a signal shows its stack
    os.environ.update(env)
    apply_cpu_threads()
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    sink = WorkerSink(channel, rank, local_rank)
    rank_display.install(lambda message: sink(dict(message, rank=sink.rank, time=time.time())))
    rank_prompts.install(rank_prompts.sink_sender(sink), channel.recv, rank)  # input()/breakpoint()/pdb ask in the notebook
    ok = execute(payload, sink)
    sink.close()
    if not ok:
        sys.exit(1)


def apply_cpu_threads() -> None:
    """Give torch the rank's OMP_NUM_THREADS. torch reads it only when it starts, so a forked rank keeps the
    kernel's thread count unless told (and N ranks of a kernel's N threads would oversubscribe the cores).
    Forking from a clean thread (kernel/fork_thread.py) is what keeps a rank's OpenMP from hanging."""
    torch = sys.modules.get("torch")
    value = os.environ.get("OMP_NUM_THREADS", "")
    if torch is None or not value.isdigit() or int(value) < 1:
        return  # a torch imported from here on reads the variable itself
    if torch.get_num_threads() != int(value):
        torch.set_num_threads(int(value))


def execute(payload: Payload, sink: WorkerSink, *, thread_rank: bool = False, device: str | None = None) -> bool:
    """Unpickle and call the function, reporting status, result or error through `sink`. True on success.
    `thread_rank`: this thread is one of several ranks of the process (telemetry per thread; the process
    group, shared by the threads, is left to the process's end). `device`: shown in status messages
    (default: NBACCEL_LAUNCH_DEVICE, else cpu); the kernel adds the host of a launch on several hosts."""
    from ... import telemetry

    telemetry.attach(sink, sink.rank, this_thread=thread_rank)
    device = device or os.environ.get(DEVICE_ENV, "cpu")
    sink.queue(Status(sink.rank, RankState.STARTING, device=device, pid=os.getpid(),
                      restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))).to_wire())
    raw = None
    try:
        from .. import serialize, shared_tensors

        function, args, kwargs = payload.load() if isinstance(payload, serialize.Payload) else serialize.loads(payload)
        running = Status(sink.rank, RankState.RUNNING, device=device).to_wire()
        start_memory_reports(telemetry, sink)
        if thread_rank:
            sink(running)
        else:
            # which raw torch.distributed collective the function is blocked in, if any (sampled, costs no call).
            # Its thread sends the status: a write here woke the kernel, which took the rank's core on a busy
            # machine right when the function should start.
            # It also starts the sink's sender thread, which PartialState's first traced collective would start
            # in this thread otherwise.
            sink.queue(running)
            raw = watch_raw_collectives(partial(sink.send, MessageKind.COLLECTIVE.value),
                                        first=partial(_first_in_watch, sink))
            if raw is None:
                sink.flush()
        try:
            value = function(*args, **kwargs)
        except SystemExit as exc:
            if exc.code not in (None, 0):
                raise
            value = None
        finally:
            if raw is not None:
                raw.stop()
        rank_display.finish()  # figures still open are shown, as at the end of a notebook cell
        try:
            data = shared_tensors.dumps_value(value)  # large tensors through shared memory
        except Exception as exc:
            raise TypeError(
                f"the return value of rank {sink.rank} ({type(value).__name__}) cannot be pickled: {exc}"
            ) from exc
        flush_std()
        _stop_telemetry_sampler(telemetry)  # what it queued goes first: the result follows every logged value
        if sink.ticker is not None and not sink.ticked:  # it ended before its first sample: its peak, for the view
            sink.queue(messages.memory(sink.rank, sink.local_rank, telemetry.peak_memory_sample()))
        sink.queue(Result(sink.rank, data, imported=[name for name in PRELOADABLE_MODULES if name in sys.modules])
                   .to_wire())
        sink(Status(sink.rank, RankState.FINISHED, device=device).to_wire())  # one write with the result
        return True
    except BaseException as exc:  # report everything, KeyboardInterrupt included, then exit non-zero
        tb = exc.__traceback__
        if tb is not None and tb.tb_frame.f_code is execute.__code__ and tb.tb_next is not None:
            tb = tb.tb_next  # start the remote traceback at the user's code
        from nbaccel.utils.exception_report import (
            report_exception,  # type and traceback, whatever __str__ does
        )

        report = report_exception(exc, tb)
        flush_std()
        _stop_telemetry_sampler(telemetry)
        if raw is not None:
            raw.report_failure(exc)  # queued: it goes out with the failure, just before it
        failure = Failure(sink.rank, report.exc_type, report.message, report.traceback)
        sink(failure.to_wire())
        sink(Status(sink.rank, RankState.FAILED, device=device, error=failure.first_line).to_wire())
        return False
    finally:
        sink.ticker = None
        if not thread_rank and _spawned():
            end_process_groups()
        telemetry.detach()
        flush_std()


def _first_in_watch(sink: WorkerSink) -> None:
    """What the raw-collective watch's thread does first, off the rank's way to its function: send the queued
    statuses, start the telemetry sender thread."""
    sink.flush()
    sink.start_sender_early()


def _spawned() -> bool:
    """True in a process started by multiprocessing's spawn, which ends through the interpreter's exit (its
    destructors then meet the process group). fork and forkserver children end in os._exit, which frees the
    group with the process: destroying it first only made the kernel wait ~20 ms longer for the exit."""
    from multiprocessing import spawn

    return spawn.is_forking(sys.argv)


def start_memory_reports(telemetry: Any, sink: WorkerSink) -> None:
    """`memory` messages every NBACCEL_MEMORY_INTERVAL seconds (default 1; 0: none), sent by the sink's
    sender thread once the function reports telemetry (the kernel samples host memory of workers that
    never do). No thread starts here: on a busy machine a thread start delays the function by ~10 ms."""
    try:
        interval = float(os.environ.get(MEMORY_INTERVAL_ENV, "1"))
    except ValueError:
        interval = 1.0
    if interval <= 0:
        return
    sink.tick_interval = interval
    sink.ticker = lambda: sink(messages.memory(sink.rank, sink.local_rank, telemetry.memory_sample()))


def _stop_telemetry_sampler(telemetry: Any) -> None:
    """If the function started nbaccel.telemetry's own sampler, let it send what it holds first."""
    stop = getattr(telemetry, "stop_sampler", None)
    if callable(stop):
        try:
            stop()
        except Exception:
            pass


def freeze_inherited_heap() -> None:
    """In a rank that torch elastic or torch_xla forked (from a thread of theirs, at no time the kernel can
    freeze its heap for, as start_methods.gc_frozen does): freeze the kernel's objects first thing. A
    collection in this rank would otherwise also finalize the kernel's uncollected garbage, whose C++
    destructors were never meant to run in a fork: a gloo process group's waits for ever
    (tests/test_launcher_elastic.py). Spawned ranks inherit no heap."""
    if not _spawned():
        gc.freeze()


def elastic_entry(payload: Payload, channels: list[Connection], stdouts: list[Connection],
                  stderrs: list[Connection], env: dict[str, str]) -> None:
    """Entry point under torch elastic: it sets RANK/LOCAL_RANK/...; pick this local rank's pipes."""
    freeze_inherited_heap()
    local_rank = int(os.environ["LOCAL_RANK"])
    for i in range(len(channels)):
        if i != local_rank:
            close_quietly(channels[i], stdouts[i], stderrs[i])
    local_env = dict(env)
    local_env[DEVICE_ENV] = env.get(DEVICE_ENV, "cpu").replace("{local_rank}", str(local_rank))
    run_worker(payload, channels[local_rank], stdouts[local_rank], stderrs[local_rank], local_env)
