"""Accelerator.save_state / load_state mid-epoch, trackers through Accelerator.log (2 gloo processes)."""

from __future__ import annotations

import torch
import torch._dynamo  # noqa: F401  DDP's constructor imports it (seconds); forked ranks inherit it
from ranks_helper import run_ranks


def _setup(accelerator, seed_model: int = 1):
    torch.manual_seed(seed_model)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(96, 4, generator=gen)
    dataset = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
    loader = torch.utils.data.DataLoader(dataset, batch_size=4, shuffle=True)
    return accelerator.prepare(model, optimizer, loader, scheduler)


def _step(accelerator, model, optimizer, scheduler, x, y):
    with accelerator.accumulate(model):
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()


def test_save_state_mid_epoch_then_load_state_resumes_identically(tmp_path):
    def body(rank):
        from nbaccel import Accelerator, ProjectConfiguration

        config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True)
        accelerator = Accelerator(gradient_accumulation_steps=2, project_config=config)
        model, optimizer, loader, scheduler = _setup(accelerator)
        for _ in loader:  # one epoch first: the shuffling generator has moved on
            pass
        after = []
        for index, (x, y) in enumerate(loader):
            _step(accelerator, model, optimizer, scheduler, x, y)
            if index == 3:  # right after an optimizer step (gradients are not part of a checkpoint)
                saved_to = accelerator.save_state()
            elif index > 3:
                after.append(x.clone())
        weights = [p.detach().clone() for p in model.parameters()]
        lr = scheduler.get_last_lr()

        resumed = Accelerator(gradient_accumulation_steps=2, project_config=ProjectConfiguration(
            project_dir=str(tmp_path), automatic_checkpoint_naming=True))
        model2, optimizer2, loader2, scheduler2 = _setup(resumed, seed_model=7)  # other initial weights
        resumed.load_state()
        again = []
        for x, y in loader2:
            _step(resumed, model2, optimizer2, scheduler2, x, y)
            again.append(x.clone())
        return (saved_to, after, again, weights, [p.detach().clone() for p in model2.parameters()], lr,
                scheduler2.get_last_lr(), resumed.save_iteration, resumed.step)

    for saved_to, after, again, weights, weights2, lr, lr2, iteration, step in run_ranks(body):
        assert saved_to.name == "checkpoint_0"  # a pathlib.Path, as Accelerate returns
        assert len(again) == len(after) == 8
        for a, b in zip(after, again):
            torch.testing.assert_close(a, b)
        for a, b in zip(weights, weights2):
            torch.testing.assert_close(a, b)
        assert lr == lr2 and iteration == 1 and step == 0


def test_each_process_saves_into_a_folder_of_its_own(tmp_path):
    """Each process passes its own folder (a per-process tempfile, or nodes without a shared filesystem), as
    Accelerate's CI script test_distributed_data_loop does: every process finds its own files there again."""
    def body(rank):
        from nbaccel import Accelerator

        accelerator = Accelerator()
        x = torch.randn(96, 4, generator=torch.Generator().manual_seed(0))
        loader = accelerator.prepare(torch.utils.data.DataLoader(x, batch_size=4, shuffle=True))
        folder = tmp_path / f"rank{rank}"
        batches = iter(loader)
        for _ in range(3):
            next(batches)
        accelerator.save_state(str(folder))
        rest = [batch.clone() for batch in batches]
        saved = sorted(p.name for p in folder.iterdir())
        accelerator.load_state(str(folder))
        resumed = [batch.clone() for batch in loader]
        return saved, rest, resumed

    (saved0, rest0, resumed0), (saved1, rest1, resumed1) = run_ranks(body)
    assert saved0 == [".nbaccel-checkpoint.json", ".nbaccel-manifest.json", "dl_state_dict.bin", "random_states_0.pkl"]
    assert saved1 == ["dl_state_dict.rank1.bin", "random_states_1.pkl"]  # its own files, in its own folder
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary folder left
    for rest, resumed in ((rest0, resumed0), (rest1, resumed1)):
        assert len(rest) == len(resumed) == 9
        for a, b in zip(rest, resumed):
            torch.testing.assert_close(a, b)


def test_log_reaches_the_trackers_and_the_dashboard(tmp_path):
    def body(rank):
        from nbaccel import Accelerator, telemetry

        messages = []
        telemetry.attach(messages.append, rank)
        accelerator = Accelerator(log_with="jsonl", project_dir=str(tmp_path))
        accelerator.init_trackers("run", config={"lr": 0.1})
        accelerator.log({"loss": 1.5}, step=1)
        tracker = accelerator.get_tracker("jsonl")
        accelerator.end_training()
        telemetry.detach()
        metrics = [m["values"] for m in messages if m["kind"] == "metrics"]
        return len(accelerator.trackers), metrics, getattr(tracker, "name", None)

    (n0, metrics0, name0), (n1, metrics1, _) = run_ranks(body)
    assert (n0, n1) == (1, 0) and name0 == "jsonl"
    assert metrics0 == metrics1 == [{"loss": 1.5}]
    assert any(tmp_path.rglob("*.jsonl"))
