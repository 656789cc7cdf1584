# Accelerate's "save, then load for inference" path and its distributed-inference guide: save_model, load with
# init_empty_weights + load_checkpoint_and_dispatch, then split_between_processes + gather_object.
import argparse
import json

import torch
from accelerate import Accelerator, init_empty_weights, load_checkpoint_and_dispatch
from accelerate.utils import gather_object


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = torch.nn.Linear(4, 8)
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.head(torch.relu(self.encoder(x)))


def training_function(args):
    accelerator = Accelerator(cpu=args.cpu)
    torch.manual_seed(0)
    model = accelerator.prepare(Net())
    accelerator.wait_for_everyone()
    accelerator.save_model(model, args.output_dir)  # safetensors, written once by the main process
    accelerator.wait_for_everyone()

    with init_empty_weights():
        empty = Net()
    on_meta = all(p.device.type == "meta" for p in empty.parameters())
    loaded = load_checkpoint_and_dispatch(empty, args.output_dir, device_map={"": "cpu"})
    probe = torch.ones(1, 4)
    same = torch.allclose(loaded(probe), accelerator.unwrap_model(model)(probe))

    prompts = [f"prompt {i}" for i in range(5)]
    with accelerator.split_between_processes(prompts) as my_prompts:
        answers = [f"{p} -> rank {accelerator.process_index}" for p in my_prompts]
    all_answers = gather_object(answers)
    accelerator.print("RESULT " + json.dumps({
        "on_meta": on_meta, "loaded_matches": same, "answers": all_answers, "num_processes": accelerator.num_processes,
    }))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--output_dir", default="saved")
    training_function(parser.parse_args())


if __name__ == "__main__":
    main()
