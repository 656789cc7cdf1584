"""Tensor parallelism through nbaccel.sharding on 2 CPU ranks (gloo): same outputs as the unsharded module."""

from __future__ import annotations

import copy

import pytest
import torch
from ranks_helper import run_ranks
from torch import nn


class MLP(nn.Module):
    def __init__(self, d: int = 16):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Stack(nn.Module):
    def __init__(self, d: int = 16, n: int = 2):
        super().__init__()
        self.layers = nn.ModuleList(MLP(d) for _ in range(n))
        self.out = nn.Linear(d, 3)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def _scenario(rank: int):
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from nbaccel import sharding

    torch.manual_seed(0)
    base = Stack()
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    reference = base(x)
    reference.sum().backward()
    ref_grad = base.layers[0].up.weight.grad.clone()

    plan = sharding.default_tp_plan(base)
    assert set(plan) == {"layers.0.up", "layers.0.down", "layers.1.up", "layers.1.down"}
    assert isinstance(plan["layers.0.up"], ColwiseParallel) and isinstance(plan["layers.0.down"], RowwiseParallel)

    base.zero_grad(set_to_none=True)
    model = sharding.prepare_tensor_parallel(copy.deepcopy(base), tp_size=2, device="cpu")
    weight = model.layers[0].up.weight
    assert isinstance(weight, DTensor) and weight.to_local().shape == (32, 16)
    model.zero_grad(set_to_none=True)
    out = model(x)
    out.sum().backward()
    grad = model.layers[0].up.weight.grad.full_tensor()
    # gradient clipping over DTensor shards mixed with plain replicated parameters (norm, out)
    base(x).sum().backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(base.parameters(), 0.1)
    norm = sharding.clip_grad_norm_(model.parameters(), 0.1)
    clipped = model.layers[0].up.weight.grad.full_tensor()
    clip_diff = max(abs(float(norm) - float(ref_norm)),
                    (clipped - base.layers[0].up.weight.grad).abs().max().item(),
                    (model.out.weight.grad - base.out.weight.grad).abs().max().item())
    # the same through a ParallelismConfig mesh, with the states reporting the ranks
    from nbaccel import ParallelismConfig
    from nbaccel.state import AcceleratorState

    config = ParallelismConfig(tp_size=2)
    mesh = config.get_device_mesh("cpu")
    meshed = sharding.prepare_tensor_parallel(copy.deepcopy(base), mesh=mesh, device="cpu")
    mesh_diff = (meshed(x) - reference).abs().max().item()
    state = AcceleratorState(parallelism_config=config, _from_accelerator=True)  # what Accelerator() does
    state.device_mesh = mesh
    ranks = (state.tensor_parallel_rank, state.data_parallel_rank, state.data_parallel_shard_rank)

    errors = []
    for bad in (lambda: sharding.prepare_tensor_parallel(copy.deepcopy(base), tp_size=3),
                lambda: sharding.prepare_tensor_parallel(nn.Sequential(nn.LayerNorm(4)), tp_size=2)):
        try:
            bad()
            errors.append(None)
        except ValueError as error:
            errors.append(str(error))
    return {"out_diff": (out - reference).abs().max().item(), "grad_diff": (grad - ref_grad).abs().max().item(),
            "mesh_diff": mesh_diff, "clip_diff": clip_diff, "ranks": ranks, "errors": errors}


def test_tensor_parallel_matches_unsharded():
    for rank, result in enumerate(run_ranks(_scenario, world_size=2, init=True, timeout=120)):
        assert result["out_diff"] < 1e-5 and result["grad_diff"] < 1e-5 and result["mesh_diff"] < 1e-5
        assert result["ranks"] == (rank, 0, 0)
        assert result["clip_diff"] < 1e-5
        divide, no_plan = result["errors"]
        assert divide and "tp_size=3 must divide the number of processes (2)" in divide
        assert no_plan and "no plan for this model" in no_plan


def test_parallelism_config_validation():
    from nbaccel import ParallelismConfig

    config = ParallelismConfig(dp_shard_size=2, tp_size=2)
    assert config.total_size == 4 and config.active_mesh_dims == ["dp_shard", "tp"] and config.tp_enabled
    assert config.fsdp_dim_names == ["dp_shard_cp"] and config.data_parallel_size == 2
    with pytest.raises(ValueError, match="tp_size must be an integer >= 1"):
        ParallelismConfig(tp_size=0)
    with pytest.raises(ValueError, match="pure data parallelism"):
        ParallelismConfig(dp_replicate_size=2, tp_size=2)
    # a context-parallel config can be built and inspected (as with Accelerate); an Accelerator refuses it
    config = ParallelismConfig(cp_size=2)
    assert config.cp_enabled and config.total_size == 2 and config.active_mesh_dims == ["cp"]
    accelerate = pytest.importorskip("accelerate")
    theirs = accelerate.ParallelismConfig(cp_size=2)
    assert (type(config.cp_handler).__name__, config.cp_handler.cp_comm_strategy) == (
        type(theirs.cp_handler).__name__, theirs.cp_handler.cp_comm_strategy)
    for library in (accelerate.utils, __import__("nbaccel").utils):
        with pytest.raises(ValueError, match="Invalid cp_comm_strategy: ring"):
            library.TorchContextParallelConfig(cp_comm_strategy="ring")
    from nbaccel import Accelerator

    with pytest.raises(NotImplementedError, match="context/sequence parallelism"):
        Accelerator(cpu=True, parallelism_config=config)


def test_tensor_parallel_needs_process_group():
    from nbaccel import sharding

    with pytest.raises(RuntimeError, match="torch.distributed to be initialized"):
        sharding.prepare_tensor_parallel(Stack(), tp_size=2)


def test_parallelism_config_smaller_than_the_world_is_refused_before_torch_builds_a_partial_mesh(monkeypatch):
    """torch builds a mesh over fewer processes than exist without a word; the config refuses that first."""
    import torch.distributed as dist

    from nbaccel import ParallelismConfig

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda *args, **kwargs: 4)
    with pytest.raises(ValueError, match=r"multiply to 2 .* but there are 4 processes"):
        ParallelismConfig(tp_size=2).build_device_mesh("cpu")
