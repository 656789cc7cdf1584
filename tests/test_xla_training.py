"""What the Accelerator does on XLA replicas (no DDP there), with torch_xla's calls recorded: gradients
averaged once per optimizer step, the recorded graph run at each batch hand-out. The real calls run in
scripts/test-xla; torch_xla is not installed here."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from nbaccel.data_loader import DataLoaderShard
from nbaccel.optimizer import AcceleratedOptimizer
from nbaccel.state import GradientState
from nbaccel.utils import xla


def test_an_xla_optimizer_averages_gradients_once_per_step(monkeypatch):
    averaged = []
    monkeypatch.setattr(xla, "average_gradients", averaged.append)
    model = torch.nn.Linear(2, 1)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer = AcceleratedOptimizer(inner, device=torch.device("xla"))
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    assert averaged == [inner]
    GradientState().is_xla_gradients_synced = True  # clip_grad_norm_ averaged them already
    optimizer.step()
    assert averaged == [inner] and not GradientState().is_xla_gradients_synced  # not twice; reset for the next
    AcceleratedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), device=torch.device("cpu")).step()
    assert averaged == [inner]  # other devices: DDP averaged during backward


def test_an_xla_loader_runs_each_step_when_the_next_batch_is_asked_for(monkeypatch):
    events = []
    monkeypatch.setattr(xla, "run_pending_graph", lambda: events.append("run"))
    loader = DataLoaderShard(TensorDataset(torch.arange(6.0)), device=torch.device("xla"), batch_size=2)
    loader._move = False  # no torch_xla here to move batches with
    for (batch,) in loader:
        events.append(batch.tolist())
    assert events == [[0.0, 1.0], "run", [2.0, 3.0], "run", [4.0, 5.0], "run"]
    cpu_loader = DataLoaderShard(TensorDataset(torch.arange(2.0)), device=torch.device("cpu"), batch_size=2)
    events.clear()
    list(cpu_loader)
    assert events == []
