"""Dispatched batches (`DataLoaderDispatcher`: an IterableDataset by default, or `dispatch_batches=True`) that
hold more than tensors, on Accelerate and on nbaccel.

Process 0 reads the batches and every process takes its slice of each tensor; a string or an int cannot be
sliced to match, so with several processes both libraries refuse such a batch with a TypeError (Accelerate
on process 0 in its concatenation, or on every process in its broadcast), and nbaccel's refusal reaches
every process: none waits for a batch that will never come. One process takes each batch whole, so there
any leaf passes. A batch that is a Mapping but no dict (`transformers`' BatchEncoding is a UserDict) is
dispatched as Accelerate dispatches it.
"""

from __future__ import annotations

import collections

import pytest
import torch
from parity_harness import assert_same, run_both, run_ranks
from torch.utils.data import DataLoader, IterableDataset

pytest.importorskip("accelerate")
pytestmark = pytest.mark.timeout(600)


class _Texts(IterableDataset):
    """Samples with a tensor and a string."""

    def __iter__(self):
        for i in range(8):
            yield {"x": torch.tensor([float(i)]), "text": f"t{i}"}


class _Failing(IterableDataset):
    """A dataset that fails on its fifth sample."""

    def __iter__(self):
        for i in range(8):
            if i == 4:
                raise ValueError("sample 4 is corrupt")
            yield torch.tensor([float(i)])


class _Encoding(collections.UserDict):
    """A Mapping that is no dict, as transformers' BatchEncoding."""


def _ids_and_tensor(samples):
    return {"t": torch.tensor(samples), "ids": list(samples)}


def _encoding(samples):
    return _Encoding({"x": torch.cat([s["x"] for s in samples]), "n": torch.tensor([len(samples)])})


def _loader(lib, mode):
    config = {"split": dict(split_batches=True), "map": dict(dispatch_batches=True)}.get(mode, {})
    accelerator = lib.Accelerator(cpu=True, dataloader_config=lib.utils.DataLoaderConfiguration(**config))
    if mode == "map":  # a map-style dataset dispatched, its collate_fn keeping a list of ints
        loader = DataLoader(list(range(7)), batch_size=2, collate_fn=_ids_and_tensor)
    elif mode == "failing":
        loader = DataLoader(_Failing(), batch_size=2)
    elif mode == "encoding":
        loader = DataLoader(_Texts(), batch_size=2, collate_fn=_encoding)
    else:  # "iterable": the default collate makes a list of the strings; "split": one batch split in two
        loader = DataLoader(_Texts(), batch_size=4 if mode == "split" else 2)
    return accelerator, accelerator.prepare(loader)


def _plain(value):
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, collections.abc.Mapping):
        return (type(value).__name__, {k: _plain(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def dispatched(lib, mode):
    accelerator, loader = _loader(lib, mode)
    batches, error = [], None
    try:
        for batch in loader:
            batches.append(_plain(batch))
    except Exception as exc:  # noqa: BLE001 - the outcome is compared
        error = (type(exc).__name__, str(exc))
    return {"rank": accelerator.process_index, "batches": batches, "error": error}


def _assert_refused_on_every_rank(results, mode):
    field = "batch['ids'][0]" if mode == "map" else "batch['text'][0]"
    for ours in results:  # every rank: the same clear TypeError, no batch delivered
        assert ours["batches"] == [] and ours["error"][0] == "TypeError", ours
        assert f"{field} is not a tensor (type {'int' if mode == 'map' else 'str'})" in ours["error"][1]
        assert "dispatch_batches=False" in ours["error"][1]


def test_a_non_tensor_in_a_split_dispatched_batch_fails_on_every_rank_as_in_accelerate():
    results = run_both(dispatched, 2, args=("split",), timeout=120)
    _assert_refused_on_every_rank(results["nbaccel"], "split")
    # Accelerate's broadcast refuses the string on every rank
    assert [(r["batches"], r["error"][0]) for r in results["accelerate"]] == [([], "TypeError")] * 2


@pytest.mark.parametrize("mode", ["iterable", "map"])
def test_a_non_tensor_in_a_dispatched_group_fails_on_every_rank(mode):
    """nbaccel only: Accelerate's concatenation raises `TypeError: Can only concatenate tensors but got
    <class 'str'>` (or 'int') on rank 0 alone, leaving rank 1 in the batch's broadcast, so the ranks leave the
    group out of step (the harness's closing barrier then hangs). nbaccel's ranks raise the TypeError together
    and end in step: run_ranks' closing barrier passes."""
    _assert_refused_on_every_rank(run_ranks(dispatched, "nbaccel", 2, args=(mode,), timeout=120), mode)


def test_a_dataset_error_on_process_0_reaches_the_other_ranks():
    """nbaccel only (Accelerate's other ranks wait for the batch): rank 0 raises its dataset's error, the
    others a RuntimeError naming it. (The second group fails, while the first is still held: as in
    Accelerate, the group after the one yielded is read before it is yielded.)"""
    results = run_ranks(dispatched, "nbaccel", 2, args=("failing",), timeout=120)
    assert [r["batches"] for r in results] == [[], []]
    assert results[0]["error"] == ("ValueError", "sample 4 is corrupt")
    assert results[1]["error"] == ("RuntimeError", "process 0 failed to read the next batch to dispatch: "
                                                   "ValueError: sample 4 is corrupt")


@pytest.mark.parametrize(("mode", "num_processes"), [("iterable", 1), ("encoding", 1), ("encoding", 2)])
def test_what_both_dispatch_is_dispatched_alike(mode, num_processes):
    """One process takes each batch whole, strings included; a UserDict batch keeps its type and is split
    by its tensors."""
    results = run_both(dispatched, num_processes, args=(mode,), timeout=120)
    for rank, (theirs, ours) in enumerate(zip(results["accelerate"], results["nbaccel"])):
        assert theirs["error"] is None and theirs["batches"], theirs
        assert_same(theirs, ours, f"dispatched[{mode}][rank {rank}]")
