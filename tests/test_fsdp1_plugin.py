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


# ---------------------------------------------------------------------------------------------------------------
# Accelerate's FSDP helper names in nbaccel.utils, compared on the same inputs
# ---------------------------------------------------------------------------------------------------------------


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x)


class Stack(torch.nn.Module):
    _no_split_modules = ["Layer"]

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(Layer() for _ in range(3))
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_fsdp2_helpers_match_accelerate(monkeypatch):
    import types

    from accelerate.utils import fsdp_utils as theirs

    import nbaccel.utils as ours
    from nbaccel.utils import fsdp_utils as our_module

    names = {"_orig_mod.layers.0._checkpoint_wrapped_module.fc.weight": 1, "head._orig_mod.bias": 2, "plain": 3}
    assert ours.fsdp2_canonicalize_names(names) == theirs.fsdp2_canonicalize_names(names)

    model = Stack()
    for kwargs in ({"auto_wrap_policy": "transformer_based_wrap"},
                   {"auto_wrap_policy": "size_based_wrap", "min_num_params": 72},  # Linear(8, 8) has exactly 72
                   {"auto_wrap_policy": "no_wrap"}):
        plugin = accelerate_utils.FullyShardedDataParallelPlugin(fsdp_version=2, **kwargs)
        mine = our_module.fsdp2_prepare_auto_wrap_policy(plugin, model)
        other = theirs.fsdp2_prepare_auto_wrap_policy(plugin, model)
        if other is None:
            assert mine is None
        else:
            assert [mine(m) for m in model.modules()] == [other(m) for m in model.modules()], kwargs

    # activation checkpointing on the selected layers: the same module tree
    plugin = accelerate_utils.FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                                             activation_checkpointing=True)
    accelerator = types.SimpleNamespace(state=types.SimpleNamespace(fsdp_plugin=plugin))
    a, b = ours.fsdp2_apply_ac(accelerator, Stack()), theirs.fsdp2_apply_ac(accelerator, Stack())
    assert [type(m).__name__ for m in a.modules()] == [type(m).__name__ for m in b.modules()]
    assert "CheckpointWrapper" in {type(m).__name__ for m in a.modules()}

    # optimizer parameters switched through a mapping keyed as Accelerate keys it
    for switch in (ours.fsdp2_switch_optimizer_parameters, theirs.fsdp2_switch_optimizer_parameters):
        old, new = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
        optimizer = torch.optim.SGD(old.parameters(), lr=0.1)
        switch(optimizer, {p.data_ptr: q for p, q in zip(old.parameters(), new.parameters())})
        assert [id(p) for p in optimizer.param_groups[0]["params"]] == [id(q) for q in new.parameters()]
        with pytest.raises(KeyError):
            switch(optimizer, {})

    from accelerate.utils import model_has_dtensor

    assert ours.model_has_dtensor(model) is model_has_dtensor(model) is False
    mine, other = ours.get_fsdp2_grad_scaler(device="cpu", init_scale=8.0), theirs.get_fsdp2_grad_scaler(
        device="cpu", init_scale=8.0)
    assert type(mine) is type(other) and mine.get_scale() == other.get_scale() == 8.0

    envs = []
    for module in (ours, theirs):
        monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
        module.enable_fsdp_ram_efficient_loading()
        enabled = (os.environ.get("ACCELERATE_USE_FSDP"), os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"])
        module.disable_fsdp_ram_efficient_loading()
        envs.append((enabled, os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"]))
    assert envs[0] == envs[1] == (("True", "True"), "False")

    from accelerate.utils import compile_regions_fsdp2 as their_compile

    a, b = ours.compile_regions_fsdp2(Stack()), their_compile(Stack())
    compiled = [[getattr(m, "_compiled_call_impl", None) is not None for m in x.modules()] for x in (a, b)]
    assert compiled[0] == compiled[1] and any(compiled[0])


def test_fsdp_utils_module_helpers_match_accelerate():
    from accelerate.utils import fsdp_utils as theirs
    from accelerate.utils.dataclasses import get_module_class_from_name as their_class_lookup

    from nbaccel.utils import fsdp_utils as ours

    model = Stack()
    for name in ("Layer", "Linear", "Stack", "Missing"):
        assert ours.get_module_class_from_name(model, name) is their_class_lookup(model, name)
    for modules in (None, r"layers\.[01]", [model.head]):
        mine = ours.get_parameters_from_modules(modules, model, "cpu")
        other = theirs.get_parameters_from_modules(modules, model, "cpu")
        assert {id(p) for p in mine} == {id(p) for p in other}
    assert ours.FSDP_MODEL_NAME == theirs.FSDP_MODEL_NAME and ours.OPTIMIZER_NAME == theirs.OPTIMIZER_NAME
    assert (ours.SAFE_WEIGHTS_NAME, ours.WEIGHTS_NAME) == (theirs.SAFE_WEIGHTS_NAME, theirs.WEIGHTS_NAME)
    bottom_up = [type(m).__name__ for m in ours.get_module_children_bottom_up(model)]
    assert bottom_up == [type(m).__name__ for m in theirs.get_module_children_bottom_up(model)]
