"""Prepared data loaders: sharding rules, iterable datasets, dispatching, shuffling agreement, resuming."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo  # noqa: F401  DDP's constructor imports it (seconds); forked ranks inherit it
from ranks_helper import run_ranks
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, SequentialSampler

from nbaccel.data_loader import BatchSamplerShard, IterableDatasetShard, SkipBatchSampler


def _shards(size, batch_size, n, split=False, even=True, drop_last=False):
    sampler = BatchSampler(SequentialSampler(range(size)), batch_size, drop_last)
    return [list(BatchSamplerShard(sampler, n, i, split, even)) for i in range(n)]


def test_round_robin_shards_complete_the_last_round_from_the_start():
    assert _shards(10, 3, 2) == [[[0, 1, 2], [6, 7, 8]], [[3, 4, 5], [9, 0, 1]]]
    assert _shards(7, 2, 3) == [[[0, 1], [6, 0]], [[2, 3], [1, 2]], [[4, 5], [3, 4]]]


def test_uneven_and_drop_last_shards():
    assert _shards(10, 3, 2, even=False) == [[[0, 1, 2], [6, 7, 8]], [[3, 4, 5], [9]]]
    assert _shards(10, 3, 2, drop_last=True) == [[[0, 1, 2]], [[3, 4, 5]]]


def test_split_batches_cut_every_batch():
    assert _shards(10, 4, 2, split=True) == [[[0, 1], [4, 5], [8, 9]], [[2, 3], [6, 7], [0, 1]]]
    with pytest.raises(ValueError, match="multiple of the number of processes"):
        _shards(10, 3, 2, split=True)


def test_lengths_match_iteration():
    for size, bs, n, split, even, drop in [(10, 3, 2, False, True, False), (11, 4, 2, True, True, False),
                                           (7, 2, 3, False, False, False), (9, 2, 2, False, True, True)]:
        sampler = BatchSampler(SequentialSampler(range(size)), bs, drop)
        for i in range(n):
            shard = BatchSamplerShard(sampler, n, i, split, even)
            assert len(shard) == len(list(shard))


def test_iterable_shard_keeps_its_slice_and_pads():
    parts = [list(IterableDatasetShard(range(10), 3, False, 2, i)) for i in range(2)]
    assert parts == [[0, 1, 2, 6, 7, 8], [3, 4, 5, 9, 0, 1]]


def test_skip_batch_sampler():
    sampler = SkipBatchSampler(BatchSampler(SequentialSampler(range(10)), 3, False), 2)
    assert list(sampler) == [[6, 7, 8], [9]] and len(sampler) == 2


class _Stream(IterableDataset):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(torch.arange(self.n, dtype=torch.float32)[:, None].unbind(0))

    def __len__(self):
        return self.n


@pytest.mark.parametrize("dispatch", [False, True])
def test_iterable_dataset_two_processes(dispatch):
    def body(rank):
        from nbaccel import Accelerator, DataLoaderConfiguration

        accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(dispatch_batches=dispatch))
        loader = accelerator.prepare(DataLoader(_Stream(11), batch_size=2))
        batches, gathered, ends = [], [], []
        for batch in loader:
            batches.append(batch[:, 0].tolist())
            gathered.extend(accelerator.gather_for_metrics(batch)[:, 0].tolist())
            ends.append(accelerator.gradient_state.end_of_dataloader)
        return type(loader).__name__, batches, gathered, ends

    (name, b0, g, ends), (_, b1, g1, _) = run_ranks(body)
    assert name == ("DataLoaderDispatcher" if dispatch else "DataLoaderShard")
    assert b0 == [[0, 1], [4, 5], [8, 9]] and b1 == [[2, 3], [6, 7], [10, 0]]
    assert sorted(g) == list(range(11)) == sorted(g1)
    assert ends == [False, False, True]


def test_shuffling_agrees_across_processes_and_seedable_sampler_follows_epochs():
    def body(rank):
        from nbaccel import Accelerator, DataLoaderConfiguration

        torch.manual_seed(100 + rank)  # different seeds: the loaders must still agree
        out = {}
        for mode in ("own generator", "seedable", "user generator"):
            config = DataLoaderConfiguration(use_seedable_sampler=mode == "seedable")
            accelerator = Accelerator(dataloader_config=config)
            generator = torch.Generator().manual_seed(rank) if mode == "user generator" else None
            loader = accelerator.prepare(DataLoader(torch.arange(16), batch_size=2, shuffle=True, generator=generator))
            epochs = []
            for epoch in range(2):
                loader.set_epoch(epoch)
                epochs.append([x for b in loader for x in accelerator.gather(b).tolist()])
            out[mode] = epochs
        return out

    r0, r1 = run_ranks(body)
    for mode in r0:
        e0, e1 = r0[mode]
        assert sorted(e0) == list(range(16)) == sorted(e1), mode  # a permutation: no sample twice, none lost
        assert e0 != e1, mode  # a new order each epoch
        assert r1[mode] == r0[mode], mode


@pytest.mark.parametrize("world_size", [1, 2])
def test_state_dict_resumes_mid_epoch_with_the_same_batches(world_size):
    def body(rank):
        from nbaccel import Accelerator

        accelerator = Accelerator()
        loader = accelerator.prepare(DataLoader(torch.arange(24), batch_size=2, shuffle=True))
        for _ in loader:  # epoch 0, so the generator has moved on
            pass
        full = []
        for index, batch in enumerate(loader):  # epoch 1, uninterrupted; a checkpoint after 2 batches
            full.append(batch.tolist())
            if index == 1:
                state = loader.state_dict()
        for _ in loader:  # epoch 2: the loader is elsewhere now
            pass
        loader.load_state_dict(state)
        resumed = [b.tolist() for b in loader]
        skipped = [b.tolist() for b in accelerator.skip_first_batches(loader, 1)]
        return state, full, resumed, skipped, len(loader)

    for state, full, resumed, skipped, length in run_ranks(body, world_size=world_size):
        # 2 processes: the sampler's generator at the epoch's start; 1 process (as Accelerate, the sampler draws
        # its order from torch's global RNG): that RNG at the epoch's start.
        assert state["epoch"] == 1 and state["batches_yielded"] == 2
        assert "generator_state" in state if world_size == 2 else "epoch_rng_state" in state
        assert resumed == full[2:]
        assert len(full) == length == 12 // world_size and len(skipped) == length - 1


@pytest.mark.parametrize("seedable", [False, True])
def test_skip_first_batches_replaces_a_restored_position(seedable):
    """Accelerate's resume idiom after load_state: skip_first_batches(loader, n) counts n from the start of the
    restored epoch (no double skip), runs that epoch's order, and the loader's next pass is the next epoch with
    the order of an uninterrupted run. Iterating the loader itself (no skip) still continues mid-epoch."""
    def body(rank):
        from nbaccel import Accelerator
        from nbaccel.utils import DataLoaderConfiguration

        accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(use_seedable_sampler=seedable))
        loader = accelerator.prepare(DataLoader(torch.arange(12), batch_size=2, shuffle=True))
        for _ in loader:  # epoch 0, so the generator has moved on
            pass
        epoch1 = []
        for index, batch in enumerate(loader):  # a checkpoint after 2 batches of epoch 1
            epoch1.append(batch.tolist())
            if index == 1:
                state = loader.state_dict()
                rng = torch.get_rng_state()  # load_state restores it too: 1 process shuffles with it
            if index == 3:
                later = loader.state_dict()
        epoch2 = [b.tolist() for b in loader]
        loader.load_state_dict(state)
        torch.set_rng_state(rng)
        copy = accelerator.skip_first_batches(loader, 3)
        copy_length = len(copy)
        skipped = []
        for batch in copy:
            if not skipped:  # a checkpoint now records the copy's position: the loader's place in the epoch
                during = loader.state_dict()
                same = {k: torch.equal(v, later[k]) if torch.is_tensor(v) else v == later[k] for k, v in during.items()}
            skipped.append(batch.tolist())
        after = [b.tolist() for b in loader]
        loader.load_state_dict(state)
        resumed = [b.tolist() for b in loader]  # nbaccel's own idiom: load, then iterate
        return epoch1, epoch2, copy_length, skipped, after, resumed, len(loader), same

    epoch1, epoch2, copy_length, skipped, after, resumed, length, same = run_ranks(body, world_size=1)[0]
    assert skipped == epoch1[3:]  # the restored epoch's order, 3 batches from its start (not 2 + 3)
    assert length == 6 and copy_length == 3
    assert after == epoch2  # the loader's next pass: the following epoch, as uninterrupted
    assert epoch2 != epoch1
    assert resumed == epoch1[2:]
    assert same and all(same.values()), same


@pytest.mark.parametrize("dispatch", [False, True])
def test_len_of_a_skip_first_batches_copy_is_the_batches_left(dispatch):
    def body(rank):
        from nbaccel import Accelerator
        from nbaccel.utils import DataLoaderConfiguration

        accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(dispatch_batches=dispatch))
        loader = accelerator.prepare(DataLoader(torch.arange(16), batch_size=2))
        copy = accelerator.skip_first_batches(loader, 1)
        far = accelerator.skip_first_batches(loader, 9)
        return len(loader), len(copy), len([b for b in copy]), len(far), len(loader)

    for before, copy, iterated, far, after in run_ranks(body, world_size=2):
        assert before == after == 4  # the loader's own length is unchanged
        assert copy == iterated == 3 and far == 0


def test_batches_reach_the_device_and_end_of_data_is_reported():
    def body(rank):
        from nbaccel import Accelerator

        accelerator = Accelerator()
        loader = accelerator.prepare(DataLoader(torch.arange(10.0), batch_size=4))
        flags = []
        for batch in loader:
            flags.append((accelerator.gradient_state.end_of_dataloader, accelerator.gradient_state.remainder,
                          batch.device.type))
        return flags, accelerator.gradient_state.in_dataloader

    flags, inside = run_ranks(body, world_size=1)[0]
    assert flags == [(False, 2, "cpu"), (False, 2, "cpu"), (True, 2, "cpu")] and not inside


def test_top_level_skip_first_batches_on_a_plain_loader():
    from nbaccel import skip_first_batches

    loader = skip_first_batches(DataLoader(torch.arange(10), batch_size=3), 2)
    assert [b.tolist() for b in loader] == [[6, 7, 8], [9]]
    stream = skip_first_batches(DataLoader(_Stream(7), batch_size=2), 2)
    assert [b[:, 0].tolist() for b in stream] == [[4.0, 5.0], [6.0]] and len(stream) == 2
    with pytest.raises(ValueError, match="num_batches"):
        skip_first_batches(loader, -1)


def test_dispatching_a_map_style_dataset():
    def body(rank):
        from nbaccel import Accelerator, DataLoaderConfiguration

        accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(dispatch_batches=True))
        loader = accelerator.prepare(DataLoader(torch.arange(10), batch_size=3))
        batches = [b.tolist() for b in loader]
        loader2 = accelerator.prepare(DataLoader(torch.arange(10), batch_size=3))
        gathered = [x for b in loader2 for x in accelerator.gather_for_metrics(b).tolist()]
        return type(loader).__name__, batches, gathered, len(loader)

    (name, b0, gathered, length), (_, b1, _, _) = run_ranks(body)
    assert name == "DataLoaderDispatcher" and length == 2
    # As Accelerate's dispatcher: the last group (4 samples) is split evenly, nothing repeated.
    assert b0 == [[0, 1, 2], [6, 7]] and b1 == [[3, 4, 5], [8, 9]]
    assert gathered == list(range(10))


def test_shards_are_the_same_as_accelerates():
    """Same batches per process as Accelerate (so a run and its checkpoints see the same data)."""
    reference = pytest.importorskip("accelerate.data_loader")
    for size in range(1, 20):
        for bs in (1, 2, 3, 4):
            for n in (2, 3):
                for split in (False, True):
                    if split and bs % n:
                        continue
                    for drop in (False, True):
                        for i in range(n):
                            for even in (True, False):
                                sampler = BatchSampler(SequentialSampler(range(size)), bs, drop)
                                ours = BatchSamplerShard(sampler, n, i, split, even)
                                theirs = reference.BatchSamplerShard(sampler, n, i, split, even)
                                assert (list(ours), len(ours)) == (list(theirs), len(theirs))
                            ours = IterableDatasetShard(range(size), bs, drop, n, i, split)
                            theirs = reference.IterableDatasetShard(range(size), bs, drop, n, i, split)
                            assert list(ours) == list(theirs)


# --- Accelerate 1.15 names: get_sampler, DataLoaderStateMixin, DataLoaderAdapter --------------------------


def test_get_sampler_looks_through_batch_samplers():
    from torch.utils.data import RandomSampler

    from nbaccel.data_loader import get_sampler

    shuffled = DataLoader(range(10), batch_size=2, shuffle=True)
    assert isinstance(get_sampler(shuffled), RandomSampler) and get_sampler(shuffled) is shuffled.sampler
    inner = SequentialSampler(range(10))
    sharded = DataLoader(range(10), batch_sampler=BatchSamplerShard(BatchSampler(inner, 2, False), 2, 0))
    assert get_sampler(sharded) is inner
    as_sampler = DataLoader(range(10), sampler=BatchSampler(inner, 2, False), batch_size=None)
    assert get_sampler(as_sampler) is inner
    assert get_sampler(DataLoader(range(4), batch_size=None)) is None  # no batching: no batch sampler to look in


def test_data_loader_state_mixin_is_what_prepared_loaders_share():
    from nbaccel.data_loader import DataLoaderDispatcher, DataLoaderShard, DataLoaderStateMixin

    assert issubclass(DataLoaderShard, DataLoaderStateMixin) and issubclass(DataLoaderDispatcher, DataLoaderStateMixin)

    class Registry:
        def __init__(self):
            self.loaders = []

        def _add_dataloader(self, loader):
            self.loaders.append(loader)

        def _remove_dataloader(self, loader):
            self.loaders.remove(loader)

    class MyLoader(DataLoaderStateMixin):  # a subclass only has to provide `gradient_state`
        def __init__(self):
            self.gradient_state = Registry()

    loader = MyLoader()
    assert (loader.end_of_dataloader, loader.remainder) == (False, -1)
    loader.end_of_dataloader, loader.remainder = True, 3
    loader.begin()
    assert (loader.end_of_dataloader, loader.remainder) == (False, -1)
    assert loader.gradient_state.loaders == [loader]
    loader.end()
    assert loader.gradient_state.loaders == []


def test_data_loader_adapter_wraps_and_delegates():
    from nbaccel.data_loader import DataLoaderAdapter
    from nbaccel.utils.imports import is_torchdata_stateful_dataloader_available

    adapter = DataLoaderAdapter(torch.arange(6), batch_size=4)
    assert isinstance(adapter, DataLoader) and type(adapter.base_dataloader) is DataLoader
    assert adapter.batch_size == 4 and len(adapter) == 2
    assert [b.tolist() for b in adapter] == [[0, 1, 2, 3], [4, 5]]
    with pytest.raises(AttributeError, match="use_stateful_dataloader=True"):
        adapter.state_dict()
    if not is_torchdata_stateful_dataloader_available():
        with pytest.raises(ImportError, match="torchdata"):
            DataLoaderAdapter(torch.arange(6), use_stateful_dataloader=True)
    else:
        from torchdata.stateful_dataloader import StatefulDataLoader

        stateful = DataLoaderAdapter(torch.arange(6), use_stateful_dataloader=True, batch_size=2)
        assert isinstance(stateful, StatefulDataLoader) and "_sampler_iter_yielded" in stateful.state_dict()


@pytest.mark.parametrize("iterable", [False, True])
def test_stateful_dataloader_resumes_like_accelerates(iterable: bool):
    """`use_stateful_dataloader=True` on one process, Accelerate and nbaccel side by side: a state_dict taken
    after 3 batches and loaded after the pass gives the same batches in both (torchdata's StatefulDataLoader)."""
    pytest.importorskip("torchdata.stateful_dataloader", reason="use_stateful_dataloader needs torchdata")
    accelerate = pytest.importorskip("accelerate")
    import nbaccel
    from nbaccel.utils import DataLoaderConfiguration as OurConfig

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(20))

    def run(library, config_class):
        library.state.AcceleratorState._reset_state(True)
        accelerator = library.Accelerator(cpu=True, dataloader_config=config_class(use_stateful_dataloader=True))
        torch.manual_seed(0)
        data = Stream() if iterable else list(range(20))
        loader = accelerator.prepare(DataLoader(data, batch_size=3, shuffle=not iterable))
        seen, state = [], None
        for step, batch in enumerate(loader):
            if step == 2:
                state = loader.state_dict()
            seen.append(batch.tolist())
        loader.load_state_dict(state)
        resumed = [batch.tolist() for batch in loader]
        library.state.AcceleratorState._reset_state(True)
        return seen, resumed

    theirs = run(accelerate, accelerate.utils.DataLoaderConfiguration)
    ours = run(nbaccel, OurConfig)
    assert ours == theirs and len(ours[1]) == 4
    if iterable:
        assert ours[1] == ours[0][3:]
    # (a shuffling map-style loader whose sampler has no generator draws a new order when restored, in both:
    # torchdata cannot restore a RandomSampler that seeds itself from torch's global RNG at each pass)


