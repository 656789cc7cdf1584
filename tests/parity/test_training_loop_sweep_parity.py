"""The training loop, run on Accelerate 1.15 and on nbaccel (1 and 2 gloo ranks) and compared: mixed precision's
autocast blocks and the prepared model's wrapped forward, the prepared optimizer's `zero_grad`, LocalSGD's step
counts, which optimizers a prepared scheduler watches, a scheduler that is no torch scheduler, the types of the
project folders, the prepared objects' public names. Found by a parity sweep of the training loop (2026-12-01);
each scenario failed on nbaccel before its fix."""

from __future__ import annotations

import copy
import inspect
import io
import pickle

import pytest
import torch
from parity_harness import assert_ranks_same, assert_same, run_both

pytest.importorskip("accelerate")
pytestmark = pytest.mark.timeout(300)


def _outcome(call):
    try:
        return ("ok", call())
    except Exception as exc:  # the type is what code written for Accelerate catches
        return ("raised", type(exc).__name__)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))


def _dtype(module, x):
    return str(module(x).dtype)


def bf16_autocast_blocks(lib):
    """AutocastKwargs(enabled=False) turns autocast off inside an enclosing autocast (it was a null context on
    nbaccel, so the block still ran in bf16), whether given to `autocast()` or to the Accelerator."""
    found = {}
    accelerator = lib.Accelerator(cpu=True, mixed_precision="bf16")
    layer, x = torch.nn.Linear(3, 3), torch.ones(2, 3)
    with accelerator.autocast():
        found["inside"] = _dtype(layer, x)
        with accelerator.autocast(lib.utils.AutocastKwargs(enabled=False)):
            found["turned_off_inside"] = _dtype(layer, x)
    with torch.autocast("cpu", dtype=torch.bfloat16), accelerator.autocast(lib.utils.AutocastKwargs(enabled=False)):
        found["turned_off_in_torch_autocast"] = _dtype(layer, x)
    found["outside"] = _dtype(layer, x)
    lib.state.AcceleratorState._reset_state(True)
    accelerator = lib.Accelerator(cpu=True, mixed_precision="bf16",
                                  kwargs_handlers=[lib.utils.AutocastKwargs(enabled=False)])
    model = accelerator.prepare(_model())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with accelerator.autocast():
            found["handler_off_in_torch_autocast"] = _dtype(layer, x)
        found["model_in_torch_autocast"] = _dtype(model, x)
    with accelerator.autocast(lib.utils.AutocastKwargs(enabled=True)):
        found["handler_overridden"] = _dtype(layer, x)
    return found


def bf16_forward_wrapper(lib):
    """The prepared model's forward under bf16: a method bound to the model, with the model's signature (code
    that reads which arguments a forward takes); deepcopy (an EMA copy) and pickling (`torch.save(model)`) of
    the prepared model; unwrapping. nbaccel's forward was a callable object: `(*args, **kwargs)`, no
    `__name__`, and pickling failed on a local function."""
    accelerator = lib.Accelerator(cpu=True, mixed_precision="bf16")
    model = accelerator.prepare(_model())
    x = torch.linspace(-1, 1, 6).reshape(2, 3)
    found = {"signature": str(inspect.signature(model.forward)), "is_method": inspect.ismethod(model.forward),
             "name": model.forward.__name__, "output": model(x), "has_original": hasattr(model, "_original_forward")}
    ema = copy.deepcopy(model)
    found["copy"] = (ema(x), ema.forward.__self__ is ema)
    buffer = io.BytesIO()
    found["torch_save"] = _outcome(lambda: torch.save(accelerator.unwrap_model(model), buffer))
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    found["loaded"] = (loaded(x), "forward" in loaded.__dict__)
    found["pickle_prepared"] = _outcome(lambda: len(pickle.dumps(model)) > 0)
    plain = accelerator.unwrap_model(model, keep_fp32_wrapper=False)
    found["unwrapped"] = (plain(x), str(inspect.signature(plain.forward)), hasattr(plain, "_original_forward"))
    with accelerator.autocast():
        found["unwrapped_in_autocast"] = str(plain(x).dtype)
    found["copy_unwrapped"] = accelerator.unwrap_model(ema, keep_fp32_wrapper=False)(x)
    return found


class _ZeroGradWithoutSetToNone(torch.optim.SGD):
    """An optimizer written before torch's `set_to_none` (as some third-party ones are)."""

    def zero_grad(self):
        for group in self.param_groups:
            for parameter in group["params"]:
                parameter.grad = None


