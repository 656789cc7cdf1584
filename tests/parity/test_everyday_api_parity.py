"""Everyday Accelerate calls, run on Accelerate 1.15 and on nbaccel (1 and 2 gloo ranks) and compared exactly.

Each scenario is code written for Accelerate (`lib` is the library's top-level module): gradient accumulation
with `adjust_scheduler`, GradientState with a nested evaluation loop, every iterable-loader setting with
`gather_for_metrics`, `split_between_processes`, the tensor operations and clipping, bf16 autocast on the CPU,
the state's text, logging records, prepare's variants and what `accelerator._models` holds, save/load hooks,
sharded `save_model`, stateful loaders, `profile`, `end_training`, LOMO's `backward(loss, learning_rate=)`, and
bad input (exception types). Results, losses and final weights must be equal bit for bit. Where nbaccel deliberately differs (docs/compat.md) the test shows both sides:
`join_uneven_inputs` on CPU ranks, dtypes gloo cannot move, the CPU device's index, `max_shard_size` strings,
inputs refused earlier.
"""

from __future__ import annotations

import math
import os
import re
import sys
import tempfile
import warnings

import pytest
import torch
from parity_harness import assert_ranks_same, assert_same, run_both, run_ranks
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

pytest.importorskip("accelerate")
pytestmark = pytest.mark.timeout(600)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))


def accumulation_with_scheduler(lib):
    """Accumulation over a loader whose length is not a multiple of the steps, with a LambdaLR."""
    plugin = lib.utils.GradientAccumulationPlugin(num_steps=3, adjust_scheduler=True)
    accelerator = lib.Accelerator(cpu=True, gradient_accumulation_plugin=plugin)
    x = torch.arange(44, dtype=torch.float32).reshape(22, 2)
    x = torch.cat([x, x[:, :1]], dim=1) / 40
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=2)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + step))
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    trace = []
    for inputs, targets in loader:
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        trace.append((accelerator.sync_gradients, accelerator.gradient_state.end_of_dataloader,
                      scheduler.get_last_lr()[0], optimizer.step_was_skipped, round(loss.item(), 6)))
    weights = {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    return {"trace": trace, "weights": weights, "step": accelerator.step}


class Counting(IterableDataset):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        for i in range(self.n):
            yield torch.tensor([float(i)])


def iterable_loaders(lib):
    out = {}
    for split_batches in (False, True):
        for dispatch in (False, True):
            for even in (True, False):
                config = lib.utils.DataLoaderConfiguration(split_batches=split_batches, dispatch_batches=dispatch,
                                                           even_batches=even)
                accelerator = lib.Accelerator(cpu=True, dataloader_config=config)
                loader = accelerator.prepare(DataLoader(Counting(11), batch_size=4))
                seen = [b.flatten().tolist() for b in loader]
                gathered = []
                for b in loader:
                    gathered.append(accelerator.gather_for_metrics(b).flatten().tolist())
                out[f"{split_batches}-{dispatch}-{even}"] = (seen, gathered, len(seen))
                lib.state.AcceleratorState._reset_state(True)
    return out


def split_between(lib):
    state = lib.PartialState(cpu=True)
    out = []
    for data, pad in (([1, 2, 3], False), ([1, 2, 3], True), ({"a": [1, 2, 3], "b": [4, 5, 6]}, False),
                      (torch.arange(5), True), (["x"], True), ([], False), ("abcde", False), ("abc", True),
                      ({"a": [1, 2, 3], "b": "xyz"}, False), ({1, 2, 3}, False)):
        with state.split_between_processes(data, apply_padding=pad) as part:
            out.append(part if not isinstance(part, torch.Tensor) else part.tolist())
    try:  # no length: a TypeError on both
        with state.split_between_processes(7):
            out.append("split 7")
    except TypeError:
        out.append("TypeError")
    return out


def ops(lib):
    accelerator = lib.Accelerator(cpu=True)
    rank = accelerator.process_index
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3) + rank
    out = {
        "reduce_mean": accelerator.reduce(t, "mean"),
        "reduce_sum": accelerator.reduce(t, "sum"),
        "pad": accelerator.pad_across_processes(torch.ones(rank + 1, 2 + rank), dim=1, pad_index=-1),
        "pad_first": accelerator.pad_across_processes(torch.ones(rank + 1, 2), dim=0, pad_first=True),
        "gather_scalar": accelerator.gather(torch.tensor(float(rank))),
        "gather_objects": accelerator.gather_for_metrics([{"r": rank}, "s"], use_gather_object=True),
        "gather_int": accelerator.gather(torch.tensor([rank], dtype=torch.int32)),
        "gather_bool": accelerator.gather(torch.tensor([rank == 0])),
        "nested": accelerator.gather({"a": (t, [t[0]]), "b": torch.zeros(1, dtype=torch.int64)}),
    }
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    loss = model(torch.ones(4, 3) * (rank + 1)).pow(2).sum()
    accelerator.backward(loss)
    out["clip_norm"] = accelerator.clip_grad_norm_(model.parameters(), 0.5)
    out["clip_norm_inf"] = accelerator.clip_grad_norm_(model.parameters(), 0.5, norm_type=math.inf)
    accelerator.clip_grad_value_(model.parameters(), 0.01)
    out["grads"] = [p.grad.clone() for p in model.parameters()]
    out["state_dict_keys"] = list(accelerator.get_state_dict(model).keys())
    out["unwrapped"] = type(accelerator.unwrap_model(model)).__name__
    return out


