"""Configuration classes: Accelerate's defaults, to_kwargs, string conversions, and clear errors."""

from __future__ import annotations

import warnings
from datetime import timedelta

import pytest
import torch

from nbaccel.utils import dataclasses as dc
from nbaccel.utils.dataclasses import (
    AutocastKwargs,
    BnbQuantizationConfig,
    DataLoaderConfiguration,
    DDPCommunicationHookType,
    DeepSpeedPlugin,
    DistributedDataParallelKwargs,
    DynamoBackend,
    FP8RecipeKwargs,
    FullyShardedDataParallelPlugin,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    ProfileKwargs,
    ProjectConfiguration,
    TorchDynamoPlugin,
    TorchTensorParallelPlugin,
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    import os

    for key in list(os.environ):
        if key.startswith(("ACCELERATE_", "NBACCEL_DYNAMO", "FSDP_")):
            monkeypatch.delenv(key)


def test_defaults_match_accelerate():
    assert vars(DataLoaderConfiguration()) == dict(
        split_batches=False, dispatch_batches=None, even_batches=True, use_seedable_sampler=False, data_seed=None,
        non_blocking=False, use_stateful_dataloader=False,
    )
    assert vars(ProjectConfiguration()) == dict(
        project_dir=None, logging_dir=None, automatic_checkpoint_naming=False, total_limit=None, iteration=0,
        save_on_each_node=False,
    )
    assert vars(GradientAccumulationPlugin()) == dict(
        num_steps=None, adjust_scheduler=True, sync_with_dataloader=True, sync_each_batch=False
    )
    assert vars(AutocastKwargs()) == dict(enabled=True, cache_enabled=None)
    assert vars(GradScalerKwargs()) == dict(
        init_scale=65536.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000, enabled=True
    )
    assert TorchTensorParallelPlugin().tp_size == 1
    ddp = DistributedDataParallelKwargs()
    assert (ddp.dim, ddp.bucket_cap_mb, ddp.comm_hook, ddp.comm_state_option) == (0, 25, DDPCommunicationHookType.NO, {})


def test_defaults_equal_installed_accelerate_where_present():
    accelerate = pytest.importorskip("accelerate.utils.dataclasses")
    for name in ("DataLoaderConfiguration", "GradientAccumulationPlugin", "AutocastKwargs", "GradScalerKwargs",
                 "ProfileKwargs", "ProjectConfiguration"):
        ours, theirs = vars(getattr(dc, name)()), vars(getattr(accelerate, name)())
        assert ours == theirs, name


def test_to_kwargs_only_non_defaults():
    assert GradScalerKwargs().to_kwargs() == {}
    assert GradScalerKwargs(init_scale=1024.0, growth_interval=10).to_kwargs() == {"init_scale": 1024.0, "growth_interval": 10}
    assert AutocastKwargs(cache_enabled=False).to_kwargs() == {"cache_enabled": False}
    assert DistributedDataParallelKwargs(find_unused_parameters=True, comm_hook="fp16").to_kwargs() == {
        "find_unused_parameters": True
    }  # the hook is applied by register_comm_hook, not passed to DDP
    assert GradientAccumulationPlugin(num_steps=4).to_kwargs() == {"num_steps": 4}
    assert ProfileKwargs(activities=["cpu"], record_shapes=True).to_kwargs() == {"activities": ["cpu"], "record_shapes": True}


def test_to_kwargs_ignores_environment_defaults(monkeypatch):
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "inductor")
    plugin = TorchDynamoPlugin()
    assert plugin.backend == DynamoBackend.INDUCTOR  # the env var sets the default...
    assert plugin.to_kwargs() == {"backend": "inductor"}  # ...but to_kwargs compares with the class defaults


def test_dynamo_plugin_strings_and_kwargs():
    plugin = TorchDynamoPlugin(backend="inductor", mode="max-autotune", fullgraph=True)
    assert plugin.backend is DynamoBackend.INDUCTOR
    assert plugin.to_kwargs() == {"backend": "inductor", "mode": "max-autotune", "fullgraph": True}
    assert TorchDynamoPlugin().backend is DynamoBackend.NO
    with pytest.raises(ValueError, match=r"`backend` must be one of NO, EAGER.*INDUCTOR.*got 'tensorflow'"):
        TorchDynamoPlugin(backend="tensorflow")
    with pytest.raises(ValueError, match="`mode` must be one of default, reduce-overhead"):
        TorchDynamoPlugin(mode="fastest")


def test_dynamo_plugin_reads_nbaccel_env(monkeypatch):
    monkeypatch.setenv("NBACCEL_DYNAMO_BACKEND", "EAGER")
    monkeypatch.setenv("ACCELERATE_DYNAMO_USE_FULLGRAPH", "true")
    plugin = TorchDynamoPlugin()
    assert plugin.backend is DynamoBackend.EAGER and plugin.fullgraph is True


