"""save_state / load_state and the data loaders' positions, on 1 and 2 gloo ranks.

Every uninterrupted run is compared with Accelerate 1.15 (same batches, epoch after epoch). A resumed run must
then see exactly the batches the uninterrupted run sees: at an epoch boundary, after several epochs and
mid-epoch; with plain shuffling, the seedable sampler and skip_first_batches. Accelerate itself saves no
loader position (without torchdata) and no shuffle generator, so its resumed runs are not the reference: a
script written for Accelerate resumes with skip_first_batches (tests/parity/test_training_parity.py)."""

from __future__ import annotations

import os

import pytest
import torch
from parity_harness import assert_same, run_ranks
from torch.utils.data import DataLoader, TensorDataset

pytest.importorskip("accelerate")
pytestmark = pytest.mark.timeout(600)

EPOCHS = 4


def epochs_scenario(lib, seedable, root, resume_from, use_skip):
    """Iterate a shuffled loader for EPOCHS epochs, saving after epoch 0, after epoch 1 and 3 batches into
    epoch 2; or load one of those checkpoints and go on to the end."""
    accelerator = lib.Accelerator(cpu=True, dataloader_config=lib.utils.DataLoaderConfiguration(
        use_seedable_sampler=seedable))
    lib.utils.set_seed(5)
    loader = accelerator.prepare(DataLoader(TensorDataset(torch.arange(22)), batch_size=3, shuffle=True))
    seen, start, skip = [], 0, 0
    if resume_from is not None:
        accelerator.load_state(os.path.join(root, resume_from))
        start, skip = {"epoch_0": (1, 0), "epoch_1": (2, 0), "mid_2": (2, 3)}[resume_from]
    for epoch in range(start, EPOCHS):
        if seedable:
            loader.set_epoch(epoch)
        active = loader
        if use_skip and skip and epoch == start:
            active = accelerator.skip_first_batches(loader, skip)
        batches = []
        for index, (batch,) in enumerate(active, start=skip if epoch == start else 0):
            batches.append(batch.tolist())
            torch.rand(1)  # training draws from torch's RNG too
            if resume_from is None and epoch == 2 and index == 2:
                accelerator.save_state(os.path.join(root, "mid_2"))
        seen.append((epoch, batches))
        if resume_from is None and epoch in (0, 1):
            accelerator.save_state(os.path.join(root, f"epoch_{epoch}"))
    return {"seen": seen, "rng": torch.rand(3)}


@pytest.mark.parametrize("num_processes", [1, 2])
@pytest.mark.parametrize("seedable", [False, True])
def test_resumed_runs_see_the_uninterrupted_batches(num_processes, seedable, tmp_path):
    full = run_ranks(epochs_scenario, "nbaccel", num_processes, args=(seedable, str(tmp_path), None, False))
    reference = run_ranks(epochs_scenario, "accelerate", num_processes,
                          args=(seedable, str(tmp_path / "accelerate"), None, False))
    assert_same(reference, full, "uninterrupted run")
    for resume_from, use_skip in (("epoch_0", False), ("epoch_1", False), ("mid_2", False), ("mid_2", True)):
        resumed = run_ranks(epochs_scenario, "nbaccel", num_processes,
                            args=(seedable, str(tmp_path), resume_from, use_skip))
        for rank in range(num_processes):
            first = resumed[rank]["seen"][0][0]
            expected = [entry for entry in full[rank]["seen"] if entry[0] >= first]
            if resume_from == "mid_2":
                expected[0] = (expected[0][0], expected[0][1][3:])
            assert resumed[rank]["seen"] == expected, (resume_from, use_skip, rank)
            assert torch.equal(resumed[rank]["rng"], full[rank]["rng"]), (resume_from, use_skip, rank)