def bf16_cpu(lib):
    accelerator = lib.Accelerator(cpu=True, mixed_precision="bf16")
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    losses = []
    for step in range(5):
        x = torch.linspace(-1, 1, 12).reshape(4, 3) * (step + 1)
        out = model(x)
        loss = out.float().pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append((loss.item(), str(out.dtype)))
    with accelerator.autocast():
        inside = model(torch.ones(2, 3)).dtype
    return {"losses": losses, "inside": str(inside),
            "weights": {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()},
            "unwrapped_fp32": str(accelerator.unwrap_model(model, keep_fp32_wrapper=False)(torch.ones(1, 3)).dtype)}


def state_text(lib):
    accelerator = lib.Accelerator(cpu=True)
    text = repr(accelerator.state)
    return {"repr": re.sub(r"Device: \S+", "Device: -", text), "device_line": re.search(r"Device: \S+", text)[0],
            "device": str(accelerator.device), "tensor_on_device": torch.ones(1).to(accelerator.device).device
            == accelerator.device, "type": str(accelerator.distributed_type),
            "mp": accelerator.mixed_precision, "num": accelerator.num_processes,
            "use_distributed": accelerator.use_distributed, "is_last": accelerator.is_last_process,
            "project_dir": accelerator.project_dir, "logging_dir": accelerator.logging_dir,
            "save_iteration": accelerator.save_iteration, "optimizer_step_was_skipped":
            accelerator.optimizer_step_was_skipped, "split_batches": accelerator.split_batches,
            "even_batches": accelerator.even_batches, "dispatch": accelerator.dispatch_batches,
            "grad_steps": accelerator.gradient_accumulation_steps,
            "fp8_backend": (type(accelerator.fp8_backend).__name__, str(accelerator.fp8_backend)),
            "fp8_enabled": accelerator.fp8_enabled}


def join_uneven(lib):
    """`join_uneven_inputs(even_batches=False)` over 7 samples in batches of 2 on 2 ranks."""
    accelerator = lib.Accelerator(cpu=True)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.linspace(0, 1, 21).reshape(7, 3)
    loader = DataLoader(TensorDataset(x), batch_size=2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    batches = []
    with accelerator.join_uneven_inputs([model], even_batches=False):
        for (inputs,) in loader:
            batches.append(inputs.shape[0])
            accelerator.backward(model(inputs).sum())
            optimizer.step()
            optimizer.zero_grad()
    return {"batches": batches, "after": [b[0].shape[0] for b in loader],
            "weights": {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}}


def dtypes_gloo_lacks(lib):
    """int16 tensors through gather, reduce and broadcast: gloo has no int16."""
    accelerator = lib.Accelerator(cpu=True)
    short = torch.tensor([accelerator.process_index, 7], dtype=torch.int16)
    results = {}
    for name, call in (("gather", lambda: accelerator.gather(short)),
                       ("reduce", lambda: accelerator.reduce(short, "sum")),
                       ("broadcast", lambda: lib.utils.broadcast(short.clone()))):
        try:
            value = call()
            results[name] = (value.tolist(), str(value.dtype))
        except RuntimeError as exc:
            results[name] = ("RuntimeError", str(exc).splitlines()[0])
    return results


def sharded_save_model(lib, root):
    """save_model in shards (an int and a decimal string size), both serializations, with tied weights: the
    files, the index file's text and every tensor in every file."""
    accelerator = lib.Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 40), torch.nn.ReLU(), torch.nn.Linear(40, 2), torch.nn.Linear(40, 2))
    model[3].weight = model[2].weight  # tied: stored once, in the first one's shard
    model = accelerator.prepare(model)
    root = os.path.join(root, lib.__name__)
    os.makedirs(root, exist_ok=True)
    out = {}
    for size in (200, "0.5KB"):
        for safe in (True, False):
            target = tempfile.mkdtemp(dir=root) if accelerator.is_main_process else None
            target = lib.utils.broadcast_object_list([target])[0]
            accelerator.save_model(model, target, max_shard_size=size, safe_serialization=safe)
            accelerator.wait_for_everyone()
            files = sorted(os.listdir(target))
            index = [name for name in files if name.endswith(".index.json")]
            tensors = {}
            for name in files:
                if name.endswith(".safetensors"):
                    from safetensors.torch import load_file

                    tensors[name] = load_file(os.path.join(target, name))
                elif name.endswith(".bin"):
                    tensors[name] = torch.load(os.path.join(target, name), weights_only=True)
            index_text = open(os.path.join(target, index[0])).read() if index else None
            out[f"{size}-{safe}"] = {"files": files, "index": index_text, "tensors": tensors}
            accelerator.wait_for_everyone()
    return out


