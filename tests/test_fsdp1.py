"""FSDP1 (torch's FullyShardedDataParallel, Accelerate's default fsdp_version=1) through the Accelerator on 2 CPU
ranks (gloo): DDP's weights for each setting, exact resume through save_state/load_state, merged checkpoints."""

from __future__ import annotations

import os

import pytest
import torch
from ranks_helper import run_ranks
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int = 16):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Tiny(nn.Module):
    def __init__(self, d: int = 16, n: int = 3):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def batches(rank: int, steps: int):
    generator = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(8, 16, generator=generator), torch.randn(8, 4, generator=generator)) for _ in range(steps)]


# Each setting trains the same model on the same data; FSDP1 must end with DDP's weights.
SETTINGS = {
    "default": {},
    "shard_grad_op+prefetch": {"sharding_strategy": "SHARD_GRAD_OP", "backward_prefetch": "BACKWARD_PRE",
                               "forward_prefetch": True},
    "no_shard": {"sharding_strategy": "NO_SHARD"},
    # (without an auto-wrap policy torch asks for an explicit device mesh, in Accelerate as here)
    "hybrid_shard": {"sharding_strategy": "HYBRID_SHARD", "auto_wrap_policy": "SIZE_BASED_WRAP",
                     "min_num_params": 1000},
    "hybrid_shard_zero2": {"sharding_strategy": "HYBRID_SHARD_ZERO2", "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                           "transformer_cls_names_to_wrap": ["Block"]},
    "transformer_wrap+orig_params": {"auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                                     "transformer_cls_names_to_wrap": ["Block"], "use_orig_params": True,
                                     "backward_prefetch": "BACKWARD_POST"},
    "size_wrap+sync_module_states": {"auto_wrap_policy": "SIZE_BASED_WRAP", "min_num_params": 1000,
                                     "sync_module_states": True},
    "cpu_offload": {"cpu_offload": True, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                    "transformer_cls_names_to_wrap": ["Block"]},
    "activation_checkpointing": {"auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                                 "transformer_cls_names_to_wrap": ["Block"], "activation_checkpointing": True},
}


def _train(rank: int, settings: dict | None, steps: int = 4, optimizer_first: bool = True):
    """Train Tiny with nbaccel's Accelerator: DDP when `settings` is None, else FSDP1 with those plugin fields.
    Returns (full weights on rank 0, grad norms, the wrapped module types)."""
    from nbaccel import Accelerator
    from nbaccel.state import reset_states
    from nbaccel.utils import FullyShardedDataParallelPlugin

    reset_states()
    torch.manual_seed(0)
    model = Tiny()
    plugin = None if settings is None else FullyShardedDataParallelPlugin(**settings)
    accelerator = Accelerator(fsdp_plugin=plugin)
    if optimizer_first:  # created before prepare and passed together with the model
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, optimizer = accelerator.prepare(model, optimizer)
    else:  # Accelerate's documented FSDP1 order: prepare the model, then build its optimizer
        model = accelerator.prepare(model)
        optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))
    norms = []
    for x, y in batches(rank, steps):
        accelerator.backward(nn.functional.mse_loss(model(x), y))
        norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 0.5)))
        optimizer.step()
        optimizer.zero_grad()
    weights = accelerator.get_state_dict(model)
    kinds = sorted({type(m).__name__ for m in model.modules()})
    return {"weights": {k: v.clone() for k, v in weights.items()}, "norms": norms, "kinds": kinds,
            "distributed_type": str(accelerator.distributed_type)}


def _all_settings(rank: int):
    results = {"ddp": _train(rank, None)}
    for name, settings in SETTINGS.items():
        results[name] = _train(rank, settings)
    results["optimizer_after_prepare"] = _train(rank, {}, optimizer_first=False)
    return results


def test_fsdp1_settings_give_ddp_weights():
    results = run_ranks(_all_settings, timeout=300)
    ddp = results[0]["ddp"]
    assert ddp["distributed_type"] == "MULTI_CPU" and ddp["weights"]
    for name in [*SETTINGS, "optimizer_after_prepare"]:
        got = results[0][name]
        assert got["distributed_type"] == "FSDP", name
        assert "FullyShardedDataParallel" in got["kinds"], (name, got["kinds"])
        assert set(got["weights"]) == set(ddp["weights"]), name
        for key, value in ddp["weights"].items():
            torch.testing.assert_close(got["weights"][key], value, rtol=0, atol=2e-5, msg=f"{name}: {key}")
        assert got["norms"] == pytest.approx(ddp["norms"], rel=1e-4), name
        assert results[1][name]["weights"] == {}, name  # full weights are gathered on rank 0 only
    assert "CheckpointWrapper" in results[0]["activation_checkpointing"]["kinds"]
