"""Packing many tensors into one communication buffer and back, in a constant number of torch calls.

A collective over a structure of 16 small tensors is dominated by per-call overhead, not by bytes: doing
16 slices and 16 copies costs more than the communication itself. So tensors are flattened per dtype in
one C++ call (`flatten_dense_tensors`), dtypes are joined as bytes, and after an all-gather the
(world, total) result is reordered into one contiguous block per tensor with ONE `index_select` whose index
is cached per structure signature; `unflatten_dense_tensors` then hands out the per-tensor views.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

try:  # the C++ helpers DDP uses; fall back to plain torch calls where a build lacks them
    from torch._C._nn import flatten_dense_tensors as _flatten
    from torch._C._nn import unflatten_dense_tensors as _unflatten
except ImportError:  # pragma: no cover - every torch 2.x build here has them

    def _flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.cat([t.reshape(-1) for t in tensors])

    def _unflatten(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return [piece.view(t.shape) for piece, t in zip(flat.split([t.numel() for t in tensors]), tensors)]


_INDEX_LIMIT = 1 << 18  # reorder with a cached index (8 bytes a unit) up to 256K units; beyond, data dominates
_CACHE_SIZE = 32  # layouts remembered; with the limits here at most ~100 MiB of cached index and buffers


@dataclass
class Group:
    """The tensors of one dtype: their indices in the structure and their place in the packed buffer."""

    dtype: torch.dtype
    members: list[int]
    start: int  # in buffer units (bytes when dtypes are mixed, elements otherwise)
    length: int
    gathered: list[torch.Tensor]  # meta tensors with the gathered shapes (templates for unflatten)
    block: int = 0  # when every member has the same size: that size in units (reorder by a transpose)
    index: torch.Tensor | None = None  # otherwise: positions in the gathered buffer, tensor by tensor
    same_shape: bool = False  # every member gathers to one shape (split by a single unbind)


@dataclass
class Plan:
    groups: list[Group]
    mixed: bool  # several dtypes: the buffer is bytes
    total: int
    world: int
    flat_inputs: bool = False  # every input is 1-D
    receive: torch.Tensor | None = None  # a gather's receive buffer, kept for the next gather of this layout
    stacked: tuple[int, ...] | None = None  # one dtype, several tensors of one shape: (count, *gathered shape)
    lock: threading.Lock = field(default_factory=threading.Lock)


_plans: OrderedDict[tuple, Plan] = OrderedDict()


def plan_for(tensors: Sequence[torch.Tensor], world: int, as_bytes: bool = False) -> Plan:
    """The packing plan for `tensors` (cached by world size, device, dtypes and shapes).

    `as_bytes`: pack as bytes even for a single dtype (one the backend cannot move natively)."""
    key = (world, tensors[0].device, as_bytes, tuple([(t.dtype, t.shape) for t in tensors]))
    plan = _plans.get(key)
    if plan is None:
        plan = _make_plan(tensors, world, as_bytes)
        _plans[key] = plan
        if len(_plans) > _CACHE_SIZE:
            _plans.popitem(last=False)
    return plan


def _make_plan(tensors: Sequence[torch.Tensor], world: int, as_bytes: bool = False) -> Plan:
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    mixed = len(by_dtype) > 1 or as_bytes
    # widest dtype first: every group then starts at a byte offset aligned to its element size
    order = sorted(by_dtype.items(), key=lambda item: -tensors[item[1][0]].element_size())
    groups, start = [], 0
    for dtype, members in order:
        numel = sum(tensors[i].numel() for i in members)
        length = numel * tensors[members[0]].element_size() if mixed else numel
        gathered = [
            torch.empty((world,) if t.ndim == 0 else (world * t.shape[0], *t.shape[1:]), dtype=dtype, device="meta")
            for t in (tensors[i] for i in members)
        ]
        groups.append(Group(dtype, members, start, length, gathered))
        start += length
    plan = Plan(groups, mixed, start, world, flat_inputs=all(t.ndim == 1 for t in tensors))
    for group in groups:
        sizes = {length for _, length in _segments(plan, group, tensors)}
        if len(sizes) == 1:
            group.block = sizes.pop()
            group.same_shape = all(g.shape == group.gathered[0].shape for g in group.gathered)
        elif world * group.length <= _INDEX_LIMIT:
            group.index = _reorder_index(plan, group, tensors).to(tensors[0].device)
    if not mixed and len(tensors) > 1 and groups[0].same_shape:
        plan.stacked = (len(tensors), *groups[0].gathered[0].shape)
    return plan


def _segments(plan: Plan, group: Group, tensors: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
    """(offset, length) of each member of `group` in the packed buffer, in buffer units."""
    segments, offset = [], group.start
    for i in group.members:
        length = tensors[i].numel() * (tensors[i].element_size() if plan.mixed else 1)
        segments.append((offset, length))
        offset += length
    return segments


def _reorder_index(plan: Plan, group: Group, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    rows = torch.arange(plan.world, dtype=torch.int64)[:, None] * plan.total
    parts = [(rows + torch.arange(offset, offset + length, dtype=torch.int64)).reshape(-1)
             for offset, length in _segments(plan, group, tensors)]
    return torch.cat(parts)


def pack(plan: Plan, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One 1-D buffer holding every tensor (a view of the input when it is a single contiguous tensor)."""
    if not plan.mixed:
        if plan.flat_inputs and len(tensors) > 1:
            return torch.cat(tensors)  # 1-D tensors: no per-tensor view needed
        return _flatten(tensors)
    flats = [_flatten([tensors[i] for i in group.members]) for group in plan.groups]
    return torch.cat([flat.view(-1).view(torch.uint8) for flat in flats])


