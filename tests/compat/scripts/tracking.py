# Shaped like Accelerate's examples/by_feature/tracking.py, plus a custom tracker as in Accelerate's tracking guide.
import argparse
import json
import os

import torch
from accelerate import Accelerator
from accelerate.tracking import GeneralTracker, on_main_process
from torch.utils.data import DataLoader, TensorDataset


class JSONLinesTracker(GeneralTracker):
    """A user-written tracker: one JSON line per call, in the run's directory."""

    name = "jsonlines"
    requires_logging_directory = True

    @on_main_process
    def __init__(self, run_name: str, logging_dir: str):
        super().__init__()
        self.run_name = run_name
        os.makedirs(logging_dir, exist_ok=True)
        self.path = os.path.join(logging_dir, f"{run_name}.jsonl")
        self.file = open(self.path, "a")

    @property
    def tracker(self):
        return self.file

    @on_main_process
    def store_init_configuration(self, values: dict):
        self.file.write(json.dumps({"config": values}) + "\n")

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs):
        self.file.write(json.dumps({"step": step, **values}) + "\n")

    @on_main_process
    def finish(self):
        self.file.close()


def training_function(args):
    custom = JSONLinesTracker("run", os.path.join(args.project_dir, "custom"))
    accelerator = Accelerator(log_with=["tensorboard", custom], project_dir=args.project_dir)
    config = {"lr": 0.1, "num_epochs": 2, "batch_size": 4}
    accelerator.init_trackers("tracking_example", config)
    x = torch.arange(32.0).reshape(16, 2) / 32
    dataloader = DataLoader(TensorDataset(x, x.sum(1)), batch_size=config["batch_size"])
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"])
    model, optimizer, dataloader = accelerator.prepare(model, optimizer, dataloader)
    overall_step = 0
    for epoch in range(config["num_epochs"]):
        total_loss = 0.0
        for inputs, targets in dataloader:
            loss = torch.nn.functional.mse_loss(model(inputs).squeeze(-1), targets)
            total_loss += loss.detach().float()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            accelerator.log({"train_loss": loss.item()}, step=overall_step)
            overall_step += 1
        accelerator.log({"epoch": epoch, "train_loss_epoch": total_loss.item() / len(dataloader)}, step=overall_step)
    tensorboard = accelerator.get_tracker("tensorboard")
    accelerator.print("RESULT " + json.dumps({
        "trackers": sorted(t.name for t in accelerator.trackers), "steps": overall_step, "num_processes": accelerator.num_processes,
        "tensorboard_tracker_type": type(tensorboard).__name__,
    }))
    accelerator.end_training()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--project_dir", type=str, default="logs")
    training_function(parser.parse_args())


if __name__ == "__main__":
    main()
