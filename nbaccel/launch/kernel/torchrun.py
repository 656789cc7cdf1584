"""`nbaccel launch`'s program: torchrun's agent runs the plan's script on every rank of this machine.

A part of placement elastic's one class (elastic.py `ElasticBackend`, which composes a `TorchrunScript` when the
plan's program is a script): torch.distributed.run (torchrun) parses the command line `torchrun_arguments(plan)`
writes and its agent starts, restarts and reaps the ranks, as under `accelerate launch`; the agent runs in the
backend's helper thread (as torch elastic's does for notebook_launcher) while the supervisor, in the calling
thread, watches and stops: the same loop and the same stop (the ranks found as this process's new children, their
descendants included) as every other launch. Each rank runs worker/script_entry.py, which reports its collectives
and its end to the launch's CollectiveWatch (collective_watch.py); the watch's verdict (a deadlock, or ranks stuck
in their process's teardown after their script ended) reaches the supervisor through the backend's `verdict()`.

On one machine the agent meets itself on a loopback store (loopback_store.py `loopback_rendezvous`), which
`prepare` opens; a rendezvous it closes before stopping the ranks keeps the agent from restarting them.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import sys
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ...utils.constants import COLLECTIVE_WATCH_ENV, EXEC_ENTRY, LINE_LOCK_ENV, RANK_GROUPS_ENV, SCRIPT_ENTRY
from ..channel import close_quietly
from ..errors import WorkerFailure, ended_how
from ..private_dirs import ELASTIC_LOGS_PREFIX, LINE_LOCK_PREFIX, make_user_dir, remove_dir
from .process_trees import signal_name

if TYPE_CHECKING:
    from ..hang_report import Diagnosis
    from .collective_watch import CollectiveWatch, ExitHang
    from .loopback_store import LoopbackStore
    from .plan import LaunchPlan

AGENT_LOGGERS = ("torch.distributed.elastic", "torch.distributed.run")


def torchrun_arguments(plan: LaunchPlan, watched: bool = False, registered: bool = False) -> list[str]:
    """The torch.distributed.run command line of a script plan (this machine's part of the run).

    `watched`: each rank runs the script through nbaccel's entry, which reports its collectives to the
    launch's collective watch (not with --no_python: there is no Python to enter).
    `registered`: a rank that is not watched (--no_python, or no watch) starts as worker/exec_entry.py, which
    registers the rank's session in the launch's folder of rank groups (RANK_GROUPS_ENV) and then becomes the
    program: what the program starts is stopped with the launch (script_entry.py registers a watched one)."""
    script, rdzv = plan.script, plan.rendezvous
    if script is None or rdzv is None:
        raise ValueError(f"a {plan.program.value} plan runs no script through torchrun")
    argv = [f"--nnodes={plan.num_nodes}", f"--nproc-per-node={plan.num_processes}",
            f"--max-restarts={rdzv.max_restarts}", f"--monitor-interval={rdzv.monitor_interval}",
            f"--rdzv-backend={rdzv.backend}"]
    if plan.num_nodes > 1:  # as Accelerate: the rendezvous endpoint, or with same_network torchrun's master
        argv.append(f"--node-rank={plan.node_rank}")
        if script.same_network:
            argv += [f"--master-addr={plan.master_addr}", f"--master-port={plan.port}"]
        else:
            argv += [f"--rdzv-endpoint={rdzv.endpoint}", f"--rdzv-id={rdzv.run_id}"]
    else:  # one machine, one agent: a rendezvous on the loopback store `start` opens, a new store per attempt
        argv.append(f"--rdzv-endpoint={rdzv.endpoint}")
    if script.role != "default":
        argv.append(f"--role={script.role}")
    if watched and not script.no_python:  # torchrun runs nbaccel's entry as a module; the entry runs the script
        argv.append("--module")
        program = [SCRIPT_ENTRY, *(["--module"] if script.module else []), script.script]
    elif registered:  # the entry registers the rank's session, then execs what torchrun would have run
        argv.append("--no-python")
        python = [] if script.no_python else [os.environ.get("PYTHON_EXEC", sys.executable), "-u",
                                              *(["-m"] if script.module else [])]
        program = [sys.executable, "-m", EXEC_ENTRY, *python, script.script]
    else:
        if script.no_python:
            argv.append("--no-python")
        if script.module:
            argv.append("--module")
        program = [script.script]
    if rdzv.conf:
        argv.append("--rdzv-conf=" + ",".join(f"{key}={value}" for key, value in rdzv.conf.items()))
    if script.log_dir:
        argv.append(f"--log-dir={script.log_dir}")
    if script.tee is not None:
        argv.append(f"--tee={script.tee}")
    return argv + [*program, *script.args]


class _ChildThreadNote(logging.Filter):
    """Drops torch elastic's warning that it cannot install signal handlers off the main thread: the
    supervisor, in the main thread, stops the ranks on a signal."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "child thread" not in record.getMessage()


class TorchrunScript:
    """Placement elastic's script program, a part of elastic.py's `ElasticBackend`: torchrun's command line and
    rendezvous, its log folder, the ranks' line lock and the collective watch with its verdicts."""

    def __init__(self) -> None:
        self.watch: CollectiveWatch | None = None
        self._store: LoopbackStore | None = None
        self.deadlock: Diagnosis | None = None  # the watch stopped the ranks: they deadlocked
        self.exit_hang: ExitHang | None = None  # the watch stopped the ranks: stuck after their script
        self._stopped = False
        self._cleanup = contextlib.ExitStack()
        self._rendezvous: list[Any] = []  # the loopback rendezvous handlers torch elastic built (one machine)
        # readable once torchrun returned: the supervisor's wait wakes at once instead of at its next poll
        self._done_read, self._done_write = os.pipe()

    # ------------------------------------------------------------------ start
    def prepare(self, plan: LaunchPlan) -> Callable[[], Any]:
        """Open the rendezvous store and the watch; return torchrun's run of the plan (for the agent's thread).
        The ranks' output goes where this process's goes (as under torchrun): no pipes, no handles."""
        from torch.distributed import run as torchrun

        assert plan.script is not None and plan.rendezvous is not None
        if plan.num_nodes == 1:  # keep the rendezvous off the network (loopback_store.py)
            plan = self._open_rendezvous(plan)
        os.environ.update(plan.environ)  # torchrun's agent gives every rank this process's environment
        self._hide_thread_note()
        if plan.script.log_dir is None:  # torchrun would leave a /tmp/torchelastic_* folder: one removed after
            own_logs = make_user_dir(ELASTIC_LOGS_PREFIX)
            self._cleanup.callback(shutil.rmtree, own_logs, ignore_errors=True)
            plan = dataclasses.replace(plan, script=dataclasses.replace(plan.script, log_dir=own_logs))
        self.watch = None if plan.script.no_python else self._start_watch(plan.exit_grace)
        if not plan.script.no_python:
            self._share_line_lock()
        args = torchrun.get_args_parser().parse_args(torchrun_arguments(
            plan, watched=self.watch is not None, registered=RANK_GROUPS_ENV in plan.environ))
        return lambda: torchrun.run(args)

    @staticmethod
    def stop_grace() -> float:
        """Seconds a stopped rank gets to end by itself (a SIGTERM handler saving a checkpoint), torch elastic's."""
        return float(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30"))

    def _open_rendezvous(self, plan: LaunchPlan) -> LaunchPlan:
        """The one-machine rendezvous store, on the plan's port (a free one when none is given or, as in
        Accelerate, when that one is taken); the plan's endpoint names the port it got."""
        from .loopback_store import loopback_rendezvous

        store = _open_loopback_store(plan.port)
        self._rendezvous = self._cleanup.enter_context(loopback_rendezvous(store))
        assert plan.rendezvous is not None
        rendezvous = dataclasses.replace(plan.rendezvous, endpoint=f"127.0.0.1:{store.port}")
        self._store = store  # the agent's rendezvous reaches it through loopback_rendezvous while it runs
        return dataclasses.replace(plan, port=store.port, rendezvous=rendezvous)

    def _hide_thread_note(self) -> None:
        """No note about the agent's thread. torch's own messages are left to torch (its LOGLEVEL), with -q too:
        `accelerate launch -q` does not silence them either (its -q only drops a single process's
        CalledProcessError traceback)."""
        note = _ChildThreadNote()
        api = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
        api.addFilter(note)
        self._cleanup.callback(api.removeFilter, note)

    def _share_line_lock(self) -> None:
        """A file for the ranks' line relays to lock while writing, named to them in LINE_LOCK_ENV, in a private
        folder removed after the launch (or, after a launcher killed with SIGKILL, by the next launch's sweep).
        Where no file can be made each relay writes unlocked, still line by line."""
        try:
            folder = make_user_dir(LINE_LOCK_PREFIX)
        except OSError:
            return
        self._cleanup.callback(remove_dir, folder)
        path = os.path.join(folder, "lock")
        try:
            open(path, "xb").close()
        except OSError:
            return
        os.environ[LINE_LOCK_ENV] = path
        self._cleanup.callback(os.environ.pop, LINE_LOCK_ENV, None)

    def _start_watch(self, exit_grace: float) -> CollectiveWatch | None:
        """The launch's collective watch, its socket named to the ranks; None where no Unix socket can be opened:
        a launch without deadlock detection, prompts or the line relay (all three go through the socket)."""
        from .collective_watch import CollectiveWatch

        try:
            watch = CollectiveWatch(on_deadlock=self._on_deadlock, on_exit_hang=self._on_exit_hang,
                                    exit_grace=exit_grace)
        except OSError as exc:
            warnings.warn("nbaccel launch: no deadlock detection in this launch, and the ranks' input(), "
                          "breakpoint() and printed lines go straight to the terminal as under plain torchrun "
                          f"(prompts not labelled, lines not kept whole): cannot open the watch's socket: {exc}",
                          stacklevel=4)
            return None
        os.environ[COLLECTIVE_WATCH_ENV] = watch.address
        self._cleanup.callback(os.environ.pop, COLLECTIVE_WATCH_ENV, None)
        return watch

    def done(self) -> None:
        """torchrun returned (the agent's thread, at its end): wake the supervisor's wait."""
        with contextlib.suppress(OSError):
            os.write(self._done_write, b"x")

    def wait_objects(self, running: bool) -> list[Any]:
        """What the supervisor waits on while torchrun runs (`running`): the end of its run."""
        return [self._done_read] if running and self._done_read >= 0 else []

    # ------------------------------------------------------------------ the watch's verdicts (its thread)
    def _on_deadlock(self, diagnosis: Diagnosis) -> None:
        if self.exit_hang is None:
            self.deadlock = diagnosis

    def _on_exit_hang(self, hang: ExitHang) -> None:
        if self.deadlock is None:
            self.exit_hang = hang

    def verdict(self) -> Diagnosis | ExitHang | None:
        """Why the ranks must be stopped although none failed: a deadlock, or ranks stuck after their script."""
        return self.deadlock or self.exit_hang

    # ------------------------------------------------------------------ stop and the end
    def before_stop(self) -> None:
        """No restart of the ranks about to be stopped (their rendezvous closes), and no word from the agent
        about ranks it did not stop: the supervisor reports."""
        self._stopped = True
        for name in AGENT_LOGGERS:
            logging.getLogger(name).setLevel(logging.CRITICAL)
        for handler in self._rendezvous:
            with contextlib.suppress(Exception):
                handler.shutdown()

    def exit_failures(self, error: BaseException | None) -> dict[int, WorkerFailure]:
        """The ranks torch elastic saw fail (after its restarts; `error`: what torchrun's run raised), the first
        failure first; none when the supervisor stopped the ranks (a verdict or an interrupt). Another error of
        torchrun is raised as is."""
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

        if self._stopped or error is None:
            return {}
        if not isinstance(error, ChildFailedError):
            raise error
        first, _ = error.get_first_failure()
        failures: dict[int, WorkerFailure] = {}
        for rank in sorted(error.failures, key=lambda r: r != first):
            code = error.failures[rank].exitcode
            failures[rank] = WorkerFailure(rank, None, ended_how(code), "", code, signal_name(code))
        return failures

    def after_failure(self, failed: dict[int, str]) -> Diagnosis | None:
        """The deadlock behind failed ranks, if any (after `close`): `failed` maps each rank to its failure."""
        return None if self.watch is None else self.watch.after_failure(failed)

    def close(self) -> None:
        """Close the watch (after reading what the ranks sent last), the rendezvous and the log folder. What the
        ranks left running is gone by now: torch elastic starts each rank in a session of its own and signals
        the sessions of live ranks only, but each rank registered its session (script_entry.py; exec_entry.py
        under --no_python), which the launch stops as notebook_launcher's groups (rank_groups.py)."""
        if self.watch is not None:
            self.watch.close()
        self._cleanup.close()
        if self._done_read >= 0:
            close_quietly(self._done_read, self._done_write)
            self._done_read = self._done_write = -1
        self._store = None


def _open_loopback_store(port: int | None) -> LoopbackStore:
    from .loopback_store import StorePortBusy, open_loopback_store

    try:
        return open_loopback_store(port or 0)
    except StorePortBusy:
        warnings.warn(f"Port `{port}` is already in use on this machine: nbaccel launch meets on a free port "
                      "instead. Pass another --main_process_port (or 0 for a free one) to choose.", stacklevel=2)
        return open_loopback_store(0)


