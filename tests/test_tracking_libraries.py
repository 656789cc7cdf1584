"""Trackers side by side with Accelerate's, through the real libraries, offline.

tests/compat/scripts/trackers.py is written for Accelerate: it logs a configuration and a mix of values (floats,
ints, a 0-dim tensor, a string, a dict, a bool, NaN) to TensorBoard, MLflow (a file store) or W&B (offline),
then prints what the library recorded, read back through the library's own API. The renamed copy must
record the same, apart from the differences docs/compat.md lists ("Trackers").
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from process_helpers import LIBRARY_PREFIXES, environment_without

pytest.importorskip("accelerate.tracking", reason="compares with Accelerate 1.15's trackers")

SCRIPT = Path(__file__).resolve().parent / "compat" / "scripts" / "trackers.py"


def record(tmp_path: Path, package: str, tracker: str, *args: str, ok: bool = True) -> tuple[dict[str, Any], str]:
    """What `tracker` recorded when the script ran on `package`, and the script's output."""
    folder = tmp_path / "-".join((package, *args))
    folder.mkdir()
    script = folder / SCRIPT.name
    script.write_text(re.sub(r"\baccelerate\b", package, SCRIPT.read_text()))
    env = environment_without(*LIBRARY_PREFIXES, "WANDB_", "MLFLOW_")
    result = subprocess.run([sys.executable, str(script), tracker, str(folder / "out"), *args], cwd=folder, env=env,
                            capture_output=True, text=True, timeout=120)
    output = result.stdout + result.stderr
    if not ok:
        assert result.returncode != 0, output[-4000:]
        return {}, output
    assert result.returncode == 0, f"{package} with {tracker} failed:\n{output[-4000:]}"
    [line] = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    return json.loads(line.removeprefix("RESULT ")), output


def comparable(value: Any) -> Any:
    """NaN compares equal to NaN; tuples and lists alike (JSON)."""
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    if isinstance(value, dict):
        return {k: comparable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [comparable(v) for v in value]
    return value


def test_tensorboard_records_what_accelerate_records(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    ours, _ = record(tmp_path, "nbaccel", "tensorboard")
    theirs, _ = record(tmp_path, "accelerate", "tensorboard")
    # add_hparams writes its own run in a folder named after the time: compare those by content
    timestamped = re.compile(r"^parity/\d+\.\d+$")
    hparams = [comparable(v) for k, v in sorted(ours.items()) if timestamped.match(k)]
    assert hparams == [comparable(v) for k, v in sorted(theirs.items()) if timestamped.match(k)] and hparams
    ours = {k: comparable(v) for k, v in ours.items() if not timestamped.match(k)}
    theirs = {k: comparable(v) for k, v in theirs.items() if not timestamped.match(k)}
    assert ours == theirs
    scalars = ours["parity"]["scalars"]
    assert scalars["b"] == [[0, 1.0], [1, 0.0], [2, 1.0]] and scalars["nan"][0][1] == "nan"  # bools, NaN kept
    assert scalars["t"] == [[0, 0.0], [1, 0.25], [2, 0.5]] and ours["parity"]["text"]["s/text_summary"]
    assert ours["parity/d_a"]["scalars"]["d"] == [[0, 0.0], [1, 1.0], [2, 2.0]]


def test_tensorboard_configuration_with_none_is_stored_as_text(tmp_path: Path) -> None:
    """Accelerate hands the configuration to torch's add_hparams, which refuses None and lists (though
    Accelerate's docstring lists None as accepted); nbaccel stores such values as their text (docs/compat.md)."""
    pytest.importorskip("tensorboard")
    _, their_output = record(tmp_path, "accelerate", "tensorboard", "none-in-config", ok=False)
    assert "ValueError: value should be one of int, float, str, bool, or torch.Tensor" in their_output
    ours, _ = record(tmp_path, "nbaccel", "tensorboard", "none-in-config")
    assert ours["parity"]["scalars"]["loss"][0] == [0, 1.0]
    hparams = (tmp_path / "nbaccel-none-in-config" / "out" / "parity" / "hparams.yml").read_text()
    assert "none: null" in hparams and "sizes:\n- 1\n- 2" in hparams


def test_mlflow_records_what_accelerate_records(tmp_path: Path) -> None:
    pytest.importorskip("mlflow")
    ours, our_output = record(tmp_path, "nbaccel", "mlflow")
    theirs, their_output = record(tmp_path, "accelerate", "mlflow")
    # the one difference (docs/compat.md): a one-element tensor is a number here, Accelerate's MLflow drops it
    assert ours["parity"]["metrics"].pop("t") == [[0, 0.0], [1, 0.25], [2, 0.5]]
    assert "t" not in theirs["parity"]["metrics"]
    assert comparable(ours) == comparable(theirs)
    assert ours["parity"]["params"] == {"epochs": "3", "flag": "True", "lr": "0.1", "name": "x", "none": "None",
                                        "sizes": "[1, 2]"}
    assert ours["parity"]["metrics"]["b"] == [[0, 1.0], [1, 0.0], [2, 1.0]] and ours["parity"]["status"] == "FINISHED"
    # both name each value they drop (strings and dicts), once per log call
    dropped_by_them = re.findall(r'for key "(\w+)" as a metric', their_output)
    dropped_by_us = re.findall(r"mlflow: '(\w+)' is \w+ .*?, not a number; not logged", our_output)
    assert sorted(dropped_by_us) == sorted(key for key in dropped_by_them if key != "t") == ["d"] * 3 + ["s"] * 3


def test_wandb_offline_run_records_what_accelerate_records(tmp_path: Path) -> None:
    pytest.importorskip("wandb")
    ours, _ = record(tmp_path, "nbaccel", "wandb")
    theirs, _ = record(tmp_path, "accelerate", "wandb")
    assert comparable(ours) == comparable(theirs)
    assert ours["config"] == {"epochs": 3, "flag": True, "lr": 0.1, "name": "x", "none": None, "sizes": [1, 2]}
    assert ours["summary"]["final"] == 7 and ours["summary"]["d"] == {"a": 2, "b": 2.0} and ours["run"] == ["parity", 3]
