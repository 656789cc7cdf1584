"""Accelerate's example-style training loop, unchanged except `accelerate` -> `nbaccel`, on 2 processes."""

from __future__ import annotations

import torch._dynamo  # noqa: F401  DDP's constructor imports it (seconds); forked ranks inherit it
from ranks_helper import run_ranks


def training_function(rank):
    # ---- from here on: Accelerate's README / nlp_example loop, with the import renamed ----
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from nbaccel import Accelerator

    accelerator = Accelerator(gradient_accumulation_steps=2)
    torch.manual_seed(42)

    generator = torch.Generator().manual_seed(0)
    features = torch.randn(203, 10, generator=generator)
    labels = (features[:, 0] + features[:, 1] > 0).long()
    train_dataloader = DataLoader(TensorDataset(features[:160], labels[:160]), shuffle=True, batch_size=8)
    eval_dataloader = DataLoader(TensorDataset(features[160:], labels[160:]), batch_size=8)  # 43: uneven

    model = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    optimizer = torch.optim.AdamW(params=model.parameters(), lr=1e-2)
    lr_scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=0.1, total_iters=100)

    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )

    accuracy = None
    for epoch in range(4):
        model.train()
        for inputs, targets in train_dataloader:
            with accelerator.accumulate(model):
                outputs = model(inputs)
                loss = torch.nn.functional.cross_entropy(outputs, targets)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()

        model.eval()
        correct, seen = 0, 0
        for inputs, targets in eval_dataloader:
            with torch.no_grad():
                outputs = model(inputs)
            predictions = outputs.argmax(dim=-1)
            predictions, references = accelerator.gather_for_metrics((predictions, targets))
            correct += (predictions == references).sum().item()
            seen += references.numel()
        accuracy = correct / seen
        accelerator.print(f"epoch {epoch}: accuracy {accuracy:.3f}")

    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    return accuracy, seen, type(unwrapped).__name__


def test_accelerate_example_loop_runs_unchanged():
    results = run_ranks(training_function)
    for accuracy, seen, name in results:
        assert seen == 43  # every evaluation sample exactly once
        assert accuracy > 0.75  # chance is about 0.5
        assert name == "Sequential"
    assert results[0] == results[1]


def test_example_loop_through_notebook_launcher():
    from nbaccel import notebook_launcher

    results = notebook_launcher(training_function, args=(0,), num_processes=2, dashboard=False)
    assert [seen for _, seen, _ in results] == [43, 43]
    assert results[0] == results[1]
