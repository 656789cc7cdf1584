"""Data loaders in the shapes users hand them, compared with Accelerate 1.15 on 1 and 2 gloo ranks
(tests/parity/parity_harness.py): `batch_size=None`, a `BatchSampler` passed as `sampler`, collate functions
returning dicts, tuples, namedtuples and non-tensors, `skip_first_batches` of unprepared loaders, and
`gather_for_metrics` of values that cannot be cut at the last batch. Where nbaccel deliberately differs
(docs/compat.md), the test shows both sides."""

from __future__ import annotations

import collections
import logging

import pytest
import torch
from parity_harness import assert_parity, assert_same, run_both
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset, SequentialSampler

pytest.importorskip("accelerate")
pytestmark = pytest.mark.timeout(600)

Pair = collections.namedtuple("Pair", ["x", "y"])


def _plain(value):
    """A batch as comparable values: tensors with their dtype, namedtuples and lists kept apart."""
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), value.tolist())
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return (type(value).__name__, [_plain(v) for v in value])
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [_plain(v) for v in value])
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _outcome(call):
    """A call's value, or its exception's type (messages are each library's own words)."""
    try:
        return ("ok", call())
    except Exception as error:  # compared between the libraries
        return ("error", type(error).__name__)


def _unbatched():
    """batch_size=None: no automatic batching, the DataLoader yields the dataset's samples one by one."""
    return DataLoader(torch.arange(5), batch_size=None)


def _batch_sampler_as_sampler():
    """A BatchSampler passed as `sampler` with batch_size=None: each sample is a slice of the dataset."""
    return DataLoader(torch.arange(10), sampler=BatchSampler(SequentialSampler(range(10)), 4, False),
                      batch_size=None)


def unbatched_scenario(lib):
    """The prepared loader of a DataLoader with batch_size=None, over two passes: what it yields, where the
    end of the data is, and its length."""
    accelerator = lib.Accelerator(cpu=True)
    loader = accelerator.prepare(_unbatched())
    gradient_state = accelerator.gradient_state
    passes = [[(_plain(batch), gradient_state.end_of_dataloader, gradient_state.remainder) for batch in loader]
              for _ in range(2)]
    return {"passes": passes, "len": len(loader), "sampler": type(loader.get_sampler()).__name__,
            "batch_size": loader.batch_size}


class Named(Dataset):
    """Samples with a tensor and a name (a str): batches are dicts with a non-tensor field."""

    def __len__(self):
        return 7

    def __getitem__(self, index):
        return {"x": torch.tensor([float(index)]), "name": f"s{index}"}


def gather_scenario(lib):
    """`gather_for_metrics` at every batch (7 samples, batches of 2) of a dict with a list of str (gathered as
    objects), of a 0-dim loss, of the names with `use_gather_object=True`, and of the tensor alone."""
    accelerator = lib.Accelerator(cpu=True)
    loader = accelerator.prepare(DataLoader(Named(), batch_size=2))
    out = []
    for batch in loader:
        out.append([_outcome(lambda value=value, objects=objects: _plain(
                        accelerator.gather_for_metrics(value, use_gather_object=objects)))
                    for value, objects in ((batch, False), (batch["x"].sum(), False), (batch["name"], True),
                                           (batch["x"], False))])
    return out


def dispatched_batch_sampler_as_sampler(lib):
    """`dispatch_batches=True` with a BatchSampler passed as `sampler`: the batches and a skip copy's."""
    config = lib.utils.DataLoaderConfiguration(dispatch_batches=True)
    accelerator = lib.Accelerator(cpu=True, dataloader_config=config)

    def run():
        loader = accelerator.prepare(_batch_sampler_as_sampler())
        return [_plain(batch) for batch in loader], [_plain(batch) for batch in accelerator.skip_first_batches(loader, 1)]
    unbatched = accelerator.prepare(_unbatched())  # 0-dim samples: nothing to split
    return _outcome(run), _outcome(lambda: [_plain(batch) for batch in unbatched])


def one_process_scenario(lib):
    return {"unbatched": unbatched_scenario(lib), "skip": unbatched_skip_scenario(lib),
            "gather": gather_scenario(lib), "too_short": too_short_to_dispatch(lib),
            "dispatched_batch_sampler": dispatched_batch_sampler_as_sampler(lib)}


@pytest.fixture(scope="module")
def one_process():
    """The 1-process scenarios, run once for the tests below (each run starts fresh interpreters)."""
    return run_both(one_process_scenario, 1)


def _part(results, name):
    return {lib: [rank[name] for rank in ranks] for lib, ranks in results.items()}


