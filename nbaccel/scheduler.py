"""AcceleratedScheduler: a learning-rate scheduler stepped in step with the optimizer.

Accelerate's semantics: with `step_with_optimizer=True` a scheduler step is skipped on accumulation steps
(when `adjust_scheduler` is set only its step counter moves) and when the optimizer skipped its step (fp16
overflow). Without `split_batches` each process sees 1/num_processes of the data per step, so the
scheduler advances num_processes times per optimizer step, keeping schedules written for the
single-process number of batches valid.
"""

from __future__ import annotations

from typing import Any

from .state import AcceleratorState, GradientState


class AcceleratedScheduler:
    """The scheduler returned by `Accelerator.prepare`; `.scheduler` is the wrapped one."""

    def __init__(self, scheduler: Any, optimizers: Any, step_with_optimizer: bool = True,
                 split_batches: bool = False) -> None:
        self.scheduler = scheduler
        self.optimizers = optimizers if isinstance(optimizers, (list, tuple)) else [optimizers]
        self.split_batches = split_batches
        self.step_with_optimizer = step_with_optimizer
        self.gradient_state = GradientState()

    def step(self, *args: Any, **kwargs: Any) -> None:
        if not self.step_with_optimizer:
            self.scheduler.step(*args, **kwargs)
            return
        if not self.gradient_state.sync_gradients:
            if self.gradient_state.adjust_scheduler:
                self.scheduler._step_count += 1
            return
        for optimizer in self.optimizers:
            if getattr(optimizer, "step_was_skipped", False):
                return
        if self.split_batches:
            self.scheduler.step(*args, **kwargs)
            return
        total_steps = getattr(self.scheduler, "total_steps", None)
        for _ in range(AcceleratorState().num_processes):
            # Schedulers with a fixed length (OneCycleLR) raise when stepped past their end.
            if total_steps is None or self.scheduler._step_count <= total_steps:
                self.scheduler.step(*args, **kwargs)

    # Everything else is the wrapped scheduler's.
    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()

    def state_dict(self) -> dict:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.scheduler.load_state_dict(state_dict)

    def get_lr(self) -> list[float]:
        return self.scheduler.get_lr()

    def print_lr(self, *args: Any, **kwargs: Any) -> None:
        return self.scheduler.print_lr(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name in ("scheduler", "__setstate__") or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.scheduler, name)
