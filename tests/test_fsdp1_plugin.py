"""FullyShardedDataParallelPlugin against Accelerate's own dataclass: the same arguments and FSDP_* environment
give the same field values (building either plugin needs no processes)."""

from __future__ import annotations

import logging
import os

import pytest
import torch

accelerate_utils = pytest.importorskip("accelerate.utils")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for key in list(os.environ):
        if key.startswith(("FSDP_", "ACCELERATE_USE_FSDP", "NBACCEL_USE_FSDP")):
            monkeypatch.delenv(key)


def comparable(value):
    """A field value in a form that compares by meaning: torch config objects by type and fields."""
    if value is None or isinstance(value, (bool, int, float, str, list, tuple, set, torch.dtype)):
        return value
    if hasattr(value, "__dataclass_fields__"):
        return (type(value), {k: comparable(v) for k, v in vars(value).items()})
    if hasattr(value, "name") and hasattr(value, "value"):  # a torch enum member
        return value
    if callable(value):
        return ("callable", getattr(value, "func", value), getattr(value, "keywords", None))
    return repr(value)


def both(**kwargs):
    from nbaccel.utils import FullyShardedDataParallelPlugin

    ours = FullyShardedDataParallelPlugin(**kwargs)
    theirs = accelerate_utils.FullyShardedDataParallelPlugin(**kwargs)
    return ours, theirs


def assert_same(ours, theirs):
    mine, other = vars(ours), vars(theirs)
    assert mine.keys() == other.keys()
    for name in mine:
        assert comparable(mine[name]) == comparable(other[name]), (name, mine[name], other[name])


CASES = [
    {},  # Accelerate's default: FSDP1, FULL_SHARD, FULL_STATE_DICT
    {"fsdp_version": 2},
    {"sharding_strategy": "SHARD_GRAD_OP"},
    {"sharding_strategy": "hybrid_shard", "backward_prefetch": "BACKWARD_POST", "forward_prefetch": True},
    {"sharding_strategy": "3"},  # (an int 3 Accelerate keeps as is, unusable by torch; nbaccel converts it)
    {"reshard_after_forward": "NO_SHARD"},
    {"backward_prefetch": "NO_PREFETCH", "use_orig_params": True, "limit_all_gathers": False},
    {"state_dict_type": "SHARDED_STATE_DICT", "cpu_offload": True},
    {"state_dict_type": "local_state_dict"},
    {"auto_wrap_policy": "transformer_based_wrap", "transformer_cls_names_to_wrap": ["Block"]},
    {"auto_wrap_policy": "SIZE_BASED_WRAP", "min_num_params": 100},
    {"auto_wrap_policy": "no_wrap", "activation_checkpointing": True},
    {"mixed_precision_policy": "bf16"},
    {"mixed_precision_policy": {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32,
                                "buffer_dtype": torch.float32}},
    {"fsdp_version": 2, "mixed_precision_policy": "fp16", "cpu_offload": True, "state_dict_type": "FULL_STATE_DICT"},
    {"fsdp_version": 2, "backward_prefetch": "BACKWARD_PRE", "use_orig_params": True},  # dropped with a warning
    {"fsdp_version": 2, "activation_checkpointing": True, "activation_checkpointing_offload": True},
    {"ignored_modules": "head.*"},
]


@pytest.mark.parametrize("kwargs", CASES, ids=[str(sorted(c)) or "default" for c in CASES])
def test_plugin_fields_match_accelerate(kwargs):
    assert_same(*both(**kwargs))


ENVS = [
    {},
    {"FSDP_VERSION": "2", "FSDP_RESHARD_AFTER_FORWARD": "false", "FSDP_OFFLOAD_PARAMS": "true"},
    {"FSDP_SHARDING_STRATEGY": "SHARD_GRAD_OP", "FSDP_BACKWARD_PREFETCH": "BACKWARD_PRE",
     "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT", "FSDP_USE_ORIG_PARAMS": "true", "FSDP_FORWARD_PREFETCH": "true"},
    {"FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP", "FSDP_TRANSFORMER_CLS_TO_WRAP": "Block,Linear",
     "FSDP_ACTIVATION_CHECKPOINTING": "true"},
    {"FSDP_AUTO_WRAP_POLICY": "SIZE_BASED_WRAP", "FSDP_MIN_NUM_PARAMS": "2000", "FSDP_IGNORED_MODULES": "x"},
    # what an Accelerate FSDP config without fsdp_version gives a worker (its launcher sets FSDP_VERSION=1)
    {"FSDP_VERSION": "1", "FSDP_BACKWARD_PREFETCH": "BACKWARD_PRE", "FSDP_SHARDING_STRATEGY": "FULL_SHARD",
     "FSDP_STATE_DICT_TYPE": "FULL_STATE_DICT", "FSDP_USE_ORIG_PARAMS": "true", "FSDP_OFFLOAD_PARAMS": "false"},
    # an FSDP1 key left in an FSDP2 config: dropped with a warning, not an error (as Accelerate)
    {"FSDP_VERSION": "2", "FSDP_BACKWARD_PREFETCH": "BACKWARD_PRE"},
]


@pytest.mark.parametrize("env", ENVS, ids=[",".join(sorted(e)) or "empty" for e in ENVS])
def test_plugin_reads_the_environment_as_accelerate(env, monkeypatch):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert_same(*both())


def test_bad_values_raise_valueerror_on_both_sides():
    for kwargs in ({"fsdp_version": 2, "sharding_strategy": "FULL_SHARD"},
                   {"fsdp_version": 1, "reshard_after_forward": True},
                   {"fsdp_version": 2, "forward_prefetch": True},
                   {"fsdp_version": 2, "state_dict_type": "LOCAL_STATE_DICT"},
                   {"activation_checkpointing_offload": True},
                   {"auto_wrap_policy": "everything"}):
        from nbaccel.utils import FullyShardedDataParallelPlugin

        with pytest.raises(ValueError):
            accelerate_utils.FullyShardedDataParallelPlugin(**kwargs)
        with pytest.raises(ValueError):
            FullyShardedDataParallelPlugin(**kwargs)


def test_fsdp2_drops_fsdp1_settings_with_one_warning(caplog):
    from nbaccel.utils import FullyShardedDataParallelPlugin

    with caplog.at_level(logging.WARNING):
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, backward_prefetch="BACKWARD_PRE", use_orig_params=True)
    assert plugin.backward_prefetch is None and plugin.use_orig_params is None
    messages = [r.getMessage() for r in caplog.records if "FSDP2 ignores" in r.getMessage()]
    assert len(messages) == 1 and "backward_prefetch" in messages[0] and "use_orig_params" in messages[0]


def test_sync_module_states_works_without_an_accelerator():
    """Accelerate's plugin refuses sync_module_states on a machine without an accelerator ("There are currently
    no available devices found"); nbaccel's materializes modules on the CPU, where FSDP1 runs with gloo."""
    from nbaccel.utils import FullyShardedDataParallelPlugin

    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="no available devices"):
            accelerate_utils.FullyShardedDataParallelPlugin(sync_module_states=True)
    plugin = FullyShardedDataParallelPlugin(sync_module_states=True)
    module = torch.nn.Linear(2, 2, device="meta")
    assert plugin.param_init_fn(module).weight.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    plugin = FullyShardedDataParallelPlugin(cpu_ram_efficient_loading=True)
    assert plugin.sync_module_states is True
