# Shaped like Accelerate's examples/by_feature/memory.py and automatic_gradient_accumulation.py:
# find_executable_batch_size halves the batch size after an out-of-memory error, and the script keeps the
# observed batch size by accumulating gradients. Out-of-memory is simulated (no GPU here) above 16 samples.
import argparse
import json

import torch
from accelerate import Accelerator
from accelerate.utils import find_executable_batch_size, set_seed
from torch.utils.data import DataLoader, TensorDataset

FITS_IN_MEMORY = 16


def training_function(args):
    accelerator = Accelerator(cpu=args.cpu)
    observed_batch_size = 32
    attempts = []

    @find_executable_batch_size(starting_batch_size=observed_batch_size)
    def inner_training_loop(batch_size):
        nonlocal accelerator
        accelerator.free_memory()
        attempts.append(batch_size)
        if batch_size > FITS_IN_MEMORY:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        gradient_accumulation_steps = observed_batch_size // batch_size
        accelerator.gradient_accumulation_steps = gradient_accumulation_steps
        set_seed(0)
        x = torch.randn(256, 3)
        dataloader = DataLoader(TensorDataset(x, x.sum(1)), batch_size=batch_size)
        model = torch.nn.Linear(3, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        model, optimizer, dataloader = accelerator.prepare(model, optimizer, dataloader)
        updates = 0
        for inputs, targets in dataloader:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(inputs).squeeze(-1), targets)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            updates += int(accelerator.sync_gradients)
        return batch_size, gradient_accumulation_steps, updates

    batch_size, steps, updates = inner_training_loop()
    accelerator.print("RESULT " + json.dumps({"attempts": attempts, "batch_size": batch_size,
                                               "gradient_accumulation_steps": steps, "updates": updates}))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cpu", action="store_true")
    training_function(parser.parse_args())


if __name__ == "__main__":
    main()