def test_a_loader_without_batch_size_yields_its_samples_as_in_accelerate(one_process):
    """nbaccel's prepared loader once rebuilt it with the DataLoader's default batch size (1), so each sample
    came wrapped in a batch of one (`[tensor(0)]` for `tensor(0)`) and `remainder` was 0."""
    results = _part(one_process, "unbatched")
    assert [b[0] for b in results["accelerate"][0]["passes"][0]] == [("tensor", "torch.int64", i) for i in range(5)]
    assert_parity(results)


def unbatched_skip_scenario(lib):
    """`skip_first_batches(loader, 2)` of unprepared and prepared loaders without a batch size, beside the
    loader's own batches."""
    out = {}
    accelerator = lib.Accelerator(cpu=True)
    for name, make in (("unbatched", _unbatched), ("batch_sampler_as_sampler", _batch_sampler_as_sampler)):
        own = [_plain(batch) for batch in make()]
        skipped = lib.skip_first_batches(make(), 2)
        prepared = _outcome(lambda make=make: accelerator.prepare(make()))
        if prepared[0] == "ok":
            copy = accelerator.skip_first_batches(prepared[1], 2)
            prepared = _outcome(lambda copy=copy: ([_plain(batch) for batch in copy], len(copy)))
        out[name] = {"own": own, "type": type(skipped).__name__,
                     "skipped": _outcome(lambda skipped=skipped: ([_plain(batch) for batch in skipped], len(skipped))),
                     "prepared": prepared}
    torch.manual_seed(0)
    out["shuffled"] = [int(b) for b in accelerator.prepare(DataLoader(torch.arange(6), batch_size=None, shuffle=True))]
    return out


def test_skip_first_batches_of_a_loader_without_batch_size_keeps_its_batches(one_process):
    """Deliberate difference (docs/compat.md): without a batch size, Accelerate's `skip_first_batches` copy of a
    DataLoader fails at its first batch (no batch sampler to skip in: TypeError), and with a BatchSampler passed
    as `sampler` it yields lists of 0-dim tensors where the DataLoader yields tensors; on 1 process its
    `prepare` of the latter raises TypeError (batch_size given twice). nbaccel's copies yield the DataLoader's
    own batches after the first two, and its `len()` is the batches left. A shuffled DataLoader without a batch
    size stays shuffled when prepared (Accelerate's rebuilds it without its sampler: in order)."""
    results = _part(one_process, "skip")
    ours, theirs = results["nbaccel"][0], results["accelerate"][0]
    for name in ("unbatched", "batch_sampler_as_sampler"):
        own = ours[name]["own"]
        assert own == theirs[name]["own"]
        assert ours[name]["type"] == theirs[name]["type"] == "DataLoader"
        assert ours[name]["skipped"] == ("ok", (own[2:], len(own) - 2))
        assert ours[name]["prepared"] == ("ok", (own[2:], len(own) - 2))
    assert theirs["unbatched"]["skipped"] == theirs["unbatched"]["prepared"] == ("error", "TypeError")
    assert theirs["batch_sampler_as_sampler"]["skipped"][1][0][0] == (
        "list", [("tensor", "torch.int64", i) for i in range(8, 10)])
    assert theirs["batch_sampler_as_sampler"]["prepared"] == ("error", "TypeError")
    assert theirs["shuffled"] == list(range(6))
    assert sorted(ours["shuffled"]) == list(range(6)) != ours["shuffled"]


def test_a_dispatched_loader_with_a_batch_sampler_as_sampler_dispatches_its_batches(one_process):
    """Deliberate difference (docs/compat.md): with `dispatch_batches=True`, a BatchSampler passed as `sampler`
    gives the DataLoader's batches (nbaccel once dropped it and failed with IndexError); Accelerate's rebuild
    drops it too and raises RuntimeError (and on two processes waits for ever)."""
    results = _part(one_process, "dispatched_batch_sampler")
    own = results["nbaccel"][0][0][1][0]
    assert own == [("tensor", "torch.int64", list(range(i, min(i + 4, 10)))) for i in (0, 4, 8)]
    assert results["nbaccel"][0][0] == ("ok", (own, own[1:]))
    assert results["accelerate"][0][0] == ("error", "RuntimeError")


def test_a_dispatched_0_dim_batch_is_a_runtime_error_as_in_accelerate(one_process):
    """A DataLoader with batch_size=None over 0-dim samples, dispatched on one process: Accelerate cannot join
    the batch (RuntimeError); nbaccel failed on slicing it (IndexError) and now says that such a batch has no
    dimension to split (RuntimeError)."""
    results = _part(one_process, "dispatched_batch_sampler")
    assert [rank[1] for rank in results["accelerate"]] == [("error", "RuntimeError")]
    assert_same(results["accelerate"][0][1], results["nbaccel"][0][1])


class SizedStream(IterableDataset):
    """An iterable dataset with a length (10 samples unless told)."""

    def __init__(self, length=10):
        self.length = length

    def __iter__(self):
        return iter(torch.tensor([i]) for i in range(self.length))

    def __len__(self):
        return self.length