def zero_grad_of_other_optimizers(lib):
    """`optimizer.zero_grad()` of a prepared optimizer whose own zero_grad takes no `set_to_none` (nbaccel
    passed it and torch raised TypeError); asking for one is a ValueError on both."""
    accelerator = lib.Accelerator(cpu=True)
    model = _model()
    model, optimizer = accelerator.prepare(model, _ZeroGradWithoutSetToNone(model.parameters(), lr=0.1))
    accelerator.backward(model(torch.ones(2, 3)).sum())
    found = {"plain": _outcome(optimizer.zero_grad), "grads": [p.grad for p in model.parameters()]}
    found["set_to_none=None"] = _outcome(lambda: optimizer.zero_grad(set_to_none=None))
    found["set_to_none=False"] = _outcome(lambda: optimizer.zero_grad(set_to_none=False))
    accelerator.backward(model(torch.ones(2, 3)).sum())
    sgd = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    found["torch_keeps_zeros"] = (_outcome(lambda: sgd.zero_grad(set_to_none=False)),
                                  [p.grad.abs().sum().item() for p in model.parameters()])
    sgd.zero_grad()
    found["torch_default_none"] = [p.grad for p in model.parameters()]
    return found


def _loader(n, batch_size):
    from torch.utils.data import DataLoader, TensorDataset

    x = torch.arange(3 * n, dtype=torch.float32).reshape(n, 3) / (3 * n)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=batch_size)


def local_sgd_step_counts(lib):
    """LocalSGD with numpy's integer as the step count (nbaccel refused it), and with None when disabled, as
    Accelerate's by_feature/local_sgd.py passes it (`enabled=local_sgd_steps is not None`; nbaccel refused
    None whatever `enabled` said); the weights after training with it."""
    import importlib

    import numpy as np

    local_sgd = importlib.import_module(f"{lib.__name__}.local_sgd")
    accelerator = lib.Accelerator(cpu=True)
    model = _model()
    model, optimizer, loader = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), _loader(12, 2))
    found = {"disabled_none": _outcome(lambda: local_sgd.LocalSGD(accelerator=accelerator, model=model,
                                                                  local_sgd_steps=None, enabled=False).enabled)}
    with local_sgd.LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=np.int64(2)) as averaging:
        for inputs, targets in loader:
            accelerator.backward(torch.nn.functional.mse_loss(model(inputs), targets))
            optimizer.step()
            optimizer.zero_grad()
            averaging.step()
    found["steps"] = (averaging.enabled, averaging.num_steps)
    found["weights"] = {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    return found


def schedulers_and_their_optimizers(lib):
    """Which prepared optimizers a prepared scheduler watches: the first wrapper of its optimizer (nbaccel took
    every wrapper of it), else every prepared optimizer (nbaccel took the bare optimizer)."""
    accelerator = lib.Accelerator(cpu=True)
    model = accelerator.prepare(_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    first = accelerator.prepare(optimizer)
    accelerator.prepare(optimizer)  # a second wrapper of the same optimizer
    scheduler = accelerator.prepare(torch.optim.lr_scheduler.StepLR(optimizer, 1))
    stray = accelerator.prepare(torch.optim.lr_scheduler.StepLR(torch.optim.SGD(_model().parameters(), lr=1.0), 1))
    return {"own": [opt is first for opt in scheduler.optimizers],
            "stray": [type(opt).__name__ for opt in stray.optimizers], "stray_step": _outcome(stray.step)}


class _SchedulerOfItsOwn:
    """A scheduler that is no torch LRScheduler, with the methods of one."""

    def __init__(self, optimizer):
        self.optimizer, self.calls = optimizer, 0

    def step(self):
        self.calls += 1
        for group in self.optimizer.param_groups:
            group["lr"] *= 0.5

    def get_last_lr(self):
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self):
        return {"calls": self.calls}

    def load_state_dict(self, state):
        self.calls = state["calls"]


def a_scheduler_of_its_own(lib):
    """`prepare` hands back a scheduler that is no torch LRScheduler as it is: stepped on every call, left out of
    checkpoints. nbaccel wrapped anything with optimizer/step/get_last_lr: stepped on synchronizing steps only,
    once per process, and saved as scheduler.bin."""
    import os
    import tempfile

    accelerator = lib.Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, _SchedulerOfItsOwn(optimizer))
    for _ in range(4):
        with accelerator.accumulate(model):
            accelerator.backward(model(torch.ones(1, 3)).sum())
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    folder = accelerator.save_state(os.path.join(tempfile.mkdtemp(), "checkpoint"))
    return {"type": type(scheduler).__name__, "calls": scheduler.calls, "lr": scheduler.get_last_lr(),
            "weights": {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()},
            "files": sorted(name for name in os.listdir(folder) if name.startswith("scheduler"))}


