"""FSDP1 (torch's FullyShardedDataParallel, Accelerate's default fsdp_version=1) through the Accelerator on 2 CPU
ranks (gloo): DDP's weights for each setting, exact resume through save_state/load_state, merged checkpoints."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from process_helpers import LIBRARY_PREFIXES, environment_without
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


def warmup_then_decay(step: int, warmup: int = 3, total: int = 16) -> float:
    """The factor of a linear warm-up then linear decay (what transformers' get_linear_schedule_with_warmup
    gives LambdaLR, one lambda per group)."""
    return step / warmup if step < warmup else max(0.0, (total - step) / (total - warmup))


def prepare_and_train(accelerator, model: nn.Module, rank: int, steps: int, optimizer_first: bool):
    """The training both libraries run: prepare, then `steps` steps with clipping; (prepared model, grad norms,
    learning rates of every group after each step).
    `optimizer_first`: the optimizer is built before prepare and passed with the model; else Accelerate's
    documented FSDP1 order (prepare the model, then build its optimizer)."""
    scheduler = None
    if optimizer_first == "groups":  # fsdp_with_peak_mem_tracking.py's two groups and warm-up, made before prepare
        no_decay = ["bias", "norm.weight"]
        groups = [{"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
                   "weight_decay": 0.3},
                  {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
                   "weight_decay": 0.0}]
        optimizer = torch.optim.AdamW(groups, lr=1e-2, weight_decay=2e-4)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_then_decay)
        model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    elif optimizer_first == "first_group_after":  # one group with the first group's settings, after prepare(model)
        model = accelerator.prepare(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.3)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_then_decay)
        optimizer, scheduler = accelerator.prepare(optimizer, scheduler)
    elif optimizer_first:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, optimizer = accelerator.prepare(model, optimizer)
    else:
        model = accelerator.prepare(model)
        optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))
    norms, lrs = [], []
    for x, y in batches(rank, steps):
        accelerator.backward(nn.functional.mse_loss(model(x), y))
        norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 0.5)))
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad()
        lrs.append([group["lr"] for group in optimizer.param_groups])
    return model, norms, lrs


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
    model, norms, lrs = prepare_and_train(accelerator, model, rank, steps, optimizer_first)
    weights = accelerator.get_state_dict(model)
    kinds = sorted({type(m).__name__ for m in model.modules()})
    return {"weights": {k: v.clone() for k, v in weights.items()}, "norms": norms, "kinds": kinds, "lrs": lrs,
            "distributed_type": accelerator.distributed_type.value}


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


# Settings Accelerate's own FSDP1 code can run on CPU ranks. Not compared: sync_module_states (Accelerate's plugin
# raises "no available devices" without an accelerator), cpu_offload (torch pins memory, which needs one),
# HYBRID_SHARD (torch derives its groups from the accelerator count; nbaccel builds the mesh on CPU ranks).
ACCELERATE_COMPARABLE = ["default", "shard_grad_op+prefetch", "no_shard", "transformer_wrap+orig_params",
                         "activation_checkpointing"]


def _accelerate_train(rank: int, settings: dict, steps: int = 4, optimizer_first: bool = False):
    """The loop of `_train` on Accelerate's Accelerator and its FSDP1 code path."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    torch.manual_seed(0)
    model = Tiny()
    plugin = FullyShardedDataParallelPlugin(**settings)
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    # Accelerate enables FSDP only on accelerators (cpu=True gives MULTI_CPU, i.e. DDP) and would hand torch's
    # FSDP the device "cpu:0", which FSDP refuses as device_id: switch its state to FSDP on "cpu" so that its own
    # FSDP1 code (prepare_model, clip_grad_norm_) runs here.
    assert accelerator.distributed_type == DistributedType.MULTI_CPU
    accelerator.state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    accelerator.state.device = torch.device("cpu")
    model, norms, lrs = prepare_and_train(accelerator, model, rank, steps, optimizer_first)
    # (Accelerate's get_state_dict gathers with offload_to_cpu, which on CPU ranks frees the tensors it returns)
    weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {"weights": {k: v.clone() for k, v in weights.items()}, "norms": norms, "lrs": lrs}


