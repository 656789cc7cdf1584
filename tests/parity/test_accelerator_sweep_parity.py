"""The Accelerator's everyday methods, second pass, run on Accelerate 1.15 and on nbaccel (1 and 2 gloo ranks)
and compared: accumulation over several models, `no_sync`/`trigger_sync_in_backward`, `backward(**kwargs)`,
clipping inside accumulation, the fp16 path (a GradScaler: skipped steps, the scheduler held back, clipping's
unscale), scheduler stepping with `split_batches`/`adjust_scheduler`/`step_scheduler_with_optimizer`, the
context managers' yields and exceptions, kwargs handlers that are honoured, properties. Where nbaccel differs
on purpose (docs/compat.md) the test shows both sides: objects that came from `prepare_data_loader` or
`prepare_optimizer` handed to `prepare`, `InitProcessGroupKwargs(backend=)` on one process,
`split_between_processes({})` on several."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
from parity_harness import assert_ranks_same, run_both
from torch.utils.data import DataLoader, TensorDataset

pytest.importorskip("accelerate")
pytestmark = pytest.mark.timeout(300)


def _outcome(call):
    try:
        return ("ok", call())
    except Exception as exc:  # the type is what code written for Accelerate catches
        return ("raised", type(exc).__name__)


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))


def _weights(accelerator, model):
    return {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}


def _grads(model):
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def _reset(lib):
    lib.state.AcceleratorState._reset_state(True)


# --- what matched: kept so that it stays so -------------------------------------------------------------------
def several_models(lib):
    """accumulate(m1, m2) with one optimizer over both, clipping both on the synchronizing steps."""
    accelerator = lib.Accelerator(cpu=True, gradient_accumulation_steps=2)
    m1, m2 = _model(0), _model(1)
    opt = torch.optim.SGD([*m1.parameters(), *m2.parameters()], lr=0.1)
    x = torch.arange(30, dtype=torch.float32).reshape(10, 3) / 30
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=2)
    m1, m2, opt, loader = accelerator.prepare(m1, m2, opt, loader)
    trace = []
    for xb, yb in loader:
        with accelerator.accumulate(m1, m2):
            accelerator.backward(torch.nn.functional.mse_loss(m1(xb) + m2(xb), yb))
            norm = accelerator.clip_grad_norm_([*m1.parameters(), *m2.parameters()], 0.1) \
                if accelerator.sync_gradients else None
            opt.step()
            opt.zero_grad()
        trace.append((accelerator.sync_gradients, norm, accelerator.optimizer_step_was_skipped, accelerator.step))
    _reset(lib)
    return {"trace": trace, "w1": _weights(accelerator, m1), "w2": _weights(accelerator, m2)}


def syncing(lib):
    """no_sync, trigger_sync_in_backward (alone and on an accumulation step), sync_each_batch, what each
    context manager yields, and the state after an exception in accumulate/autocast/no_sync."""
    out = {}
    accelerator = lib.Accelerator(cpu=True, gradient_accumulation_steps=4)
    rank = accelerator.process_index
    model = accelerator.prepare(_model())
    with accelerator.no_sync(model) as yielded:
        accelerator.backward(model(torch.ones(2, 3) * (rank + 1)).sum())
    out["no_sync"] = (_grads(model), repr(yielded))
    model.zero_grad()
    with accelerator.accumulate(model) as yielded:
        with accelerator.trigger_sync_in_backward(model):
            accelerator.backward(model(torch.ones(1, 3) * (rank + 1)).sum())
    out["trigger_in_accumulation"] = (_grads(model), accelerator.sync_gradients, repr(yielded))
    for raising in ("accumulate", "autocast", "no_sync"):
        try:
            with getattr(accelerator, raising)(*([] if raising == "autocast" else [model])):
                raise KeyError(raising)
        except KeyError:
            pass
    out["after_raises"] = (accelerator.step, accelerator.sync_gradients, torch.is_autocast_enabled("cpu"),
                           getattr(model, "require_backward_grad_sync", None))
    _reset(lib)
    plugin = lib.utils.GradientAccumulationPlugin(num_steps=2, sync_each_batch=True, sync_with_dataloader=False)
    accelerator = lib.Accelerator(cpu=True, gradient_accumulation_plugin=plugin)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = accelerator.prepare(model, opt)
    trace = []
    for i in range(3):
        with accelerator.accumulate(model):
            accelerator.backward(model(torch.ones(1, 3) * (rank + i + 1)).sum())
            trace.append((accelerator.sync_gradients, _grads(model)))
            opt.step()
            opt.zero_grad()
    out["sync_each_batch"] = (trace, _weights(accelerator, model))
    _reset(lib)
    return out


def backward_and_clipping(lib):
    """backward(retain_graph=, inputs=, gradient=), a second backward through a freed graph, clipping's return
    values on accumulation steps in fp32 and bf16."""
    out = {}
    accelerator = lib.Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = accelerator.prepare(_model())
    loss = model(torch.ones(2, 3)).sum()
    accelerator.backward(loss, retain_graph=True)
    accelerator.backward(loss)
    out["retained"] = _grads(model)
    model.zero_grad()
    y = model(torch.ones(2, 3))
    out["gradient"] = (_outcome(lambda: accelerator.backward(y, gradient=torch.ones_like(y))), _grads(model))
    model.zero_grad()
    # last: on several processes DDP's next forward fails after a backward that left parameters out
    accelerator.backward(model(torch.ones(2, 3)).sum(), inputs=[next(model.parameters())])
    out["inputs"] = _grads(model)
    out["freed"] = _outcome(lambda: accelerator.backward(loss))
    _reset(lib)
    for precision in ("no", "bf16"):
        accelerator = lib.Accelerator(cpu=True, mixed_precision=precision, gradient_accumulation_steps=2)
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = accelerator.prepare(model, opt)
        trace = []
        for i in range(4):
            with accelerator.accumulate(model):
                accelerator.backward(model(torch.ones(2, 3) * (i + 1)).pow(2).sum())
                trace.append((accelerator.sync_gradients, accelerator.clip_grad_norm_(model.parameters(), 1.0),
                              accelerator.clip_grad_value_(model.parameters(), 0.05)))
                opt.step()
                opt.zero_grad()
        out[precision] = (trace, _weights(accelerator, model))
        _reset(lib)
    return out


def _fp16(lib, gradient_accumulation_steps=1, **scaler):
    """An Accelerator on Accelerate's fp16 path on the CPU: a CPU GradScaler (Accelerate makes none there,
    docs/compat.md) and native_amp set by hand; the model stays unprepared, so neither autocasts a forward."""
    accelerator = lib.Accelerator(cpu=True, mixed_precision="fp16",
                                  gradient_accumulation_steps=gradient_accumulation_steps)
    accelerator.scaler = torch.amp.GradScaler("cpu", **scaler)
    accelerator.native_amp = True
    return accelerator


def fp16_scaler(lib):
    """Overflowing steps with a GradScaler: step_was_skipped, the scheduler held back, the scale, clipping's
    unscale (once per step: a second clip is torch's RuntimeError on both), with and without accumulation."""
    out = {}
    for steps in (1, 2):
        accelerator = _fp16(lib, steps, init_scale=2.0 ** 10, growth_interval=2)
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
        loader = DataLoader(TensorDataset(torch.arange(24.0).reshape(8, 3) / 24), batch_size=1)
        opt, loader, sched = accelerator.prepare(opt, loader, sched)
        trace = []
        for i, (x,) in enumerate(loader):
            with accelerator.accumulate(model):
                accelerator.backward(model(x * (1e30 if i in (2, 3) else 1.0)).pow(2).sum())
                norm = accelerator.clip_grad_norm_(model.parameters(), 1.0) if accelerator.sync_gradients else None
                opt.step()
                sched.step()
                opt.zero_grad()
            trace.append((accelerator.sync_gradients, norm, opt.step_was_skipped,
                          accelerator.optimizer_step_was_skipped, sched.get_last_lr()[0], accelerator.scaler.get_scale()))
        out[steps] = (trace, {k: v.clone() for k, v in model.state_dict().items()})
        _reset(lib)
    accelerator = _fp16(lib, init_scale=8.0)
    model = _model()
    opt = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.01))
    accelerator.backward(model(torch.ones(2, 3)).sum())
    out["unscaled"] = (accelerator.clip_grad_norm_(model.parameters(), 100.0), _grads(model),
                       _outcome(lambda: accelerator.clip_grad_norm_(model.parameters(), 100.0)),
                       _outcome(lambda: accelerator.clip_grad_value_(model.parameters(), 0.1)))
    _reset(lib)
    return out


