"""Distributed operations on 2 gloo processes: values, container types, one communication per group,
bad input failing on every rank, and debug mode's shape check."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch  # imported here so the forked ranks inherit it instead of importing it again
from nested_data import Pair, Record
from ranks_helper import free_port, run_ranks

import nbaccel.utils.operations  # noqa: F401 - likewise

ROOT = Path(__file__).resolve().parent.parent


def _nested(rank: int):
    """dict of list of tuple / namedtuple / Mapping subclass, with a 0-dim and a non-contiguous tensor."""

    base = torch.arange(6, dtype=torch.float32).reshape(2, 3) + 10 * rank
    return {
        "outer": [(base, torch.tensor([1, 2], dtype=torch.int64) + rank), Pair(base.t(), torch.tensor(float(rank)))],
        "record": Record({"half": torch.full((2,), rank, dtype=torch.float16), "flag": torch.tensor([rank == 1])}),
    }


class Counter:
    """Counts calls to torch.distributed's collectives in this process, and the all-gathers the stacked gather
    starts on the process group directly (collectives._start_all_gather: `ProcessGroup.allgather`, counted as
    torch.distributed's "all_gather", which calls it), each once."""

    NAMES = ("all_gather_single", "all_gather_into_tensor", "all_gather", "all_reduce", "broadcast",
             "all_gather_object", "broadcast_object_list", "barrier")

    def __init__(self):
        import torch.distributed as dist

        self.dist, self.calls, self.saved, self.inside = dist, [], {}, 0
        for name in self.NAMES:
            original = getattr(dist, name, None)
            if original is None:
                continue
            self.saved[name] = original

            def wrapper(*args, _name=name, _original=original, **kwargs):
                self.calls.append(_name)
                self.inside += 1
                try:
                    return _original(*args, **kwargs)
                finally:
                    self.inside -= 1

            setattr(dist, name, wrapper)
        self.method = vars(dist.ProcessGroup)["allgather"]  # the descriptor itself, to put back as is

        def direct(group, *args, _original=dist.ProcessGroup.allgather):
            if not self.inside:  # not already counted as torch.distributed's function
                self.calls.append("all_gather")
            return _original(group, *args)

        dist.ProcessGroup.allgather = direct

    def take(self) -> list[str]:
        calls, self.calls = self.calls, []
        return calls

    def restore(self) -> None:
        for name, original in self.saved.items():
            setattr(self.dist, name, original)
        self.dist.ProcessGroup.allgather = self.method


def _check_values_and_types(rank: int):

    from nbaccel.utils import (
        broadcast,
        broadcast_object_list,
        copy_tensor_to_devices,
        gather,
        gather_object,
        pad_across_processes,
        reduce,
        wait_for_everyone,
    )

    counter = Counter()
    data = _nested(rank)
    both = [_nested(0), _nested(1)]

    # gather: dim-0 concatenation of every tensor, containers keep their types, ONE communication (mixed dtypes)
    out = gather(data)
    assert counter.take() in (["all_gather_single"], ["all_gather_into_tensor"])
    assert type(out) is dict and type(out["outer"]) is list and type(out["outer"][1]) is Pair
    assert type(out["record"]) is Record and type(out["outer"][0]) is tuple
    assert torch.equal(out["outer"][0][0], torch.cat([b["outer"][0][0] for b in both]))
    assert torch.equal(out["outer"][0][1], torch.tensor([1, 2, 2, 3]))
    assert torch.equal(out["outer"][1].left, torch.cat([b["outer"][1].left for b in both]))  # non-contiguous
    assert torch.equal(out["outer"][1].right, torch.tensor([0.0, 1.0]))  # 0-dim -> 1-D
    assert out["record"]["half"].dtype == torch.float16 and out["record"]["half"].tolist() == [0, 0, 1, 1]
    assert out["record"]["flag"].tolist() == [False, True]
    again = gather(_nested(rank + 5))  # same layout: reuses the receive buffer, must not touch `out`
    assert torch.equal(out["outer"][0][1], torch.tensor([1, 2, 2, 3])) and again["outer"][0][1].tolist() == [6, 7, 7, 8]
    assert out["record"]["half"].tolist() == [0, 0, 1, 1] and again["record"]["half"].tolist() == [5, 5, 6, 6]
    counter.take()
    single = gather(torch.tensor(float(rank)))
    assert single.tolist() == [0.0, 1.0]
    assert len(counter.take()) == 1

    # flat containers (every item a tensor): same shapes (reordered with one copy), mixed shapes, a Parameter
    rows = {f"t{i}": torch.arange(3.0) + 10 * i + 100 * rank for i in range(4)}
    flat = gather(rows)
    assert type(flat) is dict and list(flat) == list(rows)
    assert all(torch.equal(flat[k], torch.cat([rows[k] - 100 * rank, rows[k] + 100 - 100 * rank])) for k in rows)
    kept = flat["t0"].clone()
    # same layout again (the receive buffer kept from the first): right values, earlier results stay as they were
    again = gather({f"t{i}": torch.zeros(3) + rank for i in range(4)})
    assert torch.equal(flat["t0"], kept) and all(t.tolist() == [0, 0, 0, 1, 1, 1] for t in again.values())
    param = torch.nn.Parameter(torch.full((2,), float(rank)))
    pair = gather((torch.full((2, 2), rank), torch.full((1,), rank), param))
    assert type(pair) is tuple and not pair[2].requires_grad
    assert pair[0].tolist() == [[0, 0], [0, 0], [1, 1], [1, 1]] and pair[1].tolist() == [0, 1]
    assert pair[2].tolist() == [0.0, 0.0, 1.0, 1.0]
    listed = gather([torch.tensor([rank]), torch.tensor([rank + 2])])
    assert type(listed) is list and [t.tolist() for t in listed] == [[0, 1], [2, 3]]
    empty = gather({"a": torch.empty(0, 2), "b": torch.empty(0, 2)})
    assert empty["a"].shape == (0, 2) and empty["b"].shape == (0, 2) and gather(torch.empty(0, 3)).shape == (0, 3)
    assert gather({}) == {} and gather([]) == []
    assert len(counter.take()) == 6

    # reduce: one all_reduce per dtype (float32, int64, float16, bool not for mean -> sum on ints)
    floats = {"a": [data["outer"][0][0], data["outer"][1].left], "b": torch.tensor(2.0 + rank)}
    mean = reduce(floats)
    assert counter.take() == ["all_reduce"]
    assert torch.allclose(mean["a"][0], (both[0]["outer"][0][0] + both[1]["outer"][0][0]) / 2)
    assert mean["b"].item() == 2.5 and type(mean["a"]) is list
    assert floats["b"].item() == 2.0 + rank, "reduce must not modify its input"
    mixed = reduce(Pair(torch.tensor([1, 2]) * (rank + 1), torch.tensor([1.5]) * (rank + 1)), "sum")
    assert sorted(counter.take()) == ["all_reduce", "all_reduce"]
    assert type(mixed) is Pair and mixed.left.tolist() == [3, 6] and mixed.right.tolist() == [4.5]
    assert reduce(torch.tensor([rank, 5 - rank]), "max").tolist() == [1, 5]
    assert reduce(torch.tensor([rank, 5 - rank]), "min").tolist() == [0, 4]
    with pytest.warns(UserWarning, match=r"applies on XLA only, as in Accelerate"):
        assert reduce(torch.tensor([1.0 + rank]), "sum", scale=2.0).tolist() == [3.0]
    assert counter.take() == ["all_reduce"] * 3

    # broadcast: in place, from process 1, structure and non-contiguous tensors included, ONE communication
    target = _nested(rank)
    returned = broadcast(target, from_process=1)
    assert counter.take() == ["broadcast"]
    assert returned is target
    source = _nested(1)
    assert torch.equal(target["outer"][1].left, source["outer"][1].left)
    assert torch.equal(target["outer"][0][1], source["outer"][0][1])
    assert target["record"]["half"].tolist() == [1, 1] and target["record"]["flag"].tolist() == [True]
    lone = torch.zeros(3) + rank
    broadcast(lone)
    assert lone.tolist() == [0, 0, 0]
    column = (torch.zeros(3, 2) + rank)[:, 1]
    broadcast(column, from_process=1)
    assert column.tolist() == [1, 1, 1]
    assert counter.take() == ["broadcast", "broadcast"]

    # pad_across_processes: one size exchange for the whole structure
    ragged = {"x": torch.ones(2 + rank, 3), "y": [torch.ones(1, 4 + 2 * rank, dtype=torch.int64)]}
    padded = pad_across_processes(ragged, dim=0, pad_index=-1)
    assert len(counter.take()) == 1
    assert padded["x"].shape == (3, 3) and padded["y"][0].shape == (1, 4 + 2 * rank)
    if rank == 0:
        assert padded["x"][2].tolist() == [-1, -1, -1]
    wide = pad_across_processes(ragged, dim=1, pad_first=True)
    assert wide["y"][0].shape == (1, 6) and wide["x"].shape == (2 + rank, 3)
    if rank == 0:
        assert wide["y"][0].tolist() == [[0, 0, 1, 1, 1, 1]]
    assert gather(pad_across_processes(torch.arange(1 + rank), pad_index=9)).tolist() == [0, 9, 0, 1]
    counter.take()

    # object collectives: one communication for a small object, two for one beyond the first block
    got = gather_object([{"rank": rank}])
    assert got == [{"rank": 0}, {"rank": 1}] and len(counter.take()) == 1
    assert gather_object(rank) == [0, 1]
    big = gather_object(["x" * (10_000 * (rank + 1))])
    assert [len(s) for s in big] == [10_000, 20_000] and len(counter.take()) == 3
    objects = [{"lr": 0.1}, "cfg"] if rank == 0 else [None, None]
    assert broadcast_object_list(objects) is objects and objects == [{"lr": 0.1}, "cfg"]
    assert len(counter.take()) == 1
    large = [list(range(5000))] if rank == 1 else [None]
    broadcast_object_list(large, from_process=1)
    assert large == [list(range(5000))] and len(counter.take()) == 2

    # int16: gloo has no such dtype; gather/broadcast move it as bytes, reduce widens it and comes back
    short = torch.tensor([rank, 7], dtype=torch.int16)
    assert gather(short).tolist() == [0, 7, 1, 7] and gather([short, short])[1].dtype == torch.int16
    summed = reduce(short, "sum")
    assert summed.tolist() == [1, 14] and summed.dtype == torch.int16 and short.tolist() == [rank, 7]
    broadcast(short, from_process=1)
    assert short.tolist() == [1, 7]
    counter.take()

    # parameters (leaves that require grad): gathered, reduced, and broadcast into in place
    weight = torch.nn.Parameter(torch.full((2,), float(rank)))
    assert reduce({"w": weight}, "sum")["w"].tolist() == [1.0, 1.0] and weight.tolist() == [rank, rank]
    assert gather([weight, weight])[1].tolist() == [0, 0, 1, 1]
    broadcast([weight, torch.zeros(1)], from_process=1)
    assert weight.tolist() == [1.0, 1.0] and weight.requires_grad
    counter.take()

    shared = copy_tensor_to_devices(torch.arange(6).reshape(2, 3) if rank == 1 else None)
    assert shared.tolist() == [[0, 1, 2], [3, 4, 5]] and shared.dtype == torch.int64
    wait_for_everyone()
    assert counter.take()[-1] == "barrier"
    assert gather({}) == {} and gather([]) == [] and counter.take() == []
    counter.restore()
    return True


def test_every_operation_on_nested_data_two_ranks():
    assert run_ranks(_check_values_and_types, init=True) == [True, True]


def _same_shape_gathers(rank: int):
    """Containers of same-shape tensors (gathered with their results made while the data travels): values,
    shapes, contiguity and storage as a per-tensor torch.cat gives them, first call and the remembered one."""
    from nbaccel.utils import gather

    world = torch.distributed.get_world_size()
    found = []
    for make in (lambda r: {k: torch.arange(6.0).reshape(2, 3) + 10 * k + 100 * r for k in range(4)},
                 lambda r: (torch.tensor(r), torch.tensor(10 + r)),  # 0-dim: 1-D results
                 lambda r: [torch.full((2,), r, dtype=torch.int64), torch.full((2,), 5 + r, dtype=torch.int64)],
                 # 16 rows of 1,024 per rank, each distinct: a row taken from the wrong place would show
                 lambda r: {f"k{k}": torch.arange(1024.0) + 1024 * k + 16384 * r for k in range(16)}):
        mine, everyone = make(rank), [make(r) for r in range(world)]
        for _ in range(2):  # checked, then remembered (the fast path)
            out = gather(mine)
            assert type(out) is type(mine)
            results = list(out.values()) if isinstance(out, dict) else list(out)
            for i, result in enumerate(results):
                parts = [(list(e.values()) if isinstance(e, dict) else list(e))[i] for e in everyone]
                want = torch.cat([p.reshape(1) if p.ndim == 0 else p for p in parts])
                assert torch.equal(result, want) and result.dtype == want.dtype and result.is_contiguous()
                assert not result.requires_grad
            found.append([r.shape for r in results])
            kept = [r.clone() for r in results]
            gather(make(rank + world))  # the same layout again must leave these results alone
            assert all(torch.equal(r, k) for r, k in zip(results, kept))
    return found


def _gathers_while_the_receive_buffer_is_taken(rank: int):
    """A remembered layout's receive buffer (tensors of mixed shapes: the packed path) belongs to one gather at a
    time: while another thread holds it (its lock, taken here), a gather of that layout uses a new buffer, gives
    the right values, and neither replaces the kept buffer nor releases the lock it does not hold. Tensors of
    one shape (the stacked path) are gathered straight into their results: that plan keeps no buffer."""
    from nbaccel.utils import collectives, gather

    world = torch.distributed.get_world_size()
    checked = collectives._group_facts().checked
    checked.clear()
    same_shape = {f"t{i}": torch.full((3,), 10.0 * i + rank) for i in range(4)}
    gather(same_shape)
    gather(same_shape)
    [stacked] = checked.values()
    assert stacked.stacked is not None and stacked.receive is None and not stacked.lock.locked()

    def make(r):
        return [torch.full((2,), float(r)), torch.full((5,), 7.0 + r)]

    checked.clear()
    gather(make(rank))  # checked once: the layout and its plan are remembered
    [plan] = checked.values()
    assert plan.stacked is None
    gather(make(rank))  # remembered: the plan keeps its receive buffer
    kept = plan.receive
    assert kept is not None
    with plan.lock:  # "another thread" is inside a gather of this layout
        out = gather(make(rank + 1))
        assert plan.lock.locked() and plan.receive is kept
    assert _is_cat_of_every_rank(out, [make(r + 1) for r in range(world)])
    again = gather(make(rank))  # the lock is free again: the kept buffer is used, still right
    assert plan.receive is kept and not plan.lock.locked()
    assert _is_cat_of_every_rank(again, [make(r) for r in range(world)])
    return True


def _is_cat_of_every_rank(out, inputs: list) -> bool:
    """Whether each tensor of a gathered dict or list `out` is the torch.cat of that item of every rank's input."""
    items = list(out.values()) if isinstance(out, dict) else out
    rows = [list(data.values()) if isinstance(data, dict) else data for data in inputs]
    return all(torch.equal(result, torch.cat([row[i] for row in rows])) for i, result in enumerate(items))


def test_a_gather_while_another_holds_the_receive_buffer_uses_its_own():
    assert run_ranks(_gathers_while_the_receive_buffer_is_taken, init=True) == [True, True]


def _a_gather_interrupted_while_its_data_travels(rank: int):
    """An interrupt between the asynchronous all-gather's start and its end (here: while the results' container
    is made) leaves that all-gather writing into results no one holds (its work keeps them alive): the next
    gathers of the layout give the right values, and the plan kept nothing the old one could write into."""
    from nbaccel.utils import collectives, gather

    world = torch.distributed.get_world_size()

    def make(r: int) -> dict:
        return {f"t{i}": torch.full((3,), 10.0 * i + r) for i in range(4)}

    checked = collectives._group_facts().checked
    checked.clear()
    gather(make(rank))
    [plan] = checked.values()
    gather(make(rank))
    assert plan.stacked is not None
    original = collectives.rebuild_flat

    def interrupted(*args):
        raise KeyboardInterrupt

    collectives.rebuild_flat = interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            gather(make(rank))
    finally:
        collectives.rebuild_flat = original
    assert plan.receive is None and not plan.lock.locked()
    for step in range(2, 5):
        out = gather(make(rank + step))
        assert _is_cat_of_every_rank(out, [make(r + step) for r in range(world)])
    return True


def test_a_gather_interrupted_while_its_data_travels_leaves_the_next_ones_right():
    assert run_ranks(_a_gather_interrupted_while_its_data_travels, init=True) == [True, True]


def test_same_shape_tensors_gather_like_torch_cat_on_three_ranks():
    found = run_ranks(_same_shape_gathers, world_size=3, init=True)
    assert found[0] == found[1] == found[2]
    assert found[0][0] == [torch.Size([6, 3])] * 4 and found[0][2] == [torch.Size([3])] * 2
    assert found[0][6] == [torch.Size([3 * 1024])] * 16


def _check_trace(rank: int):

    from nbaccel.utils import collective_trace, gather, reduce

    seen = []
    collective_trace.add_listener(lambda event, record: seen.append((event, record.op, record.call, record.shapes)))
    gather({"a": torch.ones(2, 3), "b": torch.ones(1)})
    reduce(torch.ones(2), "sum")
    assert collective_trace.current() is None
    return seen


def _bad_inputs(rank: int):

    from nbaccel.utils import broadcast, gather, gather_object, pad_across_processes, reduce

    errors = {}
    cases = {
        "non_tensor": lambda: gather({"ids": torch.ones(2), "labels": [torch.ones(1), "cat"]}),
        "devices": lambda: gather([torch.ones(2), torch.empty(2, device="meta")]),
        "reduction": lambda: reduce(torch.ones(1), reduction="avg"),
        "pad_dim": lambda: pad_across_processes({"a": torch.ones(2, 3)}, dim=2),
        "mean_int": lambda: reduce({"n": torch.tensor([3])}),
        "from_process": lambda: broadcast(torch.ones(1), from_process=2),
        "unpicklable": lambda: gather_object(lambda: rank) if rank == 1 else gather_object(lambda: 0),
    }
    for name, call in cases.items():
        try:
            call()
        except Exception as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
    # the group still works after all of these
    errors["after"] = gather(torch.tensor([rank])).tolist()
    errors["unpicklable_lock"] = _unpicklable(rank)
    errors["trace"] = _check_trace(rank)
    return errors


def test_bad_input_raises_clear_errors_on_every_rank_and_collectives_are_traced():
    for errors in run_ranks(_bad_inputs, init=True):
        assert errors["non_tensor"] == (
            "TypeError: gather: data['labels'][1] is a str, not a tensor. gather takes tensors nested in lists, "
            "tuples and dicts. Use gather_object for Python objects."
        )
        assert errors["devices"].startswith("ValueError: gather: the tensors are on different devices")
        assert "data[0] on cpu" in errors["devices"] and "data[1] on meta" in errors["devices"]
        assert errors["reduction"].startswith("ValueError: reduce: reduction must be one of 'mean', 'sum', 'max'")
        assert "pad_dim" not in errors  # a dim fitting no tensor leaves them as they are, as in Accelerate
        assert errors["mean_int"].startswith("RuntimeError: reduce: reduction='mean' needs floating-point")  # as Accelerate's type
        assert "data['n'] is torch.int64" in errors["mean_int"]
        assert "from_process must be a process index in [0, 1], got 2" in errors["from_process"]
        assert errors["after"] == [0, 1]
        # lambdas are cloudpickled, so this one works; a lock cannot be pickled: every rank raises
        assert "unpicklable" not in errors
        assert "rank 1: cannot pickle a lock" in errors["unpicklable_lock"]
        # every collective runs inside collective_trace.in_collective
        enters = [entry for entry in errors["trace"] if entry[0] == "enter"]
        assert [op for _, op, _, _ in enters] == ["gather", "reduce"]
        assert enters[0][2] in ("all_gather_single", "all_gather_into_tensor") and enters[0][3] == [[2, 3], [1]]
        assert enters[1][2] == "all_reduce"


def _known_inputs(rank: int):
    """Inputs of a layout that passed the checks once skip them (gather's fast path); what they skip must
    still hold for every later call: a non-tensor, a meta tensor, debug mode, gradients, a new group."""
    import tempfile

    import torch.distributed as dist

    from nbaccel.utils import DistributedOperationException, gather

    counter = Counter()
    found = {}
    rows = {f"t{i}": torch.arange(3.0) + 10 * i + 100 * rank for i in range(4)}
    for _ in range(2):  # the first call checks and remembers the layout, the second takes the fast path
        out = gather(rows)
        assert all(out[k].tolist() == (rows[k] - 100 * rank).tolist() + (rows[k] + 100 - 100 * rank).tolist()
                   for k in rows)
        assert gather(torch.tensor([rank, 5])).tolist() == [0, 5, 1, 5]
    assert len(counter.take()) == 4  # one communication each
    counter.restore()
    for name, call in {
        "non_tensor": lambda: gather({**rows, "t3": "text"}),
        "meta": lambda: gather({k: torch.empty(3, device="meta") for k in rows}),
        "mixed_devices": lambda: gather({**rows, "t3": torch.empty(3, device="meta")}),
        "lone_meta": lambda: gather(torch.empty(2, dtype=torch.int64, device="meta")),
    }.items():
        try:
            call()
            found[name] = "no error"
        except (TypeError, ValueError) as exc:
            found[name] = f"{type(exc).__name__}: {exc}"
    # the first tensor as remembered, another differs: its own layout (the stacked look-up must not take it)
    found["middle_shape"] = {k: v.tolist() for k, v in gather({**rows, "t2": torch.full((2,), float(rank))}).items()}
    found["middle_dtype"] = {k: (str(v.dtype), v.tolist())
                             for k, v in gather({**rows, "t2": torch.tensor([rank, rank, rank])}).items()}
    graph = {k: v.clone().requires_grad_() for k, v in rows.items()}
    found["grad"] = [t.requires_grad or t.grad_fn is not None for t in gather(graph).values()]
    with torch.no_grad():  # the same tensors without autograd: no graph to keep, the stacked way applies
        found["grad_off"] = [t.requires_grad or t.grad_fn is not None for t in gather(graph).values()]
    found["lone_grad"] = gather(torch.tensor([1.0, 2.0], requires_grad=True)).requires_grad
    os.environ["NBACCEL_DEBUG_MODE"] = "1"  # turned on after the layout was remembered: checked again
    try:
        gather({k: torch.ones(3 + rank) for k in rows} if rank == 1 else {k: torch.ones(3) for k in rows})
        found["debug"] = "no error"
    except DistributedOperationException as exc:
        found["debug"] = str(exc)
    finally:
        os.environ.pop("NBACCEL_DEBUG_MODE")
    # a new default group: nothing remembered from the old one applies (world size, layouts)
    dist.destroy_process_group()
    alone = torch.ones(2)
    found["no_group"] = gather(alone) is alone and gather(rows) is rows
    path = os.path.join(tempfile.gettempdir(), f"nbaccel-test-regroup-{os.environ['MASTER_PORT']}")
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    found["regrouped"] = gather(rows)["t1"].tolist()
    if rank == 0:
        dist.barrier()
        with contextlib.suppress(OSError):
            os.remove(path)
    else:
        dist.barrier()
    return found


def test_inputs_that_passed_the_checks_once_are_still_checked_where_it_matters():
    for found in run_ranks(_known_inputs, init=True):
        assert found["non_tensor"] == (
            "TypeError: gather: data['t3'] is a str, not a tensor. gather takes tensors nested in lists, tuples "
            "and dicts. Use gather_object for Python objects."
        )
        assert found["meta"].startswith("ValueError: gather: the tensors are on the 'meta' device")
        assert found["mixed_devices"].startswith("ValueError: gather: the tensors are on different devices")
        assert found["lone_meta"].startswith("ValueError: gather: the tensors are on the 'meta' device")
        assert found["grad"] == [False] * 4 and found["lone_grad"] is False and found["grad_off"] == [False] * 4
        assert found["middle_shape"]["t2"] == [0.0, 0.0, 1.0, 1.0] and found["middle_shape"]["t1"] == [
            10.0, 11.0, 12.0, 110.0, 111.0, 112.0]
        assert found["middle_dtype"]["t2"] == ("torch.int64", [0, 0, 0, 1, 1, 1])
        assert found["middle_dtype"]["t3"] == ("torch.float32", [30.0, 31.0, 32.0, 130.0, 131.0, 132.0])
        assert "rank 0: {'t0': 'float32[3]'" in found["debug"] and "rank 1: {'t0': 'float32[4]'" in found["debug"]
        assert found["no_group"] is True
        assert found["regrouped"] == [10.0, 11.0, 12.0, 110.0, 111.0, 112.0]


def _unpicklable(rank: int):
    import threading

    from nbaccel.utils import DistributedOperationException, gather_object

    try:
        gather_object(threading.Lock() if rank == 1 else "fine")
    except DistributedOperationException as exc:
        return str(exc)
    return "no error"


def _debug_mismatch(rank: int):

    from nbaccel.utils import (
        DistributedOperationException,
        debug_mode_enabled,
        gather,
        pad_across_processes,
        reduce,
    )

    assert debug_mode_enabled()
    found = {}
    for name, call in {
        "gather": lambda: gather({"x": torch.ones(2 + rank, 3)}),
        "reduce": lambda: reduce([torch.ones(2)] * (1 + rank)),
        "invalid_on_one": lambda: gather({"x": torch.ones(2) if rank == 0 else "oops"}),
    }.items():
        try:
            call()
            found[name] = "no error"
        except DistributedOperationException as exc:
            found[name] = str(exc)
    from nbaccel.utils.operations import verify_operation

    @verify_operation
    def user_op(tensor):
        return "ran"

    try:
        found["verify_operation"] = user_op(torch.ones(1 + rank))
    except DistributedOperationException as exc:
        found["verify_operation"] = str(exc)
    # lengths may differ along the padded dim in debug mode, and then gather works
    found["ok"] = gather(pad_across_processes({"x": torch.ones(2 + rank, 3)}))["x"].shape[0]
    return found


def test_debug_mode_reports_mismatched_shapes_on_every_rank():
    results = run_ranks(_debug_mismatch, init=True, env={"NBACCEL_DEBUG_MODE": "1"})
    for found in results:
        assert "gather needs the same shapes and dtypes on every rank" in found["gather"]
        assert "rank 0: {'x': 'float32[2, 3]'}" in found["gather"]
        assert "rank 1: {'x': 'float32[3, 3]'}" in found["gather"]
        assert "pad_across_processes" in found["gather"]
        assert "rank 0: ['float32[2]']" in found["reduce"] and "rank 1: ['float32[2]', 'float32[2]']" in found["reduce"]
        assert "rank 1: TypeError: gather: data['x'] is a str" in found["invalid_on_one"]
        assert found["ok"] == 6
        assert "user_op needs the same shapes" in found["verify_operation"] and "rank 1: 'float32[2]'" in found["verify_operation"]


@pytest.mark.timeout(90)
def test_check_operations_script_under_torchrun(tmp_path):
    script = ROOT / "nbaccel" / "test_utils" / "scripts" / "check_operations.py"
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmp_path))  # torchrun's torchelastic_* logs: in tmp_path
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()), str(script)],
        capture_output=True, text=True, timeout=60, env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("ok   gather (") == 1  # only rank 0 prints
    assert "FAIL" not in proc.stdout