def _both_libraries(rank: int):
    results = {}
    for name in ACCELERATE_COMPARABLE:
        results[name] = {"nbaccel": _train(rank, SETTINGS[name], optimizer_first=False),
                         "accelerate": _accelerate_train(rank, SETTINGS[name])}
    # the optimizer built before prepare and passed with the model (use_orig_params=False): Accelerate leaves it on
    # the parameters FSDP1 replaced, so it never trains; nbaccel re-points it (docs/compat.md)
    results["optimizer_first"] = {"nbaccel": _train(rank, {}, optimizer_first=True),
                                  "accelerate": _accelerate_train(rank, {}, optimizer_first=True)}
    torch.manual_seed(0)
    results["initial"] = Tiny().state_dict()
    return results


def test_fsdp1_matches_accelerate_fsdp1():
    pytest.importorskip("accelerate")
    results = run_ranks(_both_libraries, timeout=300)[0]
    for name in ACCELERATE_COMPARABLE:
        ours, theirs = results[name]["nbaccel"], results[name]["accelerate"]
        assert ours["norms"] == pytest.approx(theirs["norms"], rel=1e-6, abs=1e-7), name
        assert set(ours["weights"]) == set(theirs["weights"]), name
        for key, value in theirs["weights"].items():
            torch.testing.assert_close(ours["weights"][key], value, rtol=0, atol=1e-6, msg=f"{name}: {key}")
    stale = results["optimizer_first"]["accelerate"]["weights"]
    assert all(torch.equal(stale[k], v) for k, v in results["initial"].items())  # Accelerate: no training
    trained = results["optimizer_first"]["nbaccel"]["weights"]
    torch.testing.assert_close(trained, results["default"]["nbaccel"]["weights"], rtol=0, atol=1e-6)


def _two_groups(rank: int):
    """An optimizer with two parameter groups and a warm-up scheduler made before prepare
    (fsdp_with_peak_mem_tracking.py)."""
    import warnings

    out = {}
    for orig in (True, False):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out[orig] = {"nbaccel": _train(rank, {"use_orig_params": orig}, optimizer_first="groups"),
                         "accelerate": _accelerate_train(rank, {"use_orig_params": orig}, optimizer_first="groups")}
        out[orig]["warnings"] = [str(w.message) for w in caught if "parameter groups" in str(w.message)]
    out["first_group_after"] = _train(rank, {}, optimizer_first="first_group_after")
    torch.manual_seed(0)
    out["initial"] = Tiny().state_dict()
    return out


def test_an_optimizer_with_two_groups_and_a_scheduler_made_before_prepare():
    """use_orig_params=True (`accelerate launch`'s default): the groups are kept, nbaccel trains to Accelerate's
    weights and learning rates. use_orig_params=False: Accelerate 1.15 leaves the optimizer on the parameters
    FSDP1 replaced (it never trains); nbaccel warns that the flat parameters train in the first group, keeps
    both groups so the warm-up scheduler made over them steps (it raised `ValueError: zip()` when the groups
    were merged into one), and trains as a one-group optimizer with the first group's settings made after
    prepare(model) would (docs/compat.md)."""
    pytest.importorskip("accelerate")
    results = run_ranks(_two_groups, timeout=300)[0]
    ours, theirs = results[True]["nbaccel"], results[True]["accelerate"]
    assert ours["norms"] == pytest.approx(theirs["norms"], rel=1e-6, abs=1e-7)
    assert len(ours["lrs"][0]) == 2
    torch.testing.assert_close(torch.tensor(ours["lrs"]), torch.tensor(theirs["lrs"]))
    for key, value in theirs["weights"].items():
        torch.testing.assert_close(ours["weights"][key], value, rtol=0, atol=1e-6, msg=key)
    assert results[True]["warnings"] == []
    stale = results[False]["accelerate"]
    assert all(torch.equal(stale["weights"][k], v) for k, v in results["initial"].items())  # Accelerate: no training
    flat = results[False]["nbaccel"]
    assert len(results[False]["warnings"]) == 1, results[False]["warnings"]
    assert "2 parameter groups cannot be kept" in results[False]["warnings"][0]
    assert "group 0, with its settings (weight_decay=0.3" in results[False]["warnings"][0]
    torch.testing.assert_close(torch.tensor(flat["lrs"]), torch.tensor(stale["lrs"]))  # the schedule of both groups
    torch.testing.assert_close(torch.tensor(flat["lrs"]), torch.tensor(ours["lrs"]))
    after = results["first_group_after"]
    torch.testing.assert_close(torch.tensor(flat["lrs"])[:, 0], torch.tensor(after["lrs"])[:, 0])
    torch.testing.assert_close(flat["weights"], after["weights"], rtol=0, atol=1e-6)
    assert not any(torch.equal(flat["weights"][k], v) for k, v in results["initial"].items())
    # against use_orig_params=True: the same schedule and AdamW, element by element; the runs differ only by the
    # first group's weight decay on the second group's parameters (biases, norm weights) and what follows from it
    drift = {key: float((flat["weights"][key] - value).abs().max()) for key, value in ours["weights"].items()}
    assert 0 < max(drift.values()) < 2e-2, drift


