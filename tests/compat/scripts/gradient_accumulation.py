# Shaped like Accelerate's examples/by_feature/gradient_accumulation.py: `with accelerator.accumulate(model)` and
# the optimizer / scheduler stepping on every batch, Accelerate deciding when gradients are synchronized and applied.
import argparse
import json

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset


def training_function(args):
    accelerator = Accelerator(cpu=args.cpu, gradient_accumulation_steps=args.gradient_accumulation_steps)
    set_seed(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(80, 4, generator=g)
    dataset = TensorDataset(x, x.sum(1, keepdim=True))
    train_dataloader = DataLoader(dataset, batch_size=4, shuffle=False)  # 20 batches, 10 per process
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(model, optimizer, train_dataloader, lr_scheduler)
    sync_steps = 0
    weight_changes = 0
    for batch in train_dataloader:
        inputs, targets = batch
        before = model.module.weight.detach().clone() if hasattr(model, "module") else model.weight.detach().clone()
        with accelerator.accumulate(model):
            loss = F.mse_loss(model(inputs), targets)
            accelerator.backward(loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            sync_steps += 1
        after = accelerator.unwrap_model(model).weight.detach()
        weight_changes += int(not torch.equal(before, after))
    weights = accelerator.unwrap_model(model).weight.detach()
    all_weights = accelerator.gather(weights[None])
    accelerator.print("RESULT " + json.dumps({
        "batches": len(train_dataloader), "sync_steps": sync_steps, "weight_changes": weight_changes,
        "lr": lr_scheduler.get_last_lr()[0], "same_on_all_ranks": bool((all_weights == all_weights[0]).all()),
        "num_processes": accelerator.num_processes,
    }))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    training_function(parser.parse_args())


if __name__ == "__main__":
    main()