def project_folders(lib):
    """`project_dir`/`logging_dir` keep the type they were given (nbaccel made a pathlib.Path a str, so
    `accelerator.project_dir / "samples"` raised TypeError), through the argument or a ProjectConfiguration."""
    import os
    import pathlib
    import tempfile

    root = pathlib.Path(tempfile.mkdtemp())
    found = {}
    for name, kwargs in (("path", {"project_dir": root / "a"}), ("text", {"project_dir": os.fspath(root / "b")}),
                         ("config", {"project_config": lib.utils.ProjectConfiguration(
                             project_dir=root / "c", logging_dir=os.fspath(root / "logs"))})):
        lib.state.AcceleratorState._reset_state(True)
        accelerator = lib.Accelerator(cpu=True, **kwargs)
        found[name] = [(type(value).__name__, os.path.relpath(value, root))
                       for value in (accelerator.project_dir, accelerator.logging_dir)]
    found["joined"] = _outcome(lambda: os.path.relpath(accelerator.project_dir / "samples", root))
    return found


def prepared_again_after_free_memory(lib):
    """`free_memory()` then `prepare()` of the objects prepared before (a `find_executable_batch_size` retry does
    this): each is registered again, so `save_state` writes it. nbaccel registered the model only (no
    optimizer.bin). nbaccel's checkpoint also holds the loader's position (docs/compat.md), left out here."""
    import os
    import tempfile

    accelerator = lib.Accelerator(cpu=True)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    prepared = accelerator.prepare(model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 1), _loader(4, 2))
    accelerator.free_memory()
    again = accelerator.prepare(*prepared)
    accelerator.prepare(*prepared[1:3])  # a third time: still registered once
    folder = accelerator.save_state(os.path.join(tempfile.mkdtemp(), "checkpoint"))
    return {"same": [a is b for a, b in zip(prepared, again)],
            "registered": [len(accelerator._models), len(accelerator._optimizers), len(accelerator._schedulers),
                           len(accelerator._dataloaders)],
            "files": sorted(name for name in os.listdir(folder) if not name.startswith((".", "dl_state_dict")))}


def a_model_spread_over_devices(lib):
    """A model dispatched over several devices (`hf_device_map`, as `device_map="auto"` leaves it) is refused on
    several processes with a ValueError, before anything is prepared; nbaccel wrapped it in DDP. On one process,
    and with one device, it is prepared."""
    accelerator = lib.Accelerator(cpu=True)
    spread, whole = _model(), _model()
    spread.hf_device_map, whole.hf_device_map = {"0": "cpu", "2": "disk"}, {"": "cpu"}
    loader = _loader(4, 2)
    return {"spread": _outcome(lambda: type(accelerator.prepare(loader, spread)[1]).__name__),
            "registered_before_refusal": len(accelerator._dataloaders),
            "prepare_model": _outcome(lambda: type(accelerator.prepare_model(spread)).__name__),
            "whole": _outcome(lambda: type(accelerator.prepare(whole)).__name__)}


class _Blocks(torch.nn.Module):
    """Repeated blocks, what regional compilation compiles one by one."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(3, 3) for _ in range(3)])
        self.head = torch.nn.Linear(3, 1)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x).relu()
        return self.head(x)


def compiling(lib):
    """With a dynamo backend: a model the script compiled itself is not compiled again (nbaccel compiled the
    compiled module, and on one process `prepare` returned a function); `use_regional_compilation` compiles the
    repeated blocks one by one (nbaccel ignored it and compiled the whole model). Regional compilation is
    compared on one process: on several, Accelerate's `unwrap_model` gives back the DDP wrapper (docs/compat.md)."""
    found = {}
    accelerator = lib.Accelerator(cpu=True, dynamo_backend="eager")
    compiled = torch.compile(_model(), backend="eager")
    prepared = accelerator.prepare(compiled)
    found["compiled_before"] = (type(prepared).__name__, type(getattr(prepared, "_orig_mod", None)).__name__,
                                prepared(torch.ones(2, 3)))
    if accelerator.num_processes == 1:
        lib.state.AcceleratorState._reset_state(True)
        plugin = lib.utils.TorchDynamoPlugin(backend="eager", use_regional_compilation=True)
        accelerator = lib.Accelerator(cpu=True, dynamo_plugin=plugin)
        model = accelerator.prepare(_Blocks())
        found["regional"] = (type(model).__name__, [type(layer).__name__ for layer in model.layers],
                             model(torch.ones(2, 3)), type(accelerator.unwrap_model(model)).__name__,
                             sorted(accelerator.get_state_dict(model)))
    return found