def _resume_run(rank: int, folder: str, mode: str, state_dict_type: str, steps: int = 6, save_at: int = 3):
    """FSDP1 with the Accelerator: "full" trains `steps` steps, saving a checkpoint after `save_at` and the
    final model with save_model; "resume" starts from other weights, loads that checkpoint and trains on."""
    from nbaccel import Accelerator
    from nbaccel.state import reset_states
    from nbaccel.utils import FullyShardedDataParallelPlugin

    reset_states()
    torch.manual_seed(0 if mode == "full" else 123)  # the resumed run must not depend on its own init
    model = Tiny()
    plugin = FullyShardedDataParallelPlugin(state_dict_type=state_dict_type, auto_wrap_policy="TRANSFORMER_BASED_WRAP",
                                            transformer_cls_names_to_wrap=["Block"])
    accelerator = Accelerator(fsdp_plugin=plugin)
    model = accelerator.prepare(model)
    optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))
    data = batches(rank, steps)
    checkpoint = os.path.join(folder, "checkpoint")
    start = 0
    if mode == "resume":
        accelerator.load_state(checkpoint)
        start = save_at
    for step in range(start, steps):
        x, y = data[step]
        accelerator.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        if mode == "full" and step + 1 == save_at:
            accelerator.save_state(checkpoint)
            at_save = {k: v.clone() for k, v in accelerator.get_state_dict(model).items()}
    weights = accelerator.get_state_dict(model)
    if mode == "full":
        accelerator.save_model(model, os.path.join(folder, "export"))
    files = sorted(os.path.relpath(os.path.join(root, name), checkpoint)
                   for root, _, names in os.walk(checkpoint) for name in names)
    return {"weights": {k: v.clone() for k, v in weights.items()}, "files": files,
            "unwrapped": type(accelerator.unwrap_model(model)).__name__, "at_save": at_save if mode == "full" else None}


@pytest.mark.parametrize("state_dict_type", ["FULL_STATE_DICT", "SHARDED_STATE_DICT", "LOCAL_STATE_DICT"])
def test_fsdp1_save_state_load_state_resume_exactly(tmp_path, state_dict_type):
    """save_state/load_state with FSDP1 in Accelerate's layout (FULL: pytorch_model_fsdp.bin + optimizer.bin;
    SHARDED: torch.distributed.checkpoint folders; LOCAL: one model file per rank): a resumed run ends with the
    same weights, and save_model writes the gathered full model."""
    from safetensors.torch import load_file

    full = run_ranks(lambda rank: _resume_run(rank, str(tmp_path), "full", state_dict_type), timeout=200)
    resumed = run_ranks(lambda rank: _resume_run(rank, str(tmp_path), "resume", state_dict_type), timeout=200)
    files = full[0]["files"]
    assert full[0]["unwrapped"] == "Tiny"
    if state_dict_type == "FULL_STATE_DICT":
        assert "pytorch_model_fsdp.bin" in files and "optimizer.bin" in files
    elif state_dict_type == "SHARDED_STATE_DICT":
        assert "pytorch_model_fsdp_0/.metadata" in files and "optimizer_0/.metadata" in files
        assert len([f for f in files if f.startswith("pytorch_model_fsdp_0/") and f.endswith(".distcp")]) == 2
    else:
        assert {"pytorch_model_fsdp_rank0.bin", "pytorch_model_fsdp_rank1.bin", "optimizer_0/.metadata"} <= set(files)
    expected, got = full[0]["weights"], resumed[0]["weights"]
    assert set(got) == set(expected) and expected and full[1]["weights"] == {}
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-6)
    exported = load_file(tmp_path / "export" / "model.safetensors")
    assert exported.keys() == expected.keys() and all(torch.equal(exported[k], expected[k]) for k in expected)
    if state_dict_type == "SHARDED_STATE_DICT":  # the sharded model folder merges into one file, no processes
        from accelerate.state import AcceleratorState
        from accelerate.utils import merge_fsdp_weights as accelerate_merge

        from nbaccel.utils import merge_fsdp_weights

        folder = str(tmp_path / "checkpoint" / "pytorch_model_fsdp_0")
        merge_fsdp_weights(folder, str(tmp_path / "merged"))
        merged = load_file(tmp_path / "merged" / "model.safetensors")
        at_save = full[0]["at_save"]
        assert merged.keys() == at_save.keys() and all(torch.equal(merged[k], at_save[k]) for k in at_save)
        try:  # Accelerate merges the same folder into the same tensors
            accelerate_merge(folder, str(tmp_path / "merged_by_accelerate"))
        finally:
            AcceleratorState._reset_state(True)
        theirs = load_file(tmp_path / "merged_by_accelerate" / "model.safetensors")
        assert theirs.keys() == merged.keys() and all(torch.equal(theirs[k], merged[k]) for k in merged)


