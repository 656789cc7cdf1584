"""Multi-node launches and restarts through torch.distributed.elastic's agent.

`num_nodes > 1` (any rendezvous backend, "c10d" recommended) or `max_restarts > 0` go here. The agent runs
in a helper thread (so it does not replace the kernel's SIGINT handler) and starts the workers with
`worker.elastic_entry`, which reports over the same channel and pipes as a local launch.
"""

from __future__ import annotations

import logging
from typing import Any

from ..errors import LaunchError, WorkerFailure
from .processes import signal_name
from .threaded import ThreadedBackend


class ElasticBackend(ThreadedBackend):
    """Runs a LocalElasticAgent for this node; failures come back after its restarts are used up."""

    def __init__(self, *, entry: Any, entry_args: tuple, worker_ends: list[Any], nproc_per_node: int,
                 num_nodes: int, rdzv_backend: str, rdzv_endpoint: str, rdzv_conf: dict[str, Any],
                 rdzv_id: str, max_restarts: int, monitor_interval: float, start_method: str,
                 log_line_prefix_template: str | None = None, local_addr: str | None = None) -> None:
        from torch.distributed.elastic.agent.server.api import WorkerSpec
        from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
        from torch.distributed.elastic.rendezvous import RendezvousParameters, registry
        from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

        conf = dict(rdzv_conf)
        conf.setdefault("timeout", 900)
        params = RendezvousParameters(backend=rdzv_backend, endpoint=rdzv_endpoint, run_id=rdzv_id,
                                      min_nodes=num_nodes, max_nodes=num_nodes, local_addr=local_addr, **conf)
        master_addr = master_port = None
        if rdzv_backend == "static":
            master_addr, master_port = parse_rendezvous_endpoint(rdzv_endpoint, default_port=-1)
        self._handler = registry.get_rendezvous_handler(params)
        spec = WorkerSpec(role="default", local_world_size=nproc_per_node, entrypoint=entry,
                          args=tuple(entry_args), rdzv_handler=self._handler, max_restarts=max_restarts,
                          monitor_interval=monitor_interval, master_addr=master_addr, master_port=master_port,
                          local_addr=local_addr)
        self.agent = LocalElasticAgent(spec=spec, logs_specs=DefaultLogsSpecs(), start_method=start_method,
                                       log_line_prefix_template=log_line_prefix_template)
        self.nproc_per_node = nproc_per_node
        super().__init__(self._run_agent, worker_ends, name="nbaccel-elastic-agent")

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
        self.agent._remaining_restarts = 0  # no restart of the workers we are about to stop
        try:  # and no more waiting for nodes that are not coming
            self._handler.shutdown()
        except Exception:
            pass

    def exit_failures(self) -> dict[int, WorkerFailure]:
        if self.error is not None:
            raise LaunchError(f"torch elastic could not run the workers: {type(self.error).__name__}: "
                              f"{self.error}") from self.error
        result = self.value
        failures: dict[int, WorkerFailure] = {}
        if result is not None and result.is_failed():
            for rank, failure in result.failures.items():
                code = failure.exitcode
                sig = signal_name(code)
                failures[rank] = WorkerFailure(rank, None, f"killed by {sig}" if sig else f"exited with code {code}",
                                               "", code, sig)
        return failures
