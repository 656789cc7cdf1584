"""Does a checkpoint fit the objects it is loaded into? Checked before `load_state` changes anything.

torch's `load_state_dict` copies every tensor whose shape matches and only then reports the others, so a
checkpoint of another architecture leaves a model half overwritten; an optimizer accepts moment buffers of
the wrong shape and fails at the next `step()`. `load_accelerator_state` reads every file first, asks the
functions here for the problems of each object, and raises one error listing them all before it touches
anything. Each function returns a list of human-readable problems (empty: it fits).

What is checked: a model's keys (with `strict`) and every tensor's shape; an optimizer's parameter groups
and the shapes of its per-parameter state; a scheduler's number of learning rates; for any other registered
object, the shapes of tensors found at the same place in its current and its loaded state.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

_SHOWN = 10  # problems of one kind listed per object before "... and N more"

# Per-parameter state of torch's optimizers that has the parameter's own shape (Adam/AdamW/NAdam/RAdam,
# Adamax, SGD/RMSprop momentum, Adagrad, Adadelta, ASGD, Rprop).
_PARAMETER_SHAPED = frozenset({
    "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "exp_inf", "momentum_buffer", "square_avg", "grad_avg",
    "acc_delta", "sum", "ax", "prev", "step_size",
})


_WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # DDP's / DataParallel's, and torch.compile's OptimizedModule's


@dataclass
class ModelFit:
    """The state dict to give `load_state_dict` (prefixes fixed) and what does not fit."""

    state_dict: dict[str, Any]
    problems: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)


def _shape(value: Any) -> tuple[int, ...]:
    return tuple(value.shape)


def _storage_key(tensor: torch.Tensor) -> tuple:
    try:
        storage = tensor.untyped_storage()
        return (tensor.device, storage.data_ptr(), storage.nbytes(), tensor.data_ptr())
    except (NotImplementedError, RuntimeError):  # tensors without storage (meta, some subclasses)
        return (tensor.device, id(tensor), 0, 0)


def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:_SHOWN])
    return shown + (f" ... and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


def _renames_keys(module: torch.nn.Module) -> bool:
    """True when a submodule has load_state_dict pre-hooks, which may rename or drop keys before loading."""
    return any(getattr(sub, "_load_state_dict_pre_hooks", None) for sub in module.modules())


def tied_missing(expected: Mapping[str, Any], loaded: Mapping[str, Any], missing: set[str]) -> set[str]:
    """`missing` without weights tied to one that `loaded` holds (a tied weight is saved under one name)."""
    groups: dict[tuple, set[str]] = defaultdict(set)
    for name, tensor in expected.items():
        if isinstance(tensor, torch.Tensor):
            groups[_storage_key(tensor)].add(name)
    for names in groups.values():
        if names & set(loaded):
            missing = missing - names
    return missing


def fit_model(module: torch.nn.Module, state_dict: Mapping[str, Any], strict: bool) -> ModelFit:
    """Check `state_dict` against `module` (already unwrapped) as `load_state_dict` would, without loading.

    Wrapper prefixes every key carries (`module.` of a DDP-wrapped model, `_orig_mod.` of a `torch.compile`d one,
    as Accelerate saves them) are removed when no key matches as is.
    """
    expected = module.state_dict()
    loaded = dict(state_dict)
    while loaded and expected and not any(k in expected for k in loaded):
        prefix = next((p for p in _WRAPPER_PREFIXES if all(k.startswith(p) for k in loaded)), None)
        if prefix is None:
            break
        loaded = {k[len(prefix):]: v for k, v in loaded.items()}
    fit = ModelFit(loaded)
    mismatched = []
    for name, value in loaded.items():
        target = expected.get(name)
        if not isinstance(target, torch.Tensor) or not isinstance(value, torch.Tensor):
            continue
        if isinstance(target, torch.nn.parameter.UninitializedParameter):
            continue  # a lazy module takes whatever shape it is given
        if _shape(target) == () and _shape(value) == (1,):
            continue  # load_state_dict accepts a one-element tensor for a scalar
        if _shape(target) != _shape(value):
            mismatched.append(f"{name}: checkpoint {list(value.shape)}, model {list(target.shape)}")
    if mismatched:
        fit.problems.append(f"{len(mismatched)} tensor(s) of another shape: {_listed(mismatched)}")
    if _renames_keys(module):
        return fit  # keys are compared after loading (the hooks may rename them)
    fit.missing = sorted(tied_missing(expected, loaded, set(expected) - set(loaded)))
    fit.unexpected = [k for k in loaded if k not in expected]
    if strict and fit.missing:
        fit.problems.append(f"missing keys {_listed(fit.missing)}")
    if strict and fit.unexpected:
        fit.problems.append(f"unexpected keys {_listed(fit.unexpected)}")
    return fit


def fit_optimizer(optimizer: Any, state: Any) -> list[str]:
    """Problems of loading `state` into `optimizer` (an AcceleratedOptimizer or a torch optimizer).

    Checks what `Optimizer.load_state_dict` checks (groups and their sizes) and, beyond it, that the
    per-parameter state has the shapes of the parameters it will belong to: from the optimizer's current
    state where it has one, else for torch's parameter-shaped buffers (`exp_avg`, `momentum_buffer` ...).
    """
    inner = getattr(optimizer, "optimizer", optimizer)
    if not isinstance(inner, torch.optim.Optimizer):
        return []
    if not isinstance(state, Mapping) or "param_groups" not in state:
        return [f"the file holds {type(state).__name__}, not an optimizer state dict"]
    saved_groups, groups = state["param_groups"], inner.param_groups
    if len(saved_groups) != len(groups):
        return [f"{len(saved_groups)} parameter group(s) in the checkpoint, {len(groups)} in the optimizer"]
    sizes = [(len(s["params"]), len(g["params"])) for s, g in zip(saved_groups, groups)]
    if any(a != b for a, b in sizes):
        return ["parameter groups of other sizes: checkpoint " + str([a for a, _ in sizes])
                + ", optimizer " + str([b for _, b in sizes])]
    params = {saved_id: param for s, g in zip(saved_groups, groups) for saved_id, param in zip(s["params"], g["params"])}
    mismatched = []
    for saved_id, entries in (state.get("state") or {}).items():
        param = params.get(saved_id)
        if param is None or not isinstance(entries, Mapping):
            continue
        current = inner.state.get(param, {})
        for key, value in entries.items():
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                continue
            reference = current.get(key)
            if isinstance(reference, torch.Tensor):
                want = _shape(reference)
            elif key in _PARAMETER_SHAPED:
                want = _shape(param)
            else:
                continue
            if _shape(value) != want:
                mismatched.append(f"state of parameter {saved_id} '{key}': checkpoint {list(value.shape)}, "
                                  f"optimizer {list(want)}")
    return [f"{len(mismatched)} tensor(s) of another shape: {_listed(mismatched)}"] if mismatched else []


def fit_scheduler(scheduler: Any, state: Any) -> list[str]:
    """Problems of loading `state` into a scheduler: not a dict, another number of learning rates, or
    tensors of other shapes."""
    inner = getattr(scheduler, "scheduler", scheduler)
    if not isinstance(state, Mapping):
        return [f"the file holds {type(state).__name__}, not a scheduler state dict"]
    problems = []
    current = getattr(inner, "base_lrs", None)
    saved = state.get("base_lrs")
    if isinstance(current, list) and isinstance(saved, list) and len(current) != len(saved):
        problems.append(f"{len(saved)} learning rate(s) in the checkpoint, {len(current)} in the scheduler")
    return problems + fit_object(inner, state)


def fit_object(obj: Any, state: Any) -> list[str]:
    """Problems of loading `state` into any object with `state_dict()`: a module or optimizer is checked
    as such; otherwise tensors at the same place in `obj.state_dict()` and `state` must have one shape."""
    if isinstance(obj, torch.nn.Module):
        if not isinstance(state, Mapping):
            return [f"the file holds {type(state).__name__}, not a state dict"]
        return fit_model(obj, state, strict=True).problems
    if isinstance(obj, torch.optim.Optimizer):
        return fit_optimizer(obj, state)
    try:
        current = obj.state_dict()
    except Exception:  # an object whose state cannot be read now is checked by its own load_state_dict
        return []
    mismatched: list[str] = []
    _compare(current, state, "", mismatched, depth=0)
    return [f"{len(mismatched)} tensor(s) of another shape: {_listed(mismatched)}"] if mismatched else []


def _compare(current: Any, loaded: Any, where: str, out: list[str], depth: int) -> None:
    if depth > 20:
        return
    if isinstance(current, torch.Tensor) and isinstance(loaded, torch.Tensor):
        if _shape(current) != _shape(loaded):
            out.append(f"{where or 'the state'}: checkpoint {list(loaded.shape)}, object {list(current.shape)}")
    elif isinstance(current, Mapping) and isinstance(loaded, Mapping):
        for key in current:
            if key in loaded:
                _compare(current[key], loaded[key], f"{where}.{key}" if where else str(key), out, depth + 1)
    elif isinstance(current, (list, tuple)) and isinstance(loaded, (list, tuple)) and len(current) == len(loaded):
        for index, (a, b) in enumerate(zip(current, loaded)):
            _compare(a, b, f"{where}[{index}]", out, depth + 1)
