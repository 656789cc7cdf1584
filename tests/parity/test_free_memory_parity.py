"""`Accelerator.free_memory` after `prepare` (Accelerate's test_free_memory_dereferences_prepared_components, made
exact): both libraries drop every reference they hold, so the prepared model, optimizer, scheduler and loaders
are freed once the caller's names are reassigned. Accelerate's own test bounds the *machine's* free memory
(`psutil.virtual_memory().available`), which other processes move by more than its 50 MB tolerance on a shared
machine; here each object's lifetime is observed with a weak reference instead (docs/compat.md)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from parity_harness import assert_same, run_both
from torch.utils.data import DataLoader, TensorDataset

pytest.importorskip("accelerate")
pytestmark = pytest.mark.timeout(300)


def free_memory_scenario(lib):
    accelerator = lib.Accelerator(cpu=True)
    accelerator.free_memory()
    model = torch.nn.Linear(2, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.01, steps_per_epoch=2, epochs=1)
    train = DataLoader(TensorDataset(torch.tensor([1, 2, 3])))
    valid = DataLoader(TensorDataset(torch.tensor([4, 5, 6])))
    prepared = accelerator.prepare(model, optimizer, scheduler, train, valid)
    del model, optimizer, scheduler, train, valid
    refs = [weakref.ref(obj) for obj in prepared]
    held = [len(accelerator._models), len(accelerator._optimizers), len(accelerator._schedulers),
            len(accelerator._dataloaders)]
    prepared = accelerator.free_memory(*prepared)
    gc.collect()
    return {"held_before": held, "returned": list(prepared),
            "held_after": [len(accelerator._models), len(accelerator._optimizers), len(accelerator._schedulers),
                           len(accelerator._dataloaders)],
            "alive": [ref() is not None for ref in refs]}


def test_free_memory_releases_every_prepared_object():
    results = run_both(free_memory_scenario, 1)
    assert_same(results["accelerate"], results["nbaccel"], "free_memory")
    ours = results["nbaccel"][0]
    assert ours["held_before"] == [1, 1, 1, 2] and ours["held_after"] == [0, 0, 0, 0]
    assert ours["returned"] == [None] * 5 and ours["alive"] == [False] * 5
