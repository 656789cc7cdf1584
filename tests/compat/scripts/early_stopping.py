# Shaped like Accelerate's examples/by_feature/early_stopping.py: one process decides to stop, every process stops
# at the same step (set_trigger / check_trigger).
import argparse

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

STOP_AT = 3


def training_function(args):
    accelerator = Accelerator(cpu=args.cpu)
    x = torch.randn(64, 2)
    dataloader = DataLoader(TensorDataset(x, x.sum(1)), batch_size=2)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer, dataloader = accelerator.prepare(model, optimizer, dataloader)
    stopped_at = None
    for step, (inputs, targets) in enumerate(dataloader):
        loss = torch.nn.functional.mse_loss(model(inputs).squeeze(-1), targets)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        # only the last process sees the stopping condition
        if accelerator.process_index == accelerator.num_processes - 1 and step == STOP_AT:
            accelerator.set_trigger()
        if accelerator.check_trigger():
            stopped_at = step
            break
    with open(f"stopped_rank{accelerator.process_index}.txt", "w") as f:  # one file per process: no interleaving
        f.write(str(stopped_at))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cpu", action="store_true")
    training_function(parser.parse_args())


if __name__ == "__main__":
    main()