def schedulers(lib):
    """A StepLR under every split_batches/step_scheduler_with_optimizer/adjust_scheduler setting over a loader
    whose length is no multiple of the accumulation steps; OneCycleLR stepped past its end; ReduceLROnPlateau."""
    out = {}
    for split in (False, True):
        for with_optimizer in (True, False):
            for adjust in (True, False):
                accelerator = lib.Accelerator(
                    cpu=True, dataloader_config=lib.utils.DataLoaderConfiguration(split_batches=split),
                    gradient_accumulation_plugin=lib.utils.GradientAccumulationPlugin(num_steps=3,
                                                                                      adjust_scheduler=adjust),
                    step_scheduler_with_optimizer=with_optimizer)
                model = _model()
                opt = torch.optim.SGD(model.parameters(), lr=1.0)
                sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
                loader = DataLoader(TensorDataset(torch.ones(20, 3)), batch_size=2)
                model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
                lrs = []
                for (x,) in loader:
                    with accelerator.accumulate(model):
                        accelerator.backward(model(x).sum())
                        opt.step()
                        sched.step()
                        opt.zero_grad()
                    lrs.append((sched.get_last_lr()[0], sched.scheduler.last_epoch, sched.scheduler._step_count))
                out[f"{split}-{with_optimizer}-{adjust}"] = lrs
                _reset(lib)
    accelerator = lib.Accelerator(cpu=True)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    one = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1.0, total_steps=5)
    model, opt, one = accelerator.prepare(model, opt, one)
    lrs = []
    for _ in range(6):
        accelerator.backward(model(torch.ones(1, 3)).sum())
        opt.step()
        lrs.append((_outcome(one.step)[0], one.get_last_lr()[0], one.scheduler._step_count))
        opt.zero_grad()
    out["one_cycle"] = lrs
    opt2 = torch.optim.SGD(_model().parameters(), lr=1.0)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt2, patience=0, factor=0.5)
    opt2, plateau = accelerator.prepare(opt2, plateau)
    seen = []
    for _ in range(4):
        opt2.step()
        plateau.step(1.0)
        seen.append(opt2.param_groups[0]["lr"])
    out["plateau"] = (seen, type(plateau).__name__)
    _reset(lib)
    return out