def unpack(plan: Plan, buffer: torch.Tensor, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of a packed `buffer` shaped like `tensors` (the inverse of `pack`)."""
    results: list[torch.Tensor | None] = [None] * len(tensors)
    for group in plan.groups:
        segment = buffer[group.start : group.start + group.length]
        if plan.mixed:
            segment = segment.view(group.dtype)
        for i, view in zip(group.members, _unflatten(segment, [tensors[i] for i in group.members])):
            results[i] = view
    return results


def stacked_results(plan: Plan, buffer: torch.Tensor) -> torch.Tensor:
    """For a stacked plan: the empty (count, *gathered shape) tensor whose rows become the gathered tensors
    (`unbind(0)`; `fill_stacked`, or an all-gather into its per-rank slots, writes the data), so they can be
    handed out before the data arrives."""
    return torch.empty(plan.stacked, dtype=buffer.dtype, device=buffer.device)


def fill_stacked(plan: Plan, rows: torch.Tensor, results: torch.Tensor) -> None:
    """Copy an all-gathered (world, total) buffer into `stacked_results`'s tensor: one reordering copy (the
    same data and layout as `unpack_gathered` makes; `rows` may be reused afterwards)."""
    count, block = plan.stacked[0], plan.groups[0].block
    results.view(count, plan.world, block).copy_(rows.view(plan.world, count, block).transpose(0, 1))


def unpack_gathered(plan: Plan, rows: torch.Tensor, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Split an all-gathered (world, total) buffer into one tensor per input, concatenated along dim 0.

    Each group is reordered into one contiguous block per tensor with a single copy: a transpose when its
    members have one size, a cached `index_select` otherwise (per-tensor slices for very large groups).
    The results never share memory with `rows`, so a caller may reuse it.
    """
    if plan.stacked is not None:  # one dtype, several tensors of one shape: one copy, one split
        results = stacked_results(plan, rows)
        fill_stacked(plan, rows, results)
        return list(results.unbind(0))
    results: list[torch.Tensor | None] = [None] * len(tensors)
    for group in plan.groups:
        if group.block:
            part = rows if group.length == plan.total else rows[:, group.start : group.start + group.length]
            ordered = part.reshape(plan.world, -1, group.block).transpose(0, 1)
            # a copy in every case: `rows` may be a reused buffer (a lone member's transpose is already contiguous)
            ordered = (ordered.contiguous() if ordered.shape[0] > 1 else ordered.clone()).view(-1)
        elif group.index is not None:
            ordered = rows.reshape(-1).index_select(0, group.index)
        else:
            ordered = torch.cat([rows[:, a : a + n].reshape(-1) for a, n in _segments(plan, group, tensors)])
        if plan.mixed:
            ordered = ordered.view(group.dtype)
        if group.same_shape:
            views = ordered.view(len(group.members), *group.gathered[0].shape).unbind(0)  # one call for all
        else:
            views = _unflatten(ordered, group.gathered)
        for i, view in zip(group.members, views):
            results[i] = view
    return results
