"""`nbaccel.test_utils` against `accelerate.test_utils` (issue 14, item 3): the same helpers, used as a user would,
pointing at nbaccel's launcher and scripts."""

from __future__ import annotations

import sys

import pytest
import torch

pytest.importorskip("accelerate", reason="parity tests compare with Accelerate 1.15 (a dev dependency)")

import accelerate.test_utils as theirs  # noqa: E402

import nbaccel.test_utils as ours  # noqa: E402


def test_regression_dataset_and_model_match_accelerates():
    for seed in (None, 42):
        a, b = theirs.RegressionDataset(length=16, seed=seed), ours.RegressionDataset(length=16, seed=seed)
        if seed is not None:
            assert (a.x == b.x).all() and (a.y == b.y).all()
        assert len(a) == len(b) == 16 and set(a[0]) == set(b[0]) == {"x", "y"}
    x = torch.tensor(ours.RegressionDataset(length=4, seed=0).x)
    their_model, our_model = theirs.RegressionModel(a=2, b=3), ours.RegressionModel(a=2, b=3)
    their_out = theirs.capture_call_output(their_model, x)
    our_out = ours.capture_call_output(our_model, x)
    assert their_out == our_out == "Model dtype: torch.float32, torch.float32. Input dtype: torch.float32\n"
    assert torch.equal(their_model(x), our_model(x))


def test_launch_command_points_at_nbaccel():
    kwargs = {"num_processes": 2, "cpu": True, "debug": False, "mixed_precision": None, "monitor_interval": 0.1}
    assert theirs.get_launch_command(**kwargs)[:2] == ["accelerate", "launch"]
    assert ours.get_launch_command(**kwargs)[:4] == [sys.executable, "-m", "nbaccel", "launch"]
    assert ours.get_launch_command(**kwargs)[4:] == theirs.get_launch_command(**kwargs)[2:]
    assert ours.DEFAULT_LAUNCH_COMMAND[4:] == theirs.DEFAULT_LAUNCH_COMMAND[2:]
    assert (ours.torch_device, ours.device_count) == (theirs.torch_device, theirs.device_count)


def test_bundled_scripts_run_under_the_launch_command():
    """What a user's test does: launch the bundled script on 2 CPU processes and check it passed."""
    script = ours.path_in_accelerate_package("test_utils", "scripts", "test_script.py")
    assert script.is_file() and ours.path_in_accelerate_package().name == "nbaccel"
    result = ours.execute_subprocess_async(ours.get_launch_command(num_processes=2, cpu=True) + [script],
                                           timeout=170, quiet=True, echo=False)
    out = "\n".join(result.stdout)
    assert result.returncode == 0 and "all operations passed" in out and "gradient synchronization: ok" in out
    assert "the same weights on every process" in out
    with pytest.raises(RuntimeError, match="failed with returncode"):
        ours.execute_subprocess_async([sys.executable, "-c", "import sys; sys.exit(3)"], quiet=True, echo=False)
    with pytest.raises(RuntimeError, match="failed with returncode"):
        theirs.execute_subprocess_async([sys.executable, "-c", "import sys; sys.exit(3)"], quiet=True, echo=False)


def test_require_markers_decide_as_accelerates_on_this_machine():
    names = [n for n in dir(theirs) if n.startswith("require_") and n != "require_torch_min_version"]
    assert len(names) > 30
    for name in names:
        def case():
            pass

        skipped = {side: bool(getattr(getattr(module, name)(case), "__unittest_skip__", False))
                   for side, module in (("theirs", theirs), ("ours", ours))}
        assert skipped["theirs"] == skipped["ours"], name
    for version in ("1.0", "99.0"):
        def case():
            pass

        assert (getattr(theirs.require_torch_min_version(version=version)(case), "__unittest_skip__", False)
                == getattr(ours.require_torch_min_version(version=version)(case), "__unittest_skip__", False))


def test_assert_exception_and_skip_helpers_behave_alike(monkeypatch):
    for worker, port in ((None, 29500), ("gw3", 29503)):  # without pytest-xdist, and in its worker gw3
        if worker is None:
            monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
        else:
            monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        assert [(module.pytest_xdist_worker_id(), module.get_torch_dist_unique_port()) for module in (theirs, ours)] \
            == [(port - 29500, port)] * 2
    for module in (theirs, ours):
        with module.assert_exception(ValueError, "bad"):
            raise ValueError("a bad value")
        with pytest.raises(AssertionError):
            with module.assert_exception(ValueError):
                pass
