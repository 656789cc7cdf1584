"""Prepared data loaders, compared with Accelerate 1.15 on 1 and 2 gloo ranks (tests/parity/parity_harness.py):
the batches each rank gets over several epochs, `len()`, `end_of_dataloader`, `remainder`, what
`gather_for_metrics` returns, `skip_first_batches`, `set_epoch`, seedable samplers, split/dispatch modes,
`_is_accelerate_prepared` and the `join_uneven_inputs` warning."""

from __future__ import annotations

import warnings

import pytest
import torch
from parity_harness import assert_parity, run_both
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, SequentialSampler, TensorDataset

pytest.importorskip("accelerate")

pytestmark = pytest.mark.timeout(600)


class Stream(IterableDataset):
    def __init__(self, length):
        self.length = length

    def __iter__(self):
        return (torch.tensor([i]) for i in range(self.length))


class EpochBatchSampler(BatchSampler):
    """A custom batch sampler whose order depends on the epoch it is told (set_epoch)."""

    def __init__(self, length, batch_size):
        super().__init__(SequentialSampler(range(length)), batch_size, False)
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        order = torch.randperm(len(self.sampler), generator=torch.Generator().manual_seed(self.epoch)).tolist()
        for i in range(0, len(order), self.batch_size):
            yield order[i:i + self.batch_size]


def _plain(value):
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def make_loader(case):
    length, batch_size = case["length"], case["batch_size"]
    if case.get("iterable"):
        return DataLoader(Stream(length), batch_size=batch_size, drop_last=case.get("drop_last", False))
    data = TensorDataset(torch.arange(length))
    if case.get("custom_batch_sampler"):
        return DataLoader(data, batch_sampler=EpochBatchSampler(length, batch_size))
    return DataLoader(data, batch_size=batch_size, shuffle=case.get("shuffle", False),
                      drop_last=case.get("drop_last", False))


def run_epochs(accelerator, loader, epochs, gather):
    out = []
    for epoch in range(epochs):
        if gather == "set_epoch":
            loader.set_epoch(epoch)
        batches = []
        for batch in loader:
            entry = {"batch": _plain(batch), "end": accelerator.gradient_state.end_of_dataloader,
                     "remainder": accelerator.gradient_state.remainder}
            if gather is True:
                entry["gathered"] = _plain(accelerator.gather_for_metrics(batch))
            batches.append(entry)
        out.append(batches)
    return out


LOADER_CASES = [
    dict(length=21, batch_size=5),
    dict(length=21, batch_size=5, drop_last=True),
    dict(length=20, batch_size=5),
    dict(length=23, batch_size=4),
    dict(length=3, batch_size=4),
    dict(length=21, batch_size=5, shuffle=True),
    dict(length=21, batch_size=4, split_batches=True),
    dict(length=21, batch_size=4, split_batches=True, shuffle=True),
    dict(length=21, batch_size=5, shuffle=True, use_seedable_sampler=True),
    dict(length=21, batch_size=5, shuffle=True, use_seedable_sampler=True, data_seed=7),
    dict(length=21, batch_size=4, shuffle=True, use_seedable_sampler=True, split_batches=True),
    dict(length=21, batch_size=5, even_batches=False, gather=False),
    dict(length=21, batch_size=5, iterable=True),
    dict(length=21, batch_size=4, iterable=True, split_batches=True),
    dict(length=21, batch_size=5, iterable=True, dispatch_batches=False),
    dict(length=21, batch_size=5, iterable=True, drop_last=True),
    dict(length=21, batch_size=5, dispatch_batches=True),
    dict(length=21, batch_size=4, dispatch_batches=True, shuffle=True, use_seedable_sampler=True),
    dict(length=21, batch_size=4, dispatch_batches=True, split_batches=True),
    dict(length=21, batch_size=5, custom_batch_sampler=True, gather="set_epoch", num_processes=1),
]