def shard_size_strings(lib, root):
    """max_shard_size values the libraries read differently (docs/compat.md)."""
    accelerator = lib.Accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(3, 40))
    outcomes = {}
    for size in ("300B", "1KiB", "2000", 0):
        target = tempfile.mkdtemp(dir=root)
        try:
            accelerator.save_model(model, target, max_shard_size=size)
            outcomes[repr(size)] = len([name for name in os.listdir(target) if name.endswith(".safetensors")])
        except ValueError as exc:
            outcomes[repr(size)] = "ValueError: " + str(exc)
    return outcomes


def _outcome(call):
    try:
        value = call()
        return ("ok", type(value).__name__)
    except Exception as exc:  # noqa: BLE001
        return tuple(base.__name__ for base in (ValueError, TypeError, FileNotFoundError, AssertionError)
                     if isinstance(exc, base)) or (type(exc).__name__,)


def bad_inputs(lib):
    results = {}
    reset = lambda: lib.state.AcceleratorState._reset_state(True)  # noqa: E731
    cases = {
        "mp_bad": lambda: lib.Accelerator(cpu=True, mixed_precision="fp17"),
        "gas_zero": lambda: lib.Accelerator(cpu=True, gradient_accumulation_steps=0),
        "gas_neg": lambda: lib.Accelerator(cpu=True, gradient_accumulation_steps=-1),
        "gas_and_plugin": lambda: lib.Accelerator(cpu=True, gradient_accumulation_steps=2,
                                                  gradient_accumulation_plugin=lib.utils.GradientAccumulationPlugin(num_steps=2)),
        "log_with_bad": lambda: lib.Accelerator(cpu=True, log_with="nope"),
        "dynamo_bad": lambda: lib.Accelerator(cpu=True, dynamo_backend="nope"),
        "rng_bad": lambda: lib.Accelerator(cpu=True, rng_types=["nope"]),
        "kwargs_dup": lambda: lib.Accelerator(cpu=True, kwargs_handlers=[lib.utils.DistributedDataParallelKwargs(),
                                                                         lib.utils.DistributedDataParallelKwargs()]),
        "kwargs_bad": lambda: lib.Accelerator(cpu=True, kwargs_handlers=[object()]),
        "project_limit": lambda: lib.utils.ProjectConfiguration(total_limit=-2),
        "dl_config_bad": lambda: lib.utils.DataLoaderConfiguration(split_batches="yes"),
        "load_state_missing": lambda: lib.Accelerator(cpu=True).load_state("/nonexistent/dir/xyz"),
        "reduce_bad": lambda: lib.Accelerator(cpu=True).reduce(torch.ones(2), reduction="avg"),
        # a mean of integers: a RuntimeError on 2 processes (Accelerate's from torch's in-place division,
        # nbaccel's before communicating); neither divides, so neither refuses, on 1
        "reduce_int_mean": lambda: lib.Accelerator(cpu=True).reduce(torch.tensor([1, 4]), "mean"),
        "gather_non_tensor": lambda: lib.Accelerator(cpu=True).gather([1, 2]),
        "pad_bad_dim": lambda: lib.Accelerator(cpu=True).pad_across_processes(torch.ones(2), dim=3),
        "unwrap_plain": lambda: lib.Accelerator(cpu=True).unwrap_model(torch.nn.Linear(1, 1)),
        "skip_bad": lambda: lib.Accelerator(cpu=True).skip_first_batches(DataLoader(TensorDataset(torch.ones(4)), batch_size=2), -1),
        "get_tracker_none": lambda: lib.Accelerator(cpu=True).get_tracker("tensorboard"),
        "save_state_no_dir": lambda: lib.Accelerator(cpu=True).save_state(),
        "clip_no_model": lambda: lib.Accelerator(cpu=True).clip_grad_norm_([], 1.0),
        "prepare_bad": lambda: lib.Accelerator(cpu=True).prepare(42),
        "prepare_none": lambda: lib.Accelerator(cpu=True).prepare(None),
        "free_memory": lambda: lib.Accelerator(cpu=True).free_memory(),
    }
    for name, call in cases.items():
        results[name] = _outcome(call)
        reset()
    return results