# An FSDP config as `accelerate config` writes it: no fsdp_version (Accelerate's default, 1).
ACCELERATE_FSDP_CONFIG = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: FSDP
downcast_bf16: 'no'
fsdp_config:
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_backward_prefetch: BACKWARD_PRE
  fsdp_forward_prefetch: false
  fsdp_offload_params: false
  fsdp_sharding_strategy: FULL_SHARD
  fsdp_state_dict_type: FULL_STATE_DICT
  fsdp_transformer_layer_cls_to_wrap: Block
  fsdp_use_orig_params: true
machine_rank: 0
main_training_function: main
mixed_precision: 'no'
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
use_cpu: false
"""

LAUNCHED_SCRIPT = """\
import sys
import torch
from torch import nn
from {package} import Accelerator


class Block(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


accelerator = Accelerator()
torch.manual_seed(0)
model = nn.Sequential(Block(), Block(), nn.Linear(16, 4))
model = accelerator.prepare(model)
optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))
generator = torch.Generator().manual_seed(accelerator.process_index)
for _ in range(3):
    x, y = torch.randn(8, 16, generator=generator), torch.randn(8, 4, generator=generator)
    accelerator.backward(nn.functional.mse_loss(model(x), y))
    optimizer.step()
    optimizer.zero_grad()
plugin = getattr(accelerator.state, "fsdp_plugin", None)
if accelerator.is_main_process:
    print("RESULT", accelerator.distributed_type, type(model).__name__, getattr(plugin, "fsdp_version", None),
          getattr(plugin, "backward_prefetch", None), flush=True)
