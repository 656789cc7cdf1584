"""`LocalSGD`: train without synchronizing gradients, averaging the parameters every few steps.

Accelerate scripts use it as `with LocalSGD(accelerator=..., model=..., local_sgd_steps=8) as local_sgd:` and call
`local_sgd.step()` after each optimizer step. Inside the block the model's gradient all-reduce is skipped (DDP's
`no_sync`); every `local_sgd_steps` steps, and once more when the block ends, each parameter is replaced by its
mean over the processes. On one process it does nothing.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import torch

from .utils.dataclasses import DistributedType, whole_number

__all__ = ["LocalSGD"]

# Data parallel on CPUs or one accelerator per process (DDP), as Accelerate lists them
_SUPPORTED = {DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU, DistributedType.MULTI_XPU,
              DistributedType.MULTI_MLU, DistributedType.MULTI_HPU, DistributedType.MULTI_SDAA,
              DistributedType.MULTI_MUSA, DistributedType.MULTI_NPU, DistributedType.MULTI_NEURON}


class LocalSGD:
    """Local SGD for the data-parallel model `model` prepared by `accelerator`.

    `local_sgd_steps`: how many `step()` calls between two parameter averages (an integer >= 1).
    `enabled=False` turns it into a no-op, so the same loop runs with and without it.
    """

    def __init__(self, accelerator: Any, model: torch.nn.Module, local_sgd_steps: int, enabled: bool = True) -> None:
        steps = whole_number(local_sgd_steps)  # numpy's integers too
        # checked only when asked for: Accelerate's own example passes enabled=local_sgd_steps is not None
        if enabled and (steps is None or steps < 1):
            raise ValueError(f"LocalSGD(local_sgd_steps={local_sgd_steps!r}): pass an integer >= 1 "
                             "(or enabled=False to train without it)")
        distributed_type = accelerator.distributed_type
        if enabled and distributed_type not in _SUPPORTED:
            raise NotImplementedError(
                f"LocalSGD supports multi-CPU and multi-GPU (DDP) training, not {distributed_type.value}; "
                "pass enabled=False or train without it."
            )
        self.accelerator = accelerator
        self.model = model
        self.local_sgd_steps = steps if steps is not None else local_sgd_steps
        self.enabled = enabled and distributed_type != DistributedType.NO
        self.num_steps = 0
        self._stack: ExitStack | None = None

    def __enter__(self) -> LocalSGD:
        if self.enabled:
            self._stack = ExitStack()
            self._stack.enter_context(self.accelerator.no_sync(self.model))
        return self

    def __exit__(self, exc_type: Any, exc_value: Any, traceback: Any) -> None:
        if not self.enabled or self._stack is None:
            return
        try:
            if exc_type is None:  # after an error the other processes may not reach the collective: do not wait
                self._average_parameters()
        finally:
            self._stack.close()
            self._stack = None

    def step(self) -> None:
        """Count one optimizer step; average the parameters every `local_sgd_steps` steps."""
        self.num_steps += 1
        if self.enabled and self.num_steps % self.local_sgd_steps == 0:
            self._average_parameters()

    @torch.no_grad()
    def _average_parameters(self) -> None:
        parameters = [p for p in self.model.parameters()]
        if not parameters:
            return
        averaged = self.accelerator.reduce([p.data for p in parameters], reduction="mean")
        for parameter, value in zip(parameters, averaged):
            parameter.data.copy_(value)