def logging_records(lib):
    import logging

    accelerator = lib.Accelerator(cpu=True)
    logger = lib.logging.get_logger("probe.logger", log_level="INFO")
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append((record.levelname, record.getMessage()))

    handler = Keep()
    logger.logger.addHandler(handler)
    logger.info("all %d", 1)
    logger.info("main only")
    logger.info("everyone", main_process_only=False)
    logger.info("in order", main_process_only=False, in_order=True)
    logger.warning_once("once")
    logger.warning_once("once")
    logger.debug("debug hidden")
    logger.logger.removeHandler(handler)
    return {"records": records, "level": logger.getEffectiveLevel(), "rank": accelerator.process_index}


def stateful_loader_resume(lib, root, seedable):
    """use_stateful_dataloader=True: torchdata's state mid-epoch, save_state there, the rest of the epoch,
    then load_state and the epoch again from the saved position."""
    root = os.path.join(root, lib.__name__, str(seedable))
    accelerator = lib.Accelerator(cpu=True, dataloader_config=lib.utils.DataLoaderConfiguration(
        use_stateful_dataloader=True, use_seedable_sampler=seedable))
    lib.utils.set_seed(0)
    x = torch.arange(40, dtype=torch.float32).reshape(20, 2)
    loader = accelerator.prepare(DataLoader(TensorDataset(x), batch_size=2, shuffle=True))
    batches = iter(loader)
    seen = [next(batches)[0][:, 0].tolist() for _ in range(3)]
    state = loader.state_dict()
    accelerator.save_state(os.path.join(root, "checkpoint"))
    rest = [batch[0][:, 0].tolist() for batch in batches]
    accelerator.load_state(os.path.join(root, "checkpoint"))
    resumed = [batch[0][:, 0].tolist() for batch in loader]
    return {"seen": seen, "state": state, "rest": rest, "resumed": resumed,
            "next_epoch": [batch[0][:, 0].tolist() for batch in loader],
            "is_stateful": isinstance(loader, __import__("torchdata.stateful_dataloader").stateful_dataloader
                                      .StatefulDataLoader), "is_shard": isinstance(loader, lib.data_loader.DataLoaderShard)}


def prepare_variants(lib):
    """prepare with a device_placement list, twice, prepare_model(evaluation_mode=True), single objects,
    objects it passes through; the warnings."""
    out = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        accelerator = lib.Accelerator(cpu=True)
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = DataLoader(TensorDataset(torch.ones(8, 3)), batch_size=2)
        pm, po, pl = accelerator.prepare(model, optimizer, loader, device_placement=[False, True, True])
        out["types"] = [type(pm).__name__, type(po).__name__, type(pl).__name__]
        again = accelerator.prepare(pm)
        out["again_type"] = type(again).__name__
        out["again_same"] = again is pm
        evalm = accelerator.prepare_model(_model(), evaluation_mode=True)
        out["eval_type"] = type(evalm).__name__
        out["n_models"] = len(accelerator._models)
        out["n_opt"] = len(accelerator._optimizers)
        out["n_dl"] = len(accelerator._dataloaders)
        single = accelerator.prepare(torch.nn.Linear(2, 2))
        out["single_type"] = type(single).__name__
        out["tuple_ret"] = type(accelerator.prepare(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))).__name__
        out["passthrough"] = accelerator.prepare(5, "x")
    out["warnings"] = sorted({f"{w.category.__name__}: {str(w.message)[:100]}" for w in caught
                              if "accelerate" not in str(w.message).lower() and "nbaccel" not in str(w.message).lower()})
    out["lib_warnings"] = sorted({f"{w.category.__name__}" for w in caught
                                  if "accelerate" in str(w.message).lower() or "nbaccel" in str(w.message).lower()})
    return out


def models_list(lib):
    """What `accelerator._models` holds after prepare, prepare again and prepare_model (hooks receive it)."""
    accelerator = lib.Accelerator(cpu=True)
    model = _model()
    pm = accelerator.prepare(model)
    a = [type(m).__name__ for m in accelerator._models]
    again = accelerator.prepare(pm)
    b = [type(m).__name__ for m in accelerator._models]
    c = accelerator.prepare_model(pm)
    d = [type(m).__name__ for m in accelerator._models]
    return {"a": a, "b": b, "d": d, "flag": getattr(pm, "_is_accelerate_prepared", None), "same": again is pm and c is pm}


