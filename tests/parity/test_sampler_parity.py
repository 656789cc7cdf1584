"""Samplers and shards, compared with Accelerate 1.15 in one process (they need no process group):
`BatchSamplerShard`, `IterableDatasetShard`, `SeedableRandomSampler`, `SkipBatchSampler`, over every
combination of length, batch size, process count, `split_batches`, `even_batches` and `drop_last`."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils.data import BatchSampler, IterableDataset, RandomSampler, SequentialSampler

accelerate_data_loader = pytest.importorskip("accelerate.data_loader")
from nbaccel import data_loader as nbaccel_data_loader  # noqa: E402

LIBS = {"accelerate": accelerate_data_loader, "nbaccel": nbaccel_data_loader}


def outcome(call, *args, **kwargs):
    """What a call gives: its value, or the exception's type (messages are each library's own words; the
    ones the issue names are checked separately)."""
    try:
        return ("ok", call(*args, **kwargs))
    except Exception as error:  # compared between the libraries
        return ("error", type(error).__name__)


def shard_batches(lib, length, batch_size, drop_last, num_processes, split_batches, even_batches):
    out = []
    for rank in range(num_processes):
        inner = BatchSampler(SequentialSampler(range(length)), batch_size, drop_last)
        shard = outcome(lib.BatchSamplerShard, inner, num_processes, rank, split_batches=split_batches,
                        even_batches=even_batches)
        if shard[0] == "error":
            out.append(shard)
            continue
        out.append((outcome(list, shard[1]), outcome(len, shard[1])))
    return out


CASES = [c for c in itertools.product([0, 1, 3, 7, 16, 21, 24, 25], [1, 3, 4, 5], [False, True], [1, 2, 3],
                                      [False, True], [False, True])]


@pytest.mark.parametrize("length,batch_size,drop_last,num_processes,split_batches,even_batches", CASES)
def test_batch_sampler_shard(length, batch_size, drop_last, num_processes, split_batches, even_batches):
    args = (length, batch_size, drop_last, num_processes, split_batches, even_batches)
    expected = shard_batches(accelerate_data_loader, *args)
    assert shard_batches(nbaccel_data_loader, *args) == expected


class VariableBatches:
    """A batch sampler without `batch_size` whose batches have different sizes (Accelerate's 'dynamic' case)."""

    def __init__(self, sizes):
        self.sizes = sizes

    def __iter__(self):
        start = 0
        for size in self.sizes:
            yield list(range(start, start + size))
            start += size

    def __len__(self):
        return len(self.sizes)


@pytest.mark.parametrize("sizes", [[3, 1, 4, 1, 5], [2, 2], [5], [1, 2, 3, 4]])
@pytest.mark.parametrize("num_processes", [2, 3])
@pytest.mark.parametrize("even_batches", [True, False])
def test_batch_sampler_shard_without_batch_size(sizes, num_processes, even_batches):
    def run(lib):
        return [outcome(list, lib.BatchSamplerShard(VariableBatches(sizes), num_processes, rank,
                                                    even_batches=even_batches))
                for rank in range(num_processes)]

    assert run(nbaccel_data_loader) == run(accelerate_data_loader)


def test_split_batches_without_batch_size_is_refused_alike():
    for lib in (accelerate_data_loader, nbaccel_data_loader):
        with pytest.raises(ValueError, match="round multiple"):
            lib.BatchSamplerShard(VariableBatches([2, 2]), 2, 0, split_batches=True)


class Stream(IterableDataset):
    def __init__(self, length):
        self.length = length

    def __iter__(self):
        return iter(range(self.length))

    def __len__(self):
        return self.length


@pytest.mark.parametrize("length,batch_size,drop_last,num_processes,split_batches",
                         list(itertools.product([0, 2, 7, 16, 21], [1, 2, 4, 5], [False, True], [1, 2, 3],
                                                [False, True])))
def test_iterable_dataset_shard(length, batch_size, drop_last, num_processes, split_batches):
    def run(lib):
        out = []
        for rank in range(num_processes):
            shard = outcome(lib.IterableDatasetShard, Stream(length), batch_size, drop_last, num_processes, rank,
                            split_batches)
            out.append(shard if shard[0] == "error" else (outcome(list, shard[1]), outcome(len, shard[1])))
        return out

    assert run(nbaccel_data_loader) == run(accelerate_data_loader)


@pytest.mark.parametrize("data_seed", [None, 7])
def test_seedable_random_sampler_orders_and_epochs(data_seed):
    """The order of each pass, with and without set_epoch, and the epoch it moves to after a pass."""

    def run(lib):
        torch.manual_seed(123)
        sampler = lib.SeedableRandomSampler(range(10), data_seed=data_seed)
        passes = [list(sampler) for _ in range(3)]
        epochs = [sampler.epoch]
        sampler.set_epoch(1)
        passes.append(list(sampler))
        epochs.append(sampler.epoch)
        return passes, epochs, sampler.initial_seed

    assert run(nbaccel_data_loader) == run(accelerate_data_loader)


def test_seedable_random_sampler_with_a_generator():
    def run(lib):
        generator = torch.Generator().manual_seed(5)
        sampler = lib.SeedableRandomSampler(range(8), generator=generator, data_seed=3)
        return [list(sampler) for _ in range(2)], sampler.epoch

    assert run(nbaccel_data_loader) == run(accelerate_data_loader)


@pytest.mark.parametrize("skip", [0, 2, 5, 9])
def test_skip_batch_sampler(skip):
    def run(lib):
        sampler = lib.SkipBatchSampler(BatchSampler(RandomSampler(range(20), generator=torch.Generator().manual_seed(1)),
                                                    3, False), skip)
        return outcome(lambda: list(iter(sampler))), outcome(len, sampler), sampler.total_length

    assert run(nbaccel_data_loader) == run(accelerate_data_loader)