def loader_scenario(lib, cases):
    """Every case with a fresh Accelerator: what each rank sees over 3 epochs."""
    results = []
    for case in cases:
        config = {k: case[k] for k in ("split_batches", "even_batches", "dispatch_batches",
                                        "use_seedable_sampler", "data_seed") if k in case}
        lib.utils.set_seed(11)
        accelerator = lib.Accelerator(cpu=True, dataloader_config=lib.utils.DataLoaderConfiguration(**config))
        loader = accelerator.prepare(make_loader(case))
        entry = {"epochs": run_epochs(accelerator, loader, 3, case.get("gather", True))}
        try:
            entry["len"] = len(loader)
        except TypeError:
            entry["len"] = None
        entry["prepared_flag"] = getattr(loader, "_is_accelerate_prepared", None)
        entry["batch_sampler"] = type(loader.batch_sampler).__name__  # 1 process: the DataLoader's own
        # Not compared (deliberate differences, docs/compat.md): a custom batch sampler is told the epoch by
        # nbaccel only (see the test after this one); on a map-style dataset dispatched to several processes,
        # Accelerate's skip counts the DataLoader's batches, nbaccel's counts steps (the batches a process got).
        dispatched_map = case.get("dispatch_batches") and not case.get("iterable") and accelerator.num_processes > 1
        if case.get("gather") is not False and not case.get("custom_batch_sampler") and not dispatched_map:
            copy = accelerator.skip_first_batches(loader, 1)
            entry["skipped"] = [_plain(batch) for batch in copy]
            try:
                entry["skipped_len"] = len(copy)
            except TypeError:
                entry["skipped_len"] = None
            entry["skipped_type"] = type(copy).__name__
        entry["rng_after"] = torch.randint(0, 1 << 30, (1,)).item()  # the global RNG draws the same
        results.append(entry)
    return results


@pytest.mark.parametrize("num_processes", [1, 2])
def test_prepared_loaders_yield_what_accelerate_yields(num_processes):
    cases = [c for c in LOADER_CASES if c.get("num_processes", num_processes) == num_processes]
    results = run_both(loader_scenario, num_processes, args=(cases,))
    for index, case in enumerate(cases):
        for rank in range(num_processes):
            from parity_harness import assert_same

            assert_same(results["accelerate"][rank][index], results["nbaccel"][rank][index],
                         f"case {case} rank {rank}")
    assert_parity(results)


def test_set_epoch_reaches_a_custom_batch_sampler_through_the_shard():
    """Deliberate difference (docs/compat.md): Accelerate 1.15's BatchSamplerShard has no set_epoch, so on 2
    processes a custom batch sampler is never told the epoch and repeats epoch 0's order. nbaccel passes the
    epoch on: each epoch, the 2 ranks together get the batches of 1 process (Accelerate's 1-process order)."""
    case = dict(length=21, batch_size=5, custom_batch_sampler=True, gather="set_epoch")
    from parity_harness import run_ranks

    single = run_ranks(loader_scenario, "accelerate", 1, args=([case],))[0][0]["epochs"]
    accelerate_two = run_ranks(loader_scenario, "accelerate", 2, args=([case],))
    nbaccel_two = run_ranks(loader_scenario, "nbaccel", 2, args=([case],))
    for epoch in range(3):
        expected = [b["batch"] for b in single[epoch]]
        ranks = [[b["batch"] for b in r[0]["epochs"][epoch]] for r in nbaccel_two]
        interleaved = [batch for pair in zip(*ranks) for batch in pair]
        assert interleaved[:len(expected) - 1] == expected[:-1]  # the short last batch is then completed
    first_epoch = [[b["batch"] for b in r[0]["epochs"][0]] for r in accelerate_two]
    assert all([[b["batch"] for b in r[0]["epochs"][2]] for r in accelerate_two][i] == first_epoch[i]
               for i in range(2))  # Accelerate: the same order every epoch


def test_gather_for_metrics_with_drop_last_keeps_both_ranks_batches():
    """2 ranks, batch 5, 21 items, drop_last=True: the second (last) gathered batch holds both ranks' 10 items."""
    case = dict(length=21, batch_size=5, drop_last=True)
    results = run_both(loader_scenario, 2, args=([case],))
    for lib in ("accelerate", "nbaccel"):
        gathered = [entry["gathered"] for entry in results[lib][0][0]["epochs"][0]]
        assert [len(g[0]) for g in gathered] == [10, 10], lib
    assert_parity(results)