class Pretrained(torch.nn.Module):
    """A model with a method of its own, as transformers/diffusers models have `save_pretrained`."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(3, 2)

    def forward(self, x):
        return self.layer(x)

    def save_pretrained(self, folder):
        os.makedirs(folder, exist_ok=True)
        torch.save(self.state_dict(), os.path.join(folder, "weights.pt"))


def hooks_get_the_models(lib, root):
    """Save and load hooks that call each model's own method (diffusers' training scripts do) and pop the
    weights they saved themselves."""
    root = os.path.join(root, lib.__name__)
    accelerator = lib.Accelerator(cpu=True)
    torch.manual_seed(0)
    model = accelerator.prepare(Pretrained())
    seen = []

    def save_hook(models, weights, output_dir):
        seen.append(("save", [type(m).__name__ for m in models], len(weights)))
        for m in models:
            m.save_pretrained(os.path.join(output_dir, "pretrained"))
            weights.pop()

    def load_hook(models, input_dir):
        seen.append(("load", [type(m).__name__ for m in models]))
        while models:
            models.pop()

    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)
    accelerator.save_state(os.path.join(root, "checkpoint"))
    accelerator.wait_for_everyone()
    files = sorted(os.listdir(os.path.join(root, "checkpoint")))
    accelerator.load_state(os.path.join(root, "checkpoint"))
    return {"seen": seen, "files": [name for name in files if not name.startswith(".nbaccel")],
            "model": type(model).__name__}


def gradient_state(lib):
    """GradientState through accumulation with an evaluation loop nested in the training loop: in/end of
    dataloader, remainder, the active loader, sync flags, the step counter."""
    accelerator = lib.Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train = DataLoader(TensorDataset(torch.arange(7.0).reshape(7, 1)), batch_size=2)
    evals = DataLoader(TensorDataset(torch.arange(5.0).reshape(5, 1)), batch_size=2)
    model, optimizer, train, evals = accelerator.prepare(model, optimizer, train, evals)
    gs = accelerator.gradient_state
    trace = [("before", gs.in_dataloader, gs.end_of_dataloader, gs.remainder, gs.active_dataloader is None)]
    for i, (x,) in enumerate(train):
        with accelerator.accumulate(model):
            accelerator.backward(model(x).sum())
            optimizer.step()
            optimizer.zero_grad()
        trace.append(("train", i, gs.in_dataloader, gs.end_of_dataloader, gs.sync_gradients, gs.remainder,
                      gs.active_dataloader is train, accelerator.step))
        if i == 1:
            for j, (y,) in enumerate(evals):
                g = accelerator.gather_for_metrics(y)
                trace.append(("eval", j, gs.in_dataloader, gs.end_of_dataloader, gs.remainder,
                              gs.active_dataloader is evals, g.shape[0]))
            trace.append(("back", gs.in_dataloader, gs.end_of_dataloader, gs.active_dataloader is train))
    trace.append(("after", gs.in_dataloader, gs.end_of_dataloader, gs.remainder, gs.active_dataloader is None,
                  gs.num_steps, gs.adjust_scheduler, gs.sync_with_dataloader))
    return trace


def after_end_training(lib):
    """`end_training` destroys the process group (no launcher that forked the ranks owns it here): the state
    keeps its description, and collectives after it raise on both."""
    accelerator = lib.Accelerator(cpu=True)
    # every rank past gloo's connect first: a rank that destroys its group while the other still completes the
    # mesh ends that one's init with "Connection closed by peer" (seen under accelerate on a busy machine)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return {"initialized": torch.distributed.is_initialized(),
            "state": (str(accelerator.distributed_type), accelerator.num_processes, accelerator.process_index),
            "wait": _outcome(accelerator.wait_for_everyone),
            "gather": _outcome(lambda: accelerator.gather(torch.ones(1))),
            "reduce": _outcome(lambda: accelerator.reduce(torch.ones(1))),
            "gather_for_metrics": _outcome(lambda: accelerator.gather_for_metrics(torch.ones(1)))}


def reduced_loss_training(lib):
    """Training on losses reduced across the processes before `backward`: the reduced result keeps the graph
    (its gradient is each rank's own loss's, over the number of processes for a mean), in every reduction
    and in a nested structure whose other tensors need no gradient; the warnings torch gives on the way."""
    import warnings

    accelerator = lib.Accelerator(cpu=True)
    rank = accelerator.process_index
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    trace = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, reduction in enumerate(["mean", "sum", "max", "mean", "dict"]):
            loss = model(torch.ones(4, 3) * (rank + 1 + step)).pow(2).mean()
            if reduction == "dict":
                reduced = accelerator.reduce({"loss": loss, "seen": torch.tensor(4.0)}, "mean")
                value = reduced["loss"]
                trace.append(("seen", reduced["seen"].requires_grad, reduced["seen"].item()))
            else:
                value = accelerator.reduce(loss, reduction)
            trace.append((reduction, value.requires_grad, value.item()))
            accelerator.backward(value)
            trace.append([p.grad.clone() for p in model.parameters()])
            optimizer.step()
            optimizer.zero_grad()
        with torch.no_grad():  # no graph to keep
            plain = accelerator.reduce(model(torch.ones(1, 3)).sum(), "sum")
        trace.append(("no_grad", plain.requires_grad, plain.item()))
    weights = {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    return {"trace": trace, "weights": weights,
            "warnings": [(w.category.__name__, str(w.message)[:80]) for w in caught]}


SAME = [accumulation_with_scheduler, iterable_loaders, split_between, ops, bf16_cpu, state_text, logging_records,
        prepare_variants, models_list, gradient_state, after_end_training, reduced_loss_training]


def lomo_training(lib, kind, side):
    """`accelerator.backward(loss, learning_rate=lr)` with a LOMO optimizer: backward and update in one pass.
    `side`: where run.sh installed lomo-optim (with transformers, which the main environment leaves out)."""
    import sys

    sys.path.insert(0, side)
    import lomo_optim

    accelerator = lib.Accelerator(cpu=True)
    model = _model()
    optimizer = getattr(lomo_optim, kind)(model, lr=0.05)
    model, optimizer = accelerator.prepare(model, optimizer)
    torch.manual_seed(1)
    losses = []
    for _ in range(4):
        x = torch.randn(4, 3)
        loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
        accelerator.backward(loss, learning_rate=0.05)
        losses.append(round(loss.item(), 7))
    weights = {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    return {"has_lomo": accelerator.has_lomo_optimizer, "losses": losses, "weights": weights,
            "no_rate": _outcome(lambda: accelerator.lomo_backward(model(torch.ones(1, 3)).sum(), None))}


def profiling(lib, root):
    """`accelerator.profile`: a handler's schedule and callback, the trace file each process writes, and a
    profile on the main process alone (the processes wait for each other only when a trace is written)."""
    accelerator = lib.Accelerator(cpu=True)
    ready = []
    handler = lib.utils.ProfileKwargs(schedule_option={"wait": 1, "warmup": 1, "active": 2, "repeat": 1},
                                      on_trace_ready=lambda prof: ready.append(prof.step_num))
    with accelerator.profile(handler) as prof:
        for _ in range(6):
            torch.ones(4).sum()
            prof.step()
    traces = os.path.join(root, lib.__name__)
    with accelerator.profile(lib.utils.ProfileKwargs(output_trace_dir=traces)):
        torch.ones(8).mul(2)
    files = sorted(os.listdir(traces))
    alone = None
    if accelerator.is_main_process:
        with accelerator.profile() as prof:
            torch.ones(2).add(1)
        alone = type(prof).__name__
    accelerator.wait_for_everyone()
    return {"ready": ready, "files": files, "alone": alone}


def _compare(results: dict, name: str, num_processes: int) -> None:
    assert_ranks_same(results, f"{name}[{num_processes} processes]")


@pytest.mark.parametrize("num_processes", [1, 2])
@pytest.mark.parametrize("scenario", SAME, ids=[f.__name__ for f in SAME])
def test_the_same_on_both(scenario, num_processes):
    results = run_both(scenario, num_processes)
    if scenario is state_text and num_processes == 2:
        # docs/compat.md: Accelerate's CPU ranks all say cpu:0, which no CPU tensor's device equals
        for theirs, ours in zip(results["accelerate"], results["nbaccel"]):
            assert (theirs.pop("device"), theirs.pop("device_line"), theirs.pop("tensor_on_device")) == (
                "cpu:0", "Device: cpu:0", False)
            assert (ours.pop("device"), ours.pop("device_line"), ours.pop("tensor_on_device")) == (
                "cpu", "Device: cpu", True)
    _compare(results, scenario.__name__, num_processes)


def test_join_uneven_inputs_joins_cpu_ranks_where_accelerate_does_nothing():
    """docs/compat.md: Accelerate joins on multi-GPU types only; on CPU ranks it keeps even batches (rank 1
    trains on a repeated sample) while nbaccel's rank 1 gets its last, short batch and DDP's Join covers it."""
    results = run_both(join_uneven, 2)
    assert [r["batches"] for r in results["accelerate"]] == [[2, 2], [2, 2]]
    assert [r["batches"] for r in results["nbaccel"]] == [[2, 2], [2, 1]]
    for library in results.values():  # the override ends with the block; the ranks agree on the weights
        assert [r["after"] for r in library] == [[2, 2], [2, 2]]
        assert_same(library[0]["weights"], library[1]["weights"])


def test_dtypes_gloo_lacks_move_on_nbaccel_and_fail_on_accelerate():
    """docs/compat.md: gloo has no int16; nbaccel moves it as bytes (gather, broadcast) or reduces it in a
    wider dtype, and gives int16 back. Accelerate passes it to gloo, which raises."""
    results = run_both(dtypes_gloo_lacks, 2)
    for rank, (theirs, ours) in enumerate(zip(results["accelerate"], results["nbaccel"])):
        assert theirs == {name: ("RuntimeError", "Invalid scalar type") for name in ("gather", "reduce", "broadcast")}
        assert ours == {"gather": ([0, 7, 1, 7], "torch.int16"), "reduce": ([1, 14], "torch.int16"),
                        "broadcast": ([0, 7], "torch.int16")}, rank


@pytest.mark.parametrize("num_processes", [1, 2])
def test_save_model_in_shards_writes_the_same_files(num_processes, tmp_path):
    _compare(run_both(sharded_save_model, num_processes, args=(str(tmp_path),)), "sharded_save_model", num_processes)


LOMO_SIDE = os.path.join(sys.prefix, "side", "lomo")  # run.sh installs lomo-optim there (see constraints.txt)


@pytest.mark.parametrize("num_processes", [1, 2])
def test_backward_with_a_learning_rate_runs_the_lomo_optimizer(num_processes):
    """Lomo only: lomo-optim's AdaLomo puts its state on CUDA in its constructor (`.cuda()`), on either library."""
    assert os.path.isdir(os.path.join(LOMO_SIDE, "lomo_optim")), f"{LOMO_SIDE} lacks lomo-optim: run ./run.sh test"
    _compare(run_both(lomo_training, num_processes, args=("Lomo", LOMO_SIDE)), "lomo_training", num_processes)


