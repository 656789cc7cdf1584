"""Data loaders for several processes: sharding, device placement, end-of-data, resuming mid-epoch.

The rules are Accelerate 1.15's (tests/parity/ compares them batch by batch). `prepare_data_loader` turns a
`torch.utils.data.DataLoader` into one whose batches are this process's share:
- one process: the DataLoader's own batch sampler, unchanged.
- map-style datasets on several processes: the batch sampler is sharded (`BatchSamplerShard`): batch i goes
  to process i % num_processes, or with `split_batches` every batch is cut in num_processes slices. With
  `even_batches` a round the data leaves incomplete is filled with batches cycling from the start of the
  epoch, so every process runs the same number of steps (`gather_for_metrics` drops the repeats, see
  `remainder`).
- iterable datasets: every process reads the stream and keeps its slice (`IterableDatasetShard`), or with
  `dispatch_batches` (the default for them) only process 0 reads and broadcasts (`DataLoaderDispatcher`).
- shuffling agrees across processes: the sampler gets a generator seeded from process 0's draw, or with
  `use_seedable_sampler` it is seeded with seed + epoch (`SeedableRandomSampler`).

The prepared loader (`DataLoaderShard` / `DataLoaderDispatcher`) moves batches to the device, looks one
batch ahead so `end_of_dataloader` is True while the last batch is being used, and registers itself with
`GradientState` while it is iterated. `state_dict()` / `load_state_dict()` (nbaccel's addition) record the
epoch, the batches yielded so far, the shuffling generator and torch's RNG at the epoch's start, so a
checkpoint taken mid-epoch or at an epoch's end resumes with the batches of the uninterrupted run.
"""

from __future__ import annotations

import itertools
import math
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, Sampler

from . import telemetry
from .state import GradientState, PartialState
from .utils import xla as _xla
from .utils.dataclasses import whole_number
from .utils.operations import broadcast, broadcast_object_list, send_to_device, slice_tensors
from .utils.random import synchronize_rng_states
from .utils.structures import iter_leaves

# DataLoader arguments carried over when a loader is rebuilt around a new sampler or dataset.
_LOADER_KWARGS = (
    "num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context",
    "generator", "prefetch_factor", "persistent_workers", "pin_memory_device", "in_order",
)


def _loader_kwargs(dataloader: DataLoader) -> dict[str, Any]:
    kwargs = {name: getattr(dataloader, name) for name in _LOADER_KWARGS if hasattr(dataloader, name)}
    if not kwargs.get("num_workers"):
        kwargs.pop("prefetch_factor", None)
        kwargs.pop("persistent_workers", None)
    return kwargs


# ----------------------------------------------------------------------------------------------- samplers