def join_scenario(lib):
    """join_uneven_inputs(even_batches=False) with an iterable (dispatched) loader: the warning."""
    accelerator = lib.Accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(2, 2))
    accelerator.prepare(DataLoader(Stream(8), batch_size=2))
    if lib.__name__ == "accelerate":
        # Accelerate 1.15 takes its join path only on multi-GPU types (on MULTI_CPU it warns "only supported
        # for multi-GPU training" and does nothing); take that path on gloo to compare its warning.
        type(accelerator).multi_device = property(lambda self: True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with accelerator.join_uneven_inputs([model], even_batches=False):
            pass
    return [(w.category.__name__, "only supported for map-style datasets" in str(w.message)) for w in caught
            if "even_batches" in str(w.message)]


def test_join_uneven_inputs_warns_for_iterable_loaders():
    results = run_both(join_scenario, 2)
    assert results["accelerate"][0] == [("UserWarning", True)]
    assert_parity(results)


class Unsized(BatchSampler):
    """A batch sampler without a batch size."""

    def __init__(self):
        pass

    def __iter__(self):
        return iter([[0, 1], [2, 3]])

    def __len__(self):
        return 2


def misc_scenario(lib):
    """split_batches with no batch size; skip_first_batches of a plain iterable loader; prepared flags."""
    out = {}
    accelerator = lib.Accelerator(cpu=True)
    try:
        lib.data_loader.prepare_data_loader(DataLoader(range(4), batch_sampler=Unsized()), num_processes=2,
                                            process_index=0, split_batches=True)
        out["split_without_batch_size"] = "ok"
    except ValueError as error:
        out["split_without_batch_size"] = ("ValueError", "round multiple" in str(error)
                                           or "batch_size" in str(error))
    skipped = lib.data_loader.skip_first_batches(DataLoader(Stream(7), batch_size=2), 2)
    out["skip_type"] = type(skipped).__name__
    out["skip_base"] = type(getattr(skipped, "base_dataloader", None)).__name__
    out["skip_batches"] = [b.tolist() for b in skipped]
    out["skip_len"] = None
    model, optimizer = accelerator.prepare(torch.nn.Linear(2, 2), torch.optim.SGD([torch.nn.Parameter(
        torch.zeros(1))], lr=0.1))
    out["flags"] = [getattr(model, "_is_accelerate_prepared", None), getattr(optimizer, "_is_accelerate_prepared", None)]
    loader = accelerator.prepare(DataLoader(range(6), batch_size=2))
    again = accelerator.prepare_data_loader(loader)
    out["prepared_twice_is_same"] = again is loader
    return out


def test_split_refusal_skip_loader_and_prepared_flags():
    results = run_both(misc_scenario, 1)
    assert results["accelerate"][0]["split_without_batch_size"] == ("ValueError", True)
    assert results["accelerate"][0]["skip_base"] == "DataLoader"
    assert_parity(results)


def float_skip_scenario(lib):
    """A float batch count (a resume step divided by the accumulation steps): Accelerate skips while a batch's
    index is below it, so 2.5 skips 3; a string count is a TypeError on both (there once iterated, here at once)."""
    out = {}
    accelerator = lib.Accelerator(cpu=True)
    for count in (2.0, 2.5, 0.5):
        plain = lib.skip_first_batches(DataLoader(TensorDataset(torch.arange(10)), batch_size=2), count)
        stream = lib.data_loader.skip_first_batches(DataLoader(Stream(7), batch_size=2), count)
        prepared = accelerator.skip_first_batches(accelerator.prepare(DataLoader(torch.arange(12), batch_size=2)),
                                                  count)
        out[str(count)] = [_plain(list(plain)), _plain(list(stream)), _plain(list(prepared))]
    try:
        list(lib.skip_first_batches(DataLoader(TensorDataset(torch.arange(4)), batch_size=2), "1"))
        out["text"] = "ok"
    except TypeError:
        out["text"] = "TypeError"
    return out


@pytest.mark.parametrize("num_processes", [1, 2])
def test_skip_first_batches_counts_a_float_as_accelerate_does(num_processes):
    results = run_both(float_skip_scenario, num_processes)
    assert results["accelerate"][0]["text"] == "TypeError"
    assert_parity(results)
