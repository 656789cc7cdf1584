"""`use_stateful_dataloader=True` through a whole training run, as Accelerate's `by_feature/checkpointing.py
--use_stateful_dataloader --checkpointing_steps N` does it, on plain lists (no transformers): a shuffled
training loader and an evaluation loader prepared together, dropout drawing from torch's RNG, `save_state`
every few steps (mid-epoch, at an epoch's last batch, after an evaluation pass), then a run resumed from each
checkpoint. Everything (batches, the random draws, evaluation batches, final weights) must be what Accelerate
gives, bit for bit.

The causes these runs pin (issue 33): Accelerate's stateful loader takes torchdata's first state when it is
built, so the iterator of its first pass (and that pass's draw from torch's RNG) is made at `prepare`; a
`save_state` then reads states without drawing; and a loader saved after its pass ended is restored as
finished, so its next pass is a whole one (nbaccel restored it at its last batch: 0 batches).
"""

from __future__ import annotations

import os

import pytest
import torch
from parity_harness import assert_ranks_same, assert_same, run_both, run_ranks
from torch.utils.data import DataLoader

pytest.importorskip("accelerate")
pytest.importorskip("torchdata")
pytestmark = pytest.mark.timeout(600)

EPOCHS = 3
TRAIN = [[i / 12, (i % 3) / 3] for i in range(12)]  # 6 batches of 2 per epoch
EVALUATION = [[i / 5, 1.0] for i in range(5)]  # 2 batches of 3


def checkpointing_run(lib, root, every, resume_from, stateful=True):
    """The example's loop: train, evaluate after each epoch, `save_state` every `every` steps (0: never; "epoch":
    after each epoch's evaluation); or `load_state(resume_from)` first and go on from the step or epoch it names
    (without the stateful loader, the example's `skip_first_batches(train, resume_step)`)."""
    config = lib.utils.DataLoaderConfiguration(use_stateful_dataloader=stateful)
    accelerator = lib.Accelerator(cpu=True, dataloader_config=config)
    lib.utils.set_seed(42)
    train = DataLoader(TRAIN, shuffle=True, batch_size=2, collate_fn=torch.tensor)
    evaluation = DataLoader(EVALUATION, shuffle=False, batch_size=3, collate_fn=torch.tensor)
    model = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.Dropout(0.5), torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer, train, evaluation = accelerator.prepare(model, optimizer, train, evaluation)
    overall, start, resume_step = 0, 0, None
    if resume_from is not None:
        accelerator.load_state(os.path.join(root, resume_from))
        if resume_from.startswith("epoch_"):
            start = int(resume_from.replace("epoch_", "")) + 1
            overall = start * len(train)
        else:
            overall = int(resume_from.replace("step_", ""))
            start = overall // len(train)
            resume_step = overall - start * len(train)
    steps, evaluations = [], []
    for epoch in range(start, EPOCHS):
        model.train()
        active = train
        if resume_step is not None and epoch == start and not stateful:
            active = accelerator.skip_first_batches(train, resume_step)
        for batch in active:
            loss = model(batch).pow(2).mean()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            overall += 1
            steps.append((epoch, batch[:, 0].tolist(), loss.item()))
            if isinstance(every, int) and every and overall % every == 0:
                accelerator.save_state(os.path.join(root, f"step_{overall}"))
        model.eval()
        with torch.no_grad():
            evaluations.append((epoch, [model(batch).squeeze(1).tolist() for batch in evaluation]))
        if every == "epoch":
            accelerator.save_state(os.path.join(root, f"epoch_{epoch}"))
    weights = {name: value.detach().clone() for name, value in accelerator.unwrap_model(model).state_dict().items()}
    return {"steps": steps, "evaluations": evaluations, "weights": weights, "rng": torch.rand(2)}


def _libs_root(root, lib):
    return os.path.join(root, lib.__name__)


def checkpointing_scenario(lib, root, every, resume_from, stateful=True):
    return checkpointing_run(lib, _libs_root(root, lib), every, resume_from, stateful)


def crossed_scenario(lib, root, every, resume_from):
    """Resume (plain loaders) from the checkpoint the *other* library wrote."""
    other = "nbaccel" if lib.__name__ == "accelerate" else "accelerate"
    return checkpointing_run(lib, os.path.join(root, other), every, resume_from, False)


