"""`nbaccel to-fsdp2` and `nbaccel merge-weights` against Accelerate's `to-fsdp2` and `merge-weights`: the same
arguments give the same files, bad arguments the same exception types (one line, exit 2, on the command line)."""

from __future__ import annotations

import argparse
import copy

import pytest
import torch
import yaml

pytest.importorskip("accelerate")

FSDP1_CONFIGS = [
    {"distributed_type": "FSDP", "num_processes": 2, "fsdp_config": {
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "fsdp_backward_prefetch": "BACKWARD_PRE",
        "fsdp_cpu_ram_efficient_loading": True, "fsdp_forward_prefetch": False, "fsdp_offload_params": False,
        "fsdp_sharding_strategy": "FULL_SHARD", "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        "fsdp_sync_module_states": True, "fsdp_transformer_layer_cls_to_wrap": "BertLayer",
        "fsdp_use_orig_params": True, "fsdp_activation_checkpointing": False}},
    {"fsdp_config": {"fsdp_sharding_strategy": "SHARD_GRAD_OP", "fsdp_min_num_params": 1000,
                     "fsdp_auto_wrap_policy": "SIZE_BASED_WRAP", "fsdp_unknown_key": 3}},
    {"fsdp_config": {"fsdp_version": 1, "fsdp_reshard_after_forward": "HYBRID_SHARD_ZERO2"}},
    {"fsdp_config": {"fsdp_version": 2, "fsdp_sharding_strategy": "FULL_SHARD"}},  # already FSDP2: unchanged
    {"distributed_type": "MULTI_GPU", "fsdp_config": {}},  # nothing to convert
    {"distributed_type": "NO"},
]


@pytest.mark.parametrize("config", FSDP1_CONFIGS)
def test_convert_config_to_fsdp2_matches_accelerate(config):
    from accelerate.commands.to_fsdp2 import convert_config_to_fsdp2 as theirs

    from nbaccel.commands.to_fsdp2 import convert_config_to_fsdp2 as ours

    assert ours(copy.deepcopy(config)) == theirs(copy.deepcopy(config))


def test_to_fsdp2_command_line_writes_what_accelerate_writes(tmp_path, capsys):
    from accelerate.commands.to_fsdp2 import to_fsdp2_command, to_fsdp2_command_parser

    from nbaccel.commands.main import main

    source = tmp_path / "fsdp1.yaml"
    source.write_text(yaml.safe_dump(FSDP1_CONFIGS[0]))
    assert main(["to-fsdp2", "--config_file", str(source), "--output_file", str(tmp_path / "ours.yaml")]) == 0
    to_fsdp2_command(to_fsdp2_command_parser().parse_args(
        ["--config_file", str(source), "--output_file", str(tmp_path / "theirs.yaml")]))
    assert (tmp_path / "ours.yaml").read_text() == (tmp_path / "theirs.yaml").read_text()
    converted = yaml.safe_load((tmp_path / "ours.yaml").read_text())["fsdp_config"]
    assert converted["fsdp_version"] == 2 and converted["fsdp_reshard_after_forward"] is True
    assert "fsdp_backward_prefetch" not in converted and "fsdp_use_orig_params" not in converted
    # --overwrite without --output_file rewrites the file in place
    copy_of_source = tmp_path / "inplace.yaml"
    copy_of_source.write_text(source.read_text())
    assert main(["to-fsdp2", "--config_file", str(copy_of_source), "--overwrite"]) == 0
    assert copy_of_source.read_text() == (tmp_path / "ours.yaml").read_text()
    capsys.readouterr()

    # bad arguments: Accelerate's exception types from the Python function, one line and exit 2 from the CLI
    from nbaccel.commands.to_fsdp2 import to_fsdp2_command as our_command

    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    cases = [
        (argparse.Namespace(config_file=str(tmp_path / "missing.yaml"), overwrite=False, output_file="x.yaml"),
         FileNotFoundError),
        (argparse.Namespace(config_file=str(source), overwrite=False, output_file=None), ValueError),
        (argparse.Namespace(config_file=str(source), overwrite=False, output_file=str(tmp_path / "ours.yaml")),
         FileExistsError),
        (argparse.Namespace(config_file=str(empty), overwrite=True, output_file=None), ValueError),
    ]
    for args, kind in cases:
        with pytest.raises(kind):
            to_fsdp2_command(copy.copy(args))
        with pytest.raises(kind):
            our_command(copy.copy(args))
        argv = ["to-fsdp2", "--config_file", args.config_file]
        argv += ["--overwrite"] if args.overwrite else []
        argv += ["--output_file", args.output_file] if args.output_file else []
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("nbaccel to-fsdp2: error: ") and err.count("\n") == 1, err
    with pytest.raises(SystemExit) as exit_info:  # --config_file is required, as in Accelerate
        main(["to-fsdp2"])
    assert exit_info.value.code == 2


def _sharded_checkpoint(folder) -> dict[str, torch.Tensor]:
    """A SHARDED_STATE_DICT-style model folder ({"model": state} through torch.distributed.checkpoint, written
    here without processes) and the tensors it holds."""
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    state = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)).state_dict()
    dcp.save({"model": state}, checkpoint_id=str(folder))
    return state


@pytest.mark.parametrize("unsafe", [False, True])
def test_merge_weights_command_matches_accelerate(tmp_path, capsys, unsafe):
    from accelerate.commands.merge import merge_command, merge_command_parser
    from accelerate.state import AcceleratorState

    from nbaccel.commands.main import main

    checkpoint = tmp_path / "checkpoint" / "pytorch_model_fsdp_0"
    state = _sharded_checkpoint(checkpoint)
    flags = ["--unsafe_serialization"] if unsafe else []
    assert main(["merge-weights", str(checkpoint), str(tmp_path / "ours"), *flags]) == 0
    try:
        merge_command(merge_command_parser().parse_args([str(checkpoint), str(tmp_path / "theirs"), *flags]))
    finally:
        AcceleratorState._reset_state(True)  # Accelerate's merge creates a PartialState in this process
    name = "pytorch_model.bin" if unsafe else "model.safetensors"
    if unsafe:
        ours = torch.load(tmp_path / "ours" / name, weights_only=True)
        theirs = torch.load(tmp_path / "theirs" / name, weights_only=True)
    else:
        from safetensors.torch import load_file

        ours, theirs = load_file(tmp_path / "ours" / name), load_file(tmp_path / "theirs" / name)
    assert ours.keys() == theirs.keys() == state.keys()
    assert all(torch.equal(ours[k], theirs[k]) and torch.equal(ours[k], state[k]) for k in state)

    # the parent folder is not a checkpoint: a one-line error naming the folder to pass instead
    assert main(["merge-weights", str(tmp_path / "checkpoint"), str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "pytorch_model_fsdp_0" in err and err.count("\n") == 1
    # --remove_checkpoint_dir deletes the merged folder afterwards
    assert main(["merge-weights", str(checkpoint), str(tmp_path / "again"), "--remove_checkpoint_dir"]) == 0
    assert not checkpoint.exists() and (tmp_path / "again" / "model.safetensors").exists()
