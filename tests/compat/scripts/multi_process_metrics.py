# Shaped like Accelerate's examples/by_feature/multi_process_metrics.py: the evaluation set does not divide
# evenly among processes; gather_for_metrics returns each sample exactly once.
import argparse
import json

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, Dataset

EVAL_SIZE = 37


class Indexed(Dataset):
    def __len__(self):
        return EVAL_SIZE

    def __getitem__(self, i):
        return {"index": torch.tensor(i), "x": torch.full((2,), float(i))}


def training_function(args):
    accelerator = Accelerator(cpu=args.cpu)
    model = torch.nn.Linear(2, 1)
    eval_dataloader = DataLoader(Indexed(), batch_size=4)
    model, eval_dataloader = accelerator.prepare(model, eval_dataloader)
    model.eval()
    seen, names, samples_seen = [], [], 0
    for batch in eval_dataloader:
        with torch.no_grad():
            outputs = model(batch["x"])
        predictions, indices = accelerator.gather_for_metrics((outputs.squeeze(-1), batch["index"]))
        seen.extend(indices.tolist())
        samples_seen += predictions.shape[0]
        names.extend(accelerator.gather_for_metrics([f"sample-{i}" for i in batch["index"].tolist()],
                                                    use_gather_object=True))
    total = accelerator.reduce(torch.tensor(float(len(seen)), device=accelerator.device), reduction="mean")
    padded = accelerator.pad_across_processes(torch.ones(accelerator.process_index + 1), dim=0)
    accelerator.print("RESULT " + json.dumps({
        "samples_seen": samples_seen, "indices_sorted": sorted(seen) == list(range(EVAL_SIZE)),
        "names": len(names), "unique_names": len(set(names)), "mean_len": total.item(),
        "padded_len": padded.shape[0], "num_processes": accelerator.num_processes,
    }))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cpu", action="store_true")
    training_function(parser.parse_args())


if __name__ == "__main__":
    main()