@pytest.mark.parametrize("num_processes", [1, 2])
def test_an_uninterrupted_stateful_run_draws_what_accelerate_draws(tmp_path, num_processes):
    """No checkpoint: the stateful loaders' pass iterators (and their draws) come when Accelerate's do."""
    assert_ranks_same(run_both(checkpointing_scenario, num_processes, args=(str(tmp_path), 0, None)), "uninterrupted")


def test_saving_on_two_ranks_leaves_the_run_as_it_was(tmp_path):
    """nbaccel only (Accelerate's ranks all write the same dl_state_dict.bin at once on 2 ranks; see
    test_everyday_api_parity.py): saving every 3 steps gives the run without saving."""
    saving = run_ranks(checkpointing_scenario, "nbaccel", 2, args=(str(tmp_path), 3, None))
    plain = run_ranks(checkpointing_scenario, "nbaccel", 2, args=(str(tmp_path / "plain"), 0, None))
    assert_ranks_same({"accelerate": saving, "nbaccel": plain}, "saving vs not saving (nbaccel, 2 ranks)")


def test_save_state_mid_epoch_leaves_the_run_as_it_was(tmp_path):
    """Saving every 3 steps (mid-epoch, at the epoch's last batch, before the evaluation loader was ever
    iterated and after) changes nothing in the run: the same as without saving, and as in Accelerate."""
    saving = run_both(checkpointing_scenario, 1, args=(str(tmp_path), 3, None))
    assert_ranks_same(saving, "saving every 3 steps")
    plain = run_both(checkpointing_scenario, 1, args=(str(tmp_path / "plain"), 0, None))
    assert_ranks_same({"accelerate": saving["nbaccel"], "nbaccel": plain["nbaccel"]}, "saving vs not saving (nbaccel)")


@pytest.mark.parametrize("resume_from", ["step_3", "step_6", "step_9"])
def test_a_resumed_stateful_run_is_accelerates(tmp_path, resume_from):
    """Resumed mid-epoch 0 (the evaluation loader never iterated), at epoch 0's last batch, and mid-epoch 1
    (after an evaluation pass): the evaluation loader yields its batches on its first pass, and the resumed
    run (draws, losses, weights) is Accelerate's resumed run."""
    run_both(checkpointing_scenario, 1, args=(str(tmp_path), 3, None))
    resumed = run_both(checkpointing_scenario, 1, args=(str(tmp_path), 3, resume_from))
    assert_ranks_same(resumed, f"resumed from {resume_from}")
    assert all(len(batches) == 2 for _, batches in resumed["nbaccel"][0]["evaluations"])


def test_resumed_before_the_epochs_evaluation_the_run_differs_on_both(tmp_path):
    """On 2 processes an epoch is 3 steps: `step_3` is saved at epoch 0's last step, before its evaluation, and
    `epoch_0` right after that evaluation, at the same point of training. The uninterrupted run evaluates after
    `step_3` and its evaluation loader draws its seed from torch's RNG; the resumed run starts at epoch 1
    without that draw. So resumed from `epoch_0` nbaccel ends at the uninterrupted weights, from `step_3` it
    does not, and neither does Accelerate (docs/compat.md)."""
    full = run_both(checkpointing_scenario, 2, args=(str(tmp_path), 3, None, False))
    assert_ranks_same(full, "uninterrupted, plain loaders")
    uninterrupted = full["nbaccel"][0]["weights"]
    for lib, (result, *_) in run_both(checkpointing_scenario, 2, args=(str(tmp_path), 3, "step_3", False)).items():
        assert any(not torch.equal(result["weights"][k], v) for k, v in uninterrupted.items()), lib


@pytest.mark.parametrize("resume_from", ["step_4", "epoch_0"])
def test_a_resumed_plain_loader_run_ends_at_the_uninterrupted_weights_unlike_accelerate(tmp_path, resume_from):
    """Without the stateful loader (the example's `skip_first_batches` idiom; docs/compat.md, docs/checkpoints.md):
    the uninterrupted runs are the same on both libraries; nbaccel's resumed run sees the uninterrupted run's
    batches and draws and ends at its weights, Accelerate's does not (its checkpoint holds no loader position,
    and the shuffle generator restarts). nbaccel resuming Accelerate's checkpoint gives Accelerate's resumed run
    (there is no position to restore), and so does Accelerate resuming nbaccel's (it reads no position)."""
    every = "epoch" if resume_from.startswith("epoch") else 4
    full = run_both(checkpointing_scenario, 2, args=(str(tmp_path), every, None, False))
    assert_ranks_same(full, "uninterrupted, plain loaders")
    resumed = run_both(checkpointing_scenario, 2, args=(str(tmp_path), every, resume_from, False))
    theirs, ours = resumed["accelerate"][0], resumed["nbaccel"][0]
    uninterrupted = full["nbaccel"][0]
    skipped = len(uninterrupted["steps"]) - len(ours["steps"])
    assert ours["steps"] == uninterrupted["steps"][skipped:]
    assert_same(uninterrupted["weights"], ours["weights"], "nbaccel resumed vs uninterrupted")
    assert theirs["steps"] != uninterrupted["steps"][skipped:]
    assert any(not torch.equal(theirs["weights"][k], v) for k, v in uninterrupted["weights"].items())
    crossed = run_both(crossed_scenario, 2, args=(str(tmp_path), every, resume_from))
    assert_same(theirs, crossed["nbaccel"][0], "nbaccel resuming Accelerate's checkpoint")
    assert_same(theirs, crossed["accelerate"][0], "Accelerate resuming nbaccel's checkpoint")