def sized_stream_skip(lib):
    """`skip_first_batches(loader, 1)` of a prepared iterable loader with a length, sharded and dispatched:
    its batches and its `len()`."""
    out = {}
    for dispatch in (False, True):
        config = lib.utils.DataLoaderConfiguration(dispatch_batches=dispatch)
        accelerator = lib.Accelerator(cpu=True, dataloader_config=config)
        copy = accelerator.skip_first_batches(accelerator.prepare(DataLoader(SizedStream(), batch_size=2)), 1)
        out[dispatch] = ([_plain(batch) for batch in copy], len(copy))
    return out


def stateful_skip_scenario(lib):
    """`skip_first_batches` of a shuffled stateful loader, with a draw from torch's RNG between making the copy
    and iterating it (a model initialised there, dropout), and a copy that is never iterated."""
    config = lib.utils.DataLoaderConfiguration(use_stateful_dataloader=True)
    accelerator = lib.Accelerator(cpu=True, dataloader_config=config)
    lib.utils.set_seed(5)
    loader = accelerator.prepare(DataLoader(torch.arange(10), batch_size=3, shuffle=True))
    first = [_plain(batch) for batch in loader]
    unused = accelerator.skip_first_batches(loader, 1)
    copy = accelerator.skip_first_batches(loader, 1)
    between = torch.rand(2)
    return {"first": first, "between": between, "copy": [_plain(batch) for batch in copy], "after": torch.rand(2),
            "unused": unused is not copy, "copy_state": _outcome(lambda: sorted(copy.state_dict()))}


def constructor_scenario(lib):
    """`DataLoaderShard` and `DataLoaderDispatcher` built directly with Accelerate's keyword arguments
    (`_drop_last`, `_non_blocking`, `iteration`, `skip_batches`): batches, epoch, remainder, `len()`."""
    lib.Accelerator(cpu=True)
    loaders = {
        "shard": lambda: lib.data_loader.DataLoaderShard(torch.arange(7), batch_size=2, _drop_last=True,
                                                         _non_blocking=False, iteration=3, skip_batches=1),
        "dispatcher": lambda: lib.data_loader.DataLoaderDispatcher(torch.arange(7), batch_size=2, _drop_last=False,
                                                                   _non_blocking=False, iteration=2, skip_batches=1),
    }
    out = {}
    for name, build in loaders.items():
        def run(build=build):
            loader = build()
            batches = [(_plain(batch), loader.remainder) for batch in loader]
            return {"batches": batches, "iteration": loader.iteration, "drop_last": loader._drop_last,
                    "len": len(loader)}
        out[name] = _outcome(run)
    return out


def too_short_to_dispatch(lib):
    """A dispatched loader with `drop_last=True` whose data fill no step (3 samples in batches of 2: one batch,
    and a step on 2 processes takes 2; on 1 process 1 sample): the batches of each pass, and `len()`."""
    config = lib.utils.DataLoaderConfiguration(dispatch_batches=True)
    accelerator = lib.Accelerator(cpu=True, dataloader_config=config)
    samples = 3 if accelerator.num_processes > 1 else 1
    loader = accelerator.prepare(DataLoader(torch.arange(samples), batch_size=2, drop_last=True))
    empty = accelerator.prepare(DataLoader(SizedStream(0), batch_size=2))  # an iterable dataset: dispatched
    return {"passes": [_outcome(lambda: [_plain(batch) for batch in loader]) for _ in range(2)], "len": len(loader),
            "empty": _outcome(lambda: [_plain(batch) for batch in empty])}


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records = []

    def emit(self, record):
        self.records.append(record)


class Unsized(IterableDataset):
    """An iterable dataset without a length (5 samples)."""

    def __iter__(self):
        return iter(torch.tensor([i]) for i in range(5))