accelerator.save_model(model, sys.argv[1])
"""


def _launch(launcher: list[str], config: str, script: str, output: str, **extra: str) -> subprocess.CompletedProcess:
    env = environment_without("FSDP_", *LIBRARY_PREFIXES)
    env.update(extra, TMPDIR=os.path.dirname(config))  # torchrun's torchelastic_* log folder: in the test's tmp_path
    return subprocess.run([sys.executable, *launcher, "--config_file", config, script, output], env=env,
                          capture_output=True, text=True, timeout=240, cwd=os.path.dirname(config))


def test_accelerate_fsdp_config_without_version_runs_under_nbaccel_launch(tmp_path):
    """`nbaccel launch` with Accelerate's FSDP config file (no fsdp_version) trains with FSDP1 on 2 CPU ranks,
    with the launcher defaults of `accelerate launch` (sync_module_states, use_orig_params, ...). Accelerate
    cannot run that file here: its launcher turns on sync_module_states, which its plugin refuses without an
    accelerator. So the same script under `accelerate launch` with a multi-CPU config (DDP) gives the weights
    FSDP1 must reproduce."""
    from safetensors.torch import load_file

    fsdp_config = tmp_path / "fsdp.yaml"
    fsdp_config.write_text(ACCELERATE_FSDP_CONFIG)
    cpu_config = tmp_path / "cpu.yaml"
    # (MULTI_GPU: torchrun starts 2 processes, which ACCELERATE_USE_CPU lets train on the CPU with gloo; Accelerate's
    # MULTI_CPU launch wants mpirun)
    cpu_config.write_text(ACCELERATE_FSDP_CONFIG.replace("distributed_type: FSDP", "distributed_type: MULTI_GPU"))
    for package in ("nbaccel", "accelerate"):
        (tmp_path / f"train_{package}.py").write_text(LAUNCHED_SCRIPT.format(package=package))
    ours = _launch(["-m", "nbaccel", "launch"], str(fsdp_config), str(tmp_path / "train_nbaccel.py"),
                   str(tmp_path / "nbaccel"))
    assert ours.returncode == 0, ours.stdout + ours.stderr
    assert "RESULT DistributedType.FSDP FullyShardedDataParallel 1 BackwardPrefetch.BACKWARD_PRE" in ours.stdout, ours.stdout
    refused = _launch(["-m", "accelerate.commands.launch"], str(fsdp_config), str(tmp_path / "train_accelerate.py"),
                      str(tmp_path / "refused"))
    assert refused.returncode != 0 and "no available devices" in refused.stderr, refused.stderr[-2000:]
    ddp = _launch(["-m", "accelerate.commands.launch"], str(cpu_config), str(tmp_path / "train_accelerate.py"),
                  str(tmp_path / "accelerate"), ACCELERATE_USE_CPU="true")
    assert ddp.returncode == 0, ddp.stdout + ddp.stderr
    assert "RESULT DistributedType.MULTI_CPU DistributedDataParallel" in ddp.stdout, ddp.stdout
    mine = load_file(tmp_path / "nbaccel" / "model.safetensors")
    theirs = load_file(tmp_path / "accelerate" / "model.safetensors")
    assert mine.keys() == theirs.keys()
    for key in theirs:
        torch.testing.assert_close(mine[key], theirs[key], rtol=0, atol=1e-5, msg=key)


# fsdp_with_peak_mem_tracking.py's training loop (Accelerate's examples/by_feature/), with a tiny model and data in
# place of BERT and GLUE (no Hub here) and without its TorchTracemalloc (it reads CUDA counters only): two
# parameter groups without decay on biases and LayerNorm, a linear warm-up scheduler made before prepare, the
# plugin made in the script, prepare of all five objects, a step every `gradient_accumulation_steps` batches.
FSDP_EXAMPLE_LOOP = """\
import sys
import torch
from torch import nn
from torch.distributed.fsdp.fully_sharded_data_parallel import FullOptimStateDictConfig, FullStateDictConfig
from torch.utils.data import DataLoader, TensorDataset
from nbaccel import Accelerator, FullyShardedDataParallelPlugin


class Block(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.LayerNorm = nn.LayerNorm(d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.LayerNorm(x))))


def linear_schedule_with_warmup(optimizer, num_warmup_steps, num_training_steps):
    def factor(step):
        if step < num_warmup_steps:
            return step / max(1, num_warmup_steps)
        return max(0.0, (num_training_steps - step) / max(1, num_training_steps - num_warmup_steps))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


fsdp_plugin = FullyShardedDataParallelPlugin(
    state_dict_config=FullStateDictConfig(offload_to_cpu=False, rank0_only=False),
    optim_state_dict_config=FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=False),
)
accelerator = Accelerator(fsdp_plugin=fsdp_plugin)
accelerator.print(accelerator.distributed_type)
num_epochs, gradient_accumulation_steps = 3, 1
generator = torch.Generator().manual_seed(0)
features = torch.randn(160, 16, generator=generator)
labels = (features[:, 0] > 0).long()
train_dataloader = DataLoader(TensorDataset(features[:128], labels[:128]), shuffle=True, batch_size=8)
eval_dataloader = DataLoader(TensorDataset(features[128:], labels[128:]), batch_size=8)
torch.manual_seed(42)
model = nn.Sequential(Block(), Block(), nn.Linear(16, 2))
no_decay = ["bias", "LayerNorm.weight"]
optimizer_grouped_parameters = [
    {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)], "weight_decay": 0.003},
    {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
]
optimizer = torch.optim.AdamW(params=optimizer_grouped_parameters, lr=2e-2, weight_decay=2e-4)
lr_scheduler = linear_schedule_with_warmup(optimizer, num_warmup_steps=10,
                                           num_training_steps=(len(train_dataloader) * num_epochs))
