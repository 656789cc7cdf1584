"""Examples from README.md and docs/*.md that once failed as written, run as a user runs them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

NBACCEL = Path(sys.executable).parent / "nbaccel"  # the console script, whose sys.path lacks the working folder


def test_estimate_memory_imports_a_package_from_the_working_folder(tmp_path):
    # docs/big_models.md: `nbaccel estimate-memory my_package.models:make_model` run in the project's folder
    (tmp_path / "my_package").mkdir()
    (tmp_path / "my_package" / "__init__.py").write_text("")
    (tmp_path / "my_package" / "models.py").write_text(
        "import torch\n\ndef make_model():\n    return torch.nn.Linear(1000, 1000)\n")
    done = subprocess.run([str(NBACCEL), "estimate-memory", "my_package.models:make_model", "--dtypes", "float32"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "1,001,000" in done.stdout and "3.82 MB" in done.stdout  # parameters; float32 total size
