"""`nbaccel test`: run nbaccel's own check of the distributed operations on the configured processes."""

from __future__ import annotations

import argparse
from pathlib import Path

from .launch import (
    LaunchOptionError,
    add_launch_arguments,
    read_launch_config,
    resolve_settings,
    run_settings,
)

CHECK_SCRIPT = Path(__file__).resolve().parent.parent / "test_utils" / "scripts" / "test_script.py"


def test_command(args: argparse.Namespace) -> int:
    from ..utils.config_file import ConfigError

    parser = args._parser
    if not CHECK_SCRIPT.is_file():
        parser.error(f"the bundled check script is missing ({CHECK_SCRIPT}); reinstall nbaccel")
    args.training_script = str(CHECK_SCRIPT)
    args.training_script_args = []
    args.module = False
    try:
        settings = resolve_settings(args, read_launch_config(args.config_file))
    except (ConfigError, LaunchOptionError) as exc:
        parser.error(str(exc).replace("\n", "; "))
    print(f"Running {CHECK_SCRIPT.name} on {settings.num_processes} process(es)"
          f"{' (CPU)' if settings.use_cpu else ''}...", flush=True)
    status = run_settings(settings)
    print("Test is a success! You are ready for your distributed training!" if status == 0
          else "nbaccel test: the check failed (see above)")
    return status


def test_command_parser(subparsers=None) -> argparse.ArgumentParser:
    """The `test` parser: the launch options, without a script (added to `subparsers` when given)."""
    description = "Check that collectives work on the configured processes (a short run)."
    from .main import command_parser

    parser = command_parser(subparsers, "test", test_command, description)
    add_launch_arguments(parser, script=False)
    parser.set_defaults(_parser=parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """`python -m nbaccel.commands.test`: `nbaccel test`, through the `nbaccel` command's entry point."""
    from .main import run_as

    return run_as("test", argv)


def register(subparsers) -> None:
    test_command_parser(subparsers)


if __name__ == "__main__":
    raise SystemExit(main())
