"""A training script written for Accelerate, run on Accelerate 1.15 and on nbaccel, 1 and 2 gloo ranks:
shuffled loader with the seedable sampler, gradient accumulation, gather_for_metrics on an uneven eval set,
save_state at an epoch boundary and mid-epoch, load_state, skip_first_batches. The losses and final weights
must be bit-identical between the libraries, and a resumed run must equal the uninterrupted one."""

from __future__ import annotations

import os

import pytest
import torch
from parity_harness import assert_same
from torch.utils.data import DataLoader, TensorDataset

pytest.importorskip("accelerate")
pytestmark = pytest.mark.timeout(900)

EPOCHS = 3
MID_EPOCH_STEP = 4  # batches into epoch 1 when the mid-epoch checkpoint is taken (a synchronizing step)


def train(lib, mode, checkpoint_root, num_epochs=EPOCHS):
    """mode: "full" (saves both checkpoints), "resume_epoch" (from the end of epoch 0), "resume_mid"."""
    accelerator = lib.Accelerator(cpu=True, gradient_accumulation_steps=2,
                                  dataloader_config=lib.utils.DataLoaderConfiguration(use_seedable_sampler=True))
    lib.utils.set_seed(3)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 4, generator=g)
    y = x.sum(dim=1, keepdim=True) / 4
    train_loader = DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True)
    eval_loader = DataLoader(TensorDataset(x[:21], y[:21]), batch_size=5)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)

    start_epoch, resume_step = 0, None
    if mode == "resume_epoch":
        accelerator.load_state(os.path.join(checkpoint_root, "epoch_0"))
        start_epoch = 1
    elif mode == "resume_mid":
        accelerator.load_state(os.path.join(checkpoint_root, "mid"))
        start_epoch, resume_step = 1, MID_EPOCH_STEP
    losses, evals = [], []
    for epoch in range(start_epoch, num_epochs):
        model.train()
        train_loader.set_epoch(epoch)
        active = train_loader
        if resume_step is not None and epoch == start_epoch:
            active = accelerator.skip_first_batches(train_loader, resume_step)
            active.set_epoch(epoch)
        for step, (inputs, targets) in enumerate(active, start=resume_step if active is not train_loader else 0):
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(inputs), targets)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            losses.append((epoch, step, loss.item()))
            if mode == "full" and epoch == 1 and step + 1 == MID_EPOCH_STEP:
                accelerator.save_state(os.path.join(checkpoint_root, "mid"))
        if mode == "full" and epoch == 0:
            accelerator.save_state(os.path.join(checkpoint_root, "epoch_0"))
        model.eval()
        seen, total = 0, 0.0
        for inputs, _targets in eval_loader:
            with torch.no_grad():
                predictions = model(inputs)
            gathered = accelerator.gather_for_metrics(predictions)
            seen += gathered.shape[0]
            total += gathered.sum().item()
        evals.append((epoch, seen, total))
    weights = {k: v.detach().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    accelerator.wait_for_everyone()
    return {"losses": losses, "evals": evals, "weights": weights}


@pytest.mark.parametrize("num_processes", [1, 2])
def test_training_resuming_and_evaluating_like_accelerate(num_processes, tmp_path):
    runs = {}
    for mode in ("full", "resume_epoch", "resume_mid"):
        results = {}
        for lib in ("accelerate", "nbaccel"):
            from parity_harness import run_ranks

            results[lib] = run_ranks(train, lib, num_processes, args=(mode, str(tmp_path / lib)))
        runs[mode] = results
        assert_same(results["accelerate"], results["nbaccel"], f"{mode} on {num_processes} process(es)")
    for lib in ("accelerate", "nbaccel"):
        full = runs["full"][lib]
        for mode, first_step in (("resume_epoch", (1, 0)), ("resume_mid", (1, MID_EPOCH_STEP))):
            resumed = runs[mode][lib]
            for rank in range(num_processes):
                tail = [entry for entry in full[rank]["losses"] if entry[:2] >= first_step]
                assert resumed[rank]["losses"] == tail, (lib, mode, rank)
                assert_same(full[rank]["weights"], resumed[rank]["weights"], f"{lib} {mode} rank {rank} weights")
                assert resumed[rank]["evals"] == full[rank]["evals"][1:], (lib, mode, rank)
    assert all(seen == 21 for _, seen, _ in runs["full"]["nbaccel"][0]["evals"])  # each eval sample once


def seedable_training(lib, batch_size, split_batches, data_seed):
    """3 epochs with the seedable sampler; the final weights and the first epoch's sample order."""
    accelerator = lib.Accelerator(cpu=True, dataloader_config=lib.utils.DataLoaderConfiguration(
        use_seedable_sampler=True, split_batches=split_batches, data_seed=data_seed))
    lib.utils.set_seed(1)
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(2))
    y = x.sum(dim=1, keepdim=True)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(TensorDataset(torch.arange(64), x, y), batch_size=batch_size, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    first_epoch = []
    for epoch in range(3):
        for index, inputs, targets in loader:
            if epoch == 0:
                first_epoch.append(accelerator.gather(index).tolist())
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    return {"weights": {k: v.detach().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()},
            "order": first_epoch}


@pytest.mark.parametrize("split_batches", [False, True])
def test_seedable_sampler_two_ranks_train_like_one_process(split_batches):
    """As in Accelerate: 2 ranks x batch 8 (or batch 16 split) give the model of 1 process x batch 16, to 1e-6."""
    from parity_harness import run_ranks

    per_rank = 16 if split_batches else 8
    for lib in ("accelerate", "nbaccel"):
        single = run_ranks(seedable_training, lib, 1, args=(16, False, None))[0]
        double = run_ranks(seedable_training, lib, 2, args=(per_rank, split_batches, None))
        assert double[0]["order"] == double[1]["order"]
        assert [sorted(b) for b in double[0]["order"]] == [sorted(b) for b in single["order"]], lib
        for name, value in single["weights"].items():
            assert torch.allclose(value, double[0]["weights"][name], atol=1e-6), (lib, name)
    other_seed = run_ranks(seedable_training, "nbaccel", 1, args=(16, False, 123))[0]
    assert other_seed["order"] != single["order"]  # data_seed changes the order