def test_init_process_group_timeout():
    assert InitProcessGroupKwargs().timeout == timedelta(seconds=600)
    assert InitProcessGroupKwargs(backend="gloo").timeout == timedelta(seconds=1800)
    assert InitProcessGroupKwargs(timeout=30).timeout == timedelta(seconds=30)
    assert InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=5)).to_kwargs() == {
        "backend": "gloo", "timeout": timedelta(seconds=5)
    }
    with pytest.raises(ValueError, match="`timeout` must be a positive"):
        InitProcessGroupKwargs(timeout=-1)


@pytest.mark.parametrize(
    ("factory", "field"),
    [
        (lambda: GradScalerKwargs(growth_interval=-5), "growth_interval"),
        (lambda: GradScalerKwargs(backoff_factor=1.5), "backoff_factor"),
        (lambda: GradScalerKwargs(growth_factor=0.5), "growth_factor"),
        (lambda: GradScalerKwargs(init_scale=0), "init_scale"),
        (lambda: AutocastKwargs(enabled="maybe"), "enabled"),
        (lambda: DistributedDataParallelKwargs(comm_hook="zip"), "comm_hook"),
        (lambda: DistributedDataParallelKwargs(comm_wrapper="power_sgd"), "comm_wrapper"),
        (lambda: DistributedDataParallelKwargs(bucket_cap_mb=0), "bucket_cap_mb"),
        (lambda: ProfileKwargs(activities=["gpu"]), "activities"),
        (lambda: ProfileKwargs(schedule_option={"wait": 1, "later": 2}), "schedule_option"),
        (lambda: DataLoaderConfiguration(split_batches="sometimes"), "split_batches"),
        (lambda: DataLoaderConfiguration(data_seed="abc"), "data_seed"),
        (lambda: ProjectConfiguration(total_limit=0), "total_limit"),
        (lambda: ProjectConfiguration(iteration=-1), "iteration"),
        (lambda: GradientAccumulationPlugin(num_steps=0), "num_steps"),
        (lambda: TorchTensorParallelPlugin(tp_size=0), "tp_size"),
        (lambda: FullyShardedDataParallelPlugin(state_dict_type="HALF_STATE_DICT"), "state_dict_type"),
        (lambda: FullyShardedDataParallelPlugin(fsdp_version=1, sharding_strategy="HALF_SHARD"), "sharding_strategy"),
        (lambda: FullyShardedDataParallelPlugin(auto_wrap_policy="WRAP_EVERYTHING"), "auto_wrap_policy"),
        (lambda: FullyShardedDataParallelPlugin(fsdp_version=3), "fsdp_version"),
        (lambda: FullyShardedDataParallelPlugin(mixed_precision_policy="fp13"), "mixed_precision_policy"),
        (lambda: BnbQuantizationConfig(load_in_4bit=True, bnb_4bit_quant_type="int3"), "bnb_4bit_quant_type"),
        (lambda: BnbQuantizationConfig(load_in_8bit=True, torch_dtype="fp64"), "torch_dtype"),
    ],
)
def test_invalid_values_name_the_field(factory, field):
    with pytest.raises(ValueError, match=f"`{field}`"):
        factory()


def test_ddp_comm_hook_strings_and_registration():
    kwargs = DistributedDataParallelKwargs(comm_hook="FP16", comm_wrapper="no")
    assert kwargs.comm_hook is DDPCommunicationHookType.FP16

    class Recorder:
        def register_comm_hook(self, state, hook):
            self.state, self.hook = state, hook

    model = Recorder()
    kwargs.register_comm_hook(model)
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    assert model.hook is default_hooks.fp16_compress_hook and model.state is None


def test_project_configuration_directories():
    config = ProjectConfiguration(project_dir="runs/a")
    assert config.logging_dir == "runs/a"
    config = ProjectConfiguration(project_dir="runs/a", logging_dir="logs")
    config.set_directories("runs/b")
    assert (config.project_dir, config.logging_dir) == ("runs/b", "logs")


def test_profile_kwargs_build_cpu():
    profiler = ProfileKwargs(activities=["cpu"], schedule_option={"wait": 0, "warmup": 1, "active": 1}).build()
    assert isinstance(profiler, torch.profiler.profile)


def test_fsdp_defaults_to_version_1_as_accelerate():
    from torch.distributed.fsdp import CPUOffload, ShardingStrategy, StateDictType

    plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 1
    assert plugin.sharding_strategy == ShardingStrategy.FULL_SHARD and plugin.reshard_after_forward is None
    assert plugin.state_dict_type == StateDictType.FULL_STATE_DICT
    assert isinstance(plugin.cpu_offload, CPUOffload)
    assert plugin.use_orig_params is False and plugin.sync_module_states is False