def test_state_saved_at_an_epochs_last_batch_resumes_at_the_next_epoch():
    """A checkpoint taken while the epoch's last batch is used (the usual "save every N steps" landing on the
    epoch's end) resumes with the whole next epoch, in the uninterrupted run's order; it once resumed with an
    empty pass (the finished epoch's remaining zero batches), losing an epoch. Accelerate's order as reference."""
    accelerate = pytest.importorskip("accelerate")
    import nbaccel

    def run(library, resume: bool):
        library.state.AcceleratorState._reset_state(True)
        accelerator = library.Accelerator(cpu=True)
        torch.manual_seed(0)
        loader = accelerator.prepare(DataLoader(list(range(12)), batch_size=4, shuffle=True))
        state = rng = None
        for step, _ in enumerate(loader):
            if step == len(loader) - 1 and resume:
                state, rng = loader.state_dict(), torch.get_rng_state()
        uninterrupted = [batch.tolist() for batch in loader]
        if resume:
            torch.set_rng_state(rng)
            loader.load_state_dict(state)
            assert [batch.tolist() for batch in loader] == uninterrupted
        library.state.AcceleratorState._reset_state(True)
        return uninterrupted

    assert run(nbaccel, resume=True) == run(accelerate, resume=False)


@pytest.mark.parametrize("kind", ["shard", "dispatcher", "skip"])
def test_stateful_loaders_are_torchdatas_and_report_the_batch_in_use(kind: str):
    """With use_stateful_dataloader=True a prepared loader is a torchdata StatefulDataLoader: after 3 batches
    its state is the one a plain StatefulDataLoader reports after 3 batches (not after the batch it read ahead),
    and a loader given that state continues with the 4th batch."""
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    from nbaccel import PartialState
    from nbaccel.data_loader import DataLoaderDispatcher, DataLoaderShard, SkipDataLoader

    PartialState(cpu=True)
    build = {"shard": DataLoaderShard, "dispatcher": DataLoaderDispatcher, "skip": SkipDataLoader}[kind]
    loader = build(list(range(20)), batch_size=2, use_stateful_dataloader=True)
    reference = stateful.StatefulDataLoader(list(range(20)), batch_size=2)
    assert isinstance(loader, stateful.StatefulDataLoader) and isinstance(loader, build)
    assert loader.use_stateful_dataloader and isinstance(loader.base_dataloader, stateful.StatefulDataLoader)
    for batches in (iter(loader), iter(reference)):
        for _ in range(3):
            next(batches)
    assert loader.state_dict() == reference.state_dict()
    resumed = build(list(range(20)), batch_size=2, use_stateful_dataloader=True)
    resumed.load_state_dict(loader.state_dict())
    assert resumed.state_dict() == reference.state_dict()
    assert [batch.tolist() for batch in resumed][0] == [6, 7]
    with pytest.raises(AttributeError):
        build.base_dataloader  # noqa: B018  (Accelerate's: an attribute of a loader, not of the class)
