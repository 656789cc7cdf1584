"""Hugging Face `datasets.IterableDataset` (streaming) prepared on 2 gloo ranks, compared with Accelerate 1.15
(tests/parity/parity_harness.py). Accelerate gives each process its own shards of such a dataset
(`IterableDataset.shard`) when it has at least one per process and batches are not split; otherwise every
process reads the whole stream and keeps its slice (`IterableDatasetShard`), as for any iterable dataset.
The batches each rank sees, across epochs with a shuffle buffer, and `gather_for_metrics` must be the same."""

from __future__ import annotations

import pytest
from parity_harness import assert_parity, run_both

pytest.importorskip("accelerate")
pytest.importorskip("datasets")
pytestmark = pytest.mark.timeout(300)

def _stream(rows: int, shards: int, shuffle: bool):
    import datasets

    stream = datasets.Dataset.from_dict({"x": list(range(rows))}).to_iterable_dataset(num_shards=shards)
    return stream.shuffle(seed=3, buffer_size=4) if shuffle else stream


def streaming_scenario(lib, rows, shards, shuffle, split_batches, dispatch_batches):
    """Two epochs of a prepared DataLoader over a streaming dataset of `shards` shards: each rank's batches and,
    where every rank has as many rows (Accelerate's gather needs that), what `gather_for_metrics` gives."""
    import torch
    from torch.utils.data import DataLoader

    config = lib.utils.DataLoaderConfiguration(split_batches=split_batches, dispatch_batches=dispatch_batches)
    accelerator = lib.Accelerator(cpu=True, dataloader_config=config)
    loader = accelerator.prepare(DataLoader(_stream(rows, shards, shuffle), batch_size=4,
                                            collate_fn=lambda rows: torch.tensor([row["x"] for row in rows])))
    epochs = []
    for epoch in range(2):
        loader.set_epoch(epoch)
        batches = [batch.tolist() for batch in loader]
        gathered = [accelerator.gather_for_metrics(torch.tensor(b)).tolist() for b in batches] if rows == 24 else []
        epochs.append((batches, gathered))
    return {"type": type(loader.dataset).__name__, "epochs": epochs}


@pytest.mark.parametrize("rows, shards, shuffle, split_batches, dispatch_batches", [
    (24, 4, True, False, False),  # a shard of its own per process, a shuffle buffer reseeded by set_epoch
    (22, 3, True, False, False),  # shards that do not divide among the processes, uneven rows
    (22, 1, True, False, False),  # fewer shards than processes: the whole stream, sliced
    (24, 4, False, True, False),  # split batches: the whole stream, sliced
])
def test_a_streaming_dataset_gives_accelerates_batches(rows, shards, shuffle, split_batches, dispatch_batches):
    assert_parity(run_both(streaming_scenario, 2, args=(rows, shards, shuffle, split_batches, dispatch_batches)))
