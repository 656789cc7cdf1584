"""Placement elastic: multi-node launches and restarts through torch.distributed.elastic's agent, for a function
(notebook_launcher) and a script (`nbaccel launch`, torchrun's agent: the part in torchrun.py).

`num_nodes > 1` (any rendezvous backend, "c10d" recommended) or `max_restarts > 0` go here. The agent runs
in a helper thread (so it does not replace the kernel's SIGINT handler) and starts the workers with
`worker.elastic_entry`, which reports over the same channel and pipes as a local launch.

On one node (`AttemptStores`) the agent meets itself in torch's static rendezvous, and every store listens on
loopback only (loopback_store.py): nothing of a restartable launch is open to the network, whatever
`rdzv_backend` says (with one agent the backends behave alike). Every attempt's workers meet in a store of
their own: torch elastic would hand each attempt the same store, where the previous attempt's keys (the dead
ranks' gloo addresses) make a restarted process group fail with "Gloo connectFullMesh failed ... Connection
refused" instead of running. `nbaccel launch` on one machine has torchrun's agent meet the same way
(`loopback_rendezvous`).
Under fork the payload (nbaccel.launch.serialize.Payload) is inherited by every attempt's workers.
"""

from __future__ import annotations

import collections
import logging
import shutil
import signal
from typing import TYPE_CHECKING, Any

from ..errors import LaunchError, WorkerFailure, ended_how
from ..private_dirs import ELASTIC_LOGS_PREFIX, make_user_dir
from ..worker.entry import elastic_entry
from .loopback_store import LOOPBACK, AttemptStores, open_loopback_store
from .plan import Program
from .process_trees import signal_name
from .threaded import ThreadedBackend, _children

if TYPE_CHECKING:
    from ..hang_report import Diagnosis
    from ..serialize import Payload
    from .collective_watch import ExitHang
    from .placement_base import StartedRank
    from .plan import LaunchPlan
    from .torchrun import TorchrunScript


