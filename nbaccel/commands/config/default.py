"""`nbaccel config default`: a basic config file for this machine, without questions (Accelerate's
`accelerate.commands.config.default`)."""

from __future__ import annotations

import argparse

from ...utils.config_file import ConfigError, default_config_file, display_path
from ...utils.constants import MIXED_PRECISION_CHOICES

# write_basic_config: imported on first use (lazy_namespace below)
__all__ = ["default_command_parser", "default_config_command", "description", "write_basic_config"]  # noqa: F822

description = "Write a basic config file for this machine (every visible GPU, else the CPU), without questions."


def default_config_command(args: argparse.Namespace) -> int:
    """Write the file unless one exists there already (as Accelerate: an existing file is kept)."""
    # imports torch: not at the top, where `--help` would wait on it
    from ...utils.other import write_basic_config

    try:
        path = write_basic_config(mixed_precision=args.mixed_precision, save_location=args.save_location or getattr(args, "config_file", None))
    except (ValueError, ConfigError) as exc:
        args._parser.error(str(exc))
    if path:
        print(f"nbaccel configuration saved at {display_path(path)}")
    return 0


def default_command_parser(parser, parents) -> argparse.ArgumentParser:
    """Add `default` to the subparsers `parser`, with Accelerate's arguments."""
    parser = parser.add_parser("default", parents=parents, help=description, description=description,
                               allow_abbrev=False)
    parser.add_argument("--config_file", "--config-file", default=None, dest="save_location",
                        help=f"Where to save (default: {display_path(default_config_file())}).")
    parser.add_argument("--mixed_precision", "--mixed-precision", default="no", choices=MIXED_PRECISION_CHOICES,
                        help="Mixed precision mode to write.")
    parser.set_defaults(func=default_config_command, _parser=parser)
    return parser



from ..._lazy import lazy_namespace  # noqa: E402

# `write_basic_config`, Accelerate's name in this module, imported on first use: `nbaccel --help` and every command
# that does not write a config would otherwise wait on torch's import
__getattr__, __dir__ = lazy_namespace(__name__, {"write_basic_config": "nbaccel.utils.other"})