@pytest.mark.parametrize("num_processes", [1, 2])
def test_profile_writes_the_same_traces_and_waits_only_for_them(num_processes, tmp_path):
    _compare(run_both(profiling, num_processes, args=(str(tmp_path),)), "profiling", num_processes)


def test_shard_sizes_accelerate_refuses_or_reads_differently(tmp_path):
    """docs/compat.md: nbaccel reads bytes ("300B", "2000") and binary units ("1KiB"), which Accelerate's
    parser (huggingface_hub's) refuses; a size of 0 is an error in nbaccel, one tensor per shard in Accelerate."""
    [theirs], [ours] = run_both(shard_size_strings, 1, args=(str(tmp_path),)).values()
    assert {size: str(outcome).split(".")[0] for size, outcome in theirs.items()} == {
        "'300B'": "ValueError: Unit '0B' not supported", "'1KiB'": "ValueError: Unit 'IB' not supported",
        "'2000'": "ValueError: Unit '00' not supported", "0": "2"}
    assert ours == {"'300B'": 2, "'1KiB'": 1, "'2000'": 1, "0": "ValueError: max_shard_size must be positive, got 0."}


# Where Accelerate accepts a value and fails later (or never), nbaccel refuses it at once; where both refuse
# with different types (docs/compat.md, "Bad input fails early").
REFUSED_EARLY = {
    "gas_zero": (("ok", "Accelerator"), ("ValueError",)),
    "gas_neg": (("ok", "Accelerator"), ("ValueError",)),
    "rng_bad": (("ok", "Accelerator"), ("ValueError",)),
    "project_limit": (("ok", "ProjectConfiguration"), ("ValueError",)),
    "reduce_bad": (("ok", "Tensor"), ("ValueError",)),
    "skip_bad": (("ok", "DataLoader"), ("ValueError",)),
    "kwargs_bad": (("AssertionError",), ("TypeError",)),
    "save_state_no_dir": (("TypeError",), ("ValueError",)),
    # the same ValueError, and a FileNotFoundError too
    "load_state_missing": (("ValueError",), ("ValueError", "FileNotFoundError")),
}


