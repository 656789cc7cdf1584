"""`nbaccel tpu-config`: run setup commands on every VM of a Google Cloud TPU pod through `gcloud`, before a
launch there (Accelerate's `accelerate tpu-config`). Needs the Google Cloud SDK (`gcloud`) on PATH; `--debug`
prints the command instead of running it."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys

from packaging.version import InvalidVersion, Version

__all__ = ["main", "tpu_command_launcher", "tpu_command_parser"]

_description = "Run commands on every VM of a TPU pod (gcloud) before launching there."


def tpu_command_parser(subparsers=None) -> argparse.ArgumentParser:
    """The `tpu-config` parser, with Accelerate's options (added to `subparsers` when given)."""
    if subparsers is not None:
        from .main import add_command

        parser = add_command(subparsers, "tpu-config", tpu_command_launcher, help=_description)
    else:
        parser = argparse.ArgumentParser("nbaccel tpu-config", description=_description)
    config = parser.add_argument_group("Config", "Also settable in the config file.")
    config.add_argument("--config_file", type=str, default=None, help="The config file to read.")
    config.add_argument("--tpu_name", default=None, help="The TPU's name (default: the config file's tpu_name).")
    config.add_argument("--tpu_zone", default=None, help="The TPU's zone (default: the config file's tpu_zone).")
    pod = parser.add_argument_group("TPU", "What runs on the pod.")
    pod.add_argument("--use_alpha", action="store_true", help="Use `gcloud alpha`.")
    pod.add_argument("--command_file", default=None, help="A file of commands to run on the pod, one a line.")
    pod.add_argument("--command", action="append", nargs="+", help="A command to run on the pod (repeatable).")
    pod.add_argument("--install_accelerate", action="store_true", help="pip-install nbaccel on the pod first.")
    pod.add_argument("--accelerate_version", default="latest",
                     help="The nbaccel version to install: latest, dev, or a version number.")
    pod.add_argument("--debug", action="store_true", help="Print the gcloud command instead of running it.")
    if subparsers is not None:
        parser.set_defaults(func=tpu_command_launcher)
    return parser


def _install_line(version: str) -> str:
    if version == "latest":
        return "pip install nbaccel -U"
    if version == "dev":
        return "pip install git+https://github.com/nbaccel/nbaccel.git"
    try:
        return f"pip install nbaccel=={Version(version)}"
    except InvalidVersion:
        raise ValueError(f"--accelerate_version must be latest, dev or a version number, got {version!r}") from None


def tpu_command_launcher(args: argparse.Namespace) -> int:
    """Build the `gcloud compute tpus tpu-vm ssh ... --worker all` command and run it (or print it with --debug)."""
    from ..utils.config_file import find_config_file, load_config

    path = find_config_file(args.config_file)
    config = load_config(path) if path is not None else None
    if config is not None:
        if not args.command_file and not args.command:
            args.command_file = config.command_file
            args.command = [config.commands] if config.commands else None
        args.tpu_name = args.tpu_name or config.tpu_name
        args.tpu_zone = args.tpu_zone or config.tpu_zone
    if not args.command_file and not args.command:
        raise ValueError("Give a command to run on the pod (--command) or a file of them (--command_file).")
    if args.command_file:
        with open(args.command_file, encoding="utf-8") as handle:
            lines = handle.read().splitlines()
    else:
        lines = [" ".join(part) if isinstance(part, list) else part for group in args.command for part in
                 (group if isinstance(group, list) else [group])]
    steps = ["cd /usr/share", *([_install_line(args.accelerate_version)] if args.install_accelerate else []), *lines]
    cmd = ["gcloud", *(["alpha"] if args.use_alpha else []), "compute", "tpus", "tpu-vm", "ssh", str(args.tpu_name),
           "--zone", str(args.tpu_zone), "--command", "; ".join(steps), "--worker", "all"]
    if args.debug:
        print(f"Running {' '.join(cmd)}")
        return 0
    if shutil.which("gcloud") is None:
        raise FileNotFoundError("tpu-config runs `gcloud`, which is not on PATH: install the Google Cloud SDK "
                                "(https://cloud.google.com/sdk/docs/install)")
    subprocess.run(cmd, check=True)
    print("Successfully set up the pod.")
    return 0


def register(subparsers) -> None:
    tpu_command_parser(subparsers)


def main() -> int:
    """`python -m nbaccel.commands.tpu`."""
    try:
        return tpu_command_launcher(tpu_command_parser().parse_args())
    except (ValueError, FileNotFoundError) as error:
        print(f"nbaccel tpu-config: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
