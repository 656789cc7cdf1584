"""`accelerate.utils.torch_xla`: `install_xla()` installs the torch_xla matching the installed torch on Colab."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

from .environment import is_colab

__all__ = ["install_xla"]


def install_xla(upgrade: bool = False) -> None:
    """On Google Colab, pip-install the torch_xla release matching the installed torch (after upgrading torch
    when `upgrade`). Elsewhere raise RuntimeError: install it yourself (`pip install torch_xla[tpu]`)."""
    if not is_colab():
        raise RuntimeError("`install_xla` works only on Google Colab; elsewhere run "
                           "`pip install torch_xla[tpu]` with the version of your torch.")
    if upgrade:
        subprocess.run([sys.executable, "-m", "pip", "install", "-U", "torch"], check=True)
    major_minor = ".".join(importlib.metadata.version("torch").split("+")[0].split(".")[:2])
    subprocess.run([sys.executable, "-m", "pip", "install", f"torch_xla[tpu]~={major_minor}.0"], check=True)
