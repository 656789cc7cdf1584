# Pipeline-parallel inference with prepare_pippy (Accelerate's "Distributed inference" guide, its third
# bracket), on a small model so that it runs on CPU processes. Every rank saves what each case gave it:
#   python pipeline_inference.py OUT_DIR [--stop-on-error] CASE [CASE ...]
import os
import sys
from pathlib import Path

import torch
from accelerate import PartialState
from accelerate.inference import prepare_pippy
from accelerate.utils import set_seed


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(64, 64)

    def forward(self, x):
        return torch.relu(self.lin(x))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.Sequential(*[Block() for _ in range(4)])
        self.head = torch.nn.Linear(64, 3)

    def forward(self, x):
        return self.head(self.blocks(x))


def model_and_batch(rows):
    set_seed(42)
    model = Net().eval()
    batch = torch.randn(rows, 64)
    with torch.no_grad():
        expected = model(batch)  # the whole model in one process, for comparison
    return model, batch, expected


def run(model, *args, **kwargs):
    with torch.no_grad():
        return model(*args, **kwargs)


def auto():  # split_points="auto", one micro-batch of 1 row per process
    model, batch, expected = model_and_batch(2)
    model = prepare_pippy(model, example_args=(torch.randn(1, 64),), no_split_module_classes=["Block"])
    return {"split_points": model.hf_split_points, "output": run(model, batch), "expected": expected,
            "schedule": type(model.pippy_stage).__name__}


def padded():  # a batch of 1 is padded to one row per micro-batch
    model, batch, expected = model_and_batch(1)
    model = prepare_pippy(model, example_args=(torch.randn(1, 64),), no_split_module_classes=["Block"])
    return {"output": run(model, batch), "expected": expected}


def named_split_called_twice():
    model, batch, expected = model_and_batch(4)
    model = prepare_pippy(model, split_points=["blocks.3"], example_args=(torch.randn(2, 64),))
    return {"split_points": model.hf_split_points, "first": run(model, batch), "second": run(model, batch + 1),
            "expected": expected}


def keyword_inputs():  # example_kwargs, and no module kept whole
    model, batch, expected = model_and_batch(2)
    model = prepare_pippy(model, example_kwargs={"x": torch.randn(1, 64)})
    return {"split_points": model.hf_split_points, "output": run(model, x=batch), "expected": expected}


def padded_to_traced_size():  # traced with 2 rows: a batch of 3 is padded to 4, 2 per micro-batch
    model, batch, expected = model_and_batch(3)
    model = prepare_pippy(model, example_args=(torch.randn(2, 64),), no_split_module_classes=["Block"])
    return {"output": run(model, batch), "expected": expected}


def missing_split_point():
    model, _, _ = model_and_batch(2)
    prepare_pippy(model, split_points=["blocks.9"], example_args=(torch.randn(1, 64),))


def too_small_to_split():  # one Block, kept whole: the balanced split finds no second stage
    set_seed(42)
    prepare_pippy(torch.nn.Sequential(Block()), example_args=(torch.randn(1, 64),), no_split_module_classes=["Block"])


def gather_output():
    model, batch, expected = model_and_batch(2)
    model = prepare_pippy(model, example_args=(torch.randn(1, 64),), no_split_module_classes=["Block"],
                          gather_output=True)
    return {"output": run(model, batch), "expected": expected}


def more_chunks_than_processes():  # 4 micro-batches of 1 row through 2 stages
    model, batch, expected = model_and_batch(4)
    model = prepare_pippy(model, example_args=(torch.randn(1, 64),), no_split_module_classes=["Block"], num_chunks=4)
    return {"output": run(model, batch), "expected": expected}


def more_stages_than_processes():
    model, batch, _ = model_and_batch(2)
    model = prepare_pippy(model, split_points=["blocks.1", "blocks.2"], example_args=(torch.randn(1, 64),))
    return run(model, batch)


def batch_larger_than_traced():  # traced with 1 row per micro-batch, called with 5 rows (3 per micro-batch)
    model, batch, _ = model_and_batch(5)
    model = prepare_pippy(model, example_args=(torch.randn(1, 64),), no_split_module_classes=["Block"])
    return run(model, batch)


if __name__ == "__main__":
    # --stop-on-error: a rank whose case raised saves and exits at once (its peers may be left waiting
    # inside the pipeline: the launcher stops them)
    out, stop_on_error = Path(sys.argv[1]), sys.argv[2] == "--stop-on-error"
    state = PartialState(cpu=True)
    results = {}
    for name in sys.argv[3 if stop_on_error else 2 :]:
        try:
            results[name] = ("returned", globals()[name]())
        except Exception as error:  # the case's outcome: compared across libraries by the test
            results[name] = ("raised", type(error).__name__, str(error))
        print(f"rank {state.process_index}: {name} {results[name][0]}", flush=True)
        torch.save(results, out / f"rank{state.process_index}.pt")
        if stop_on_error and results[name][0] == "raised":
            os._exit(3)
        state.wait_for_everyone()
    state.destroy_process_group()
