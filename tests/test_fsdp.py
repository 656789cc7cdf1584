"""FSDP2 through nbaccel.sharding on 2 CPU ranks (gloo): same training as DDP, sharded resume, full export."""

from __future__ import annotations

import contextlib
import copy

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
        self.register_buffer("temperature", torch.tensor([0.5, 1.0, 1.5, 2.0]), persistent=False)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x) * self.temperature


def make_plugin(**overrides):
    from nbaccel.utils import FullyShardedDataParallelPlugin

    fields = dict(fsdp_version=2, auto_wrap_policy="TRANSFORMER_BASED_WRAP", transformer_cls_names_to_wrap=["Block"],
                  reshard_after_forward=True, cpu_offload=False)
    fields.update(overrides)
    return FullyShardedDataParallelPlugin(**fields)


def batches(rank: int, steps: int):
    generator = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(8, 16, generator=generator), torch.randn(8, 4, generator=generator)) for _ in range(steps)]


def train(model, optimizer, data, clip):
    norms = []
    for x, y in data:
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        norms.append(float(clip(model.parameters())))
        optimizer.step()
    return norms


def _scenario(rank: int, folder: str):
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel

    from nbaccel import sharding

    torch.manual_seed(0)
    base = Tiny()
    data = batches(rank, 6)
    probe = torch.randn(5, 16, generator=torch.Generator().manual_seed(7))

    ddp_model = copy.deepcopy(base)
    ddp = DistributedDataParallel(ddp_model)
    ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    ddp_norms = train(ddp, ddp_opt, data, lambda ps: torch.nn.utils.clip_grad_norm_(list(ps), 0.5))

    model = copy.deepcopy(base)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)  # created before prepare, passed together
    model, optimizer = sharding.prepare_fsdp2_args([model, optimizer], make_plugin(), "no", device="cpu")
    assert sharding.is_sharded(model) and not sharding.is_sharded(Tiny())
    assert isinstance(model, FSDPModule) and isinstance(model.blocks[0], FSDPModule)
    assert isinstance(model.blocks[0].up.weight, DTensor)
    assert model.blocks[0].up.weight.to_local().shape == (32, 16)  # half of (64, 16) on each rank
    clip = lambda ps: sharding.clip_grad_norm_(ps, 0.5)  # noqa: E731
    norms = train(model, optimizer, data[:3], clip)
    sharding.save_sharded_checkpoint(model, optimizer, f"{folder}/sharded")
    norms += train(model, optimizer, data[3:], clip)
    full = sharding.get_full_state_dict(model, cpu_offload=False)
    reference = ddp_model.state_dict()
    diff = max((full[k] - reference[k]).abs().max().item() for k in reference)

    # resume from the sharded checkpoint in a fresh model + optimizer: exactly the same weights
    torch.manual_seed(123)
    fresh = Tiny()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    fresh = sharding.prepare_fsdp2(fresh, [fresh_opt], make_plugin(), device="cpu")
    sharding.load_sharded_checkpoint(fresh, fresh_opt, f"{folder}/sharded")
    train(fresh, fresh_opt, data[3:], clip)
    resumed = sharding.get_full_state_dict(fresh, cpu_offload=False)
    resume_exact = all(torch.equal(resumed[k], full[k]) for k in full)

    # Accelerate's function names and layouts: sharded (default for FSDP2) and full state dicts
    from nbaccel.utils import load_fsdp_model, load_fsdp_optimizer, save_fsdp_model, save_fsdp_optimizer

    for kind in ("SHARDED_STATE_DICT", "FULL_STATE_DICT"):
        plugin = make_plugin(state_dict_type=kind)
        save_fsdp_model(plugin, None, model, f"{folder}/{kind}")
        save_fsdp_optimizer(plugin, None, optimizer, model, f"{folder}/{kind}")
        torch.manual_seed(5)
        other = Tiny()
        other_opt = torch.optim.AdamW(other.parameters(), lr=1e-2)
        other = sharding.prepare_fsdp2(other, [other_opt], make_plugin(), device="cpu")
        other_opt.zero_grad()
        nn.functional.mse_loss(other(data[0][0]), data[0][1]).backward()
        other_opt.step()  # give the optimizer state to overwrite
        load_fsdp_model(plugin, None, other, f"{folder}/{kind}")
        load_fsdp_optimizer(plugin, None, other_opt, other, f"{folder}/{kind}")
        assert all(torch.equal(v, full[k]) for k, v in sharding.get_full_state_dict(other, False).items()), kind
        mine, theirs = optimizer.state_dict()["state"], other_opt.state_dict()["state"]
        assert all(torch.equal(mine[i]["exp_avg"].full_tensor(), theirs[i]["exp_avg"].full_tensor()) for i in mine)

    path = sharding.save_full_model(model, f"{folder}/export")
    with torch.no_grad():
        out = model(probe)

    # cpu_ram_efficient_loading: only rank 0 has the weights; rank 1 builds everything on meta
    from nbaccel import init_empty_weights

    if rank == 0:
        light = copy.deepcopy(base)
    else:
        with init_empty_weights(include_buffers=True):
            light = Tiny()
    light_opt = torch.optim.AdamW(light.parameters(), lr=1e-2)
    light = sharding.prepare_fsdp2(light, [light_opt], make_plugin(cpu_ram_efficient_loading=True), device="cpu")
    train(light, light_opt, data, clip)
    light_full = sharding.get_full_state_dict(light, cpu_offload=False)
    light_diff = max((light_full[k] - reference[k]).abs().max().item() for k in reference)
    light_buffer = light.temperature.tolist()

    errors = []
    stale = torch.optim.SGD(Tiny().parameters(), lr=0.1)
    for bad in (lambda: sharding.prepare_fsdp2(Tiny(), [stale], make_plugin(), device="cpu"),
                lambda: sharding.prepare_fsdp2(model, [torch.optim.SGD(base.parameters(), lr=0.1)], make_plugin()),
                lambda: sharding.prepare_fsdp2_args([Tiny()], make_plugin())):
        try:
            bad()
            errors.append(None)
        except ValueError as error:
            errors.append(str(error))
    from nbaccel.state import AcceleratorState

    state = AcceleratorState(fsdp_plugin=make_plugin(), _from_accelerator=True)  # what Accelerator() does
    return {"light_diff": light_diff, "light_buffer": light_buffer, "distributed_type": state.distributed_type.value, "is_fsdp2": state.is_fsdp2, "diff": diff, "norms": norms, "ddp_norms": ddp_norms, "resume_exact": resume_exact, "path": path,
            "out": out, "errors": errors}


