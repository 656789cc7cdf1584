"""Collectives over nested structures of tensors: gather, reduce, broadcast, pad_across_processes.

A structure moves in as few communications as its data allows: gather and broadcast pack every tensor
(any dtype, viewed as bytes) into one buffer per device and make ONE torch.distributed call; reduce makes one
call per dtype (a sum of float16 and int64 cannot share a buffer). The result is split and reshaped back
into the caller's containers (lists, tuples, namedtuples, dicts, Mapping subclasses keep their types).

gather checks its input (every leaf a tensor, on one device, ...) once per layout: a plain dict, list or
tuple whose tensors have the dtypes, shapes and devices of one that passed the checks on this process group,
or a lone tensor of a dtype and device that passed, goes straight to the communication (see `gather`).

In one process (no process group, or a group of one) every operation returns its input: gather returns the
tensor itself, reduce a copy. `utils` sits below `state`, so this module talks to torch.distributed directly.
Every communication runs inside `collective_trace.in_collective`, which is what the hang report reads.

Debug mode (NBACCEL_DEBUG_MODE=1 or ACCELERATE_DEBUG_MODE=1) adds one object exchange before each
collective: the ranks compare their structures' shapes and dtypes and, when they differ, all raise
`DistributedOperationException` naming each rank's shapes, instead of hanging or mixing data.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import os
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from . import packing, xla
from .collective_trace import in_collective
from .env_flags import parse_flag_from_env
from .structures import (
    flat_tensors,
    flatten_tensors,
    iter_leaves,
    plain_items,
    rebuild,
    rebuild_flat,
    recursively_apply,
)
from .user_warnings import warn_at_caller

_REDUCTIONS = ("mean", "sum", "max", "min", "none")
_KEEP_RECEIVE_BYTES = 1 << 20  # gathers up to this size keep their receive buffer for the next call
_dtype_of = operator.attrgetter("dtype")
_TRACE_EACH = 4  # up to this many tensors, the trace records each shape; beyond, the packed buffer's


class DistributedOperationException(Exception):
    """A collective cannot run as called: the ranks passed data that does not match (shapes, structure)."""


class CannotPadNestedTensorWarning(UserWarning):
    """`pad_across_processes` met a nested (jagged) tensor, which it leaves unpadded."""


# `os.environ` keeps its variables in a dict keyed by encoded names; looking a name up there is ~20x cheaper
# than `name in os.environ`, which raises and catches a KeyError for a missing name (and this runs before
# every collective). Where an interpreter lacks these attributes, `os.environ` is read the public way.
_ENV_DATA = getattr(os.environ, "_data", None)
_DEBUG_KEYS = (
    tuple(os.environ.encodekey(name) for name in ("NBACCEL_DEBUG_MODE", "ACCELERATE_DEBUG_MODE"))
    if isinstance(_ENV_DATA, dict) and callable(getattr(os.environ, "encodekey", None)) else None
)


def debug_mode_enabled() -> bool:
    """Whether debug mode is on: NBACCEL_DEBUG_MODE when set (PartialState(debug=...) sets it), else
    ACCELERATE_DEBUG_MODE. Read on every call, so turning it on or off takes effect at the next collective."""
    if _DEBUG_KEYS is not None and _DEBUG_KEYS[0] not in _ENV_DATA and _DEBUG_KEYS[1] not in _ENV_DATA:
        return False  # the common case: neither variable set
    name = "NBACCEL_DEBUG_MODE" if os.environ.get("NBACCEL_DEBUG_MODE", "").strip() else "ACCELERATE_DEBUG_MODE"
    return parse_flag_from_env(name, False)


@dataclass
class _GroupFacts:
    """What every collective asks about the default process group, read once per group.

    `group` holds the group weakly: a strong reference would keep the group (and gloo's worker threads)
    alive past `destroy_process_group`, into interpreter finalization, where a worker thread releasing its
    last collective's tensors needs the GIL and aborts the process ("terminate called without an active
    exception", exit code -6) although the script finished."""

    group: Callable[[], Any]
    world: int = 1
    backend: str = ""
    # gather inputs that passed the input checks on this group: a gather of the same kind skips them
    # (see `gather`). A plain container's layout (`_layout`) with its packing plan:
    checked: dict[tuple, packing.Plan] = field(default_factory=dict)
    # the stacked ones among them (tensors of one dtype and one shape) by (count, dtype, shape, device):
    # `_gather_known_stacked` finds them without building the whole layout key
    stacked: dict[tuple, packing.Plan] = field(default_factory=dict)
    checked_tensors: set[tuple[torch.dtype, torch.device]] = field(default_factory=set)  # lone tensors' (dtype, device)


_DIST_AVAILABLE = dist.is_available()
_NO_GROUP = _GroupFacts(lambda: None)
_facts = _NO_GROUP
_CHECKED_LAYOUTS = 32  # layouts remembered per group (each keeps its plan, receive buffers up to 1 MiB)


_destroyed_by_state = False  # see `note_group_destroyed`


def note_group_destroyed(destroyed: bool = True) -> None:
    """Called by `PartialState.destroy_process_group` (as `accelerator.end_training()` does) when it destroys
    the default group of a run of several processes, and with False when the state is reset. Until a new
    group exists, collectives then raise, as on Accelerate, instead of acting as one process with only
    this process's data (which would return a wrong result without a word)."""
    global _destroyed_by_state
    _destroyed_by_state = destroyed


def _group_facts() -> _GroupFacts:
    """The default group's facts, refreshed when the group changes (runs on every collective: one
    attribute read and one weakref call when nothing changed)."""
    global _facts
    group = dist.group.WORLD if _DIST_AVAILABLE else None
    if group is None:  # (checked first: the weakref of a destroyed group also answers None)
        if _destroyed_by_state:
            raise ValueError(
                "The process group of this run was destroyed (accelerator.end_training() or "
                "destroy_process_group()), and collectives need it: call them before end_training()."
            )
        _facts = _NO_GROUP
    elif _facts.group() is not group:
        note_group_destroyed(False)
        _facts = _GroupFacts(weakref.ref(group), dist.get_world_size(group), str(dist.get_backend(group)).lower())
    return _facts


def _world_size() -> int:
    return _group_facts().world


def _backend() -> str:
    """The default group's backend name, lowercased ("" without a group)."""
    return _group_facts().backend


def _rank() -> int:
    """This rank in the default group. torch_xla's group is shared by the replica threads of a process (TPU
    v2/v3, its CPU device) and holds the first thread's rank, so on XLA the thread's own ordinal is used."""
    if _backend() == "xla":
        import torch_xla.runtime as xr

        return xr.global_ordinal()
    return dist.get_rank()


_GLOO_DTYPES = {
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8, torch.int32,
    torch.int64, torch.bool, torch.complex64, torch.complex128,
}


def _native(dtype: torch.dtype) -> bool:
    """Whether the backend moves `dtype` as it is (gloo has no int16, uint16/32/64 or float8)."""
    return dtype in _GLOO_DTYPES or _backend() != "gloo"


def _reducible_as(dtype: torch.dtype) -> torch.dtype:
    """The dtype a reduction runs in: `dtype`, or a wider one the backend supports."""
    if _native(dtype):
        return dtype
    return torch.float32 if dtype.is_floating_point else torch.int64


# torch's single-tensor all-gather, by the torch installed: `all_gather_single` (torch >= 2.13) or
# `all_gather_into_tensor`; what `_all_gather_fn` calls and every traced all-gather names
_ALL_GATHER_CALL = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"


def _all_gather_fn() -> tuple[Callable[..., Any], str]:
    """torch's single-tensor all-gather function and its name (looked up at each call: tests count it)."""
    return getattr(dist, _ALL_GATHER_CALL), _ALL_GATHER_CALL


def all_gather_rows(
    op: str, flat: torch.Tensor, traced: Any = (), out: torch.Tensor | None = None, world: int = 0
) -> torch.Tensor:
    """All-gather the 1-D tensor `flat` (same size on every rank) into a (world, size) tensor, traced as `op`.

    `out`: a 1-D receive buffer of world * size elements to reuse (else a new one); `world`: the world
    size, when the caller has it."""
    all_gather, call = _all_gather_fn()
    world = world or _world_size()
    if out is None:
        out = flat.new_empty(world * flat.numel())  # the flat form: gloo has no stacked output
    with in_collective(op, call, traced if traced != () else [flat]):
        _call_checked(op, all_gather, out, flat)
    return out.view(world, flat.numel())


@functools.cache
def _async_options() -> Any:
    """torch's AllgatherOptions for an asynchronous all-gather (made once; the process group only reads it)."""
    options = dist.distributed_c10d.AllgatherOptions()
    options.asyncOp = True
    return options


# the stacked gather's all-gather: torch.distributed.all_gather, the list form (ProcessGroup.allgather)
_SLOTS_CALL = "all_gather"


def _start_all_gather(group: Any, slots: list[torch.Tensor], rows: torch.Tensor) -> Any:
    """Start the all-gather of `rows` (the dense (count, block) tensor nbaccel packed) into `slots` (one
    strided view of the results per rank) on the default `group`; return its work.

    The list form, because the process group receives into a flat buffer of its own and then copies each
    rank's part into its output tensor (gloo and nccl both do): into strided slots, that copy is also the
    reordering a gather needs, which a single-tensor all-gather leaves to a second copy (2-4% of a 64 KiB
    gather on 2 gloo ranks, benchmarks/RESULTS.md, 2026-12-02).
    torch.distributed's function is a Python wrapper around the process group's own method: its checks,
    torch-function dispatch and coalescing bookkeeping cost ~17 us a call in a warm loop, 17-37 us between
    real collectives (benchmarks/RESULTS.md, 2026-11-29 18:05). Here the inputs are known, so the method is
    called directly; torch's function is used wherever its extra work could matter: a torch-function mode or
    subclass active, complex data (viewed as real there). (Inside torch's private `_coalescing_manager` the
    all-gather runs at once rather than joining the batch; torch's function would hand back a work that
    cannot be waited for, which a gather must do.)"""
    if rows.is_complex() or torch.overrides.has_torch_function((rows,)):  # (the slots: views of a new tensor)
        return dist.all_gather(slots, rows, None, True)
    return group.allgather([slots], [rows], _async_options())


def _call_checked(op: str, fn: Callable[..., Any], *args: Any) -> Any:
    """Run a torch collective (or wait for one), returning what it returns; a size mismatch between ranks
    becomes an error that says what to do."""
    try:
        return fn(*args)
    except RuntimeError as exc:
        _raise_if_sizes_differ(op, exc)
        raise


def _raise_if_sizes_differ(op: str, exc: RuntimeError) -> None:
    """For torch's error of a collective whose ranks' sizes differ: raise the error that says what to do."""
    if "size" in str(exc):
        raise DistributedOperationException(
            f"{op} failed: the ranks most likely passed tensors of different shapes ({exc}). Every rank must "
            "pass the same shapes: pad with pad_across_processes first, or set NBACCEL_DEBUG_MODE=1 to have the "
            "ranks compare their shapes and name them."
        ) from exc


# ---------------------------------------------------------------------------------------------------------
# Checking the input (before any communication, so every rank with the same bad input fails the same way)
# ---------------------------------------------------------------------------------------------------------


def _collect(op: str, data: Any, leaves: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """The tensors of `data` in traversal order (`leaves` when the caller found them already);
    TypeError/ValueError naming the first offending leaf."""
    tensors: list[torch.Tensor] = [] if leaves is None else leaves
    if leaves is None and not flatten_tensors(data, tensors):
        path, leaf = next((p, v) for p, v in iter_leaves(data) if not isinstance(v, torch.Tensor))
        hint = " Use gather_object for Python objects." if op == "gather" else ""
        raise TypeError(
            f"{op}: {path} is a {type(leaf).__name__}, not a tensor. {op} takes tensors nested in lists, "
            f"tuples and dicts.{hint}"
        )
    if not tensors:
        return tensors
    device = tensors[0].device
    for t in tensors:
        if t.device != device:
            where = ", ".join(f"{p} on {v.device}" for p, v in iter_leaves(data) if isinstance(v, torch.Tensor))
            raise ValueError(
                f"{op}: the tensors are on different devices ({where}). Put them on one device first, "
                "e.g. `send_to_device(data, device)`."
            )
    if device.type == "meta":
        raise ValueError(
            f"{op}: the tensors are on the 'meta' device, which holds no data to communicate. "
            "Materialize them on a real device first."
        )
    if device.type != "cuda" and _backend() == "nccl":
        raise ValueError(
            f"{op}: the process group uses nccl, which moves CUDA tensors only, but the data is on {device}. "
            "Move it first: `send_to_device(data, accelerator.device)`."
        )
    return tensors


def _describe(data: Any, pad_dim: int | None = None) -> Any:
    """The structure of `data` with "dtype[shape]" in place of tensors (size along `pad_dim` as '*')."""

    def one(t: torch.Tensor) -> str:
        shape = [str(s) for s in t.shape]
        if pad_dim is not None and -t.ndim <= pad_dim < t.ndim:
            shape[pad_dim] = "*"
        return f"{str(t.dtype).replace('torch.', '')}[{', '.join(shape)}]"

    return recursively_apply(one, data, test_type=lambda x: isinstance(x, torch.Tensor))


def _debug_check(op: str, data: Any, error: Exception | None, pad_dim: int | None = None) -> None:
    """Debug mode: exchange structures; raise DistributedOperationException on every rank if they differ."""
    try:
        mine = {"op": op, "structure": repr(_describe(data, pad_dim)), "error": None}
    except Exception as exc:  # an exotic container that cannot be described: report it rather than hang
        mine = {"op": op, "structure": f"<{type(data).__name__}>", "error": f"{type(exc).__name__}: {exc}"}
    if error is not None:
        mine["error"] = f"{type(error).__name__}: {error}"
    everyone: list[Any] = [None] * _world_size()
    with in_collective(op, "all_gather_object (debug check)"):
        dist.all_gather_object(everyone, mine)
    failed = [(rank, s["error"]) for rank, s in enumerate(everyone) if s["error"]]
    if failed:
        lines = "\n".join(f"  - rank {rank}: {message}" for rank, message in failed)
        raise DistributedOperationException(f"{op} cannot run: invalid input on some ranks:\n{lines}")
    ops = {s["op"] for s in everyone}
    if len(ops) > 1:
        lines = "\n".join(f"  - rank {rank}: {s['op']}" for rank, s in enumerate(everyone))
        raise DistributedOperationException(f"the ranks are in different collectives:\n{lines}")
    if any(s["structure"] != everyone[0]["structure"] for s in everyone):
        lines = "\n".join(f"  - rank {rank}: {s['structure']}" for rank, s in enumerate(everyone))
        what = "the same shapes except along `dim`" if pad_dim is not None else "the same shapes and dtypes"
        hint = " (use pad_across_processes before gathering tensors of different lengths)" if op == "gather" else ""
        raise DistributedOperationException(
            f"{op} needs {what} on every rank, got:\n{lines}{hint}"
        )


def _prepare(
    op: str, data: Any, pad_dim: int | None = None, check: Callable[[], None] | None = None,
    leaves: list[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """Validate `data` for collective `op` (plus `check()`); in debug mode, also check every rank matches.
    The input's error (TypeError, ValueError or `check`'s RuntimeError) is raised after debug mode's check.

    `leaves`: the tensors of `data` in order, when the caller already has them (`flat_tensors`)."""
    error: Exception | None = None
    tensors: list[torch.Tensor] = []
    try:
        tensors = _collect(op, data, leaves)
        if check is not None:
            check()
    except (TypeError, ValueError, RuntimeError) as exc:  # (RuntimeError: a mean of integers)
        error = exc
    if debug_mode_enabled():
        _debug_check(op, data, error, pad_dim)
    if error is not None:
        raise error
    return tensors


def _without_grad(function: Callable[..., Any]) -> Callable[..., Any]:
    """Run `function` with autograd off: communication is not differentiable, results never carry a graph.
    (A plain `with torch.no_grad()`: cheaper per call than torch's decorator form.)"""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return function(*args, **kwargs)
        with torch.no_grad():
            return function(*args, **kwargs)

    return wrapper


def _dtype_groups(tensors: Sequence[torch.Tensor]) -> list[list[int]]:
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    return list(groups.values())


def _communication_groups(tensors: Sequence[torch.Tensor]) -> list[list[int]]:
    """Tensors that share one buffer: all of them (as bytes), or one group per dtype on XLA (no byte views)."""
    if tensors[0].device.type == "xla":
        return _dtype_groups(tensors)
    return [list(range(len(tensors)))]


def _traced(tensors: Sequence[torch.Tensor], buffer: torch.Tensor) -> Sequence[torch.Tensor]:
    """What the collective trace records: the caller's tensors when few, else the packed buffer (cheaper)."""
    return tensors if len(tensors) <= _TRACE_EACH else [buffer]


# ---------------------------------------------------------------------------------------------------------
# gather, reduce, broadcast, pad_across_processes
# ---------------------------------------------------------------------------------------------------------


def gather(tensor: Any) -> Any:
    """Gather a tensor, or a nested structure of them, from every process, concatenated along dim 0.

    Every process gets the result. Tensors must have the same shape on every process (pad them first with
    `pad_across_processes` when their first dims differ); 0-dim tensors gather into a 1-D tensor.
    """
    facts = _group_facts()
    if facts.world == 1:
        return tensor
    if not debug_mode_enabled():  # inputs like ones that passed the checks before skip them
        kind = type(tensor)
        if kind is torch.Tensor:
            if (tensor.dtype, tensor.device) in facts.checked_tensors:
                return _gather_one(tensor, facts.world)
        elif facts.checked:
            known = _gather_known(tensor, facts)
            if known is not None:
                return known
    return _gather_checked(tensor, facts)


def _layout(items: list[Any]) -> tuple:
    """The layout key of a gather's tensors (AttributeError when an item is not a tensor). It includes
    `requires_grad`: only layouts without gradients are remembered, since the fast path runs with autograd
    on (the checked path turns it off; a reused receive buffer made there must not meet a graph)."""
    return tuple([(t.dtype, t.shape, t.device, t.requires_grad) for t in items])


def _gather_known(data: Any, facts: _GroupFacts) -> Any:
    """Gather a plain dict, list or tuple whose layout already passed the input checks on this group (the
    common case: the same outputs gathered at every step); None for any other input or a new layout, which
    takes the checked path.

    Each step of the checked path costs little alone, but between two ranks sharing their cores every
    extra Python call before the all-gather shows in its time (docs/internals.md, "Where the time goes")."""
    items = plain_items(data)
    if items is None:
        return None
    if facts.stacked:
        known = _gather_known_stacked(data, items, facts)
        if known is not None:
            return known
    try:
        plan = facts.checked.get(_layout(items))
    except (AttributeError, TypeError, RuntimeError):  # not (plain) tensors: the checked path says what is wrong
        return None
    if plan is None:
        return None
    if plan.stacked is not None:
        return _gather_stacked(data, items, facts, plan)
    return rebuild_flat(data, _gather_packed(items, facts.world, plan))


def _gather_known_stacked(data: Any, items: list[Any], facts: _GroupFacts) -> Any:
    """`_gather_known` for tensors of one dtype and one shape whose layout passed the checks: the first item
    finds the plan, `torch.stack` (which is the packing) checks in C++ that every other item has its shape
    and device, and the dtypes are compared apart (stack would promote them). None when anything differs or
    a graph would have to be kept; the caller then builds the whole layout key. Costs ~2 us in a warm loop
    against ~6 us for that key; 1-2.5% of a gather (benchmarks/RESULTS.md, 2026-11-29 18:35)."""
    first = items[0] if items else None
    try:
        plan = facts.stacked.get((len(items), first.dtype, first.shape, first.device))
        if plan is None or len(set(map(_dtype_of, items))) != 1:
            return None
        buffer = torch.stack(items)
    except (AttributeError, TypeError, RuntimeError):  # not tensors, or shapes or devices differ
        return None
    if buffer.requires_grad:  # a graph would be kept: the checked path turns autograd off
        return None
    return _gather_stacked(data, items, facts, plan, buffer.view(-1))


@_without_grad
def _gather_checked(tensor: Any, facts: _GroupFacts) -> Any:
    """`gather` with every input check (and debug mode's exchange); remembers the layouts that passed."""
    world = facts.world
    flat = None if isinstance(tensor, torch.Tensor) else flat_tensors(tensor)
    tensors = _prepare("gather", tensor, leaves=flat)
    if not tensors:
        return tensor
    if len(tensors) == 1 and _native(tensors[0].dtype):
        if type(tensor) is torch.Tensor:  # a lone plain tensor: its dtype and device are what the checks saw
            facts.checked_tensors.add((tensor.dtype, tensor.device))
        results = [_gather_one(tensors[0], world)]
    elif tensors[0].device.type != "xla":
        plan = packing.plan_for(tensors, world, as_bytes=not _native(tensors[0].dtype))
        if flat is not None and not any(t.requires_grad for t in tensors):  # plain, no graph: remember it
            if len(facts.checked) >= _CHECKED_LAYOUTS:
                facts.checked.clear()
                facts.stacked.clear()
            facts.checked[_layout(tensors)] = plan
            if plan.stacked is not None:
                first = tensors[0]
                facts.stacked[(len(tensors), first.dtype, first.shape, first.device)] = plan
        if flat is not None and plan.stacked is not None:
            return _gather_stacked(tensor, tensors, facts, plan)
        results = _gather_packed(tensors, world, plan)
    else:  # no byte views on XLA: one buffer per dtype
        results = [None] * len(tensors)
        for group in _dtype_groups(tensors):
            for i, out in zip(group, _gather_packed([tensors[i] for i in group], world)):
                results[i] = out
    if isinstance(tensor, torch.Tensor):
        return results[0]
    return rebuild(tensor, iter(results)) if flat is None else rebuild_flat(tensor, results)


def _gather_packed(tensors: list[torch.Tensor], world: int, plan: packing.Plan | None = None) -> list[torch.Tensor]:
    """Gather `tensors` packed into one buffer (as bytes when their dtypes differ) with one all-gather.

    `plan`: their packing plan, when the caller has it."""
    if plan is None:
        plan = packing.plan_for(tensors, world, as_bytes=not _native(tensors[0].dtype))
    buffer = packing.pack(plan, tensors)
    receive, held = _take_receive_buffer(plan, buffer, world)
    try:
        rows = all_gather_rows("gather", buffer, _traced(tensors, buffer), receive, world)
        return packing.unpack_gathered(plan, rows, tensors)
    finally:
        if held:
            plan.lock.release()


def _take_receive_buffer(plan: packing.Plan, buffer: torch.Tensor, world: int) -> tuple[torch.Tensor, bool]:
    """Where `world` ranks' `buffer`s arrive: the plan's own buffer when no other thread is using it (it is only
    scratch, the results are copied out of it), kept for the next call when small; else a new one. The flag:
    this thread now holds `plan.lock`, which the caller releases once the results are copied out.

    A function and a `try`/`finally` at the caller, not a context manager: between two collectives, with cold
    caches, a generator-based one cost ~10-15 us more per gather (benchmarks/RESULTS.md, 2026-11-29 15:12).
    The lock is only taken without blocking, so one left held (an interrupt between this return and the
    caller's `try`) costs the reuse, never a wait."""
    held = plan.lock.acquire(blocking=False)
    rows = plan.receive if held else None
    if rows is None:
        try:
            rows = buffer.new_empty(world * buffer.numel())
        except BaseException:  # out of memory, an interrupt: the lock is not the caller's to release yet
            if held:
                plan.lock.release()
            raise
        if held and rows.numel() * rows.element_size() <= _KEEP_RECEIVE_BYTES:
            plan.receive = rows
    return rows, held


def _gather_stacked(data: Any, tensors: list[torch.Tensor], facts: _GroupFacts, plan: packing.Plan,
                    buffer: torch.Tensor | None = None) -> Any:
    """`_gather_packed` for a plain dict, list or tuple (`data`) of tensors of one dtype and one shape (a
    stacked plan), returning `data` rebuilt: the results are one new tensor (as `unpack_gathered` makes
    them), and the all-gather, started asynchronously, writes each rank's rows straight into their slots
    there (`_start_all_gather`); the trace's listeners and the results' container are made while the data
    travels. `buffer`: the tensors already packed, when the caller has them. Nothing is reused between
    calls, so an interrupted gather leaves nothing behind that a later one could meet."""
    if buffer is None:
        buffer = packing.pack(plan, tensors)
    results = packing.stacked_results(plan, buffer)
    # rank r's rows (count, block) land in a strided slot of the results: row i is block r of result i.
    # Inline, not a helper: a call more costs a gather between two ranks ~1.5% (benchmarks/RESULTS.md, 2026-12-02)
    count, block = plan.stacked[0], plan.groups[0].block
    slots = list(results.view(count, facts.world, block).unbind(1))
    trace = in_collective("gather", _SLOTS_CALL, _traced(tensors, buffer), announce=False)
    try:  # one `try` for the start and the wait, no wrapper call each
        with trace:
            work = _start_all_gather(facts.group(), slots, buffer.view(count, block))
            trace.announce()  # the telemetry's share, while the data travels
            gathered = rebuild_flat(data, list(results.unbind(0)))
            if work is not None:  # (a backend that completes in the call returns no work)
                work.wait()
    except RuntimeError as exc:
        _raise_if_sizes_differ("gather", exc)
        raise
    return gathered


def _gather_one(t: torch.Tensor, world: int) -> torch.Tensor:
    """A lone tensor needs no packing: gather it straight into the result (never part of a graph)."""
    t = t.detach()
    src = t.reshape(1) if t.ndim == 0 else t.contiguous()
    out = src.new_empty((world,) if t.ndim == 0 else (world * t.shape[0], *t.shape[1:]))
    all_gather, call = _all_gather_fn()
    with in_collective("gather", call, [t]):
        _call_checked("gather", all_gather, out, src)
    return out


def reduce(tensor: Any, reduction: str = "mean", scale: float = 1.0) -> Any:
    """Reduce a tensor, or a nested structure of them, across processes; returns new tensors.

    `reduction`: "mean", "sum", "max" or "min"; "none" sums, as Accelerate's reduce does (with a warning that
    says so). `scale` multiplies the result on XLA only, as in Accelerate (elsewhere it is ignored, with a
    warning). On one process: copies. One communication per dtype of the structure.

    With autograd on, a result made from tensors that require grad stays in their graph, as in Accelerate:
    the communication itself counts as the identity (torch has no gradient for it and warns so), the
    division of a mean and `scale` count as usual. So `backward(reduce(loss))` gives each rank its own
    loss's gradient over the number of processes.
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduce: reduction must be one of {', '.join(map(repr, _REDUCTIONS))}, got {reduction!r}.")
    world = _world_size()
    if world == 1:  # copies, in the caller's grad mode (they keep the inputs' graph); no scale, as Accelerate
        return recursively_apply(lambda t: t.clone(), tensor, error_on_other_type=True)
    if reduction == "none":
        warn_at_caller("reduce(reduction='none') sums across processes, as Accelerate's reduce does: pass "
                       "reduction='sum' to say so.")
        reduction = "sum"
    if scale != 1.0 and _backend() != "xla":
        warn_at_caller(f"reduce(scale={scale}) applies on XLA only, as in Accelerate: the result is not scaled "
                       "here; multiply it yourself.")
        scale = 1.0
    if not torch.is_grad_enabled():
        return _reduce_across(tensor, reduction, scale, world, False)
    with torch.no_grad():
        return _reduce_across(tensor, reduction, scale, world, True)


def _reduce_across(tensor: Any, reduction: str, scale: float, world: int, grad: bool) -> Any:
    """`reduce` on several processes, called with autograd off; `grad`: the caller had it on, so a dtype group
    holding a tensor that requires grad is reduced with it on again (its result keeps the graph)."""
    tensors = _prepare("reduce", tensor, check=(lambda: _check_mean(tensor)) if reduction == "mean" else None)
    if not tensors:
        return tensor
    op = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[
        reduction
    ]
    results: list[torch.Tensor | None] = [None] * len(tensors)
    # One communication per dtype, whatever requires grad (that may differ between ranks; the communications
    # may not)
    for group in _dtype_groups(tensors):  # a sum needs one dtype per buffer
        members = [tensors[i] for i in group]
        if grad and any(t.requires_grad for t in members):
            with torch.enable_grad():
                outs = _reduce_group(members, op, reduction, scale, world)
            # one buffer held them all: those from tensors without a graph leave it, as Accelerate's would
            outs = [out if t.requires_grad else out.detach() for t, out in zip(members, outs)]
        else:
            outs = _reduce_group(members, op, reduction, scale, world)
        for i, out in zip(group, outs):
            results[i] = out
    if isinstance(tensor, torch.Tensor):
        return results[0]
    return rebuild(tensor, iter(results))


def _reduce_group(members: list[torch.Tensor], op: Any, reduction: str, scale: float, world: int) -> list[torch.Tensor]:
    """Reduce tensors of one dtype with one all-reduce of a packed copy; views of it shaped like `members`.

    Only in-place operations on that copy (never on an input), so with autograd on the results hang off the
    inputs' graph through the packing."""
    plan = packing.plan_for(members, world)
    buffer = packing.pack(plan, members)
    if len(members) == 1 and buffer.data_ptr() == members[0].data_ptr():
        buffer = buffer.clone()  # a lone contiguous tensor packs as a view: never reduce into the input
    wide = _reducible_as(buffer.dtype)
    if wide != buffer.dtype:  # e.g. int16 on gloo: reduce in a wider dtype, then come back
        narrow, buffer = buffer, buffer.to(wide)
    with in_collective("reduce", "all_reduce", _traced(members, buffer)):
        dist.all_reduce(buffer, op)
    if wide != members[0].dtype:
        buffer = narrow.copy_(buffer)
    if reduction == "mean":
        buffer /= world
    if scale != 1.0:
        buffer *= scale
    return packing.unpack(plan, buffer, members)


def _check_mean(data: Any) -> None:
    """A mean of integer or bool tensors is refused with a RuntimeError: Accelerate's error type there (torch
    cannot divide its all-reduced integer tensor in place). With one process neither refuses: no division."""
    for path, leaf in iter_leaves(data):
        if isinstance(leaf, torch.Tensor) and not (leaf.is_floating_point() or leaf.is_complex()):
            raise RuntimeError(
                f"reduce: reduction='mean' needs floating-point tensors, but {path} is {leaf.dtype}. "
                "Use reduction='sum', or convert it with `.float()`."
            )


@_without_grad
def broadcast(tensor: Any, from_process: int = 0) -> Any:
    """Copy a tensor, or a nested structure of them, from process `from_process` into every process's tensors.

    The tensors are overwritten in place (they must have the same shapes and dtypes on every process); the
    structure is returned for convenience.
    """
    world = _world_size()
    if world == 1:
        return tensor
    if not isinstance(from_process, int) or not 0 <= from_process < world:
        raise ValueError(f"broadcast: from_process must be a process index in [0, {world - 1}], got {from_process!r}.")
    tensors = _prepare("broadcast", tensor)
    if not tensors:
        return tensor
    sending = _rank() == from_process
    if _backend() == "xla":  # replicas must run one graph: plain device data in, one broadcast per tensor
        xla.run_pending_graph()
        with in_collective("broadcast", "broadcast", tensors):
            for member in tensors:
                dist.broadcast(member, src=from_process)
        return tensor
    for group in _communication_groups(tensors):
        members = [tensors[i].detach() for i in group]
        native = _native(members[0].dtype)
        if len(members) == 1 and native and members[0].is_contiguous():  # broadcast straight into the tensor
            with in_collective("broadcast", "broadcast", members):
                dist.broadcast(members[0], src=from_process)
            continue
        plan = packing.plan_for(members, world, as_bytes=not native)
        if sending:
            buffer = packing.pack(plan, members)
        else:
            buffer = torch.empty(plan.total, dtype=torch.uint8 if plan.mixed else members[0].dtype,
                                 device=members[0].device)
        with in_collective("broadcast", "broadcast", _traced(members, buffer)):
            dist.broadcast(buffer, src=from_process)
        if not sending:
            torch._foreach_copy_(members, packing.unpack(plan, buffer, members))
    return tensor


def pad_across_processes(tensor: Any, dim: int = 0, pad_index: Any = 0, pad_first: bool = False) -> Any:
    """Pad every tensor of a nested structure along `dim` to the largest size any process has.

    Padding uses `pad_index` and goes at the end (`pad_first=True`: at the start), so the result can be
    gathered. All sizes move in one communication. Tensors that `dim` does not fit (too few dims) are left
    as they are, as in Accelerate, even when it fits none of them.
    """
    world = _world_size()
    if world == 1:
        _pad_eligible(tensor, dim)  # the same argument checks as with several processes
        return tensor
    eligible: list[torch.Tensor] = []
    tensors = _prepare(
        "pad_across_processes", tensor, pad_dim=dim, check=lambda: eligible.extend(_pad_eligible(tensor, dim))
    )
    if not tensors or not eligible:
        return tensor
    lengths = torch.tensor([t.shape[dim] for t in eligible], dtype=torch.int64, device=eligible[0].device)
    everyone = all_gather_rows("pad_across_processes", lengths, eligible)
    targets = everyone.max(dim=0).values.tolist()
    padded = {id(t): _pad_one(t, dim, n, pad_index, pad_first) for t, n in zip(eligible, targets)}
    if isinstance(tensor, torch.Tensor):
        return padded.get(id(tensor), tensor)
    return recursively_apply(lambda t: padded.get(id(t), t), tensor)


def _pad_eligible(data: Any, dim: int) -> list[torch.Tensor]:
    """The tensors `pad_across_processes` pads: those `dim` fits (a nested tensor is left, with a warning)."""
    tensors: list[torch.Tensor] = []
    flatten_tensors(data, tensors)
    eligible = []
    for t in tensors:
        if getattr(t, "is_nested", False):
            warn_at_caller("pad_across_processes cannot pad a nested tensor (its rows have their own lengths); "
                           "it is left as it is.", CannotPadNestedTensorWarning)
        elif -t.ndim <= dim < t.ndim:
            eligible.append(t)
    return eligible


def _pad_one(t: torch.Tensor, dim: int, length: int, pad_index: Any, pad_first: bool) -> torch.Tensor:
    dim = dim % t.ndim
    old = t.shape[dim]
    if length == old:
        return t
    shape = list(t.shape)
    shape[dim] = length
    out = t.new_full(shape, pad_index)
    out.narrow(dim, length - old if pad_first else 0, old).copy_(t)
    return out


def wait_for_everyone() -> None:
    """Block until every process reaches this call (a barrier); nothing to wait for in one process."""
    if _world_size() == 1:
        return
    with in_collective("wait_for_everyone", "barrier"):
        if _backend() == "nccl" and torch.cuda.is_available():
            dist.barrier(device_ids=[torch.cuda.current_device()])
        else:
            dist.barrier()


def verify_operation(function: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator: in debug mode, check that the first argument (`tensor`) has the same shapes on every rank
    before calling `function`; raise DistributedOperationException on every rank if not."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _world_size() > 1 and debug_mode_enabled():
            data = kwargs["tensor"] if "tensor" in kwargs else args[0]
            _debug_check(f"{function.__module__}.{function.__name__}", data, None)
        return function(*args, **kwargs)

    return wrapper


def chained_operation(function: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator: a DistributedOperationException raised inside `function` is re-raised naming `function`."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except DistributedOperationException as exc:
            raise DistributedOperationException(
                f"{function.__module__}.{function.__name__} failed: {exc}"
            ) from exc

    return wrapper


@contextlib.contextmanager
def GatheredParameters(  # noqa: N802 - Accelerate's name
    params: Any, modifier_rank: int | None = None, fwd_module: Any = None, enabled: bool = True
) -> Iterator[None]:
    """Inside the block, DeepSpeed ZeRO-3 partitioned `params` are whole on every rank (DeepSpeed's own
    `deepspeed.zero.GatheredParameters`); for parameters DeepSpeed does not partition, nothing to do."""
    single = isinstance(params, torch.Tensor)
    items = [params] if single else list(params) if params is not None else []  # a generator is read once
    if enabled and any(hasattr(p, "ds_id") for p in items):  # ZeRO-3 tags the parameters it partitions
        import deepspeed

        with deepspeed.zero.GatheredParameters(params if single else items, modifier_rank=modifier_rank,
                                               fwd_module=fwd_module, enabled=enabled):
            yield
    else:
        yield


def is_torch_xpu_tensor(tensor: Any) -> bool:
    """True for a tensor on an Intel XPU."""
    return isinstance(tensor, torch.Tensor) and tensor.device.type == "xpu"
