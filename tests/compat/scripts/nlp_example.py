# An Accelerate user's training script, shaped like Accelerate's examples/nlp_example.py, with a tiny synthetic
# classification task instead of BERT/GLUE so it runs in seconds on a CPU.
import argparse
import json

import torch
import torch.nn.functional as F
from accelerate import Accelerator, DistributedType
from accelerate.logging import get_logger
from accelerate.utils import set_seed
from torch.optim import AdamW
from torch.utils.data import DataLoader, Dataset

logger = get_logger(__name__)

EVAL_SIZE = 30  # not a multiple of 2 processes x batch size 4: gather_for_metrics must drop the padding


class PairsDataset(Dataset):
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 8, generator=g)
        self.labels = (self.x[:, :4].sum(1) > self.x[:, 4:].sum(1)).long()

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return {"input": self.x[i], "labels": self.labels[i]}


class TinyClassifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))

    def forward(self, input, labels=None):
        logits = self.net(input)
        loss = F.cross_entropy(logits, labels) if labels is not None else None
        return {"loss": loss, "logits": logits}


def get_dataloaders(accelerator, batch_size=8):
    with accelerator.main_process_first():  # where a tokenizer would map the dataset
        train, evaluation = PairsDataset(256, seed=0), PairsDataset(EVAL_SIZE, seed=1)
    train_dataloader = DataLoader(train, shuffle=True, batch_size=batch_size, drop_last=True)
    eval_dataloader = DataLoader(evaluation, shuffle=False, batch_size=4)
    return train_dataloader, eval_dataloader


def training_function(config, args):
    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision)
    lr, num_epochs, seed, batch_size = config["lr"], int(config["num_epochs"]), int(config["seed"]), int(config["batch_size"])
    set_seed(seed)
    train_dataloader, eval_dataloader = get_dataloaders(accelerator, batch_size)
    model = TinyClassifier()
    model = model.to(accelerator.device)
    optimizer = AdamW(params=model.parameters(), lr=lr)
    lr_scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.1, total_iters=len(train_dataloader) * num_epochs)
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )
    logger.info(f"distributed type {accelerator.distributed_type}, {accelerator.num_processes} processes")
    assert accelerator.distributed_type in (DistributedType.MULTI_CPU, DistributedType.NO)
    for epoch in range(num_epochs):
        model.train()
        for batch in train_dataloader:
            outputs = model(**batch)
            loss = outputs["loss"]
            accelerator.backward(loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()

        model.eval()
        correct = total = 0
        for batch in eval_dataloader:
            with torch.no_grad():
                outputs = model(**batch)
            predictions = outputs["logits"].argmax(dim=-1)
            predictions, references = accelerator.gather_for_metrics((predictions, batch["labels"]))
            correct += (predictions == references).sum().item()
            total += references.numel()
        accelerator.print(f"epoch {epoch}:", {"accuracy": correct / total})
    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    checksum = sum(p.double().abs().sum().item() for p in unwrapped.parameters())
    accelerator.print("RESULT " + json.dumps({"accuracy": correct / total, "eval_count": total, "checksum": checksum,
                                               "num_processes": accelerator.num_processes}))
    with open(f"checksum_rank{accelerator.process_index}.txt", "w") as f:  # one file per process: no interleaving
        f.write(f"{checksum:.10f}")
    accelerator.end_training()


def main():
    parser = argparse.ArgumentParser(description="Simple example of training script.")
    parser.add_argument("--mixed_precision", type=str, default=None, choices=["no", "fp16", "bf16", "fp8"])
    parser.add_argument("--cpu", action="store_true", help="If passed, will train on the CPU.")
    args = parser.parse_args()
    config = {"lr": 1e-2, "num_epochs": 3, "seed": 42, "batch_size": 8}
    training_function(config, args)


if __name__ == "__main__":
    main()