model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
)
for epoch in range(num_epochs):
    model.train()
    for step, (inputs, targets) in enumerate(train_dataloader):
        loss = nn.functional.cross_entropy(model(inputs), targets)
        accelerator.backward(loss)
        if step % gradient_accumulation_steps == 0:
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
    model.eval()
    correct = seen = 0
    for inputs, targets in eval_dataloader:
        with torch.no_grad():
            predictions = model(inputs).argmax(dim=-1)
        predictions, references = accelerator.gather_for_metrics((predictions, targets))
        correct += int((predictions == references).sum())
        seen += references.numel()
    accelerator.print(f"epoch {epoch}: accuracy {correct / seen:.4f} lrs {[g['lr'] for g in optimizer.param_groups]}")
accelerator.print("GROUPS", len(optimizer.param_groups), type(model).__name__)
"""


def test_the_fsdp_peak_memory_example_loop_trains_under_nbaccel_launch(tmp_path):
    """fsdp_with_peak_mem_tracking.py's loop under `nbaccel launch`, 2 CPU ranks, FSDP1 with use_orig_params
    False (the plugin's default) and True: both train to the end with the warm-up schedule on both groups (with
    False the first `lr_scheduler.step()` raised `ValueError: zip()` when nbaccel merged the groups)."""
    (tmp_path / "example.py").write_text(FSDP_EXAMPLE_LOOP)
    outputs = {}
    for orig in ("false", "true"):
        config = tmp_path / f"fsdp_{orig}.yaml"
        config.write_text(ACCELERATE_FSDP_CONFIG.replace("fsdp_use_orig_params: true", f"fsdp_use_orig_params: {orig}"))
        run = _launch(["-m", "nbaccel", "launch"], str(config), str(tmp_path / "example.py"), str(tmp_path))
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        outputs[orig] = run
    lines = {orig: [line for line in run.stdout.splitlines() if line.startswith("epoch ")]
             for orig, run in outputs.items()}
    assert len(lines["false"]) == len(lines["true"]) == 3, outputs["false"].stdout
    lrs = {orig: [line.split(" lrs ")[1] for line in found] for orig, found in lines.items()}
    assert lrs["false"] == lrs["true"]  # the same schedule, on both groups
    assert "GROUPS 2 FullyShardedDataParallel" in outputs["false"].stdout
    assert "parameter groups cannot be kept" in outputs["false"].stderr
    assert "parameter groups cannot be kept" not in outputs["true"].stderr


def _load_full_state(rank: int):
    """fsdp2_load_full_state_dict of nbaccel and of Accelerate on FSDP2 models built on the meta device."""
    import types

    from accelerate.utils import fsdp2_load_full_state_dict as theirs
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    from nbaccel.utils import fsdp2_load_full_state_dict as ours

    torch.manual_seed(0)
    full = Tiny().state_dict() if rank == 0 else {}
    accelerator = types.SimpleNamespace(device=torch.device("cpu"), is_main_process=rank == 0)
    results = []
    for load in (ours, theirs):
        with torch.device("meta"):
            model = Tiny()
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        failure = ""
        try:
            load(accelerator, model, full)
        except RuntimeError as error:
            failure = str(error)
        flag = torch.tensor(0 if failure else 1)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)  # did every rank load?
        if not flag.item():
            results.append(failure or "failed on another rank")
            continue
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        results.append({k: v.clone() for k, v in state.items()})
    return results


def test_fsdp2_load_full_state_dict_matches_accelerate():
    """nbaccel's fsdp2_load_full_state_dict fills every rank's shards from rank 0's weights. Accelerate's fails
    with torch 2.13 here (its `load_state_dict(..., assign=True)` of the shards reports a size mismatch); where it
    works, both must give the same weights."""
    pytest.importorskip("accelerate")
    per_rank = run_ranks(_load_full_state, init=True, timeout=120)
    mine, theirs = per_rank[1][0], per_rank[0][1]  # rank 1 had no weights of its own; rank 0 reports the error
    torch.manual_seed(0)
    expected = Tiny().state_dict()
    assert isinstance(mine, dict) and mine.keys() == expected.keys()
    assert all(torch.equal(mine[k], expected[k]) for k in expected)
    if isinstance(theirs, str):
        assert "size mismatch" in theirs, theirs
    else:
        assert all(torch.equal(theirs[k], expected[k]) for k in expected)


def _per_rank_files(rank: int, folder: str, version: int):
    """save/load_fsdp_model and _optimizer with use_dcp=False (each rank writes its shard with torch.save)."""
    from nbaccel import Accelerator
    from nbaccel.state import reset_states
    from nbaccel.utils import (
        FullyShardedDataParallelPlugin,
        load_fsdp_model,
        load_fsdp_optimizer,
        save_fsdp_model,
        save_fsdp_optimizer,
    )

    def trained(seed: int, steps: int):
        reset_states()
        torch.manual_seed(seed)
        plugin = FullyShardedDataParallelPlugin(fsdp_version=version, state_dict_type="SHARDED_STATE_DICT",
                                                auto_wrap_policy="TRANSFORMER_BASED_WRAP",
                                                transformer_cls_names_to_wrap=["Block"])
        accelerator = Accelerator(fsdp_plugin=plugin)
        model = Tiny()
        model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        for x, y in batches(rank, steps):
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
        return accelerator, plugin, model, optimizer

    accelerator, plugin, model, optimizer = trained(0, 3)
    save_fsdp_model(plugin, accelerator, model, folder, use_dcp=False)
    save_fsdp_optimizer(plugin, accelerator, optimizer, model, folder, use_dcp=False)
    x, y = batches(rank, 4)[3]
    accelerator.backward(nn.functional.mse_loss(model(x), y))
    optimizer.step()
    expected = {k: v.clone() for k, v in accelerator.get_state_dict(model).items()}

    accelerator, plugin, model, optimizer = trained(123, 1)  # other weights and optimizer state
    load_fsdp_model(plugin, accelerator, model, folder, use_dcp=False)
    load_fsdp_optimizer(plugin, accelerator, optimizer, model, folder, use_dcp=False)
    accelerator.backward(nn.functional.mse_loss(model(x), y))
    optimizer.step()
    got = accelerator.get_state_dict(model)
    return {"files": sorted(os.listdir(folder)), "exact": all(torch.equal(got[k], expected[k]) for k in expected)}


@pytest.mark.parametrize("version", [1, 2])
def test_fsdp_checkpoint_functions_without_dcp(tmp_path, version):
    results = run_ranks(lambda rank: _per_rank_files(rank, str(tmp_path), version), timeout=200)
    assert results[0]["exact"]  # (full weights are gathered on rank 0)
    assert results[0]["files"] == ["optimizer_0_rank0.bin", "optimizer_0_rank1.bin", "pytorch_model_fsdp_0_rank0.bin",
                                   "pytorch_model_fsdp_0_rank1.bin"]


def _mixed_precision(rank: int, mixed_precision: str):
    from nbaccel import Accelerator
    from nbaccel.state import reset_states
    from nbaccel.utils import FullyShardedDataParallelPlugin

    out = {}
    for name, plugin in (("ddp", None), ("fsdp1", FullyShardedDataParallelPlugin())):
        reset_states()
        torch.manual_seed(0)
        model = Tiny()
        accelerator = Accelerator(mixed_precision=mixed_precision, fsdp_plugin=plugin)
        model = accelerator.prepare(model)
        optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))
        losses = []
        for x, y in batches(rank, 4):
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        out[name] = {"losses": losses, "scaler": type(accelerator.scaler).__name__,
                     "policy": str(getattr(accelerator.state.fsdp_plugin, "mixed_precision_policy", None))}
    return out


@pytest.mark.parametrize("mixed_precision", ["bf16", "fp16"])
def test_fsdp1_mixed_precision_tracks_ddp(mixed_precision):
    """Accelerator(mixed_precision=...) gives FSDP1 a MixedPrecision of that dtype (Accelerate's rule); the losses
    follow DDP's autocast run closely (FSDP1 also keeps parameters and reductions in half precision). fp16 uses
    torch's ShardedGradScaler, so every rank skips or steps alike. (Accelerate trains fp16 in fp32 on CPU, and
    runs FSDP only on accelerators: no comparison with it here.)"""
    result = run_ranks(lambda rank: _mixed_precision(rank, mixed_precision), timeout=200)[0]
    dtype = {"bf16": "torch.bfloat16", "fp16": "torch.float16"}[mixed_precision]
    assert f"param_dtype={dtype}" in result["fsdp1"]["policy"]
    assert result["fsdp1"]["scaler"] == ("ShardedGradScaler" if mixed_precision == "fp16" else "NoneType")
    assert result["fsdp1"]["losses"] == pytest.approx(result["ddp"]["losses"], rel=5e-3)


def _ram_efficient(rank: int):
    """cpu_ram_efficient_loading: rank 1 builds its model on the meta device, rank 0's weights reach it."""
    from nbaccel import Accelerator, init_empty_weights
    from nbaccel.state import reset_states
    from nbaccel.utils import FullyShardedDataParallelPlugin

    reset_states()
    plugin = FullyShardedDataParallelPlugin(cpu_ram_efficient_loading=True, auto_wrap_policy="TRANSFORMER_BASED_WRAP",
                                            transformer_cls_names_to_wrap=["Block"])
    accelerator = Accelerator(fsdp_plugin=plugin)
    torch.manual_seed(0)
    if rank == 0:
        model = Tiny()
    else:
        with init_empty_weights():
            model = Tiny()
    model = accelerator.prepare(model)
    optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))
    for x, y in batches(rank, 4):  # the loop of `_train`
        accelerator.backward(nn.functional.mse_loss(model(x), y))
        accelerator.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.clone() for k, v in accelerator.get_state_dict(model).items()}