class SeedableRandomSampler(RandomSampler):
    """A RandomSampler whose order depends only on (seed, epoch): the same on every process and on resume.

    Each pass seeds the generator with `initial_seed + epoch` and, once complete, moves to the next epoch (as
    Accelerate's). The generator is made at the first pass when none was given."""

    def __init__(self, *args: Any, data_seed: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.initial_seed = torch.random.initial_seed() if data_seed is None else data_seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        if self.generator is None:
            self.generator = torch.Generator()
        self.generator.manual_seed(self.initial_seed + self.epoch)
        yield from super().__iter__()
        self.set_epoch(self.epoch + 1)


def _round_multiple_error(kind: str, batch_size: Any, num_processes: int) -> ValueError:
    return ValueError(
        f"{kind} with split_batches=True needs a batch size that is a round multiple of the number of processes "
        f"({num_processes}), got {batch_size}: change the batch size (or give the batch sampler a `batch_size`), "
        "or use split_batches=False."
    )


class BatchSamplerShard(BatchSampler):
    """This process's batches of `batch_sampler`, with Accelerate's rules.

    Without `split_batches`, batch i goes to process i % num_processes, and a round is handed out only once its
    last batch is full. When the data runs out mid-round: with `drop_last` the round is dropped; with
    `even_batches` the short last batch is completed from the first samples of the epoch and the round is
    completed with whole batches that go on cycling through those samples; otherwise the processes that have a
    batch get it (short or not). With `split_batches` every batch is cut in `num_processes` equal slices, the
    short last batch completed from the first batch with `even_batches`.
    """

    def __init__(self, batch_sampler: Any, num_processes: int = 1, process_index: int = 0,
                 split_batches: bool = False, even_batches: bool = True) -> None:
        self.batch_sampler = batch_sampler
        self.sampler = getattr(batch_sampler, "sampler", None)  # nbaccel: get_sampler() finds it through the shard
        self.num_processes = num_processes
        self.process_index = process_index
        self.split_batches = split_batches
        self.even_batches = even_batches
        self.batch_size = getattr(batch_sampler, "batch_size", None)
        self.drop_last = getattr(batch_sampler, "drop_last", False)
        if split_batches and (self.batch_size is None or self.batch_size % num_processes != 0):
            raise _round_multiple_error("BatchSamplerShard", self.batch_size, num_processes)

    @property
    def total_length(self) -> int:
        return len(self.batch_sampler)

    def set_epoch(self, epoch: int) -> None:
        """Pass the epoch on to the wrapped batch sampler, when it takes one (custom batch samplers)."""
        if hasattr(self.batch_sampler, "set_epoch"):
            self.batch_sampler.set_epoch(epoch)

    def __len__(self) -> int:
        total, n = len(self.batch_sampler), self.num_processes
        if self.split_batches or total % n == 0:
            return total if self.split_batches else total // n
        if self.drop_last:
            return total // n
        if self.even_batches:
            return total // n + 1
        return total // n + (1 if self.process_index < total % n else 0)

    def __iter__(self) -> Iterator[list]:
        return self._iter_split() if self.split_batches else self._iter_round_robin()

    def _iter_round_robin(self) -> Iterator[list]:
        n, me, size = self.num_processes, self.process_index, self.batch_size
        start: list = []  # the first round: whole batches when their size varies, else its samples
        mine = None  # this process's batch in the round being read
        index, last = -1, []
        for index, batch in enumerate(self.batch_sampler):
            if not self.drop_last and index < n:
                if size is None:
                    start.append(batch)
                else:
                    start.extend(batch)
            if index % n == me:
                mine = batch
            if index % n == n - 1 and (size is None or len(batch) == size):
                yield mine
                mine = None
            last = batch
        if self.drop_last or not start:
            return
        if not self.even_batches:
            if mine:
                yield mine
            return
        if mine and (size is None or len(mine) == size):
            yield mine
        while len(start) < (n if size is None else n * size):  # fewer samples than one round needs
            start = start + start
        # Finish the round: the short last batch is completed from the start, then whole batches follow,
        # cycling on through the first samples.
        if size is None or len(last) == size:
            partial, index = [], index + 1
        else:
            partial = list(last)
        position = 0
        while index % n != 0 or partial:
            if size is None:
                batch, position = start[position], position + 1
            else:
                take = size - len(partial)
                batch, position = partial + start[position:position + take], position + take
            if index % n == me:
                yield batch
            partial, index = [], index + 1

    def _iter_split(self) -> Iterator[list]:
        n, me, size = self.num_processes, self.process_index, self.batch_size
        per = size // n
        mine = slice(per * me, per * (me + 1))
        first: list = []
        last: list = []
        for index, batch in enumerate(self.batch_sampler):
            if index == 0:
                first = list(batch)
            if len(batch) == size:
                yield batch[mine]
            last = batch
        if self.drop_last or not first or len(last) == size:
            return
        if not self.even_batches:
            if len(last) > per * me:
                yield last[mine]
            return
        while len(first) < size:
            first = first + first
        yield (list(last) + first)[mine]


class SkipBatchSampler(BatchSampler):
    """A batch sampler that leaves out the first `skip_batches` batches of `batch_sampler`."""

    def __init__(self, batch_sampler: Any, skip_batches: int = 0) -> None:
        self.batch_sampler = batch_sampler
        self.skip_batches = _batches_to_skip(skip_batches)

    def __iter__(self) -> Iterator[list]:
        return itertools.islice(iter(self.batch_sampler), self.skip_batches, None)

    @property
    def total_length(self) -> int:
        return len(self.batch_sampler)

    def __len__(self) -> int:
        return len(self.batch_sampler) - self.skip_batches  # negative (len() raises) when skipping too many


class IterableDatasetShard(IterableDataset):
    """This process's samples of an iterable dataset: every process reads the stream and keeps its slice
    of each group of samples (batch_size x num_processes, or batch_size with `split_batches`); the last group
    is completed by repeating the first one, unless `drop_last`."""

    def __init__(self, dataset: Any, batch_size: int = 1, drop_last: bool = False, num_processes: int = 1,
                 process_index: int = 0, split_batches: bool = False) -> None:
        if split_batches and batch_size > 1 and batch_size % num_processes != 0:
            raise _round_multiple_error("IterableDatasetShard", batch_size, num_processes)
        self.dataset = dataset
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.num_processes = num_processes
        self.process_index = process_index
        self.split_batches = split_batches

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __len__(self) -> int:
        # As Accelerate: counted with batch_size x num_processes per group, whatever split_batches says.
        group = self.batch_size * self.num_processes
        if self.drop_last:
            return (len(self.dataset) // group) * self.batch_size
        return math.ceil(len(self.dataset) / group) * self.batch_size

    def __iter__(self) -> Iterator[Any]:
        generator = getattr(self.dataset, "generator", None)
        if not hasattr(self.dataset, "set_epoch") and isinstance(generator, torch.Generator):
            generator.manual_seed(getattr(self, "epoch", 0))  # a dataset that shuffles with its generator
        group = self.batch_size if self.split_batches else self.batch_size * self.num_processes
        per = self.batch_size // self.num_processes if self.split_batches else self.batch_size
        mine = slice(self.process_index * per, (self.process_index + 1) * per)
        first: list | None = None
        buffer: list = []
        for sample in self.dataset:
            buffer.append(sample)
            if len(buffer) == group:
                yield from buffer[mine]
                if first is None:
                    first = list(buffer)
                buffer = []
        if buffer and not self.drop_last:
            first = list(buffer) if first is None else first
            while len(buffer) < group:
                buffer = buffer + first
            yield from buffer[mine]


# ----------------------------------------------------------------------------------------------- loaders

_END = object()  # marks the end of the wrapped iterator


class _InstanceOnly:
    """`loader.base_dataloader`: the DataLoader a prepared loader reads through, itself (on the class: no such
    attribute, as in Accelerate)."""

    def __get__(self, instance: Any, owner: type) -> Any:
        if instance is None:
            raise AttributeError("base_dataloader is an attribute of a loader, not of its class")
        return instance


def _new_loader(cls: type, use_stateful_dataloader: bool, reads_through_base: bool = False) -> Any:
    """A new, uninitialised `cls`, or its `StatefulDataLoader` variant (stateful_loaders.py)."""
    if use_stateful_dataloader and not getattr(cls, "use_stateful_dataloader", False):
        from .stateful_loaders import stateful_variant

        cls = stateful_variant(cls, reads_through_base)
    return object.__new__(cls)


class _PreparedLoaderMixin:
    """What both prepared loaders share: end-of-data, GradientState registration, positions for resume."""

    _base: type = DataLoader  # the DataLoader class it is (torchdata's StatefulDataLoader in the variants)
    use_stateful_dataloader = False
    base_dataloader = _InstanceOnly()

    def __new__(cls, *args: Any, use_stateful_dataloader: bool = False, **kwargs: Any) -> Any:
        return _new_loader(cls, use_stateful_dataloader)

    def _note_position(self) -> None:
        """The stateful variants record torchdata's position here, once the batch in use was read."""

    def _init_prepared(self, device, non_blocking: bool, drop_last: bool) -> None:
        self.device = device
        self.non_blocking = non_blocking
        self._move = device is not None and torch.device(device).type != "cpu"
        self.gradient_state = GradientState()
        self.end_of_dataloader = False
        self.remainder = -1
        self.iteration = 0
        self._drop_last = drop_last
        self._batches_yielded = 0
        self._epoch_batches: int | None = None  # the batches of the epoch being iterated (set by begin)
        self._resume_skip = 0  # batches a restored position leaves out of the next pass
        self._resume_pending = False  # load_state_dict set a position no pass has used yet
        self._resume_fork_rng = False  # the next pass continues an interrupted epoch: replay its start's draws
        self._epoch_rng_state: torch.Tensor | None = None  # torch's global RNG when this epoch's pass began
        self._note_position()  # a stateful loader takes torchdata's first state now, as Accelerate's does

    end_of_dataloader = False
    remainder = -1

    def reset(self) -> None:
        """Forget the end-of-data flag and the remainder (Accelerate's `DataLoaderStateMixin.reset`)."""
        self.end_of_dataloader = False
        self.remainder = -1

    def _starting_remainder(self) -> int:
        """The samples of the last global batch that are real (Accelerate: dataset length modulo the total batch
        size, unless `drop_last`); -1 when unknown."""
        if getattr(self, "_drop_last", False):
            return -1
        try:
            length = getattr(self.dataset, "total_dataset_length", None)
            length = len(self.dataset) if length is None else length
            return length % self.total_batch_size
        except Exception:  # an unsized dataset or no batch size: unknown, as in Accelerate
            return -1

    def begin(self) -> None:
        """Start of an epoch: reset end-of-data, compute the remainder, register with GradientState."""
        self.reset()
        self.remainder = self._starting_remainder()
        try:
            self._epoch_batches = len(self) + self.skip_batches
        except Exception:  # an unsized dataset (or a __len__ that fails): the dashboard shows no epoch length
            self._epoch_batches = None
        self.gradient_state._add_dataloader(self)

    def epoch_position(self) -> telemetry.EpochPosition:
        """Where the pass being iterated is: its epoch, the batches of it yielded so far (those a resumed
        or `skip_first_batches` pass left out included) and the epoch's batches (None when unsized)."""
        return telemetry.EpochPosition(self.iteration, self._batches_yielded, self._epoch_batches)

    def end(self) -> None:
        self.gradient_state._remove_dataloader(self)

    def _position_holder(self) -> _PreparedLoaderMixin:
        """The loader whose pass is this loader's position: a `skip_first_batches` copy of it while that copy
        is being iterated (the copy stands in for this loader during the resumed epoch), else itself."""
        for loader in reversed(self.gradient_state.dataloader_references):
            if loader is not None and loader is not self and getattr(loader, "_skip_source", None) is self:
                return loader
        return self

    def _pass_done(self) -> bool:
        """The pass being iterated has yielded its last batch (it ends when the loop asks for one more)."""
        return self.end_of_dataloader and self._batches_yielded > 0

    def _state(self) -> dict[str, Any]:
        holder = self._position_holder()
        if holder._pass_done():  # saved during the epoch's last step: resume where the finished pass leaves it
            return {"epoch": holder.iteration + 1, "batches_yielded": 0}
        state = {"epoch": holder.iteration, "batches_yielded": holder._batches_yielded}
        if holder._batches_yielded and holder._epoch_rng_state is not None:
            state["epoch_rng_state"] = holder._epoch_rng_state.clone()
        return state

    def _load_state(self, state: dict[str, Any]) -> None:
        self.set_epoch(int(state.get("epoch", 0)))
        self._resume_skip = int(state.get("batches_yielded", 0))
        self._resume_pending = True
        self._resume_fork_rng = self._resume_skip > 0
        self._epoch_rng_state = state.get("epoch_rng_state")

    def _take_resume(self) -> tuple[int, bool]:
        """At the start of a pass: the restored batches to leave out and whether the pass resumes an epoch
        (see `_start_iterator`); the restored position is used up."""
        taken = (self._resume_skip, self._resume_fork_rng)
        self._resume_skip, self._resume_pending, self._resume_fork_rng = 0, False, False
        return taken

    def _hand_over_resume(self, copy: _PreparedLoaderMixin) -> None:
        """For `skip_first_batches(self, n)`: its copy's `n` counts from the start of the epoch and replaces a
        restored position that no pass has used. The copy runs the restored epoch (same order); this loader's
        next pass is the following epoch, as after an uninterrupted run of that epoch."""
        copy._resume_skip, copy._resume_pending, copy._resume_fork_rng = 0, False, False
        # While the copy is iterated, the loader it was made from reports the copy's position in state_dict().
        copy._skip_source = getattr(self, "_skip_source", None) or self
        if not self._resume_pending:
            return
        copy._resume_fork_rng = self._resume_fork_rng
        copy._epoch_rng_state = self._epoch_rng_state
        self._take_resume()
        self.iteration = copy.iteration + 1

    def set_sampler(self, sampler: Sampler) -> None:
        """Replace the index sampler (in the batch sampler, and in the one a shard wraps)."""
        if isinstance(self.sampler, BatchSampler):
            self.sampler.sampler = sampler
            return
        self.batch_sampler.sampler = sampler
        if hasattr(self.batch_sampler, "batch_sampler"):
            self.batch_sampler.batch_sampler.sampler = sampler

    def _skipped_length(self, length: int) -> int:
        """The batches a pass yields: a `skip_first_batches` copy leaves out its first `skip_batches`."""
        return max(length - self.skip_batches, 0)

    def _open_pass(self, skip: int, resuming: bool) -> Iterator[Any]:
        """Start a pass of this DataLoader, leaving out its first `skip` batches (by index when it has a batch
        sampler: no sample of a skipped batch is loaded).

        Starting a pass draws from torch's global RNG (the loader's base seed; a shuffling sampler without a
        generator draws its seed at the first batch). When the pass resumes an interrupted epoch, those draws
        are replayed from the RNG state the interrupted run had when the epoch began (so the order is the
        same), on a forked RNG, so the state `load_state` restored is left exactly as it was."""
        if not resuming:
            self._epoch_rng_state = torch.get_rng_state()
            return self._skipping_iterator(skip)
        with torch.random.fork_rng(devices=[]):
            if self._epoch_rng_state is not None:
                torch.set_rng_state(self._epoch_rng_state)
            batches = self._skipping_iterator(skip)
            first = next(batches, _END)
        return batches if first is _END else itertools.chain([first], batches)

    def _skipping_iterator(self, skip: int) -> Iterator[Any]:
        batch_sampler = self.__dict__.get("batch_sampler")
        if not skip:
            return self._base.__iter__(self)
        if batch_sampler is None or not _has_length(batch_sampler) or self.__dict__.get("_initial_iter_for_state_dict"):
            # (a stateful loader's first pass uses the iterator it made when built: skipped by reading)
            return itertools.islice(self._base.__iter__(self), skip, None)
        # The DataLoader reads its batch sampler when the iterator is made: skip by index for this pass only.
        self.__dict__["batch_sampler"] = SkipBatchSampler(batch_sampler, skip)
        try:
            return self._base.__iter__(self)
        finally:
            self.__dict__["batch_sampler"] = batch_sampler


class SkipDataLoader(DataLoader):
    """A DataLoader that leaves out the first `skip_batches` batches of every pass (what `skip_first_batches`
    gives for an iterable dataset, where batches cannot be skipped by index). As Accelerate's, it reads through
    `base_dataloader` (a plain DataLoader built from the same arguments) and registers with `GradientState`
    while iterated."""

    use_stateful_dataloader = False

    def __new__(cls, *args: Any, use_stateful_dataloader: bool = False, **kwargs: Any) -> Any:
        return _new_loader(cls, use_stateful_dataloader, reads_through_base=True)

    def __init__(self, dataset: Any, skip_batches: int = 0, use_stateful_dataloader: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(dataset, **kwargs)
        self.base_dataloader = (self._base if self.use_stateful_dataloader else DataLoader)(dataset, **kwargs)
        self.skip_batches = _batches_to_skip(skip_batches)
        self.gradient_state = GradientState()
        self.end_of_dataloader = False
        self.remainder = -1

    def __iter__(self) -> Iterator[Any]:
        self.end_of_dataloader, self.remainder = False, -1
        self.gradient_state._add_dataloader(self)
        try:
            yield from itertools.islice(iter(self.base_dataloader), self.skip_batches, None)
        finally:
            self.gradient_state._remove_dataloader(self)

    def __len__(self) -> int:
        return len(self.base_dataloader) - self.skip_batches


class DataLoaderShard(_PreparedLoaderMixin, DataLoader):
    """A DataLoader yielding this process's batches on `device` (see the module docstring)."""

    def __init__(self, dataset: Any, device: torch.device | None = None, rng_types: list | None = None,
                 synchronized_generator: torch.Generator | None = None, skip_batches: int = 0,
                 non_blocking: bool = False, drop_last_of_source: bool = False,
                 use_stateful_dataloader: bool = False, _drop_last: bool | None = None,
                 _non_blocking: bool | None = None, torch_device_mesh: Any = None, iteration: int = 0,
                 **kwargs: Any) -> None:
        self._base.__init__(self, dataset, **kwargs)
        # `_drop_last`, `_non_blocking`: Accelerate's names of the two flags (code that builds the class itself
        # passes them); `torch_device_mesh` changes nothing here, as in Accelerate.
        self._init_prepared(device, _pick(_non_blocking, non_blocking), _pick(_drop_last, drop_last_of_source))
        self.iteration = iteration
        # At each epoch's start every process takes process 0's state of these RNGs ("generator": the
        # sampler's generator when the user gave it; one nbaccel created is agreed once, at prepare).
        self.rng_types = [str(r) for r in rng_types or [] if synchronized_generator is not None or str(r) != "generator"]
        self.synchronized_generator = synchronized_generator
        self.skip_batches = skip_batches
        self._epoch_generator_state: torch.Tensor | None = None

    @property
    def total_batch_size(self) -> int | None:
        """Samples per step: the batch size with `split_batches`, else the batch size times the processes
        (Accelerate's rule: read from the batch sampler)."""
        batch_sampler = self.sampler if isinstance(self.sampler, BatchSampler) else self.batch_sampler
        size = getattr(batch_sampler, "batch_size", None)
        if size is None or getattr(batch_sampler, "split_batches", False):
            return size
        return size * getattr(batch_sampler, "num_processes", 1)

    @property
    def total_dataset_length(self) -> int:
        return getattr(self.dataset, "total_length", None) or len(self.dataset)

    def _starting_remainder(self) -> int:
        shard = self.dataset
        if isinstance(shard, IterableDatasetShard) and not self._drop_last:
            # Deliberate difference (docs/compat.md): Accelerate divides the shard's padded length by the
            # per-process batch size, which gives 0, and gather_for_metrics then keeps the repeated samples.
            # The real remainder is the stream's length modulo the samples of one step over all processes.
            group = shard.batch_size if shard.split_batches else shard.batch_size * shard.num_processes
            return len(shard.dataset) % group if _has_length(shard.dataset) and group else -1
        return super()._starting_remainder()

    def __iter__(self) -> Iterator[Any]:
        if self.rng_types:
            synchronize_rng_states(self.rng_types, self.synchronized_generator)
        self.begin()
        self.set_epoch(self.iteration)
        resume_skip, resuming = self._take_resume()
        skip = self.skip_batches + resume_skip
        self._batches_yielded = skip  # the epoch's position, for state_dict
        if self.synchronized_generator is not None and not resuming:
            self._epoch_generator_state = self.synchronized_generator.get_state()
        move, device, non_blocking = self._move, self.device, self.non_blocking
        run_step = _xla_step_runner(device)
        try:
            batches = self._open_pass(skip, resuming)
            # Look one batch ahead, so end_of_dataloader is already True while the last batch is used.
            current = next(batches, _END)
            while current is not _END:
                self._note_position()
                if move:
                    current = send_to_device(current, device, non_blocking=non_blocking)
                upcoming = next(batches, _END)
                if upcoming is _END:
                    self.end_of_dataloader = True
                    self._note_position()  # the pass is finished: restored, the next pass is a whole one
                self._batches_yielded += 1
                yield current
                if run_step is not None:
                    run_step()  # the step done with `current` executes now
                current = upcoming
            self.end_of_dataloader = True
            self.iteration += 1
            self._batches_yielded = 0
            # The epoch is over: a checkpoint taken now must give the next epoch's order.
            if self.synchronized_generator is not None:
                self._epoch_generator_state = self.synchronized_generator.get_state()
            self._epoch_rng_state = None
        finally:
            self.end()

    def __len__(self) -> int:
        return self._skipped_length(DataLoader.__len__(self))

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch of the next pass, and tell it (as Accelerate does) to the batch sampler, the sampler
        (seedable samplers), the sampler behind a sharded batch sampler, or else the dataset."""
        self.iteration = epoch
        batch_sampler = self.batch_sampler
        if hasattr(batch_sampler, "set_epoch"):
            batch_sampler.set_epoch(epoch)
        if hasattr(getattr(batch_sampler, "sampler", None), "set_epoch"):
            batch_sampler.sampler.set_epoch(epoch)
        inner = getattr(batch_sampler, "batch_sampler", None)
        if hasattr(getattr(inner, "sampler", None), "set_epoch"):
            if inner.sampler is not getattr(batch_sampler, "sampler", None):
                inner.sampler.set_epoch(epoch)
        elif hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def get_sampler(self) -> Sampler | None:
        return get_sampler(self)

    def state_dict(self) -> dict[str, Any]:
        """Where this loader is: epoch, batches yielded in it, the shuffling generator at the epoch's start
        (after a complete pass: at the next epoch's start), torch's RNG when an unfinished epoch began."""
        state = self._state()
        holder = self._position_holder()
        generator_state = holder._epoch_generator_state
        if holder._pass_done() and self.synchronized_generator is not None:  # the next epoch's start
            generator_state = self.synchronized_generator.get_state()
        if generator_state is not None:
            state["generator_state"] = generator_state.clone()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at `state`: the next iteration repeats the epoch's order and skips the batches yielded."""
        self._load_state(state)
        generator_state = state.get("generator_state")
        if generator_state is not None and self.synchronized_generator is not None:
            self.synchronized_generator.set_state(generator_state)
            self._epoch_generator_state = generator_state


class DataLoaderDispatcher(_PreparedLoaderMixin, DataLoader):
    """A DataLoader where process 0 reads the data and sends each process its share (`dispatch_batches`).

    As Accelerate's: process 0 reads one batch (`split_batches`) or one batch per process, the group is
    broadcast and every process takes its equal slice. A last group that does not divide evenly is completed
    with the first samples of the epoch (unless `drop_last`), and `remainder` then says how many samples were
    real. Per step: one object broadcast of the group's structure and shapes, then one broadcast per tensor.
    """

    def __init__(self, dataset: Any, split_batches: bool = False, skip_batches: int = 0,
                 device: torch.device | None = None, non_blocking: bool = False, drop_last_of_source: bool = False,
                 slice_fn: Any = None, use_stateful_dataloader: bool = False, _drop_last: bool | None = None,
                 _non_blocking: bool | None = None, torch_device_mesh: Any = None, iteration: int = 0,
                 **kwargs: Any) -> None:
        if torch_device_mesh is not None:
            raise ValueError("torch_device_mesh (tensor parallel dispatching) is not supported by nbaccel.")
        self._base.__init__(self, dataset, **kwargs)
        self._init_prepared(device, _pick(_non_blocking, non_blocking), _pick(_drop_last, drop_last_of_source))
        self.iteration = iteration
        state = PartialState()
        self.num_processes = state.num_processes
        self.process_index = state.process_index
        self.split_batches = split_batches
        self.skip_batches = skip_batches
        self.slice_fn = slice_fn or slice_tensors
        self._comm_device = state.device if dist.is_initialized() and dist.get_backend() == "nccl" else "cpu"

    @property
    def total_batch_size(self) -> int | None:
        size = self.batch_size if self.batch_size is not None else getattr(self.batch_sampler, "batch_size", None)
        if size is None:
            return None
        return size if self.split_batches else size * self.num_processes

    @property
    def total_dataset_length(self) -> int:
        return len(self.dataset)

    def _starting_remainder(self) -> int:
        return -1  # as Accelerate: only known once the last group is read

    def _read_group(self, iterator: Iterator[Any]) -> Any:
        """On process 0: the next group (one batch per process, concatenated; one batch with split_batches),
        or None at the end. A partial group at the end is kept, unless `drop_last`."""
        wanted = 1 if self.split_batches else self.num_processes
        batches = list(itertools.islice(iterator, wanted))
        if not batches or (len(batches) < wanted and self._drop_last):
            return None
        for batch in batches:
            _check_batch_dimension(batch)
            if self.num_processes > 1:
                _check_dispatchable(batch)
        return _concatenate(batches)

    def __iter__(self) -> Iterator[Any]:
        self.begin()
        self.set_epoch(self.iteration)
        resume_skip, resuming = self._take_resume()
        skip = self.skip_batches + resume_skip
        self._batches_yielded = skip  # the epoch's position, for state_dict
        run_step = _xla_step_runner(self.device)
        n, me = self.num_processes, self.process_index
        try:
            # Every process starts a pass (as Accelerate: the DataLoader draws its base seed everywhere); only
            # process 0 reads from it.
            iterator = self._open_pass(0, resuming)
            start = None  # the first samples of the epoch, to complete the last group
            current = self._fetch(iterator)
            index = 0
            while current is not None:
                self._note_position()
                upcoming = self._fetch(iterator)
                if start is None and not self._drop_last:
                    start = self.slice_fn(current, slice(0, n), process_index=me, num_processes=n)
                observed = _batch_length(current)
                per = observed // n
                if upcoming is None:
                    if not self._drop_last and observed % n:
                        current, per = _concatenate([current, start]), per + 1
                    self.end_of_dataloader = True
                    self._note_position()
                    self.remainder = observed
                share = self.slice_fn(current, slice(me * per, (me + 1) * per), process_index=me, num_processes=n)
                if self._move:
                    share = send_to_device(share, self.device, non_blocking=self.non_blocking)
                if index >= skip:
                    self._batches_yielded += 1
                    yield share
                    if run_step is not None:
                        run_step()
                index += 1
                current = upcoming
            self.iteration += 1
            self._batches_yielded = 0
            self._epoch_rng_state = None
        finally:
            self.end()

    def _fetch(self, iterator: Iterator[Any]) -> Any:
        """Every process: the next whole group, broadcast from process 0, or None at the end of the data.

        When process 0 cannot make the group (a batch it may not dispatch, an error of the dataset), it tells
        the others before raising, so they raise too instead of waiting for the group forever."""
        if self.process_index == 0:
            try:
                group = self._read_group(iterator)
                meta = [None if group is None else _describe(group)]
            except Exception as exc:
                if self.num_processes > 1:
                    broadcast_object_list([_Refused(exc)], from_process=0)
                raise
        else:
            group, meta = None, [None]
        broadcast_object_list(meta, from_process=0)
        if isinstance(meta[0], _Refused):
            raise meta[0].error()
        if meta[0] is None:
            return None
        return _receive(meta[0], group, self._comm_device)

    def set_epoch(self, epoch: int) -> None:
        self.iteration = epoch
        if hasattr(getattr(self.batch_sampler, "sampler", None), "set_epoch"):
            self.batch_sampler.sampler.set_epoch(epoch)
        elif hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def get_sampler(self) -> Sampler | None:
        return get_sampler(self)

    def state_dict(self) -> dict[str, Any]:
        return self._state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._load_state(state)

    def __len__(self) -> int:
        whole = DataLoader.__len__(self)
        if not self.split_batches:
            whole = whole // self.num_processes if self._drop_last else math.ceil(whole / self.num_processes)
        return self._skipped_length(whole)


def _pick(accelerate_name: bool | None, ours: bool) -> bool:
    """A flag given under Accelerate's private name (`_drop_last`, `_non_blocking`) or under nbaccel's."""
    return ours if accelerate_name is None else accelerate_name


def _batch_length(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    if isinstance(batch, Mapping):
        return _batch_length(next(iter(batch.values())))
    if isinstance(batch, (list, tuple)) and batch and not isinstance(batch[0], (str, bytes, int, float)):
        return _batch_length(batch[0])
    return len(batch)


class _Refused:
    """What process 0 broadcasts instead of a group's structure when it could not make the group: its error,
    as text (the exception itself may not pickle)."""

    def __init__(self, exc: Exception) -> None:
        self.type_error = isinstance(exc, TypeError)
        self.text = str(exc) if self.type_error else f"{type(exc).__name__}: {exc}"

    def error(self) -> Exception:
        """The error the other processes raise: process 0's TypeError as it is (a batch it may not dispatch),
        anything else named."""
        if self.type_error:
            return TypeError(self.text)
        return RuntimeError(f"process 0 failed to read the next batch to dispatch: {self.text}")


def _check_batch_dimension(batch: Any) -> None:
    """RuntimeError (Accelerate's type for batches it cannot join) for a 0-dim tensor: a dispatched batch is cut
    along its first dimension, which a sample yielded without batching (batch_size=None) may lack."""
    for path, leaf in iter_leaves(batch, "batch"):
        if isinstance(leaf, torch.Tensor) and leaf.dim() == 0:
            raise RuntimeError(
                f"Dispatched batches are split along their first dimension, but {path} is a 0-dim tensor (a "
                "DataLoader with batch_size=None yields its samples unbatched). Give the DataLoader a batch_size, "
                "or pass `DataLoaderConfiguration(dispatch_batches=False)`."
            )


def _check_dispatchable(batch: Any) -> None:
    """TypeError unless every leaf of `batch` is a tensor: only tensors can be split between the processes
    in step with each other (Accelerate refuses other leaves too, in its concatenation or broadcast)."""
    for path, leaf in iter_leaves(batch, "batch"):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"Dispatched batches can only hold tensors (in lists, tuples and dicts), but {path} is not a "
                f"tensor (type {type(leaf).__name__}): process 0 reads the batches and splits them between the processes, and "
                "only tensors can be split so that each process's part matches its tensors. Keep non-tensor "
                "fields out of the batch (e.g. turn them into tensors in the collate_fn), or pass "
                "`DataLoaderConfiguration(dispatch_batches=False)` so that each process reads its own batches "
                "(the default for an IterableDataset is to dispatch)."
            )


def _concatenate(batches: list) -> Any:
    first = batches[0]
    if len(batches) == 1:
        return first
    if isinstance(first, torch.Tensor):
        return torch.cat(batches, dim=0)
    if isinstance(first, Mapping):
        return type(first)({k: _concatenate([b[k] for b in batches]) for k in first})
    if isinstance(first, (list, tuple)) and first and not isinstance(first[0], (str, bytes, int, float)):
        items = [_concatenate([b[i] for b in batches]) for i in range(len(first))]
        return type(first)(*items) if hasattr(first, "_fields") else type(first)(items)
    return [x for b in batches for x in b]


class _TensorSlot:
    """Where a tensor sits in a batch being broadcast: its shape and dtype."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.shape, self.dtype = tuple(tensor.shape), tensor.dtype


def _describe(batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return _TensorSlot(batch)
    if isinstance(batch, Mapping):
        return type(batch)({k: _describe(v) for k, v in batch.items()})
    if isinstance(batch, (list, tuple)) and any(isinstance(v, (torch.Tensor, Mapping, list, tuple)) for v in batch):
        items = [_describe(v) for v in batch]
        return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)
    return batch


def _receive(meta: Any, batch: Any, device: Any) -> Any:
    """Broadcast every tensor of `batch` from process 0 into fresh tensors described by `meta` elsewhere."""
    if isinstance(meta, _TensorSlot):
        tensor = batch.to(device).contiguous() if batch is not None else torch.empty(
            meta.shape, dtype=meta.dtype, device=device)
        broadcast(tensor, from_process=0)
        return tensor
    if isinstance(meta, Mapping):
        return type(meta)({k: _receive(v, None if batch is None else batch[k], device) for k, v in meta.items()})
    if isinstance(meta, (list, tuple)) and any(isinstance(v, (_TensorSlot, Mapping, list, tuple)) for v in meta):
        items = [_receive(v, None if batch is None else batch[i], device) for i, v in enumerate(meta)]
        return type(meta)(*items) if hasattr(meta, "_fields") else type(meta)(items)
    return meta


# ----------------------------------------------------------------------------------------------- entry points


def prepare_data_loader(
    dataloader: DataLoader,
    device: torch.device | None = None,
    num_processes: int | None = None,
    process_index: int | None = None,
    split_batches: bool = False,
    put_on_device: bool = False,
    rng_types: list | None = None,
    dispatch_batches: bool | None = None,
    even_batches: bool = True,
    slice_fn_for_dispatch: Any = None,
    use_seedable_sampler: bool = False,
    data_seed: int | None = None,
    non_blocking: bool = False,
    use_stateful_dataloader: bool = False,
    torch_device_mesh: Any = None,
) -> DataLoader:
    """Wrap `dataloader` so this process gets its share of every batch (Accelerate's function and arguments)."""
    if not isinstance(dataloader, DataLoader):
        raise TypeError(f"prepare_data_loader expects a torch.utils.data.DataLoader, got {type(dataloader).__name__}.")
    if use_stateful_dataloader:  # the prepared loader is a torchdata StatefulDataLoader (stateful_loaders.py)
        from .stateful_loaders import require_torchdata

        require_torchdata()
    if torch_device_mesh is not None:
        raise ValueError("torch_device_mesh (tensor/context parallel data loading) is not supported by nbaccel.")
    if dispatch_batches is None:
        dispatch_batches = put_on_device and isinstance(dataloader.dataset, IterableDataset)
    if dispatch_batches and not put_on_device:
        raise ValueError("dispatch_batches=True needs put_on_device=True: the batches are sent from process 0 to "
                         "each process's device.")
    state = PartialState()
    num_processes = state.num_processes if num_processes is None else num_processes
    process_index = state.process_index if process_index is None else process_index
    dataset = dataloader.dataset
    iterable = isinstance(dataset, IterableDataset)
    batch_size = dataloader.batch_size
    if split_batches:
        if batch_size is None:
            batch_size = getattr(dataloader.batch_sampler, "batch_size", None)
        if batch_size is None:
            raise _round_multiple_error("A DataLoader", "None (neither the DataLoader nor its batch sampler has a "
                                        "batch_size)", num_processes)
        if batch_size > 1 and batch_size % num_processes != 0:
            raise _round_multiple_error("A DataLoader", batch_size, num_processes)
    place = device if put_on_device else None
    kwargs = _loader_kwargs(dataloader)
    sync = [str(r) for r in rng_types or []]
    sampler = get_sampler(dataloader)
    if isinstance(sampler, RandomSampler) and use_seedable_sampler:
        seed = data_seed if data_seed is not None else _agreed_seed()
        sampler = SeedableRandomSampler(sampler.data_source, replacement=sampler.replacement,
                                        num_samples=sampler._num_samples, generator=sampler.generator,
                                        data_seed=seed)

    if dispatch_batches:
        kwargs.pop("generator", None)
        if iterable:
            kwargs.update(batch_size=dataloader.batch_size, drop_last=dataloader.drop_last)
        elif dataloader.batch_sampler is None:  # batch_size=None: the sampler's items are the batches
            kwargs.update(sampler=dataloader.sampler, batch_size=None)
        else:
            kwargs.update(batch_sampler=dataloader.batch_sampler)
        prepared: DataLoader = DataLoaderDispatcher(
            dataset, split_batches=split_batches, device=place, slice_fn=slice_fn_for_dispatch,
            non_blocking=non_blocking, drop_last_of_source=dataloader.drop_last,
            use_stateful_dataloader=use_stateful_dataloader, **kwargs)
    elif iterable:
        generator = None
        own_shards = None if split_batches else _own_streaming_shards(dataset, num_processes, process_index)
        if own_shards is not None:
            dataset = own_shards
        elif num_processes > 1:
            dataset = IterableDatasetShard(dataset, batch_size=dataloader.batch_size, drop_last=dataloader.drop_last,
                                           num_processes=num_processes, process_index=process_index,
                                           split_batches=split_batches)
            generator = getattr(dataloader.dataset, "generator", None)
        per_process = dataloader.batch_size // num_processes if split_batches else dataloader.batch_size
        prepared = DataLoaderShard(dataset, device=place, rng_types=sync, synchronized_generator=generator,
                                   batch_size=per_process, drop_last=dataloader.drop_last,
                                   non_blocking=non_blocking, drop_last_of_source=dataloader.drop_last,
                                   use_stateful_dataloader=use_stateful_dataloader, **kwargs)
    else:
        batch_sampler = dataloader.sampler if isinstance(dataloader.sampler, BatchSampler) else dataloader.batch_sampler
        generator = None
        if num_processes > 1:
            if not use_seedable_sampler and hasattr(sampler, "generator"):
                if sampler.generator is None:
                    # A generator of the sampler's own, seeded alike everywhere (process 0's draw from torch's
                    # global RNG, as Accelerate draws it), draws the same order on every process.
                    sampler.generator = torch.Generator()
                    sampler.generator.manual_seed(_agreed_random_seed())
                    sync = [r for r in sync if r != "generator"]  # agreed once here, not at every epoch
                generator = sampler.generator
            batch_sampler = BatchSamplerShard(batch_sampler, num_processes, process_index,
                                              split_batches=split_batches, even_batches=even_batches)
        if isinstance(dataloader.sampler, BatchSampler):
            loader_args = dict(sampler=batch_sampler, batch_size=dataloader.batch_size)
        elif batch_sampler is None:
            # batch_size=None: no automatic batching, each sample is a batch (as in the user's DataLoader and in
            # Accelerate; without batch_size=None here the DataLoader's default would wrap it in a batch of 1).
            loader_args = dict(sampler=dataloader.sampler, batch_size=None)
        else:
            loader_args = dict(batch_sampler=batch_sampler)
        prepared = DataLoaderShard(dataset, device=place, rng_types=sync, synchronized_generator=generator,
                                   non_blocking=non_blocking, drop_last_of_source=dataloader.drop_last,
                                   use_stateful_dataloader=use_stateful_dataloader, **loader_args, **kwargs)
    if isinstance(sampler, SeedableRandomSampler):
        prepared.set_sampler(sampler)
    return prepared


def _own_streaming_shards(dataset: Any, num_processes: int, process_index: int) -> Any:
    """This process's shards of a Hugging Face `datasets.IterableDataset` (streaming) that has at least one per
    process, as Accelerate gives them: each process then reads only its own files, rather than the whole stream
    to keep every n-th batch. None for any other dataset (or one process)."""
    streaming = getattr(sys.modules.get("datasets"), "IterableDataset", None)  # imported if the dataset is one
    if num_processes < 2 or streaming is None or not isinstance(dataset, streaming):
        return None
    if dataset.n_shards < num_processes:
        return None
    return dataset.shard(num_shards=num_processes, index=process_index)


def _has_length(obj: Any) -> bool:
    try:
        len(obj)
    except TypeError:
        return False
    return True


def _agreed_random_seed() -> int:
    """A fresh random seed drawn by process 0 (from torch's global RNG) and broadcast once."""
    seed = [int(torch.empty((), dtype=torch.int64).random_().item())]
    broadcast_object_list(seed, from_process=0)
    return int(seed[0])


def _agreed_seed() -> int:
    """The seed of a seedable sampler without `data_seed`: torch's initial seed, process 0's (Accelerate takes
    each process's own, the same after `set_seed`)."""
    seed = [torch.random.initial_seed()]
    broadcast_object_list(seed, from_process=0)
    return int(seed[0])


def skip_first_batches(dataloader: DataLoader, num_batches: int = 0) -> DataLoader:
    """A loader over the same data that leaves out the first `num_batches` batches (for resuming mid-epoch).

    As in Accelerate, `num_batches` counts from the start of the epoch, and `len()` of the copy is the batches
    left. On a prepared loader with a position restored by `load_state` that no pass has used yet, the skip
    replaces that position (no double skip): the copy runs the restored epoch, and the loader itself then runs
    the next epoch.
    """
    num_batches = _batches_to_skip(num_batches)
    if isinstance(dataloader, (DataLoaderDispatcher, DataLoaderShard)):
        new = _copy_loader(dataloader)
        new.skip_batches = num_batches
        dataloader._hand_over_resume(new)
        return new
    if not isinstance(dataloader, DataLoader):
        raise TypeError(f"skip_first_batches expects a DataLoader, got {type(dataloader).__name__}.")
    kwargs = _loader_kwargs(dataloader)
    if isinstance(dataloader.dataset, IterableDataset):
        return SkipDataLoader(dataloader.dataset, skip_batches=num_batches, batch_size=dataloader.batch_size,
                              drop_last=dataloader.drop_last,
                              use_stateful_dataloader=getattr(dataloader, "use_stateful_dataloader", False), **kwargs)
    if dataloader.batch_sampler is None:
        # batch_size=None: the sampler's items are the batches (indices, or index lists of a BatchSampler passed
        # as `sampler`). Skipping them keeps the DataLoader's own batches; Accelerate's copy fails on the first
        # (no batch sampler) or collates a BatchSampler's samples into a list of tensors.
        return DataLoader(dataloader.dataset, sampler=SkipBatchSampler(dataloader.sampler, num_batches),
                          batch_size=None, **kwargs)
    return DataLoader(dataloader.dataset, batch_sampler=SkipBatchSampler(dataloader.batch_sampler, num_batches),
                      **kwargs)


def _batches_to_skip(num_batches: Any) -> int:
    """`num_batches` as a whole count. Accelerate skips while a batch's index is below it, so a float such as
    2.5 (a resume step divided by the accumulation steps) skips 3 batches; here too, as an int from the start."""
    whole = whole_number(num_batches)
    if whole is None and isinstance(num_batches, float) and math.isfinite(num_batches):
        whole = math.ceil(num_batches)
    if whole is None:
        raise TypeError(f"num_batches must be a number of batches, got {num_batches!r}.")
    if whole < 0:
        raise ValueError(f"num_batches must be >= 0, got {num_batches}.")
    return whole


def _copy_loader(loader: DataLoader) -> DataLoader:
    """A shallow copy of a prepared loader with its own position (DataLoader forbids re-setting some fields)."""
    new = loader.__class__.__new__(loader.__class__)
    new.__dict__.update(loader.__dict__)
    new.__dict__["_DataLoader__initialized"] = True
    new._iterator = None
    new._batches_yielded = 0
    if getattr(new, "use_stateful_dataloader", False):
        # Its own position, taken when it is iterated (or asked for its state_dict): Accelerate's copy is a plain
        # DataLoaderShard, which draws nothing from torch's RNG until iterated, so neither does this one.
        new._initial_iter_for_state_dict = False
        new._position = None
    return new


# ----------------------------------------------------------------------------------------- Accelerate's names
DataLoaderStateMixin = _PreparedLoaderMixin
"""Accelerate's name for what prepared loaders share: `end_of_dataloader`, `remainder`, `reset()`, and
`begin()` / `end()` that register the loader with `self.gradient_state` (a `GradientState` the class creates)."""


def get_sampler(dataloader: DataLoader) -> Sampler | None:
    """The index sampler of `dataloader`: found through its batch sampler (or through `sampler` when that is a
    `BatchSampler`); None when there is no batch sampler (`batch_size=None`)."""
    source = dataloader.sampler if isinstance(dataloader.sampler, BatchSampler) else dataloader.batch_sampler
    return getattr(source, "sampler", None)


class DataLoaderAdapter:
    """A `DataLoader` (a torchdata `StatefulDataLoader` with `use_stateful_dataloader=True`) built from the same
    arguments and wrapped: attributes, `len`, iteration and `state_dict` go to it, and `isinstance(adapter,
    DataLoader)` holds, so code expecting a DataLoader accepts the adapter.
    """

    def __init__(self, dataset: Any, use_stateful_dataloader: bool = False, batch_sampler: Any = None,
                 **kwargs: Any) -> None:
        from .utils.imports import is_torchdata_stateful_dataloader_available

        self.use_stateful_dataloader = use_stateful_dataloader
        if use_stateful_dataloader:
            if not is_torchdata_stateful_dataloader_available():
                raise ImportError("use_stateful_dataloader=True needs torchdata's StatefulDataLoader: "
                                  "pip install 'torchdata>=0.8.0'.")
            from torchdata.stateful_dataloader import StatefulDataLoader

            self.base_dataloader = StatefulDataLoader(dataset, batch_sampler=batch_sampler, **kwargs)
        else:
            self.base_dataloader = DataLoader(dataset, batch_sampler=batch_sampler, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name == "base_dataloader":  # not set yet (e.g. during unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.base_dataloader, name)

    @property
    def __class__(self) -> type:  # isinstance(adapter, DataLoader) is True, as in Accelerate
        return self.base_dataloader.__class__

    def __len__(self) -> int:
        return len(self.base_dataloader)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.base_dataloader)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped loader's position (only a `StatefulDataLoader` has one)."""
        if not hasattr(self.base_dataloader, "state_dict"):
            raise AttributeError("a plain DataLoader has no state_dict: build the adapter with "
                                 "use_stateful_dataloader=True to save and restore its position.")
        return self.base_dataloader.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.base_dataloader.load_state_dict(state_dict)


def _xla_step_runner(device: Any) -> Callable[[], None] | None:
    """On an XLA device, what runs the recorded step when the next batch is asked for; None elsewhere."""
    return _xla.run_pending_graph if _xla.is_xla_device(device) else None
