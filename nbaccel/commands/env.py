"""`nbaccel env`: versions, devices and the config in use, to paste into a bug report."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
from shutil import which

import yaml

from ..utils.config_file import ConfigError, display_path, find_config_file, load_config


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def environment_report(config_file: str | None = None) -> dict[str, object]:
    """The facts `nbaccel env` prints, as a dict (name -> value)."""
    import psutil
    import torch

    import nbaccel

    info: dict[str, object] = {
        "nbaccel version": nbaccel.__version__,
        "Platform": platform.platform(),
        "Python version": platform.python_version(),
        "`nbaccel` bash location": which("nbaccel") or "Not found",
        "PyTorch version": torch.__version__,
        "PyTorch accelerator": "CUDA" if torch.cuda.is_available() else "none (CPU only)",
        "torch.distributed backends": ", ".join(
            name for name, ok in (("gloo", torch.distributed.is_gloo_available()),
                                  ("nccl", torch.distributed.is_nccl_available()),
                                  ("mpi", torch.distributed.is_mpi_available())) if ok
        ) or "none",
        "CPU cores": os.cpu_count(),
        "System RAM": f"{psutil.virtual_memory().total / 2**30:.2f} GB",
    }
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            info[f"GPU {index}"] = f"{props.name}, {props.total_memory / 2**30:.1f} GB"
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        info["MPS"] = "available"
    for package in ("accelerate", "numpy", "cloudpickle", "ipywidgets", "safetensors", "deepspeed", "torch_xla"):
        info[f"{package} version"] = _version(package)
    path = find_config_file(config_file)
    if path is None:
        info["Config file"] = "none (defaults; write one with `nbaccel config` or `nbaccel config default`)"
    else:
        info["Config file"] = display_path(path)
        try:
            config = load_config(path)
            info["Config"] = config.to_dict() if config is not None else "missing"
        except ConfigError as exc:
            info["Config"] = f"INVALID: {exc}"
    return info


def env_command(args: argparse.Namespace) -> dict[str, object]:
    """Print the report for a bug report and return it (a dict, as Accelerate's `env_command` does)."""
    info = environment_report(args.config_file)
    print("\nCopy-and-paste the text below in your GitHub issue\n")
    for key, value in info.items():
        if isinstance(value, dict):
            print(f"- {key}:")
            for line in yaml.safe_dump(value, sort_keys=True).splitlines():
                print(f"\t{line}")
        else:
            print(f"- {key}: {value}")
    return info


def env_command_parser(subparsers=None) -> argparse.ArgumentParser:
    """The `env` parser (added to `subparsers` when given, as `nbaccel env`)."""
    description = "Print versions, devices and the config in use."
    from .main import command_parser

    parser = command_parser(subparsers, "env", env_command, description)
    parser.add_argument("--config_file", "--config-file", default=None, help="Config file to report on.")
    return parser


def main(argv: list[str] | None = None) -> int:
    """`python -m nbaccel.commands.env`: `nbaccel env`, through the `nbaccel` command's entry point."""
    from .main import run_as

    return run_as("env", argv)


def register(subparsers) -> None:
    env_command_parser(subparsers)


if __name__ == "__main__":
    raise SystemExit(main())