@pytest.mark.parametrize("num_processes", [1, 2])
def test_bad_input_fails_as_in_accelerate_or_earlier(num_processes):
    results = run_both(bad_inputs, num_processes)
    for theirs, ours in zip(results["accelerate"], results["nbaccel"]):
        for name, (accelerate_outcome, nbaccel_outcome) in REFUSED_EARLY.items():
            assert (theirs.pop(name), ours.pop(name)) == (accelerate_outcome, nbaccel_outcome), name
        assert ours == theirs


@pytest.mark.parametrize("seedable", [False, True])
def test_a_stateful_loader_resumes_as_in_accelerate(tmp_path, seedable):
    pytest.importorskip("torchdata")
    _compare(run_both(stateful_loader_resume, 1, args=(str(tmp_path), seedable)), "stateful_loader_resume", 1)


def test_a_stateful_loader_resumes_on_two_ranks(tmp_path):
    """Not compared with Accelerate on 2 ranks: there every rank `torch.save`s the same `dl_state_dict.bin`
    at once and loads it without a barrier, so a rank now and then reads a half-written file
    (`UnpicklingError`, in one of the first two runs here; docs/compat.md). nbaccel's ranks resume at the saved position."""
    pytest.importorskip("torchdata")
    ranks = run_ranks(stateful_loader_resume, "nbaccel", 2, args=(str(tmp_path), True))
    for rank in ranks:  # the resumed pass starts at the saved position: 3 of 5 batches were used
        assert len(rank["seen"]) == 3 and len(rank["rest"]) == len(rank["resumed"]) == 2
        assert rank["is_stateful"] and rank["is_shard"]
    for part in ("seen", "rest", "resumed", "next_epoch"):  # the ranks read disjoint samples
        first, second = ({x for batch in rank[part] for x in batch} for rank in ranks)
        assert not first & second, part