def test_fsdp2_defaults():
    from torch.distributed.fsdp import OffloadPolicy, StateDictType

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    assert plugin.reshard_after_forward is True
    assert plugin.state_dict_type == StateDictType.SHARDED_STATE_DICT
    assert isinstance(plugin.cpu_offload, OffloadPolicy)
    assert plugin.use_orig_params is None and plugin.sync_module_states is None


def test_fsdp_accelerate_fsdp1_code_keeps_working():
    from torch.distributed.fsdp import BackwardPrefetch, CPUOffload, ShardingStrategy, StateDictType

    plugin = FullyShardedDataParallelPlugin(
        sharding_strategy=ShardingStrategy.FULL_SHARD, backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
        limit_all_gathers=True, use_orig_params=True, sync_module_states=True,
    )
    assert plugin.fsdp_version == 1
    assert isinstance(plugin.cpu_offload, CPUOffload)
    assert plugin.state_dict_type == StateDictType.FULL_STATE_DICT
    assert plugin.param_init_fn is not None  # sync_module_states: ranks > 0 materialize empty modules


def test_fsdp_strings_and_env(monkeypatch):
    from torch.distributed.fsdp import MixedPrecisionPolicy, ShardingStrategy, StateDictType
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    plugin = FullyShardedDataParallelPlugin(fsdp_version=1, sharding_strategy="2", state_dict_type="full_state_dict")
    assert plugin.sharding_strategy == ShardingStrategy.SHARD_GRAD_OP
    assert plugin.state_dict_type == StateDictType.FULL_STATE_DICT
    monkeypatch.setenv("FSDP_AUTO_WRAP_POLICY", "TRANSFORMER_BASED_WRAP")
    monkeypatch.setenv("FSDP_TRANSFORMER_CLS_TO_WRAP", "Linear,ReLU")
    monkeypatch.setenv("FSDP_RESHARD_AFTER_FORWARD", "false")
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, mixed_precision_policy="bf16")
    assert plugin.auto_wrap_policy is transformer_auto_wrap_policy
    assert plugin.transformer_cls_names_to_wrap == ["Linear", "ReLU"]
    assert plugin.reshard_after_forward is False
    assert isinstance(plugin.mixed_precision_policy, MixedPrecisionPolicy)
    assert plugin.mixed_precision_policy.param_dtype == torch.bfloat16
    plugin.set_auto_wrap_policy(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()))
    assert plugin.auto_wrap_policy.keywords["transformer_layer_cls"] == {torch.nn.Linear, torch.nn.ReLU}
    with pytest.raises(ValueError, match="no layer class 'Block'"):
        FullyShardedDataParallelPlugin(auto_wrap_policy="transformer_based_wrap",
                                       transformer_cls_names_to_wrap=["Block"]).set_auto_wrap_policy(torch.nn.Linear(1, 1))
    with pytest.raises(ValueError, match="LOCAL_STATE_DICT is not supported by FSDP2"):
        FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="LOCAL_STATE_DICT")


def test_deepspeed_without_deepspeed_says_what_to_install():
    if dc._is_available("deepspeed"):
        pytest.skip("deepspeed is installed here")
    with pytest.raises(ImportError, match="pip install deepspeed"):
        DeepSpeedPlugin(zero_stage=2)
    with pytest.raises(ValueError, match="`zero_stage` must be one of 0, 1, 2, 3"):
        DeepSpeedPlugin(zero_stage=7)


def test_fp8_recipes():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        if not dc._is_available("transformer_engine"):
            with pytest.raises(ImportError, match="pip install transformer-engine"):
                FP8RecipeKwargs(backend="TE", fp8_format="HYBRID")
        with pytest.raises(ValueError, match="`fp8_format` must be one of HYBRID, E4M3, E5M2"):
            FP8RecipeKwargs(backend="TE", fp8_format="E9M9")
        with pytest.raises(ValueError, match="`backend` must be one of TE, MSAMP"):
            FP8RecipeKwargs(backend="XLA")
    assert dc.MSAMPRecipeKwargs(opt_level="o1").opt_level == "O1"


def test_bnb_config():
    config = BnbQuantizationConfig(load_in_4bit=True, bnb_4bit_compute_dtype="bf16", bnb_4bit_quant_type="nf4")
    assert config.bnb_4bit_compute_dtype == torch.bfloat16 and config.torch_dtype == torch.bfloat16
    assert BnbQuantizationConfig(load_in_8bit=True).target_dtype == torch.int8
    with pytest.raises(ValueError, match="exactly one of `load_in_4bit` and `load_in_8bit`"):
        BnbQuantizationConfig()
