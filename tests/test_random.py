"""set_seed and synchronize_rng_state(s): determinism in one process, equal generators across 2 ranks."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from ranks_helper import run_ranks

from nbaccel.utils import RNGType, set_seed, synchronize_rng_state, synchronize_rng_states


def _draw() -> tuple:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_set_seed_makes_every_library_repeat():
    set_seed(1234)
    first = _draw()
    set_seed(1234)
    assert _draw() == first
    set_seed(4321)
    assert _draw() != first


def test_set_seed_accepts_numpy_ints_and_large_seeds():
    set_seed(np.int64(7))
    first = _draw()
    set_seed(7)
    assert _draw() == first
    set_seed(2**40)  # numpy only takes 32-bit seeds: reduced, not an error


def test_set_seed_deterministic_turns_on_deterministic_algorithms():
    assert not torch.are_deterministic_algorithms_enabled()
    try:
        set_seed(0, deterministic=True)
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("seed", ["1", 1.5, True, None])
def test_set_seed_rejects_non_integers(seed):
    with pytest.raises(TypeError, match="needs an int"):
        set_seed(seed)


def test_synchronize_in_one_process_keeps_the_state():
    torch.manual_seed(5)
    before = torch.get_rng_state()
    synchronize_rng_state()  # None means the torch generator
    synchronize_rng_states(["torch"])
    assert torch.equal(torch.get_rng_state(), before)
    generator = torch.Generator().manual_seed(3)
    expected = generator.get_state()
    synchronize_rng_state(RNGType.GENERATOR, generator)
    assert torch.equal(generator.get_state(), expected)


def test_synchronize_bad_input():
    with pytest.raises(ValueError, match=r"unknown rng_type 'numpy'.*'torch', 'cuda'"):
        synchronize_rng_states(["torch", "numpy"])
    with pytest.raises(ValueError, match="needs the `generator`"):
        synchronize_rng_state("generator")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            synchronize_rng_state("cuda")
    with pytest.raises(ValueError, match="torch_xla is not installed"):
        synchronize_rng_state("xla")


def _ranks_random(rank: int) -> dict:
    import torch

    from nbaccel.state import PartialState
    from nbaccel.utils import set_seed, synchronize_rng_states

    PartialState()
    set_seed(100, device_specific=True)
    specific = torch.rand(2).tolist()
    torch.manual_seed(rank)  # different on each rank...
    generator = torch.Generator().manual_seed(10 + rank)
    before = (torch.rand(2).tolist(), torch.rand(2, generator=generator).tolist())
    synchronize_rng_states(["torch", "generator"], generator)  # ...until rank 0's states are broadcast
    after = (torch.rand(2).tolist(), torch.rand(2, generator=generator).tolist())
    return {"specific": specific, "before": before, "after": after}


def test_synchronize_rng_states_makes_ranks_equal_and_device_specific_seeds_differ():
    first, second = run_ranks(_ranks_random)
    assert first["before"] != second["before"]
    assert first["after"] == second["after"]
    assert first["specific"] != second["specific"]
    set_seed(101)  # seed + process index 1
    assert torch.rand(2).tolist() == second["specific"]