class ElasticBackend(ThreadedBackend):
    """Placement elastic, one class for both programs. A function: a LocalElasticAgent for this node forks the
    ranks from this process; failures come back after its restarts are used up. A script (`nbaccel launch`):
    torchrun's agent runs it, through the `TorchrunScript` part (torchrun.py: its command line, rendezvous, log
    folder and collective watch) this class composes for that program. Either agent runs in the helper thread."""

    programs = frozenset({Program.FUNCTION, Program.SCRIPT})
    inherits_objects = True  # a function: its agent forks from this process
    preloads_modules = True

    @classmethod
    def for_plan(cls, plan: LaunchPlan) -> ElasticBackend:
        return cls(plan.program)

    def __init__(self, program: Program = Program.FUNCTION) -> None:
        self.thread_name = "nbaccel-torchrun-agent" if program is Program.SCRIPT else "nbaccel-elastic-agent"
        super().__init__()
        self.script: TorchrunScript | None = None  # the script program's part (None: a function)
        self._ended_attempts: collections.deque[dict[int, WorkerFailure]] = collections.deque()
        if program is Program.SCRIPT:
            from .torchrun import TorchrunScript

            self.script = TorchrunScript()
            # torchrun's agent starts the ranks itself (its own start method), and there is no payload to inherit
            self.inherits_objects = self.preloads_modules = False

    def start(self, plan: LaunchPlan, payload: Payload | None) -> list[StartedRank]:
        """A function: the local ranks' pipes, then the agent (ThreadedBackend). A script: torchrun's run; its
        ranks' output goes where this process's goes (no pipes, no handles)."""
        if self.script is None:
            assert payload is not None
            return super().start(plan, payload)
        try:
            self._target = self.script.prepare(plan)
            self.stop_grace = self.script.stop_grace()
            self._before = set(_children())
            self._thread.start()
        except BaseException:
            self.close()
            raise
        return []

    def _run(self) -> None:
        try:
            super()._run()
        finally:
            if self.script is not None:
                self.script.done()

    def wait_objects(self) -> list[Any]:
        return [] if self.script is None else self.script.wait_objects(self._thread.is_alive())

    def verdict(self) -> Diagnosis | ExitHang | None:
        return None if self.script is None else self.script.verdict()

    def target(self, plan: LaunchPlan, entry_args: tuple) -> Any:
        from torch.distributed.elastic.agent.server.api import WorkerSpec
        from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
        from torch.distributed.elastic.rendezvous import RendezvousParameters, registry
        from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

        rdzv = plan.rendezvous
        assert rdzv is not None
        conf = dict(rdzv.conf)
        conf.setdefault("timeout", 900)
        master_addr = master_port = None
        if plan.num_nodes == 1:  # one agent: a static rendezvous, every store on loopback (loopback_store.py)
            _, port = parse_rendezvous_endpoint(rdzv.endpoint, default_port=0)
            self._handler = AttemptStores(open_loopback_store(port), rdzv.run_id, int(conf["timeout"]))
            master_addr = LOOPBACK  # and each attempt's own store: no master_port, which would override it
        else:
            if rdzv.backend == "static":
                master_addr, master_port = parse_rendezvous_endpoint(rdzv.endpoint, default_port=-1)
            self._handler = registry.get_rendezvous_handler(RendezvousParameters(
                backend=rdzv.backend, endpoint=rdzv.endpoint, run_id=rdzv.run_id, min_nodes=plan.num_nodes,
                max_nodes=plan.num_nodes, local_addr=None, **conf))
        spec = WorkerSpec(role="default", local_world_size=plan.num_processes, entrypoint=elastic_entry,
                          args=(*entry_args[:4], plan.agent_environ()), rdzv_handler=self._handler,
                          max_restarts=rdzv.max_restarts, monitor_interval=rdzv.monitor_interval,
                          master_addr=master_addr, master_port=master_port, local_addr=None)
        # torch elastic's log folder (error files, attempt folders): one of this launch's own, removed by
        # close(); DefaultLogsSpecs() would leave a /tmp/torchelastic_* folder behind every launch
        self._log_dir = make_user_dir(ELASTIC_LOGS_PREFIX)
        self.agent = LocalElasticAgent(spec=spec, logs_specs=DefaultLogsSpecs(log_dir=self._log_dir),
                                       start_method=plan.start_method,
                                       log_line_prefix_template=rdzv.log_line_prefix_template)
        self._watch_attempts(self.agent)
        self.nproc_per_node = plan.num_processes
        return self._run_agent

    def _watch_attempts(self, agent: Any) -> None:
        """Keep how the processes of each failed attempt ended (the agent's own monitoring result, which it
        acts on and then forgets when it restarts the workers): `restarted_failures` hands them over."""
        monitor = agent._monitor_workers

        def monitored(group: Any) -> Any:
            result = monitor(group)
            if result.is_failed():  # appended before the agent restarts the workers that will report it
                self._ended_attempts.append({**_exited(agent, group), **_process_failures(result)})
            return result

        agent._monitor_workers = monitored

    def _run_agent(self) -> Any:
        # The agent logs each worker failure and warns about running off the main thread (on purpose):
        # the supervisor reports failures itself, with the remote traceback.
        loggers = [logging.getLogger(name) for name in ("torch.distributed.elastic", "torch.multiprocessing")]
        levels = [logger.level for logger in loggers]
        for logger in loggers:
            logger.setLevel(logging.CRITICAL)
        try:
            return self.agent.run()
        finally:
            for logger, level in zip(loggers, levels):
                logger.setLevel(level)
            try:
                self._handler.shutdown()
            except Exception:
                pass

    def before_stop(self) -> None:
        if self.script is not None:
            self.script.before_stop()
            return
        self.agent._remaining_restarts = 0  # no restart of the workers we are about to stop
        try:  # and no more waiting for nodes that are not coming
            self._handler.shutdown()
        except Exception:
            pass

    def after_kill(self) -> None:
        """Wake torch elastic's agent thread out of its "workers finished" event's `set()`: a returned worker
        waits on that event (a multiprocessing Condition) until the agent sets it, and the Condition's notify
        waits for each sleeper it woke to say so. A worker killed while it slept never says so, and the agent's
        thread waited for ever (an interrupt right as the ranks returned then took the stop's whole join
        timeout). The workers are dead now: say it for them, once for each wake-up no one took."""
        event = getattr(getattr(getattr(self, "agent", None), "_pcontext", None), "_worker_finished_event", None)
        condition = getattr(event, "_cond", None)
        if condition is None:
            return
        while condition._wait_semaphore.acquire(False):
            condition._woken_count.release()

    def close(self) -> None:
        """Close what torch elastic keeps of the last workers (process objects, result queues): their pipes
        would stay open until a garbage collection otherwise. Remove the launch's log folder. A script: its
        part's watch, rendezvous and folders (torchrun.py `TorchrunScript.close`)."""
        if self.script is not None:
            self.script.close()
            return
        log_dir = getattr(self, "_log_dir", None)
        if log_dir is not None:
            shutil.rmtree(log_dir, ignore_errors=True)
            self._log_dir = None
        pcontext = getattr(getattr(self, "agent", None), "_pcontext", None)
        inner = getattr(pcontext, "_pc", None)
        queues = [*getattr(pcontext, "_ret_vals", {}).values(), *getattr(inner, "error_queues", ())]
        for proc in getattr(inner, "processes", ()):
            try:
                if proc.exitcode is None:
                    proc.join(1.0)
                proc.close()
            except (ValueError, AttributeError):
                pass
        for queue in queues:
            close = getattr(queue, "close", None)
            try:
                if callable(close):
                    close()
            except Exception:
                pass
        # Dropped, not collected: the agent and its rendezvous handler sit in reference cycles, but hold no
        # descriptor any more once the above is closed (tests/test_launch_reliability.py counts them with the
        # collector off). A full collection here cost 0.26-0.37 s with torch loaded, seconds on a busy
        # machine, on the way of every elastic launch's end and of every interrupt. `_watch_attempts`'s wrapper
        # goes first: through it the agent referred to itself, and kept its workers' pipes until a collection.
        agent = getattr(self, "agent", None)  # none yet: closed before the launch made it
        if agent is not None:
            vars(agent).pop("_monitor_workers", None)
        self.agent = self._handler = None

    def exit_failures(self) -> dict[int, WorkerFailure]:
        if self.script is not None:
            return self.script.exit_failures(self.error)
        if self.error is not None:
            raise LaunchError(f"torch elastic could not run the workers: {type(self.error).__name__}: "
                              f"{self.error}") from self.error
        result = self.value
        return _process_failures(result) if result is not None and result.is_failed() else {}

    def prompt_moot(self) -> str | None:
        # the agent's thread appends an attempt that failed before it restarts (or gives up on) the ranks; the
        # supervisor's loop, blocked at the prompt meanwhile, has not taken it yet
        if self._ended_attempts:
            failed = ", ".join(f.summary() for attempt in list(self._ended_attempts) for f in attempt.values())
            return f"{failed or 'a rank failed'}; torch elastic's agent restarts or stops the ranks"
        return None

    def restarted_failures(self) -> dict[int, WorkerFailure]:
        failures: dict[int, WorkerFailure] = {}
        while self._ended_attempts:  # the agent's thread appends, the supervisor's takes: a deque is safe for both
            failures.update(self._ended_attempts.popleft())
        return failures


def _process_failures(result: Any) -> dict[int, WorkerFailure]:
    """How each failed process of torch elastic's RunResult ended, by global rank."""
    return {rank: _ended(rank, failure.exitcode) for rank, failure in result.failures.items()}


def _exited(agent: Any, group: Any) -> dict[int, WorkerFailure]:
    """How every process of the agent's worker group that failed on its own ended, by global rank. The agent's
    RunResult names one failed process only (the first by local rank among those found dead), so a rank killed
    by a signal was left out when its peer's collective failed because of it. SIGTERM is left out: by the time
    the result is back the agent has stopped the other workers with it."""
    processes = getattr(getattr(getattr(agent, "_pcontext", None), "_pc", None), "processes", ())
    return {worker.global_rank: _ended(worker.global_rank, process.exitcode)
            for worker, process in zip(group.workers, processes)
            if process.exitcode and process.exitcode != -signal.SIGTERM}


def _ended(rank: int, code: int) -> WorkerFailure:
    return WorkerFailure(rank, None, ended_how(code), "", code, signal_name(code))