def test_a_built_stateful_loader_still_pickles():
    """The iterator a stateful loader makes when built (as Accelerate's) cannot be pickled; nbaccel's loader
    leaves it out of its pickle, so a prepared loader can still be sent to other processes (Accelerate's
    raises NotImplementedError here)."""
    import pickle

    from nbaccel.data_loader import DataLoaderShard

    loader = DataLoaderShard(list(range(10)), batch_size=2, use_stateful_dataloader=True)
    copy = pickle.loads(pickle.dumps(loader))
    assert [b.tolist() for b in copy] == [b.tolist() for b in loader] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]


def dispatched_draws_scenario(lib, root, resume_from, checkpoints):
    """A dispatched stateful run on 2 ranks (every epoch 3 steps) saving at each epoch's end, or resumed from
    `checkpoints`'s `resume_from`: where torch's RNG stands at each step (a digest of its state) and the batch."""
    import hashlib

    def draws():
        return hashlib.sha1(torch.get_rng_state().numpy().tobytes()).hexdigest()[:12]

    config = lib.utils.DataLoaderConfiguration(use_stateful_dataloader=True, dispatch_batches=True)
    accelerator = lib.Accelerator(cpu=True, dataloader_config=config)
    lib.utils.set_seed(42)
    train = DataLoader(TRAIN, shuffle=True, batch_size=2, collate_fn=torch.tensor)
    model = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.Dropout(0.5), torch.nn.Linear(4, 1))
    model, train = accelerator.prepare(model, train)
    overall = 0
    if resume_from is not None:
        accelerator.load_state(os.path.join(root, checkpoints, resume_from))
        overall = int(resume_from.replace("step_", ""))
    steps = []
    for _ in range(overall // len(train), EPOCHS):
        for batch in train:
            steps.append((overall, draws(), batch[:, 0].tolist()))
            model(batch)  # dropout draws from torch's RNG
            overall += 1
        if resume_from is None:
            accelerator.save_state(os.path.join(root, lib.__name__, f"step_{overall}"))
    return steps


def test_a_resumed_dispatched_stateful_loader_draws_on_rank_1_as_the_uninterrupted_run(tmp_path):
    """Deliberate difference (docs/compat.md): resumed from an epoch's end, a dispatched stateful loader on
    process 1 (which reads no data: process 0 sends it its batches) draws one seed from torch's RNG as its next
    pass begins, as in the run that was never interrupted; Accelerate's restored loader there draws one more,
    so every later draw on that rank (dropout here) differs from its own uninterrupted run. The batches and
    process 0's draws are the same on both (the batches after such a resume are not the uninterrupted run's on
    either library). Both resume nbaccel's checkpoint: on 2 ranks Accelerate's ranks
    write the loader's state to one file at once (see `test_saving_on_two_ranks_leaves_the_run_as_it_was`)."""
    root = str(tmp_path)
    uninterrupted = run_ranks(dispatched_draws_scenario, "nbaccel", 2, args=(root, None, "nbaccel"))
    resumed = run_both(dispatched_draws_scenario, 2, args=(root, "step_3", "nbaccel"))
    ours, theirs = resumed["nbaccel"], resumed["accelerate"]
    assert [[(n, batch) for n, _, batch in rank] for rank in ours] == [[(n, b) for n, _, b in rank] for rank in theirs]
    assert ours[0] == theirs[0]
    assert [step[:2] for step in ours[1]] == [step[:2] for step in uninterrupted[1] if step[0] >= 3]
    assert ours[1][0][1] != theirs[1][0][1]
