# Shaped like Accelerate's examples/complete_cv_example.py and by_feature/checkpointing.py: save_state every epoch
# or every N steps, and --resume_from_checkpoint picks up where a checkpoint left off (skip_first_batches mid-epoch).
import argparse
import json
import os

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration, set_seed
from torch.utils.data import DataLoader, TensorDataset


def make_data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 6, generator=g)
    y = x @ torch.arange(1.0, 7.0) / 10
    return TensorDataset(x, y)


def training_function(args):
    project_config = ProjectConfiguration(project_dir=args.output_dir)
    dataloader_config = DataLoaderConfiguration(use_seedable_sampler=True)  # reproducible shuffling across resumes
    accelerator = Accelerator(cpu=args.cpu, project_config=project_config, dataloader_config=dataloader_config)
    set_seed(args.seed)
    train_dataloader = DataLoader(make_data(), batch_size=8, shuffle=True)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.8)
    model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(model, optimizer, train_dataloader, lr_scheduler)

    checkpointing_steps = args.checkpointing_steps
    if checkpointing_steps is not None and checkpointing_steps.isdigit():
        checkpointing_steps = int(checkpointing_steps)

    overall_step = 0
    starting_epoch = 0
    resume_step = None
    if args.resume_from_checkpoint:
        accelerator.print(f"Resumed from checkpoint: {args.resume_from_checkpoint}")
        accelerator.load_state(args.resume_from_checkpoint)
        path = os.path.basename(args.resume_from_checkpoint)
        training_difference = os.path.splitext(path)[0]
        if "epoch" in training_difference:
            starting_epoch = int(training_difference.replace("epoch_", "")) + 1
        else:
            resume_step = int(training_difference.replace("step_", ""))
            starting_epoch = resume_step // len(train_dataloader)
            resume_step -= starting_epoch * len(train_dataloader)
        overall_step = starting_epoch * len(train_dataloader) + (resume_step or 0)

    batches_seen = 0
    for epoch in range(starting_epoch, args.num_epochs):
        model.train()
        if args.resume_from_checkpoint and epoch == starting_epoch and resume_step is not None:
            active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_step)
        else:
            active_dataloader = train_dataloader
        active_dataloader.set_epoch(epoch)
        for batch in active_dataloader:
            inputs, targets = batch
            loss = F.mse_loss(model(inputs).squeeze(-1), targets)
            accelerator.backward(loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
            overall_step += 1
            batches_seen += 1
            if isinstance(checkpointing_steps, int) and overall_step % checkpointing_steps == 0:
                accelerator.save_state(os.path.join(args.output_dir, f"step_{overall_step}"))
        if checkpointing_steps == "epoch":
            accelerator.save_state(os.path.join(args.output_dir, f"epoch_{epoch}"))

    accelerator.wait_for_everyone()
    params = torch.cat([p.detach().flatten() for p in accelerator.unwrap_model(model).parameters()])
    accelerator.print("RESULT " + json.dumps({
        "starting_epoch": starting_epoch, "batches_seen": batches_seen, "overall_step": overall_step,
        "batches_per_epoch": len(train_dataloader), "params": params.tolist(),
        "lr": lr_scheduler.get_last_lr()[0],
    }))
    accelerator.end_training()


def main():
    parser = argparse.ArgumentParser(description="Simple example of training script with checkpointing.")
    parser.add_argument("--cpu", action="store_true", help="If passed, will train on the CPU.")
    parser.add_argument("--checkpointing_steps", type=str, default=None,
                        help="Save state every n steps, or 'epoch' at the end of every epoch.")
    parser.add_argument("--output_dir", type=str, default=".")
    parser.add_argument("--resume_from_checkpoint", type=str, default=None)
    parser.add_argument("--num_epochs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()
    training_function(args)


if __name__ == "__main__":
    main()
