# Accelerate's checkpointing guide: ProjectConfiguration(automatic_checkpoint_naming=True, total_limit=2),
# save_state() without a path each epoch, register_for_checkpointing of a user object, load_state() of the latest.
import argparse
import json
import os

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration, set_seed
from torch.utils.data import DataLoader, TensorDataset


class EpochCounter:
    """A user object saved with the checkpoint: it only needs state_dict / load_state_dict."""

    def __init__(self):
        self.epochs = 0

    def state_dict(self):
        return {"epochs": self.epochs}

    def load_state_dict(self, state):
        self.epochs = state["epochs"]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--project_dir", default="project")
    args = parser.parse_args()
    config = ProjectConfiguration(project_dir=args.project_dir, automatic_checkpoint_naming=True, total_limit=2)
    accelerator = Accelerator(cpu=args.cpu, project_config=config)
    set_seed(0)
    x = torch.randn(32, 3)
    dataloader = DataLoader(TensorDataset(x, x.sum(1)), batch_size=4)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer, dataloader = accelerator.prepare(model, optimizer, dataloader)
    counter = EpochCounter()
    accelerator.register_for_checkpointing(counter)
    for _ in range(3):
        for inputs, targets in dataloader:
            loss = torch.nn.functional.mse_loss(model(inputs).squeeze(-1), targets)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        counter.epochs += 1
        accelerator.save_state()
    trained = accelerator.unwrap_model(model).weight.detach().clone()
    with torch.no_grad():
        accelerator.unwrap_model(model).weight.zero_()
    counter.epochs = -1
    accelerator.load_state()  # the latest checkpoint under project_dir/checkpoints
    accelerator.wait_for_everyone()
    checkpoints = sorted(os.listdir(os.path.join(args.project_dir, "checkpoints")))
    accelerator.print("RESULT " + json.dumps({
        "checkpoints": checkpoints, "restored_weights": bool(torch.equal(trained, accelerator.unwrap_model(model).weight)),
        "epochs": counter.epochs, "iteration": accelerator.save_iteration,
        "files": sorted(os.listdir(os.path.join(args.project_dir, "checkpoints", checkpoints[-1]))),
    }))


if __name__ == "__main__":
    main()
