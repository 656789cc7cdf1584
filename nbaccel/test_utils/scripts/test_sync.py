"""Check gradient synchronization on every process of this launch: inside `accelerator.no_sync(model)` (and
while `accumulate` collects) each rank keeps its own gradients; on a synchronizing step they are averaged.

`nbaccel launch --num_processes 2 --cpu test_sync.py`; exits non-zero on a failure.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__" and __package__ in (None, ""):  # run as a file: make this checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))


def _grads(model) -> torch.Tensor:  # noqa: F821
    import torch

    return torch.stack([p.grad.detach().clone() for p in model.parameters()])


def main() -> int:
    """Run the synchronization checks; 0 when they pass."""
    import torch

    from nbaccel import Accelerator
    from nbaccel.test_utils.testing import are_the_same_tensors
    from nbaccel.test_utils.training import RegressionModel

    accelerator = Accelerator(gradient_accumulation_steps=2)
    model = accelerator.prepare(RegressionModel(a=1, b=1))
    rank_input = torch.full((4,), float(accelerator.process_index + 1), device=accelerator.device)
    failures = []
    with accelerator.no_sync(model):
        accelerator.backward(model(rank_input).sum())
    if accelerator.num_processes > 1 and are_the_same_tensors(_grads(model)):
        failures.append("gradients were synchronized inside no_sync")
    model.zero_grad()
    accelerator.backward(model(rank_input).sum())
    if not are_the_same_tensors(_grads(model)):
        failures.append("gradients differ across processes after a synchronizing backward")
    model.zero_grad()
    steps = []
    for _ in range(2):
        with accelerator.accumulate(model):
            accelerator.backward(model(rank_input).sum())
            steps.append(accelerator.sync_gradients)
    if steps != [False, True]:
        failures.append(f"accumulate over 2 steps synchronized as {steps}, expected [False, True]")
    for failure in failures:
        accelerator.print(f"FAIL {failure}")
    accelerator.print("gradient synchronization: " + ("ok" if not failures else f"{len(failures)} failure(s)"))
    accelerator.wait_for_everyone()  # (no end_training: test_script runs more checks on this process group)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
