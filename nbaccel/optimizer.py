"""AcceleratedOptimizer: a torch optimizer that steps only when gradients are synchronized.

Wraps the user's optimizer (which stays reachable as `.optimizer`). On a gradient-accumulation step
(`GradientState().sync_gradients` is False) `step` and `zero_grad` do nothing, so the usual loop
`backward(); optimizer.step(); optimizer.zero_grad()` accumulates without code changes. With fp16 the
GradScaler unscales, steps (skipping the step when gradients overflowed) and updates its scale;
`step_was_skipped` tells whether the last step was skipped. On XLA replicas (no DDP there) `step` first
averages the gradients across replicas.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from . import telemetry
from .state import AcceleratorState, GradientState
from .utils import xla as _xla
from .utils.operations import send_to_device


class AcceleratedOptimizer(torch.optim.Optimizer):
    """The optimizer returned by `Accelerator.prepare`; behaves like the wrapped one."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        device_placement: bool = True,
        scaler: torch.amp.GradScaler | None = None,
        device: torch.device | None = None,
    ) -> None:
        # No super().__init__: parameters, defaults and state belong to the wrapped optimizer.
        self.optimizer = optimizer
        self.scaler = scaler
        self.gradient_state = GradientState()
        self.device_placement = device_placement
        self._is_overflow = False
        self._steps_done = 0
        self._on_xla = _xla.is_xla_device(device)  # replicas average their gradients at each step (no DDP)
        # their step() is a no-op, as in Accelerate (theirs would raise NotImplementedError)
        self._updates_in_backward = is_lomo(optimizer)
        if device_placement and device is not None and optimizer.state:
            optimizer.load_state_dict(send_to_device(optimizer.state_dict(), device))

    @property
    def accelerator_state(self) -> AcceleratorState:
        """The processes' shared state (Accelerate's optimizer keeps it as an attribute)."""
        return AcceleratorState()

    # -- what the wrapped optimizer holds -------------------------------------------------------------
    @property
    def state(self):
        return self.optimizer.state

    @state.setter
    def state(self, state) -> None:
        self.optimizer.state = state

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, param_groups) -> None:
        self.optimizer.param_groups = param_groups

    @property
    def defaults(self):
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, defaults) -> None:
        self.optimizer.defaults = defaults

    def add_param_group(self, param_group: dict) -> None:
        self.optimizer.add_param_group(param_group)

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.optimizer.load_state_dict(state_dict)

    def train(self) -> None:
        """For optimizers with train/eval modes (schedule-free); a no-op for the others."""
        if hasattr(self.optimizer, "train"):
            self.optimizer.train()

    def eval(self) -> None:
        if hasattr(self.optimizer, "eval"):
            self.optimizer.eval()

    # -- the hot path ---------------------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Clear the gradients on synchronizing steps (set them to None unless `set_to_none=False`).

        An optimizer whose own `zero_grad()` takes no `set_to_none` is called without it, as in Accelerate;
        asking it for a `set_to_none` it cannot honour is a ValueError."""
        if not self.gradient_state.sync_gradients:
            return
        if _takes_set_to_none(self.optimizer.zero_grad):
            self.optimizer.zero_grad(set_to_none=True if set_to_none is None else set_to_none)
        elif set_to_none is not None:
            raise ValueError(f"set_to_none={set_to_none!r} was given, but {type(self.optimizer).__name__}.zero_grad() "
                             "takes no set_to_none: call zero_grad() without it.")
        else:
            self.optimizer.zero_grad()

    def step(self, closure: Any = None) -> Any:
        if not self.gradient_state.sync_gradients or self._updates_in_backward:
            return None
        result = None
        if self._on_xla:
            if self.gradient_state.is_xla_gradients_synced:  # clip_grad_norm_ averaged them this step
                self.gradient_state.is_xla_gradients_synced = False
            else:
                _xla.average_gradients(self.optimizer)
        if self.scaler is not None:
            scale_before = self.scaler.get_scale()
            result = self.scaler.step(self.optimizer, closure) if closure else self.scaler.step(self.optimizer)
            self.scaler.update()
            # GradScaler lowers its scale only when it found inf/NaN gradients and skipped the step.
            self._is_overflow = self.scaler.get_scale() < scale_before
        else:
            result = self.optimizer.step(closure) if closure is not None else self.optimizer.step()
        if not self._is_overflow:
            self._steps_done += 1
            if telemetry.is_attached():  # a launch's dashboard: the step, and where the training loader is
                loader = self.gradient_state.active_dataloader
                position = loader.epoch_position() if hasattr(loader, "epoch_position") else None
                telemetry.report_step(self._steps_done, position=position)
        return result

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last `step` was skipped because fp16 gradients overflowed."""
        return self._is_overflow

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state.pop("gradient_state", None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.gradient_state = GradientState()

    def __repr__(self) -> str:
        return f"AcceleratedOptimizer({self.optimizer!r})"


def is_lomo(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` is lomo_optim's Lomo or AdaLomo (or a subclass), which update the parameters inside
    backward (`accelerator.backward(loss, learning_rate=...)`). Read from the class names: importing lomo_optim
    imports transformers."""
    return any(cls.__module__.partition(".")[0] == "lomo_optim" and cls.__name__ in ("Lomo", "AdaLomo")
               for cls in type(optimizer).__mro__)


def _takes_set_to_none(zero_grad: Any) -> bool:
    try:
        return "set_to_none" in inspect.signature(zero_grad).parameters
    except (TypeError, ValueError):  # no signature to read (a builtin): torch's own optimizers take it
        return True