def fp8_without_a_backend(lib):
    """mixed_precision="fp8" with no fp8 library installed (this environment has none): a ValueError, as
    Accelerate's (nbaccel's was an ImportError only; it is both now)."""
    import importlib.util

    if any(importlib.util.find_spec(name) for name in ("transformer_engine", "torchao", "msamp")):
        return "an fp8 backend is installed"
    try:
        lib.Accelerator(cpu=True, mixed_precision="fp8")
    except ValueError as error:
        return ("ValueError", "fp8" in str(error))
    return "no error"


def public_names(lib):
    """The public names of the prepared optimizer and scheduler and of the gradient state (nbaccel's optimizer
    had no `accelerator_state`)."""
    accelerator = lib.Accelerator(cpu=True)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 1))

    def names(obj):
        return sorted(name for name in dir(obj) if not name.startswith("_"))

    return {"optimizer": names(optimizer), "scheduler": names(scheduler), "gradient_state": names(
        accelerator.gradient_state), "state": type(optimizer.accelerator_state).__name__,
        "distributed_type": str(optimizer.accelerator_state.distributed_type)}


SCENARIOS = [bf16_autocast_blocks, bf16_forward_wrapper, zero_grad_of_other_optimizers, local_sgd_step_counts,
             schedulers_and_their_optimizers, a_scheduler_of_its_own, project_folders,
             prepared_again_after_free_memory, a_model_spread_over_devices, compiling,
             fp8_without_a_backend, public_names]


def every_scenario(lib):
    """The scenarios one after the other in one process (each on fresh states): one start of the ranks."""
    found = {}
    for scenario in SCENARIOS:
        lib.state.AcceleratorState._reset_state(True)
        lib.state.GradientState._reset_state()
        found[scenario.__name__] = scenario(lib)
    return found


@pytest.mark.parametrize("num_processes", [1, 2])
def test_the_training_loop_as_in_accelerate(num_processes):
    assert_ranks_same(run_both(every_scenario, num_processes), f"{num_processes} processes")


def local_sgd_left_by_an_exception(lib):
    """Every process leaves a LocalSGD block by the same exception, between two averages."""
    import importlib

    local_sgd = importlib.import_module(f"{lib.__name__}.local_sgd")
    accelerator = lib.Accelerator(cpu=True)
    model = _model()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    try:
        with local_sgd.LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=5) as averaging:
            for _ in range(2):
                accelerator.backward(model(torch.ones(2, 3) * (accelerator.process_index + 1)).sum())
                optimizer.step()
                optimizer.zero_grad()
                averaging.step()
            raise KeyError("stop")
    except KeyError:
        pass
    return {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}


def test_local_sgd_left_by_an_exception_does_not_average_where_accelerate_does():
    """docs/compat.md: nbaccel does not enter the averaging collective on the way out of an exception (the other
    processes may never reach it); Accelerate averages, so its replicas end equal."""
    results = run_both(local_sgd_left_by_an_exception, 2)
    theirs, ours = results["accelerate"], results["nbaccel"]
    assert_same(theirs[0], theirs[1])
    assert not torch.equal(ours[0]["0.weight"], ours[1]["0.weight"])
    averaged = {k: (ours[0][k] + ours[1][k]) / 2 for k in ours[0]}
    for name, value in averaged.items():
        assert torch.allclose(value, theirs[0][name], atol=1e-6), name


def lomo_step_and_zero_grad(lib, side):
    """The usual loop with a LOMO optimizer: `backward(loss, learning_rate=)` updates the parameters, and the
    `optimizer.step()` / `zero_grad()` the loop still calls do nothing (nbaccel's step raised torch's
    NotImplementedError, Lomo having no step of its own)."""
    import sys

    sys.path.insert(0, side)
    import lomo_optim

    accelerator = lib.Accelerator(cpu=True)
    model = _model()
    model, optimizer = accelerator.prepare(model, lomo_optim.Lomo(model, lr=0.05))
    torch.manual_seed(1)
    calls = []
    for _ in range(3):
        x = torch.randn(4, 3)
        accelerator.backward(torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)), learning_rate=0.05)
        calls += [_outcome(optimizer.step), _outcome(optimizer.zero_grad)]
    return {"calls": calls, "weights": {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}}


@pytest.mark.parametrize("num_processes", [1, 2])
def test_a_lomo_optimizers_step_does_nothing_as_in_accelerate(num_processes):
    import os
    import sys

    side = os.path.join(sys.prefix, "side", "lomo")  # run.sh installs lomo-optim there (see constraints.txt)
    assert os.path.isdir(os.path.join(side, "lomo_optim")), f"{side} lacks lomo-optim: run ./run.sh test"
    assert_ranks_same(run_both(lomo_step_and_zero_grad, num_processes, args=(side,)),
                      f"lomo[{num_processes} processes]")