def unsized_gather_log(lib):
    """`gather_for_metrics` over a sharded iterable dataset without a length (remainder unknown): the INFO
    records of the accelerator's logger, per batch."""
    config = lib.utils.DataLoaderConfiguration(dispatch_batches=False)
    accelerator = lib.Accelerator(cpu=True, dataloader_config=config)
    logger = logging.getLogger(f"{lib.__name__}.accelerator")
    handler, level = _Records(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        out = []
        for batch in accelerator.prepare(DataLoader(Unsized(), batch_size=2)):
            gathered = accelerator.gather_for_metrics(batch)
            out.append((_plain(gathered), [(r.levelname, "no length" in r.getMessage()) for r in handler.records]))
            handler.records.clear()
        return out
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def two_process_scenario(lib):
    return {"stateful_skip": stateful_skip_scenario(lib), "sized_stream_skip": sized_stream_skip(lib),
            "constructors": constructor_scenario(lib), "too_short": too_short_to_dispatch(lib),
            "unsized_gather_log": unsized_gather_log(lib)}


@pytest.fixture(scope="module")
def two_processes():
    """The 2-process scenarios, run once for the tests below."""
    return run_both(two_process_scenario, 2)


def test_a_stateful_loaders_skip_copy_draws_when_iterated_as_in_accelerate(two_processes):
    """nbaccel's copy took torchdata's first state when made, drawing the pass's seeds from torch's RNG then
    (Accelerate's copy is a plain DataLoaderShard that draws them when iterated): the draws in between, and
    with them the copy's order, differed. Deliberate difference (docs/compat.md): the copy is a stateful loader
    too, whose `state_dict()` gives its position; Accelerate's has no `state_dict` (AttributeError)."""
    results = _part(two_processes, "stateful_skip")
    states = {lib: [rank.pop("copy_state") for rank in ranks] for lib, ranks in results.items()}
    assert states["accelerate"] == [("error", "AttributeError")] * 2
    assert all(state[0] == "ok" and "_num_yielded" in state[1] for state in states["nbaccel"])
    assert_parity(results)


def test_len_of_an_iterable_loaders_skip_copy_is_the_batches_it_yields(two_processes):
    """Deliberate difference (docs/compat.md): `len()` of the copy is the batches it yields (2 processes, 10
    samples in batches of 2: 3 steps, 1 skipped, 2 left); Accelerate's counts the whole pass (3). The batches
    are the same."""
    results = _part(two_processes, "sized_stream_skip")
    for dispatch in (False, True):
        for theirs, ours in zip(results["accelerate"], results["nbaccel"]):
            assert theirs[dispatch][0] == ours[dispatch][0]
            assert len(ours[dispatch][0]) == ours[dispatch][1] == 2
            assert theirs[dispatch][1] == 3


def test_gather_for_metrics_returns_what_it_cannot_cut_at_the_last_batch(one_process):
    """On one process the last batch (1 of 7 samples) has a remainder of 1: nbaccel cut every gathered value to
    it and failed on a dict gathered as an object (TypeError) and on a 0-dim loss (IndexError), where Accelerate
    returns such values whole."""
    results = _part(one_process, "gather")
    last = results["accelerate"][0][-1]
    assert last[0] == ("ok", {"x": ("tensor", "torch.float32", [[6.0]]), "name": ("list", ["s6"])})
    assert last[1] == ("ok", ("tensor", "torch.float32", 6.0))
    assert_parity(results)


def test_prepared_loader_classes_take_accelerates_constructor_arguments(two_processes):
    """`DataLoaderShard(..., _drop_last=, _non_blocking=, iteration=)` and the same for `DataLoaderDispatcher`
    (Accelerate's signatures) raised TypeError ("unexpected keyword argument '_drop_last'"). Built with
    `skip_batches`, `len()` is the batches they yield (docs/compat.md); Accelerate's counts the skipped one."""
    results = _part(two_processes, "constructors")
    lengths = {lib: [{name: value[1].pop("len") for name, value in rank.items()} for rank in ranks]
               for lib, ranks in results.items()}
    assert lengths["accelerate"] == [{"shard": 4, "dispatcher": 2}] * 2
    assert lengths["nbaccel"] == [{"shard": 3, "dispatcher": 1}] * 2
    assert_parity(results)


def test_a_dispatched_loader_with_no_whole_step_yields_nothing(one_process, two_processes):
    """Deliberate difference (docs/compat.md): with `drop_last=True` and too few samples for one step, or no
    samples at all, nbaccel's dispatched loader yields no batch (what the DataLoader yields on one process) and
    its `len()` is 0, pass after pass. Accelerate's raises ValueError ("Batch does not contain any data") on one
    process and TypeError (a broadcast of None) on two."""
    for results, error in ((one_process, "ValueError"), (two_processes, "TypeError")):
        results = _part(results, "too_short")
        for theirs, ours in zip(results["accelerate"], results["nbaccel"]):
            assert theirs["passes"] == [("error", error)] * 2 and theirs["empty"] == ("error", error)
            assert ours["passes"] == [("ok", [])] * 2 and ours["empty"] == ("ok", [])
            assert theirs["len"] == ours["len"] == 0


def test_gather_for_metrics_says_at_the_last_batch_that_an_unsized_dataset_was_not_trimmed(two_processes):
    """Accelerate logs an INFO record on the main process when `gather_for_metrics` reaches the last batch of a
    loader whose dataset has no length (it cannot drop the repeated samples); nbaccel logged nothing."""
    results = _part(two_processes, "unsized_gather_log")
    assert [logs for _, logs in results["accelerate"][0]] == [[], [("INFO", True)]]
    assert all(logs == [] for _, logs in results["accelerate"][1])
    assert_parity(results)
