"""nbaccel.utils.memory: OOM detection, batch-size search, releasing memory."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from nbaccel.utils.memory import (
    clear_device_cache,
    find_executable_batch_size,
    release_memory,
    should_reduce_batch_size,
)


@pytest.fixture(autouse=True)
def gc_calls(monkeypatch):
    """Count gc.collect calls instead of running them (a full collection takes ~0.5 s on a loaded 2-core box)."""
    calls = []
    monkeypatch.setattr("nbaccel.utils.memory.gc.collect", lambda *a: calls.append(a) or 0)
    return calls


CUDA_OOM = "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 15.78 GiB total capacity)"


@pytest.mark.parametrize(
    "message",
    [
        CUDA_OOM,
        "HIP out of memory. Tried to allocate 20.00 MiB",
        "XPU out of memory. Tried to allocate 1.00 GiB",
        "NPU out of memory. Tried to allocate 512.00 MiB",
        "MPS backend out of memory (MPS allocated: 1.2 GB)",
        "[enforce fail at alloc_cpu.cpp:114] data. DefaultCPUAllocator: can't allocate memory: you tried to "
        "allocate 8000000000000 bytes.",
        "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous input.",
    ],
)
def test_out_of_memory_messages_are_recognised(message):
    assert should_reduce_batch_size(RuntimeError(message))


def test_other_errors_are_not_out_of_memory():
    assert not should_reduce_batch_size(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not should_reduce_batch_size(ValueError(CUDA_OOM))  # only RuntimeError-family messages count
    assert should_reduce_batch_size(MemoryError())
    assert should_reduce_batch_size(torch.OutOfMemoryError("CUDA out of memory."))


def test_real_cpu_allocation_failure_is_recognised():
    try:
        torch.empty(2**62, dtype=torch.uint8)
    except RuntimeError as error:  # the CPU allocator's own message
        assert should_reduce_batch_size(error), str(error)
    else:  # pragma: no cover - a machine with 4 EiB of memory
        pytest.skip("allocation unexpectedly succeeded")


def test_batch_size_is_halved_until_it_fits_with_reduce_fn(gc_calls):
    calls = []
    size = {"value": 64}

    def halve() -> int:
        size["value"] //= 2
        return size["value"]

    @find_executable_batch_size(starting_batch_size=64, reduce_batch_size_fn=halve)
    def train(batch_size, scale, *, offset=0):
        calls.append(batch_size)
        if batch_size > 8:
            raise RuntimeError(CUDA_OOM)
        return batch_size * scale + offset

    assert train(10, offset=1) == 81
    assert calls == [64, 32, 16, 8]
    assert len(gc_calls) == 4  # once before the first try, once after each out-of-memory error


def test_default_reduction_is_accelerate_factor():
    calls = []

    @find_executable_batch_size(starting_batch_size=100)
    def train(batch_size):
        calls.append(batch_size)
        if batch_size > 75:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes")
        return batch_size

    assert train() == 72
    assert calls == [100, 90, 81, 72]


def test_reaching_zero_raises_clear_error():
    @find_executable_batch_size(starting_batch_size=4)
    def train(batch_size):
        raise RuntimeError(CUDA_OOM)

    with pytest.raises(RuntimeError, match=r"No executable batch size found, reached zero: `train` ran out of memory "
                                           r"with each of \[4, 3, 2, 1\]"):
        train()


def test_starting_at_zero_fails_when_called_as_in_accelerate():
    import accelerate.utils

    for decorate in (accelerate.utils.find_executable_batch_size, find_executable_batch_size):
        @decorate(starting_batch_size=0)
        def train(batch_size):
            return batch_size

        with pytest.raises(RuntimeError, match="No executable batch size found, reached zero"):
            train()


def test_other_exceptions_propagate_without_retry():
    calls = []

    @find_executable_batch_size(starting_batch_size=16)
    def train(batch_size):
        calls.append(batch_size)
        raise KeyError("boom")

    with pytest.raises(KeyError):
        train()
    assert calls == [16]


def test_passing_the_batch_size_is_an_error():
    @find_executable_batch_size(starting_batch_size=16)
    def train(batch_size, model):
        return batch_size

    with pytest.raises(TypeError, match="supplies it: call `train\\(model='m'\\)`"):
        train(16, "m")
    with pytest.raises(TypeError, match="`batch_size` was passed to `train`"):
        train(batch_size=16, model="m")
    assert train("m") == 16


def test_bare_decorator_uses_default_start():
    @find_executable_batch_size
    def train(batch_size):
        return batch_size

    assert train() == 128


def test_bad_starting_batch_size():
    with pytest.raises(ValueError, match="starting_batch_size"):
        find_executable_batch_size(lambda b: b, starting_batch_size=-1)


def test_release_memory_returns_nones_and_frees():
    a, b = torch.ones(10), torch.zeros(3)
    ref = weakref.ref(a)
    a, b = release_memory(a, b)
    gc.collect()
    assert (a, b) == (None, None)
    assert ref() is None
    assert release_memory() == []


def test_clear_device_cache_runs_on_cpu():
    clear_device_cache()
    clear_device_cache(garbage_collection=True)