@pytest.mark.parametrize("num_processes", [1, 2])
def test_save_and_load_hooks_get_the_models_themselves(num_processes, tmp_path):
    """Accelerate hands hooks `accelerator._models`: the modules, not their DDP wrappers (nbaccel handed the
    wrappers on several ranks, and `model.save_pretrained` failed there)."""
    results = run_both(hooks_get_the_models, num_processes, args=(str(tmp_path),))
    _compare(results, "hooks_get_the_models", num_processes)
    assert results["nbaccel"][0]["seen"] == [("save", ["Pretrained"], 1), ("load", ["Pretrained"])]


def resume_across(lib, root, phase):
    """Train 3 steps and `save_state` mid-epoch ("save"), or `load_state` that checkpoint and train to the end
    of the next epoch ("resume"), or train both epochs without a break ("full"): AdamW, a scheduler, a
    registered object, the seedable sampler, RNG states."""
    accelerator = lib.Accelerator(cpu=True, dataloader_config=lib.utils.DataLoaderConfiguration(
        use_seedable_sampler=True))
    lib.utils.set_seed(7)
    x = torch.linspace(-1, 1, 66).reshape(22, 3)
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=2, shuffle=True)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.7)
    counter = {"steps": 0}

    class Steps:
        def state_dict(self):
            return dict(counter)

        def load_state_dict(self, state):
            counter.update(state)

    accelerator.register_for_checkpointing(Steps())
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    checkpoint = os.path.join(root, "checkpoint")
    losses, skip = [], 0
    if phase == "resume":
        accelerator.load_state(checkpoint)
        skip = counter["steps"]
    for epoch in range(2):
        loader.set_epoch(epoch)
        batches = accelerator.skip_first_batches(loader, skip) if epoch == 0 and skip else loader
        for inputs, targets in batches:
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            counter["steps"] += 1
            losses.append(round(loss.item(), 7))
            if phase == "save" and counter["steps"] == 3:
                accelerator.save_state(checkpoint)
                accelerator.wait_for_everyone()
                return {"losses": losses, "noise": torch.rand(2)}
    weights = {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    return {"losses": losses, "weights": weights, "lr": scheduler.get_last_lr(), "noise": torch.rand(2),
            "steps": counter["steps"]}


@pytest.mark.parametrize("saved_by", ["accelerate", "nbaccel"])
def test_a_checkpoint_of_either_library_resumes_the_same_on_both(saved_by, tmp_path):
    """Moving a project over mid-training: a checkpoint `save_state` wrote on one library, loaded by
    `load_state` on each, continues with the same losses, weights and learning rate. The random numbers after
    the resume are the same too, except (docs/compat.md, "Prepared loaders save their position") where
    nbaccel resumes its own checkpoint: it replays the interrupted epoch's RNG draws on a forked RNG, so its
    stream is the uninterrupted run's; Accelerate draws again at the resume."""
    run_ranks(resume_across, saved_by, 2, args=(str(tmp_path), "save"))
    resumed = {lib: run_ranks(resume_across, lib, 2, args=(str(tmp_path), "resume"))
               for lib in ("accelerate", "nbaccel")}
    assert resumed["nbaccel"][0]["steps"] == 12  # 3 before the checkpoint, 9 after (6 per epoch and rank)
    if saved_by == "nbaccel":
        uninterrupted = run_ranks(resume_across, "nbaccel", 2, args=(str(tmp_path / "full"), "full"))
        for rank, ours in enumerate(resumed["nbaccel"]):
            assert_same(uninterrupted[rank]["noise"], ours.pop("noise"), f"rank {rank}: the uninterrupted run's RNG")
            assert_same(uninterrupted[rank]["weights"], ours["weights"], f"rank {rank}: the uninterrupted run's weights")
            resumed["accelerate"][rank].pop("noise")
    _compare(resumed, f"resume_across (saved by {saved_by})", 2)
