"""`nbaccel config [default|update]`, with Accelerate's module tree (`accelerate.commands.config`):
`config` (the questions), `default`, `update`, `cluster`, `config_args`, `config_utils`."""

from __future__ import annotations

import argparse

from .config import config_command_parser, interactive_config
from .config_args import default_config_file, load_config_from_file
from .default import default_command_parser
from .update import update_command_parser

__all__ = ["config_command_parser", "default_command_parser", "default_config_file", "get_config_parser",
           "interactive_config", "load_config_from_file", "main", "register", "update_command_parser"]


def get_config_parser(subparsers=None) -> argparse.ArgumentParser:
    """The `config` parser with its `default` and `update` subcommands (added to `subparsers` when given)."""
    from ..main import CommandParser

    parent = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser = config_command_parser(subparsers)
    subcommands = parser.add_subparsers(title="subcommands", dest="subcommand", parser_class=CommandParser)
    default_command_parser(subcommands, parents=[parent])
    update_command_parser(subcommands, parents=[parent])
    return parser


def register(subparsers) -> None:
    """Join the `nbaccel` command line (see commands/main.py)."""
    get_config_parser(subparsers)


def main() -> int:
    """`python -m nbaccel.commands.config`."""
    parser = get_config_parser()
    args = parser.parse_args()
    if not hasattr(args, "func"):
        parser.print_help()
        return 1
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())


from ..._lazy import lazy_namespace  # noqa: E402

__getattr__, __dir__ = lazy_namespace(__name__, {})  # the other submodules (cluster, config_utils) as attributes