def handlers_and_properties(lib):
    """DDP kwargs and communication hooks (PowerSGD) change the training as on Accelerate, an
    InitProcessGroupKwargs timeout reaches the process group; the Accelerator's properties and setters."""
    out = {}
    u = lib.utils
    for name, handler in (
            ("timeout", u.InitProcessGroupKwargs(timeout=timedelta(seconds=77))),  # first: it makes the group
            ("ddp", u.DistributedDataParallelKwargs(static_graph=True, gradient_as_bucket_view=True,
                                                    broadcast_buffers=False)),
            ("power_sgd", u.DistributedDataParallelKwargs(comm_hook=u.DDPCommunicationHookType.POWER_SGD,
                                                          comm_wrapper=u.DDPCommunicationHookType.FP16,
                                                          comm_state_option={"matrix_approximation_rank": 1}))):
        accelerator = lib.Accelerator(cpu=True, kwargs_handlers=[handler])
        rank = accelerator.process_index
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = accelerator.prepare(model, opt)
        for i in range(3):
            torch.manual_seed(10 + i)
            accelerator.backward(model(torch.randn(4, 6) * (rank + 1)).pow(2).sum())
            opt.step()
            opt.zero_grad()
        timeout = None
        if torch.distributed.is_initialized():
            group = torch.distributed.distributed_c10d._get_default_group()
            timeout = str(group._get_backend(torch.device("cpu")).options._timeout)
        out[name] = (_weights(accelerator, model), type(model).__name__, timeout,
                     tuple(getattr(model, k, None) for k in ("static_graph", "gradient_as_bucket_view",
                                                             "broadcast_buffers")))
        _reset(lib)
    a = lib.Accelerator(cpu=True, gradient_accumulation_steps=3)
    out["properties"] = (
        type(a.device).__name__, a.device.type, a.is_main_process, a.is_local_main_process, a.is_last_process,
        a.num_processes, a.process_index, a.use_distributed, a.sync_gradients, a.gradient_accumulation_steps,
        a.mixed_precision, type(a.mixed_precision).__name__, type(a.distributed_type).__name__,
        str(a.distributed_type), a.optimizer_step_was_skipped, a.native_amp, a.step)
    a.gradient_accumulation_steps = 5
    out["setters"] = ((a.gradient_accumulation_steps, a.gradient_state.num_steps),
                      _outcome(lambda: setattr(a, "sync_gradients", False)), a.sync_gradients,
                      _outcome(lambda: setattr(a, "mixed_precision", "bf16")),
                      _outcome(lambda: setattr(a, "device", "cpu")))
    _reset(lib)
    return out


# handlers first: its InitProcessGroupKwargs makes the process group
MATCHED = [handlers_and_properties, several_models, syncing, backward_and_clipping, fp16_scaler, schedulers]


