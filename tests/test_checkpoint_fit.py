"""A checkpoint that does not fit the objects it is loaded into changes nothing (nbaccel.checkpoint_fit).

torch's load_state_dict copies every tensor whose shape matches before it reports the others, so
Accelerate's load_state leaves a model half overwritten; nbaccel checks every object first.
"""

from __future__ import annotations

import copy

import pytest
import torch

from nbaccel import checkpoint_fit
from nbaccel.checkpointing import CheckpointMismatchError, load_accelerator_state, save_accelerator_state

pytestmark = pytest.mark.timeout(120)


def mlp(hidden: int, seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 4))


def trained(model: torch.nn.Module) -> torch.optim.Optimizer:
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(3, 8)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    return optimizer


def snapshot(*objects) -> list:
    return [copy.deepcopy(obj.state_dict()) for obj in objects]


def assert_same(before: list, after: list) -> None:
    assert repr(before) == repr(after)  # tensors print their values: every number and key compared


def test_model_of_another_shape_changes_nothing_where_accelerate_overwrites_what_fits(tmp_path):
    """The issue's case, side by side: saved from Linear(8, 16), loaded into Linear(8, 32) in a Sequential
    where `2.bias` has the same shape. Both raise a RuntimeError naming each mismatching tensor; Accelerate
    has overwritten `2.bias` (and would have loaded the optimizer after a model that fits), nbaccel nothing."""
    accelerate = pytest.importorskip("accelerate")
    import nbaccel

    outcomes = {}
    for library in (accelerate, nbaccel):
        library.state.AcceleratorState._reset_state(True)
        saver = library.Accelerator(cpu=True)
        model = mlp(16, seed=0)
        model, optimizer = saver.prepare(model, trained(model))
        folder = tmp_path / library.__name__
        saver.save_state(str(folder))
        library.state.AcceleratorState._reset_state(True)

        loader = library.Accelerator(cpu=True)
        other = mlp(32, seed=1)
        other, other_optimizer = loader.prepare(other, trained(other))
        before = snapshot(other, other_optimizer)
        with pytest.raises(RuntimeError) as info:
            loader.load_state(str(folder))
        changed = [name for name, tensor in other.state_dict().items() if not torch.equal(tensor, before[0][name])]
        outcomes[library.__name__] = (str(info.value), changed, snapshot(other, other_optimizer), before)
        library.state.AcceleratorState._reset_state(True)

    for message, _, _, _ in outcomes.values():
        for name, saved, current in (("0.weight", "16, 8", "32, 8"), ("0.bias", "16", "32"), ("2.weight", "4, 16", "4, 32")):
            assert name in message and saved in message and current in message, (name, message)
        assert "2.bias" not in message
    assert outcomes["accelerate"][1] == ["2.bias"]  # Accelerate's partial overwrite (docs/compat.md)
    message, changed, after, before = outcomes["nbaccel"]
    assert changed == []
    assert_same(before, after)
    assert "nothing was loaded" in message and "0.weight: checkpoint [16, 8], model [32, 8]" in message
    assert isinstance(CheckpointMismatchError("x"), RuntimeError)


def test_optimizer_that_does_not_fit_stops_the_load_before_the_model(tmp_path):
    """Models fit but the optimizer was built over other parameters: the model (loaded first) is untouched."""
    model = mlp(16, seed=0)
    folder = save_accelerator_state(tmp_path / "c", models=[model], optimizers=[trained(model)])
    fresh = mlp(16, seed=1)
    partial = torch.optim.Adam(fresh[0].parameters(), lr=0.01)
    before = snapshot(fresh, partial)
    with pytest.raises(CheckpointMismatchError, match=r"optimizer 0 \(optimizer.bin\): parameter groups of other sizes: "
                       r"checkpoint \[4\], optimizer \[2\]"):
        load_accelerator_state(folder, models=[fresh], optimizers=[partial])
    assert_same(before, snapshot(fresh, partial))


def test_optimizer_state_of_another_shape_is_named():
    """torch's Optimizer.load_state_dict accepts Adam moments of another shape (and fails at the next step);
    the check names them, against the current state or the parameter's shape."""
    small, large = mlp(16, seed=0), mlp(32, seed=0)
    saved = trained(small).state_dict()
    stepped, fresh = trained(large), torch.optim.Adam(mlp(32, seed=2).parameters(), lr=0.01)
    for optimizer in (stepped, fresh):
        problems = checkpoint_fit.fit_optimizer(optimizer, saved)
        assert len(problems) == 1 and "6 tensor(s) of another shape" in problems[0]
        assert "state of parameter 0 'exp_avg': checkpoint [16, 8], optimizer [32, 8]" in problems[0]
    assert checkpoint_fit.fit_optimizer(trained(mlp(16, seed=3)), saved) == []


def test_registered_object_and_scheduler_that_do_not_fit_change_nothing(tmp_path):
    class Ema:
        def __init__(self, size: int) -> None:
            self.shadow = {"w": torch.full((size,), float(size))}

        def state_dict(self):
            return {"shadow": self.shadow}

        def load_state_dict(self, state):
            self.shadow = state["shadow"]

    model = mlp(16, seed=0)
    optimizer = trained(model)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    folder = save_accelerator_state(tmp_path / "c", models=[model], optimizers=[optimizer], schedulers=[scheduler],
                                    custom_objects=[Ema(3)])
    fresh = mlp(16, seed=1)
    fresh_optimizer = trained(fresh)
    fresh_optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    ema = Ema(5)
    before = snapshot(fresh, ema)
    with pytest.raises(CheckpointMismatchError) as info:
        load_accelerator_state(folder, models=[fresh], optimizers=[fresh_optimizer],
                               schedulers=[torch.optim.lr_scheduler.StepLR(fresh_optimizer, step_size=1)],
                               custom_objects=[ema])
    message = str(info.value)
    assert "1 parameter group(s) in the checkpoint, 2 in the optimizer" in message
    assert "scheduler 0 (scheduler.bin): 1 learning rate(s) in the checkpoint, 2 in the scheduler" in message
    assert "registered object 0 (Ema, custom_checkpoint_0.pkl): 1 tensor(s) of another shape: " \
           "shadow.w: checkpoint [3], object [5]" in message
    assert_same(before, snapshot(fresh, ema))


def test_strict_false_allows_other_keys_but_never_other_shapes(tmp_path):
    model = mlp(16, seed=0)
    folder = save_accelerator_state(tmp_path / "c", models=[model])
    extended = torch.nn.Sequential(*mlp(16, seed=1), torch.nn.Linear(4, 2))
    with pytest.raises(CheckpointMismatchError, match=r"missing keys 3.bias, 3.weight"):
        load_accelerator_state(folder, models=[extended])
    load_accelerator_state(folder, models=[extended], strict=False)
    assert torch.equal(extended[0].weight, model[0].weight)
    with pytest.raises(CheckpointMismatchError, match=r"0.weight: checkpoint \[16, 8\], model \[32, 8\]"):
        load_accelerator_state(folder, models=[mlp(32, seed=1)], strict=False)


def test_many_mismatches_are_listed_shortly():
    wide = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(30)])
    narrow = torch.nn.Sequential(*[torch.nn.Linear(3, 3) for _ in range(30)])
    fit = checkpoint_fit.fit_model(wide, narrow.state_dict(), strict=True)
    assert len(fit.problems) == 1 and "60 tensor(s) of another shape" in fit.problems[0]
    assert "... and 50 more" in fit.problems[0]
