"""Dispatched batches (`DataLoaderDispatcher`: an IterableDataset by default, or `dispatch_batches=True`) that
hold more than plain dicts of tensors, on Accelerate and on nbaccel. A batch that is a Mapping but no dict
(`transformers`' BatchEncoding is a UserDict) is dispatched as Accelerate dispatches it.
"""

from __future__ import annotations

import collections

import pytest
import torch
from parity_harness import assert_same, run_both
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


@pytest.mark.parametrize(("mode", "num_processes"), [("iterable", 1), ("encoding", 1), ("encoding", 2)])
def test_what_both_dispatch_is_dispatched_alike(mode, num_processes):
    """One process takes each batch whole, strings included; a UserDict batch keeps its type and is split
    by its tensors."""
    results = run_both(dispatched, num_processes, args=(mode,), timeout=120)
    for rank, (theirs, ours) in enumerate(zip(results["accelerate"], results["nbaccel"])):
        assert theirs["error"] is None and theirs["batches"], theirs
        assert_same(theirs, ours, f"dispatched[{mode}][rank {rank}]")