def every_matching_scenario(lib):
    return {scenario.__name__: scenario(lib) for scenario in MATCHED}


@pytest.mark.parametrize("num_processes", [1, 2])
def test_the_accelerators_methods_as_in_accelerate(num_processes):
    assert_ranks_same(run_both(every_matching_scenario, num_processes), f"{num_processes} processes")


# --- on purpose otherwise (docs/compat.md) -------------------------------------------------------------------
def prepared_again(lib):
    """prepare() of what prepare_data_loader / prepare_optimizer returned, and of what prepare returned."""
    accelerator = lib.Accelerator(cpu=True)
    loader = DataLoader(TensorDataset(torch.arange(8.0)), batch_size=2)
    direct = accelerator.prepare_data_loader(loader)
    again = accelerator.prepare(direct)
    via_prepare = accelerator.prepare(loader)
    model = _model()
    opt = accelerator.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    opt_again = accelerator.prepare(opt)
    out = {"loader": (again is direct, [b[0].tolist() for b in again]),
           "via_prepare": (accelerator.prepare(via_prepare) is via_prepare),
           "optimizer": (opt_again is opt, type(opt_again.optimizer).__name__),
           "counts": (len(accelerator._dataloaders), len(accelerator._optimizers))}
    skipped = accelerator.skip_first_batches(accelerator.prepare(DataLoader(TensorDataset(torch.arange(16.0)),
                                                                            batch_size=2)), 1)
    again = accelerator.prepare(skipped)
    out["skipped"] = (again is skipped, [b[0].tolist() for b in again])
    return out


def one_process_backend(lib):
    made = _outcome(lambda: lib.Accelerator(cpu=True, kwargs_handlers=[
        lib.utils.InitProcessGroupKwargs(backend="gloo")]))
    return made if made[0] == "raised" else ("ok", made[1].num_processes, str(made[1].distributed_type))


def unwrap_no_module(lib):
    accelerator = lib.Accelerator(cpu=True)
    return [_outcome(lambda obj=obj: accelerator.unwrap_model(obj)) for obj in (3, None)]


def empty_dict_split(lib):
    state = lib.PartialState(cpu=True)
    return _outcome(lambda: state.split_between_processes({}).__enter__())


def test_what_nbaccel_does_on_purpose_otherwise():
    two = run_both(prepared_again, 2)
    # Accelerate shards the already sharded loader again (rank 0 sees a quarter of the data) and wraps the
    # prepared optimizer in a second AcceleratedOptimizer; nbaccel hands both back as they are
    assert [r["loader"] for r in two["accelerate"]] == [(False, [[0.0, 1.0]]), (False, [[6.0, 7.0]])]
    assert [r["loader"] for r in two["nbaccel"]] == [(True, [[0.0, 1.0], [4.0, 5.0]]), (True, [[2.0, 3.0], [6.0, 7.0]])]
    assert [r["skipped"] for r in two["accelerate"]] == [(False, [[4.0, 5.0], [12.0, 13.0]]),
                                                         (False, [[10.0, 11.0], [6.0, 7.0]])]
    assert [r["skipped"] for r in two["nbaccel"]] == [(True, [[4.0, 5.0], [8.0, 9.0], [12.0, 13.0]]),
                                                      (True, [[6.0, 7.0], [10.0, 11.0], [14.0, 15.0]])]
    assert [r["optimizer"] for r in two["accelerate"]] == [(False, "AcceleratedOptimizer")] * 2
    assert [r["optimizer"] for r in two["nbaccel"]] == [(True, "SGD")] * 2
    assert [(r["via_prepare"], r["counts"]) for r in two["accelerate"]] == [(True, (3, 2))] * 2
    assert [(r["via_prepare"], r["counts"]) for r in two["nbaccel"]] == [(True, (2, 1))] * 2

    one = run_both(one_process_backend, 1)  # Accelerate asks torch for a process group it never made
    assert one == {"accelerate": [("raised", "ValueError")], "nbaccel": [("ok", 1, "DistributedType.NO")]}

    unwrapped = run_both(unwrap_no_module, 1)  # Accelerate looks for compiled regions in `3._modules`
    assert unwrapped == {"accelerate": [[("raised", "AttributeError")] * 2], "nbaccel": [[("ok", 3), ("ok", None)]]}

    split = run_both(empty_dict_split, 2)  # Accelerate reads the first key of a dict that has none
    assert split == {"accelerate": [("raised", "IndexError")] * 2, "nbaccel": [("ok", {})] * 2}