def test_fsdp1_cpu_ram_efficient_loading_from_rank0():
    ddp = run_ranks(lambda rank: _train(rank, None, optimizer_first=False), timeout=200)[0]["weights"]
    got = run_ranks(_ram_efficient, timeout=200)[0]
    assert got.keys() == ddp.keys()
    for key, value in ddp.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=2e-5, msg=key)


def _accumulating(rank: int, settings: dict | None):
    """Gradient accumulation over 2 batches with `accelerator.accumulate` (FSDP1's no_sync, as DDP's)."""
    from nbaccel import Accelerator
    from nbaccel.state import reset_states
    from nbaccel.utils import FullyShardedDataParallelPlugin

    reset_states()
    torch.manual_seed(0)
    model = Tiny()
    plugin = None if settings is None else FullyShardedDataParallelPlugin(**settings)
    accelerator = Accelerator(fsdp_plugin=plugin, gradient_accumulation_steps=2)
    model = accelerator.prepare(model)
    optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))
    for x, y in batches(rank, 6):
        with accelerator.accumulate(model):
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
    return {k: v.clone() for k, v in accelerator.get_state_dict(model).items()}


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_fsdp1_gradient_accumulation_gives_ddp_weights(strategy):
    ddp = run_ranks(lambda rank: _accumulating(rank, None), timeout=200)[0]
    got = run_ranks(lambda rank: _accumulating(rank, {"sharding_strategy": strategy}), timeout=200)[0]
    assert got.keys() == ddp.keys()
    for key, value in ddp.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=2e-5, msg=key)