def test_fsdp2_matches_ddp_resumes_and_exports(tmp_path):
    results = run_ranks(lambda rank: _scenario(rank, str(tmp_path)), world_size=2, init=True, timeout=120)
    for result in results:
        assert result["distributed_type"] == "FSDP" and result["is_fsdp2"]
        assert result["light_diff"] < 1e-5 and result["light_buffer"] == [0.5, 1.0, 1.5, 2.0]
        assert result["diff"] < 1e-5, result["diff"]
        assert result["norms"] == pytest.approx(result["ddp_norms"], rel=1e-5)
        assert result["resume_exact"]
    assert results[0]["path"] == str(tmp_path / "export" / "model.safetensors") and results[1]["path"] is None

    from safetensors.torch import load_file

    plain = Tiny()
    plain.load_state_dict(load_file(results[0]["path"]))
    with torch.no_grad():
        expected = plain(torch.randn(5, 16, generator=torch.Generator().manual_seed(7)))
    assert torch.allclose(results[0]["out"], expected, atol=1e-6)

    from nbaccel.utils import merge_fsdp_weights

    merged = merge_fsdp_weights(tmp_path / "SHARDED_STATE_DICT" / "pytorch_model_fsdp_0", tmp_path / "merged")
    merged_state = load_file(merged)
    exported = load_file(results[0]["path"])
    assert merged_state.keys() == exported.keys() and all(torch.equal(merged_state[k], exported[k]) for k in exported)
    assert (tmp_path / "FULL_STATE_DICT" / "pytorch_model_fsdp.bin").exists()
    assert (tmp_path / "FULL_STATE_DICT" / "optimizer.bin").exists()

    stale_other, stale_sharded, alone = results[0]["errors"]
    assert stale_other and "not parameters of the model being prepared" in stale_other and "another model" in stale_other
    assert stale_sharded and "already sharded by an earlier prepare" in stale_sharded
    assert alone and "must be passed together" in alone


