"""`nbaccel config update`: rewrite an existing config file (e.g. one an older Accelerate wrote) in the current
format, keeping its values (Accelerate's `accelerate.commands.config.update`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ...utils.config_file import ConfigError, display_path, find_config_file, load_config

__all__ = ["description", "update_command_parser", "update_config", "update_config_command"]

description = "Rewrite an existing config file with the current defaults, keeping its settings."


def update_config(args: argparse.Namespace) -> str:
    """Rewrite `args.config_file` (default: the config file in use); returns its path.

    Raises ValueError when there is no such file, ConfigError when it holds a value that cannot work.
    """
    given = getattr(args, "config_file", None)
    path = find_config_file(given)
    if given is not None and not Path(given).is_file():
        raise ValueError(f"no such config file: {given} (pass an existing file to --config_file)")
    if path is None:
        raise ValueError("no config file to update: write one with `nbaccel config` or `nbaccel config default`, "
                         "or pass --config_file")
    load_config(path).save(path)
    return str(path)


def update_config_command(args: argparse.Namespace) -> int:
    try:
        path = update_config(args)
    except (ValueError, ConfigError) as exc:
        args._parser.error(str(exc).replace("\n", "; "))
    print(f"nbaccel configuration updated at {display_path(path)}")
    return 0


def update_command_parser(parser, parents) -> argparse.ArgumentParser:
    """Add `update` to the subparsers `parser`, with Accelerate's arguments."""
    parser = parser.add_parser("update", parents=parents, help=description, description=description,
                               allow_abbrev=False)
    parser.add_argument("--config_file", "--config-file", default=argparse.SUPPRESS,
                        help="The config file to update (default: the one in use, see `nbaccel env`).")
    parser.set_defaults(func=update_config_command, _parser=parser)
    return parser