@pytest.mark.parametrize("fsdp_config", [
    None,  # the file of ACCELERATE_FSDP_CONFIG
    "fsdp_config: {}\n",  # FSDP with nothing said: every value from the launchers' defaults
    "fsdp_config:\n  fsdp_version: 2\n  fsdp_reshard_after_forward: false\n  fsdp_offload_params: true\n"
    "  fsdp_state_dict_type: SHARDED_STATE_DICT\n  fsdp_activation_checkpointing: true\n",
])
def test_launch_sets_the_fsdp_environment_accelerate_launch_sets(tmp_path, fsdp_config):
    """The FSDP_* variables `nbaccel launch` gives the workers for an FSDP config file equal those of
    `accelerate launch` (its own parser, validation and environment builder, run here without launching)."""
    pytest.importorskip("accelerate")
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    from nbaccel.commands.launch import resolve_settings, worker_environment
    from nbaccel.commands.main import build_parser
    from nbaccel.utils.config_file import load_config

    text = ACCELERATE_FSDP_CONFIG
    if fsdp_config is not None:
        head, rest = text.split("fsdp_config:\n", 1)
        rest = "\n".join(line for line in rest.splitlines() if not line.startswith("  "))
        text = head + fsdp_config + rest + "\n"
    config = tmp_path / "fsdp.yaml"
    config.write_text(text)
    script = tmp_path / "train.py"
    script.write_text("")
    validated = _validate_launch_command(launch_command_parser().parse_args(["--config_file", str(config), str(script)]))
    accelerate_args = validated[0] if isinstance(validated, tuple) else validated
    theirs = {k: v for k, v in prepare_multi_gpu_env(accelerate_args).items() if k.startswith("FSDP_")}
    ours_args = build_parser().parse_args(["launch", "--config_file", str(config), str(script)])
    environment = worker_environment(resolve_settings(ours_args, load_config(config)))
    ours = {k: v for k, v in environment.items() if k.startswith("FSDP_")}
    assert ours == theirs
