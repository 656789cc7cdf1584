"""`nbaccel to-fsdp2`: Accelerate's `accelerate to-fsdp2`, rewriting a config file's FSDP1 `fsdp_config` keys as
FSDP2 ones (same arguments, same result).

`fsdp_sharding_strategy` becomes `fsdp_reshard_after_forward` (FULL_SHARD / HYBRID_SHARD -> True, the others ->
False); keys FSDP2 has no use for (`fsdp_backward_prefetch`, `fsdp_sync_module_states`, `fsdp_use_orig_params`)
and the one it lacks (`fsdp_forward_prefetch`) are dropped with a logged warning; other keys are kept; the result
says `fsdp_version: 2`. A config that already says version 2, or has no `fsdp_config`, is written unchanged.
"""

from __future__ import annotations

import argparse
import enum
import logging
import sys
from pathlib import Path
from typing import Any

from ..utils.atomic_files import atomic_write

logger = logging.getLogger(__name__)


class ConversionStatus(enum.Enum):
    """What happens to an FSDP1 key that has no FSDP2 counterpart."""

    NOT_YET_IMPLEMENTED = 0
    REMOVED = -1


# FSDP1 key -> its FSDP2 name, or why it goes away (Accelerate's table).
ARGUMENT_KEY_MAPPING: dict[str, Any] = {
    "fsdp_version": "fsdp_version",
    "fsdp_reshard_after_forward": "fsdp_reshard_after_forward",
    "fsdp_auto_wrap_policy": "fsdp_auto_wrap_policy",
    "fsdp_backward_prefetch": ConversionStatus.REMOVED,
    "fsdp_forward_prefetch": ConversionStatus.NOT_YET_IMPLEMENTED,
    "fsdp_cpu_ram_efficient_loading": "fsdp_cpu_ram_efficient_loading",
    "fsdp_offload_params": "fsdp_offload_params",
    "fsdp_sharding_strategy": "fsdp_reshard_after_forward",
    "fsdp_state_dict_type": "fsdp_state_dict_type",
    "fsdp_sync_module_states": ConversionStatus.REMOVED,
    "fsdp_transformer_layer_cls_to_wrap": "fsdp_transformer_layer_cls_to_wrap",
    "fsdp_min_num_params": "fsdp_min_num_params",
    "fsdp_use_orig_params": ConversionStatus.REMOVED,
    "fsdp_activation_checkpointing": "fsdp_activation_checkpointing",
}

# Does an FSDP1 sharding strategy free the parameters after the forward pass (FSDP2's reshard_after_forward)?
_RESHARDS = {"FULL_SHARD": True, "SHARD_GRAD_OP": False, "HYBRID_SHARD": True, "HYBRID_SHARD_ZERO2": False,
             "NO_SHARD": False}
ARGUMENT_VALUE_MAPPING: dict[str, dict[str, bool]] = {
    "fsdp_sharding_strategy": dict(_RESHARDS),
    "fsdp_reshard_after_forward": dict(_RESHARDS),  # configs written for FSDP1 keep a strategy name here
}


def _validate_to_fsdp2_args(args: argparse.Namespace) -> None:
    if not Path(args.config_file).exists():
        raise FileNotFoundError(f"Config file {args.config_file} not found")
    if not args.overwrite and args.output_file is None:
        raise ValueError("If --overwrite is not set, --output_file must be provided")
    if not args.overwrite and Path(args.output_file).exists():
        raise FileExistsError(f"Output file {args.output_file} already exists and --overwrite is not set")


def convert_config_to_fsdp2(config: dict) -> dict:
    """Return `config` with its `fsdp_config` rewritten for FSDP2 (the dict is updated in place)."""
    fsdp_config = config.get("fsdp_config") or {}
    if not fsdp_config:
        logger.info("The config has no fsdp_config: nothing to convert.")
        return config
    if fsdp_config.get("fsdp_version", 1) == 2:
        logger.warning("Config already specifies FSDP2, skipping conversion...")  # Accelerate's words
        logger.warning("(fsdp_version is 2 already.) If its keys are still FSDP1 names, set fsdp_version to 1 and "
                       "run the command again.")
        return config
    converted: dict[str, Any] = {}
    for key, value in fsdp_config.items():
        target = ARGUMENT_KEY_MAPPING.get(key)
        if target is None:  # a key this table does not know: kept as it is
            converted[key] = value
        elif target is ConversionStatus.REMOVED:
            logger.warning(f"{key} does not exist in FSDP2: dropped.")
        elif target is ConversionStatus.NOT_YET_IMPLEMENTED:
            logger.warning(f"{key} is not implemented in FSDP2 yet: dropped.")
        else:
            converted[target] = ARGUMENT_VALUE_MAPPING.get(key, {}).get(value, value)
    converted["fsdp_version"] = 2
    config["fsdp_config"] = converted
    return config


def load_config(config_file: str) -> dict:
    """The YAML config file as a dict; ValueError when it is empty (or absurdly large: nbaccel.utils.safe_yaml)."""
    from ..utils.safe_yaml import load_yaml

    with open(config_file) as handle:
        config = load_yaml(handle)
    if not config:
        raise ValueError("Config file is empty")
    return config


def to_fsdp2_command(args: argparse.Namespace) -> None:
    """Convert `args.config_file` and write the result to `args.output_file` (or over the input with
    `args.overwrite`). Raises FileNotFoundError / ValueError / FileExistsError on bad arguments, as Accelerate."""
    import yaml

    _validate_to_fsdp2_args(args)
    config = load_config(args.config_file)
    if args.overwrite and args.output_file is None:
        args.output_file = args.config_file
    converted = convert_config_to_fsdp2(config)
    with atomic_write(args.output_file) as handle:  # it may be the config file itself (--overwrite)
        yaml.dump(converted, handle)


def _cli(args: argparse.Namespace) -> int:
    """The command line's entry: bad arguments are one line on stderr and exit status 2."""
    try:
        to_fsdp2_command(args)
    except (FileNotFoundError, FileExistsError, ValueError) as error:
        print(f"nbaccel to-fsdp2: error: {error}", file=sys.stderr)
        return 2
    return 0


def to_fsdp2_command_parser(subparsers=None) -> argparse.ArgumentParser:
    """The `to-fsdp2` parser with Accelerate's arguments (a subcommand of `nbaccel` when `subparsers` is given)."""
    description = "Convert an Accelerate/nbaccel config file from FSDP1 to FSDP2"
    from .main import command_parser

    parser = command_parser(subparsers, "to-fsdp2", _cli, description)
    parser.add_argument("--config_file", type=str, required=True, help="The config file to convert to FSDP2")
    parser.add_argument("--overwrite", action="store_true", default=False,
                        help="Overwrite the config file (or the output file) if it exists")
    parser.add_argument("--output_file", type=str, default=None,
                        help="Where to write the converted config (default with --overwrite: the input file)")
    return parser


def register(subparsers) -> None:
    """Join the `nbaccel` command line (discovered by nbaccel.commands.main)."""
    to_fsdp2_command_parser(subparsers)


def main(argv: list[str] | None = None) -> int:
    args = to_fsdp2_command_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