def _stacked_gathers_that_need_torchs_function(rank: int):
    """The stacked gather starts its all-gather on the process group itself (collectives._start_all_gather);
    where torch.distributed's function does more than call that method, the function is used."""
    from torch.overrides import TorchFunctionMode

    from nbaccel.utils import gather

    class Watch(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.seen.append(getattr(func, "__name__", ""))
            return func(*args, **(kwargs or {}))

    data = {f"t{i}": torch.full((3,), float(10 * i + rank)) for i in range(4)}
    gather(data)  # the layout is remembered: the next call takes the fast path
    with Watch() as watch:
        out = gather(data)
    complex_data = {k: v * (1 + 1j) for k, v in data.items()}
    gathered_complex = gather(complex_data)
    gathered_complex = gather(complex_data)
    return {
        "mode_saw_the_all_gather": any(name.startswith("all_gather") for name in watch.seen),
        "values": {k: v.tolist() for k, v in out.items()},
        "complex": {k: v.tolist() for k, v in gathered_complex.items()},
    }


def test_a_stacked_gather_under_a_torch_function_mode_or_of_complex_data_goes_through_torchs_function():
    for found in run_ranks(_stacked_gathers_that_need_torchs_function, init=True):
        assert found["mode_saw_the_all_gather"]
        assert found["values"] == {f"t{i}": [10.0 * i] * 3 + [10.0 * i + 1] * 3 for i in range(4)}
        assert found["complex"] == {f"t{i}": [complex(10 * i, 10 * i)] * 3 + [complex(10 * i + 1, 10 * i + 1)] * 3
                                    for i in range(4)}