def test_fsdp_errors_without_process_group():
    from nbaccel import sharding

    with pytest.raises(RuntimeError, match="torch.distributed to be initialized"):
        sharding.apply_fsdp2(Tiny(), make_plugin())
    with pytest.raises(ValueError, match="must be passed together"):
        sharding.check_fsdp2_prepare_args([torch.optim.SGD(Tiny().parameters(), lr=0.1)])
    from nbaccel.utils import FullyShardedDataParallelPlugin

    fsdp1 = FullyShardedDataParallelPlugin(fsdp_version=1)  # FSDP1 is accepted (nbaccel.fsdp1 wraps the model)
    assert sharding.default_plugins(fsdp1, None) == (fsdp1, None)
    with pytest.raises(ValueError, match="FSDP1 models are wrapped by nbaccel.fsdp1.wrap_fsdp1"):
        sharding.apply_fsdp2(Tiny(), fsdp1)
    with pytest.raises(TypeError, match="torch_tp_plugin must be a TorchTensorParallelPlugin"):
        sharding.default_plugins(None, {"tp_size": 2})


def _accelerator_run(rank: int, folder: str, mode: str):
    from nbaccel import Accelerator, ParallelismConfig
    from nbaccel.utils import FullyShardedDataParallelPlugin

    torch.manual_seed(0)
    model = Tiny()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if mode == "fsdp":
        accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(
            fsdp_version=2, auto_wrap_policy="TRANSFORMER_BASED_WRAP", transformer_cls_names_to_wrap=["Block"]))
    elif mode == "tp":
        accelerator = Accelerator(parallelism_config=ParallelismConfig(tp_size=2))
    else:
        accelerator = Accelerator()
    model, optimizer = accelerator.prepare(model, optimizer)
    # tensor parallel ranks must see the same batch; data parallel ranks different ones
    data = batches(0 if mode == "tp" else rank, 4)
    norms = []
    for x, y in data:
        accelerator.backward(nn.functional.mse_loss(model(x), y))
        norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 0.5)))
        optimizer.step()
        optimizer.zero_grad()
    accelerator.save_model(model, f"{folder}/{mode}")
    extra = None
    if mode == "tp":
        extra = (accelerator.tensor_parallel_rank, accelerator.data_parallel_rank)
    if mode == "fsdp":
        try:  # an optimizer prepared without its model cannot be re-pointed at the shards
            accelerator.prepare(torch.optim.SGD(Tiny().parameters(), lr=0.1))
        except ValueError as error:
            extra = str(error)
    return {"norms": norms, "distributed_type": accelerator.distributed_type.value, "extra": extra}


def test_accelerator_fsdp_and_tensor_parallel(tmp_path):
    """The Accelerator's prepare/backward/clip_grad_norm_/save_model with FSDP2 give DDP's training; tensor
    parallelism through a ParallelismConfig trains and reports its ranks."""
    pytest.importorskip("nbaccel.accelerator")
    pytest.importorskip("nbaccel.checkpointing")
    from safetensors.torch import load_file

    results = {mode: run_ranks(lambda rank, mode=mode: _accelerator_run(rank, str(tmp_path), mode), timeout=120)
               for mode in ("ddp", "fsdp", "tp")}
    assert results["fsdp"][0]["distributed_type"] == "FSDP"
    assert results["fsdp"][0]["extra"] and "passed together" in results["fsdp"][0]["extra"]
    ddp = load_file(tmp_path / "ddp" / "model.safetensors")
    fsdp = load_file(tmp_path / "fsdp" / "model.safetensors")
    assert max((ddp[k] - fsdp[k]).abs().max().item() for k in ddp) < 1e-5
    assert results["fsdp"][0]["norms"] == pytest.approx(results["ddp"][0]["norms"], rel=1e-5)
    assert [r["extra"] for r in results["tp"]] == [(0, 0), (1, 0)]
    assert set(load_file(tmp_path / "tp" / "model.safetensors")) == set(ddp)


