# Shaped like Accelerate's examples/by_feature/local_sgd.py: gradients are not synchronized every step; LocalSGD
# averages the parameters every `local_sgd_steps` steps.
import argparse
import json

import torch
from accelerate import Accelerator, DistributedType
from accelerate.local_sgd import LocalSGD
from torch.utils.data import DataLoader, TensorDataset


def training_function(args):
    accelerator = Accelerator(cpu=args.cpu)
    assert accelerator.distributed_type in (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)
    torch.manual_seed(0)
    x = torch.randn(64, 2)
    dataloader = DataLoader(TensorDataset(x, x.sum(1)), batch_size=4, shuffle=True)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer, dataloader = accelerator.prepare(model, optimizer, dataloader)
    steps = 0
    with LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=4, enabled=True) as local_sgd:
        for inputs, targets in dataloader:
            loss = torch.nn.functional.mse_loss(model(inputs).squeeze(-1), targets)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            local_sgd.step()
            steps += 1
    weights = accelerator.unwrap_model(model).weight.detach()
    all_weights = accelerator.gather(weights[None])
    accelerator.print("RESULT " + json.dumps({"steps": steps, "same_on_all_ranks": bool((all_weights == all_weights[0]).all())}))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cpu", action="store_true")
    training_function(parser.parse_args())


if __name__ == "__main__":
    main()
