# A tour of the Accelerator API as Accelerate users call it. Every observable value goes into one JSON object per
# process; the test compares it with what Accelerate 1.15 printed for the same script (api_tour.expected.json).
import argparse
import json
import os

import torch
from accelerate import Accelerator, PartialState
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import (
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    GradientAccumulationPlugin,
    broadcast,
    broadcast_object_list,
    gather_object,
    pad_across_processes,
    send_to_device,
    set_seed,
)
from torch.utils.data import DataLoader, TensorDataset


def values(t):
    return [round(v, 5) for v in torch.as_tensor(t).flatten().tolist()]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--out", default="tour")
    args = parser.parse_args()
    out = {}
    plugin = GradientAccumulationPlugin(num_steps=2)
    accelerator = Accelerator(
        cpu=args.cpu, gradient_accumulation_plugin=plugin,
        dataloader_config=DataLoaderConfiguration(even_batches=True),
        kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=False)],
    )
    rank = accelerator.process_index
    out["state"] = {
        "num_processes": accelerator.num_processes, "process_index": rank,
        "is_main_process": accelerator.is_main_process, "is_local_main_process": accelerator.is_local_main_process,
        "is_last_process": accelerator.is_last_process, "distributed_type": str(accelerator.distributed_type),
        "mixed_precision": accelerator.mixed_precision, "device": str(accelerator.device),
        "use_distributed": accelerator.use_distributed, "gradient_accumulation_steps": accelerator.gradient_accumulation_steps,
        "partial_state_is_same": PartialState().process_index == rank,
        "accelerator_state_mp": AcceleratorState().mixed_precision,
        "gradient_state_sync": GradientState().sync_gradients, "split_batches": accelerator.split_batches,
        "even_batches": accelerator.even_batches,
    }
    set_seed(0)
    x = torch.arange(40, dtype=torch.float32).reshape(20, 2) / 40
    y = x.sum(1, keepdim=True)
    dataloader = DataLoader(TensorDataset(x, y), batch_size=3)  # 7 batches: uneven over 2 processes
    model = torch.nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.fill_(0.5)
        model.bias.fill_(0.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    model, optimizer, dataloader, scheduler = accelerator.prepare(model, optimizer, dataloader, scheduler)
    out["len_dataloader"] = len(dataloader)
    batches, syncs, ends, norms = [], [], [], []
    for inputs, targets in dataloader:
        batches.append(values(inputs[:, 0] * 40 / 1))
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norms.append(round(float(accelerator.clip_grad_norm_(model.parameters(), 1.0)), 4))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        syncs.append(accelerator.sync_gradients)
        ends.append(accelerator.gradient_state.end_of_dataloader)
    out["batches"], out["syncs"], out["end_of_dataloader"], out["grad_norms"] = batches, syncs, ends, norms
    out["weights"] = values(accelerator.unwrap_model(model).weight)
    out["lr"] = round(scheduler.get_last_lr()[0], 6)
    out["step_was_skipped"] = accelerator.optimizer_step_was_skipped

    t = torch.tensor([rank + 1.0, 10.0 * (rank + 1)])
    out["gather"] = values(accelerator.gather(t))
    out["reduce_sum"] = values(accelerator.reduce(t, reduction="sum"))
    out["reduce_mean"] = values(accelerator.reduce(t, reduction="mean"))
    out["gather_dict"] = {k: values(v) for k, v in accelerator.gather({"a": t[:1], "b": t[1:]}).items()}
    out["pad"] = values(accelerator.pad_across_processes(torch.ones(rank + 1), dim=0, pad_index=-1))
    out["pad_first"] = values(pad_across_processes(torch.ones(rank + 1), dim=0, pad_index=-1, pad_first=True))
    out["broadcast"] = values(broadcast(torch.tensor([float(rank)]), from_process=1))
    objs = [f"from {rank}", rank]
    broadcast_object_list(objs, from_process=0)
    out["broadcast_object_list"] = objs
    out["gather_object"] = gather_object([{"rank": rank}])
    out["send_to_device"] = sorted(send_to_device({"a": torch.ones(1), "b": [torch.zeros(1)]}, "cpu"))
    with accelerator.split_between_processes(list(range(5)), apply_padding=True) as part:
        out["split_padded"] = part
    with accelerator.split_between_processes({"a": [1, 2, 3, 4], "b": torch.arange(4)}) as part:
        out["split_dict"] = {"a": part["a"], "b": part["b"].tolist()}
    order = []
    with accelerator.main_process_first():
        order.append(rank)
    out["main_process_first"] = order

    @accelerator.on_main_process
    def only_main():
        return "main"

    @accelerator.on_process(process_index=1)
    def only_one():
        return "one"

    out["on_main_process"], out["on_process_1"] = only_main(), only_one()
    state_dict = accelerator.get_state_dict(model)
    out["state_dict_keys"] = sorted(state_dict)
    os.makedirs(args.out, exist_ok=True)
    accelerator.save({"x": 1}, os.path.join(args.out, "obj.pt"))
    accelerator.wait_for_everyone()
    out["saved_obj"] = torch.load(os.path.join(args.out, "obj.pt"))
    skipped = accelerator.skip_first_batches(dataloader, 2)
    out["skip_first_batches_len"] = len(skipped)
    out["skipped_first"] = values(next(iter(skipped))[0][:, 0] * 40)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