def _resume_run(rank: int, folder: str, mode: str, state_dict_type: str, steps: int = 6, save_at: int = 3):
    """Train `steps` steps with the Accelerator and FSDP2: "full" saves a checkpoint after `save_at` steps
    and goes on; "resume" builds everything afresh (other initial weights), loads that checkpoint and trains
    the remaining steps. Returns the final full weights (rank 0) and the checkpoint's file names."""
    import os

    from nbaccel import Accelerator

    torch.manual_seed(0 if mode == "full" else 123)  # the resumed run must not depend on its own init
    model = Tiny()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    accelerator = Accelerator(fsdp_plugin=make_plugin(state_dict_type=state_dict_type))
    model, optimizer = accelerator.prepare(model, optimizer)
    data = batches(rank, steps)
    checkpoint = os.path.join(folder, "checkpoint")
    start = 0
    if mode == "resume":
        from nbaccel.checkpointing import CheckpointFileMissingError

        accelerator.wait_for_everyone()
        if rank == 0:  # a checkpoint without the optimizer shards is refused before the model is touched
            import shutil

            shutil.copytree(checkpoint, checkpoint + "-partial")
            shutil.rmtree(os.path.join(checkpoint + "-partial", "optimizer_0"), ignore_errors=True)  # sharded
            with contextlib.suppress(FileNotFoundError):  # full
                os.remove(os.path.join(checkpoint + "-partial", "optimizer.bin"))
        accelerator.wait_for_everyone()
        before = {k: v.clone() for k, v in accelerator.get_state_dict(model).items()}
        with pytest.raises(CheckpointFileMissingError, match="optimizer"):
            accelerator.load_state(checkpoint + "-partial")
        after = accelerator.get_state_dict(model)
        assert all(torch.equal(before[k], after[k]) for k in before)
        accelerator.load_state(checkpoint)
        start = save_at
    for step in range(start, steps):
        x, y = data[step]
        accelerator.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        if mode == "full" and step + 1 == save_at:
            accelerator.save_state(checkpoint)
    weights = accelerator.get_state_dict(model)
    files = sorted(os.path.relpath(os.path.join(root, name), checkpoint)
                   for root, _, names in os.walk(checkpoint) for name in names)
    return {"weights": {k: v.clone() for k, v in weights.items()}, "files": files}


@pytest.mark.parametrize("state_dict_type", ["SHARDED_STATE_DICT", "FULL_STATE_DICT"])
def test_accelerator_save_state_fsdp_resume_is_exact(tmp_path, state_dict_type):
    """save_state/load_state with FSDP2: SHARDED_STATE_DICT (the default) writes each rank's shard of the model
    and the optimizer through torch.distributed.checkpoint (no single model file); FULL_STATE_DICT one gathered
    file each (Accelerate's names). Either way a resumed run ends with the same weights."""
    pytest.importorskip("nbaccel.accelerator")
    full = run_ranks(lambda rank: _resume_run(rank, str(tmp_path), "full", state_dict_type), timeout=120)
    resumed = run_ranks(lambda rank: _resume_run(rank, str(tmp_path), "resume", state_dict_type), timeout=120)
    files = full[0]["files"]
    assert "model.safetensors" not in files and "pytorch_model.bin" not in files
    if state_dict_type == "SHARDED_STATE_DICT":
        assert "optimizer.bin" not in files
        for stem in ("pytorch_model_fsdp_0", "optimizer_0"):
            assert f"{stem}/.metadata" in files
            shards = [f for f in files if f.startswith(f"{stem}/") and f.endswith(".distcp")]
            assert len(shards) == 2, files  # one per rank
    else:
        assert "pytorch_model_fsdp.bin" in files and "optimizer.bin" in files
        assert not any(f.endswith(".distcp") for f in files)
    expected, got = full[0]["weights"], resumed[0]["weights"]
    assert set(got) == set(expected) and expected
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-6)


def _clip_by_value(rank: int, version: int) -> bool | None:
    from nbaccel import Accelerator
    from nbaccel.utils import FullyShardedDataParallelPlugin

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    reference = copy.deepcopy(model)
    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=version))
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=1.0))
    torch.manual_seed(1)
    inputs = [torch.randn(8, 4) for _ in range(2)]
    accelerator.backward(model(inputs[rank]).pow(2).sum())
    accelerator.clip_grad_value_(model.parameters(), 0.05)
    optimizer.step()
    (sum(reference(x).pow(2).sum() for x in inputs) / 2).backward()  # what data parallel averages
    torch.nn.utils.clip_grad_value_(reference.parameters(), 0.05)
    with torch.no_grad():
        for parameter in reference.parameters():
            parameter -= parameter.grad
    full = accelerator.get_state_dict(model)
    if not accelerator.is_main_process:
        return None
    return all(torch.allclose(full[name], value, atol=1e-6) for name, value in reference.state_dict().items())


@pytest.mark.parametrize("version", [1, 2])
def test_clip_grad_value_on_shards_is_the_whole_models(version):
    """docs/compat.md: clipping by value is elementwise, so clipping each rank's shards gives the unsharded
    model's step (Accelerate refuses clip_grad_value_ under FSDP)."""
    assert run_ranks(lambda rank: _clip_by_value(rank, version), timeout=120) == [True, None]
