"""The script `nbaccel test` runs (Accelerate's `test_script.py`): the process state, every distributed
operation, gradient synchronization, and a short training run whose weights must agree on every process.

`nbaccel launch --num_processes 2 --cpu test_script.py`; exits non-zero on a failure.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__" and __package__ in (None, ""):  # run as a file: make this checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))


def training_check() -> list[str]:
    """Train RegressionModel on RegressionDataset for 20 epochs; the weights must agree on every process and
    approach the data's a=2, b=3."""
    import torch
    from torch.utils.data import DataLoader

    from nbaccel import Accelerator
    from nbaccel.test_utils.testing import are_the_same_tensors
    from nbaccel.test_utils.training import RegressionDataset, RegressionModel
    from nbaccel.utils import set_seed

    set_seed(42)
    accelerator = Accelerator()
    model = RegressionModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(RegressionDataset(length=96, seed=42), batch_size=16, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for _ in range(20):
        for batch in loader:
            loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    weights = torch.stack([p.detach() for p in accelerator.unwrap_model(model).parameters()])
    failures = []
    if not are_the_same_tensors(weights):
        failures.append("training gave different weights on different processes")
    if not torch.allclose(weights.cpu(), torch.tensor([2.0, 3.0]), atol=0.5):
        failures.append(f"training did not fit the data: a, b = {weights.tolist()}, expected about 2, 3")
    return failures


def main() -> int:
    """Run every check; 0 when all pass."""
    from nbaccel.state import PartialState
    from nbaccel.test_utils.scripts import test_ops, test_sync

    state = PartialState()
    state.print(f"**Initialization**\n{state}")
    code = test_ops.main()
    code |= test_sync.main()
    failures = training_check()
    for failure in failures:
        state.print(f"FAIL {failure}")
    state.print("**Training**: " + ("ok, the same weights on every process" if not failures else "failed"))
    state.wait_for_everyone()
    state.destroy_process_group()  # last, as end_training() would: the checks are done
    return 1 if code or failures else 0


if __name__ == "__main__":
    sys.exit(main())
