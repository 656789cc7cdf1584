"""Helpers for testing training code (Accelerate's `accelerate.test_utils.testing`), pointing at nbaccel:
`get_launch_command()` builds an `nbaccel launch` command line, `require_*` skip a test unless the hardware or
library is there, `execute_subprocess_async` runs a launch and streams its output.
"""

from __future__ import annotations

import asyncio
import io
import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest
from collections.abc import Callable
from contextlib import contextmanager, redirect_stdout
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from ..state import AcceleratorState, GradientState, PartialState
from ..utils import imports
from ..utils.environment import parse_flag_from_env, str_to_bool  # noqa: F401  (Accelerate exposes both here)
from ..utils.operations import gather


def get_backend() -> tuple[str, int, Callable[[], int]]:
    """(device type, device count, function returning the allocated device memory) of this machine."""
    if imports.is_torch_xla_available():
        return "xla", torch.cuda.device_count(), torch.cuda.memory_allocated
    if imports.is_cuda_available():
        return "cuda", torch.cuda.device_count(), torch.cuda.memory_allocated
    if imports.is_mps_available():
        return "mps", 1, getattr(torch.mps, "current_allocated_memory", lambda: 0)
    for name, check in (("mlu", imports.is_mlu_available), ("sdaa", imports.is_sdaa_available),
                        ("musa", imports.is_musa_available), ("npu", imports.is_npu_available),
                        ("xpu", imports.is_xpu_available), ("hpu", imports.is_hpu_available),
                        ("neuron", imports.is_neuron_available)):
        if check():
            module = getattr(torch, name)
            return name, module.device_count(), module.memory_allocated
    return "cpu", 1, lambda: 0


torch_device, device_count, memory_allocated_func = get_backend()


def get_launch_command(**kwargs: Any) -> list[str]:
    """`[python, -m, nbaccel, launch, --k=v ...]` for the keyword arguments: True as a bare `--k`, None left out,
    anything else (False too, as in Accelerate) as `--k=value`. The interpreter is this one, so the command works
    without the `nbaccel` script on PATH."""
    command = [sys.executable, "-m", "nbaccel", "launch"]
    for key, value in kwargs.items():
        if value is True:
            command.append(f"--{key}")
        elif value is not None:
            command.append(f"--{key}={value}")
    return command


DEFAULT_LAUNCH_COMMAND = get_launch_command(num_processes=device_count, monitor_interval=0.1)

_run_slow_tests = parse_flag_from_env("RUN_SLOW", default=False)


def skip(test_case):
    """Skip the test, always."""
    return unittest.skip("Test was skipped")(test_case)


def slow(test_case):
    """Skip the test unless RUN_SLOW is set to a true value."""
    return unittest.skipUnless(_run_slow_tests, "test is slow")(test_case)


def _marker(condition: Callable[[], bool], reason: str) -> Callable:
    def decorate(test_case):
        return unittest.skipUnless(condition(), reason)(test_case)

    return decorate


def _torch_at_least(version: str) -> bool:
    return imports.is_torch_version(">=", version)


def _tracker_available() -> bool:
    return any(check() for check in (imports.is_wandb_available, imports.is_tensorboard_available,
                                     imports.is_comet_ml_available, imports.is_aim_available,
                                     imports.is_mlflow_available, imports.is_clearml_available,
                                     imports.is_dvclive_available, imports.is_swanlab_available,
                                     imports.is_trackio_available))


_ON_DEVICE = torch_device != "cpu"
_MARKERS: dict[str, tuple[Callable[[], bool], str]] = {
    "require_cpu": (lambda: torch_device == "cpu", "test requires only a CPU"),
    "require_non_cpu": (lambda: _ON_DEVICE, "test requires a GPU"),
    "require_cuda": (lambda: imports.is_cuda_available() and not imports.is_torch_xla_available(), "test requires a GPU"),
    "require_cuda_or_hpu": (lambda: (imports.is_cuda_available() and not imports.is_torch_xla_available())
                            or imports.is_hpu_available(), "test requires a GPU or HPU"),
    "require_cuda_or_xpu": (lambda: imports.is_cuda_available() or imports.is_xpu_available(),
                            "test requires a CUDA GPU or an XPU"),
    "require_xpu": (imports.is_xpu_available, "test requires an XPU"),
    "require_non_xpu": (lambda: torch_device != "xpu", "test requires a non-XPU"),
    "require_non_hpu": (lambda: torch_device != "hpu", "test requires a non-HPU"),
    "require_mlu": (imports.is_mlu_available, "test requires an MLU"),
    "require_sdaa": (imports.is_sdaa_available, "test requires an SDAA"),
    "require_musa": (imports.is_musa_available, "test requires a MUSA"),
    "require_npu": (imports.is_npu_available, "test requires an NPU"),
    "require_neuron": (imports.is_neuron_available, "test requires a Neuron device"),
    "require_mps": (imports.is_mps_available, "test requires a `mps` backend support in `torch`"),
    "require_tpu": (lambda: imports.is_torch_xla_available(check_is_tpu=True), "test requires a TPU"),
    "require_non_torch_xla": (lambda: not imports.is_torch_xla_available(), "test requires an env without TorchXLA"),
    "require_single_device": (lambda: _ON_DEVICE and device_count == 1, "test requires a single hardware accelerator"),
    "require_single_gpu": (lambda: torch.cuda.device_count() == 1, "test requires a GPU"),
    "require_single_xpu": (lambda: imports.is_xpu_available() and torch.xpu.device_count() == 1,
                           "test requires an XPU"),
    "require_multi_device": (lambda: device_count > 1, "test requires multiple hardware accelerators"),
    "require_multi_gpu": (lambda: torch.cuda.device_count() > 1, "test requires multiple GPUs"),
    "require_multi_xpu": (lambda: imports.is_xpu_available() and torch.xpu.device_count() > 1,
                          "test requires multiple XPUs"),
    "require_multi_gpu_or_xpu": (lambda: torch.cuda.device_count() > 1 or
                                 (imports.is_xpu_available() and torch.xpu.device_count() > 1),
                                 "test requires multiple GPUs or XPUs"),
    "require_fp16": (lambda: imports.is_fp16_available(), "test requires accelerator with fp16 support"),
    "require_fp8": (lambda: imports.is_fp8_available(), "test requires an fp8 library (torchao, TE or MS-AMP)"),
    "require_fsdp2": (lambda: _torch_at_least("2.6.0"), "test requires FSDP2 (torch >= 2.6.0)"),
    "require_tp": (lambda: _torch_at_least("2.3.0") and imports.compare_versions("transformers", ">=", "4.52.0")
                   if imports.is_transformers_available() else False, "test requires torch >= 2.3, transformers >= 4.52"),
    "require_pippy": (imports.is_pippy_available, "test requires pippy"),
    "require_deepspeed": (imports.is_deepspeed_available, "test requires DeepSpeed"),
    "require_bnb": (imports.is_bnb_available, "test requires the bitsandbytes library"),
    "require_transformer_engine": (imports.is_transformer_engine_available, "test requires transformer_engine"),
    "require_transformer_engine_mxfp8": (imports.is_transformer_engine_mxfp8_available,
                                         "test requires transformer_engine with MXFP8 support"),
    "require_torchao": (imports.is_torchao_available, "test requires torchao"),
    "require_torchvision": (imports.is_torchvision_available, "test requires the torchvision library"),
    "require_transformers": (imports.is_transformers_available, "test requires the transformers library"),
    "require_datasets": (imports.is_datasets_available, "test requires the datasets library"),
    "require_huggingface_suite": (lambda: imports.is_transformers_available() and imports.is_datasets_available(),
                                  "test requires the Hugging Face suite"),
    "require_peft": (imports.is_peft_available, "test requires the peft library"),
    "require_timm": (imports.is_timm_available, "test requires the timm library"),
    "require_triton": (imports.is_triton_available, "test requires the triton library"),
    "require_schedulefree": (imports.is_schedulefree_available, "test requires the schedulefree library"),
    "require_torchdata_stateful_dataloader": (imports.is_torchdata_stateful_dataloader_available,
                                              "test requires torchdata.stateful_dataloader"),
    "require_import_timer": (imports.is_import_timer_available, "test requires the import_timer library"),
    "require_pandas": (imports.is_pandas_available, "test requires pandas"),
    "require_matplotlib": (imports.is_matplotlib_available, "test requires matplotlib"),
    "require_wandb": (imports.is_wandb_available, "test requires wandb"),
    "require_tensorboard": (imports.is_tensorboard_available, "test requires Tensorboard"),
    "require_comet_ml": (imports.is_comet_ml_available, "test requires comet_ml"),
    "require_aim": (imports.is_aim_available, "test requires aim"),
    "require_clearml": (imports.is_clearml_available, "test requires clearml"),
    "require_dvclive": (imports.is_dvclive_available, "test requires dvclive"),
    "require_swanlab": (imports.is_swanlab_available, "test requires swanlab"),
    "require_trackio": (imports.is_trackio_available, "test requires trackio"),
    "require_mlflow": (imports.is_mlflow_available, "test requires mlflow"),
    "require_trackers": (_tracker_available, "test requires at least one tracker to be available"),
}
globals().update({name: _marker(condition, reason) for name, (condition, reason) in _MARKERS.items()})


def require_torch_min_version(test_case=None, version: str | None = None):
    """Skip unless torch >= `version`; usable as `@require_torch_min_version(version="2.4")`."""
    if test_case is None:
        return lambda case: require_torch_min_version(case, version=version)
    return unittest.skipUnless(_torch_at_least(version), f"test requires torch version >= {version}")(test_case)


def run_first(test_case):
    """Mark a test to run first when pytest-order is installed (else unchanged)."""
    if imports.is_pytest_available():
        import pytest

        return pytest.mark.order(1)(test_case)
    return test_case


class TempDirTestCase(unittest.TestCase):
    """A TestCase with one temporary folder for the class (`self.tmpdir`), emptied before each test when
    `clear_on_setup`, removed at the end."""

    clear_on_setup = True

    @classmethod
    def setUpClass(cls) -> None:
        cls.tmpdir = Path(tempfile.mkdtemp())

    @classmethod
    def tearDownClass(cls) -> None:
        shutil.rmtree(cls.tmpdir, ignore_errors=True)

    def setUp(self) -> None:
        if self.clear_on_setup:
            for path in list(self.tmpdir.iterdir()):
                shutil.rmtree(path) if path.is_dir() else path.unlink()


class AccelerateTestCase(unittest.TestCase):
    """A TestCase that resets the AcceleratorState and GradientState singletons after each test."""

    def tearDown(self) -> None:
        super().tearDown()
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


class MockingTestCase(unittest.TestCase):
    """A TestCase whose `setUp` can start mocks (`self.add_mocks(...)`) that stop after each test."""

    def add_mocks(self, mocks: mock.Mock | list[mock.Mock]) -> None:
        self.mocks = mocks if isinstance(mocks, (tuple, list)) else [mocks]
        for patcher in self.mocks:
            patcher.start()
            self.addCleanup(patcher.stop)


def are_the_same_tensors(tensor: torch.Tensor) -> bool:
    """Whether `tensor` holds the same values on every process."""
    state = AcceleratorState() if AcceleratorState._shared_state else PartialState()
    gathered = gather(tensor[None].clone().to(state.device)).cpu()
    return all(torch.equal(gathered[i], tensor.cpu()) for i in range(gathered.shape[0]))


class _RunOutput:
    def __init__(self, returncode: int, stdout: list[str], stderr: list[str]) -> None:
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


async def _stream(cmd: list[str], env, stdin, timeout, quiet: bool, echo: bool) -> _RunOutput:
    if echo:
        print("\nRunning: ", " ".join(cmd))
    process = await asyncio.create_subprocess_exec(cmd[0], *cmd[1:], stdin=stdin, stdout=asyncio.subprocess.PIPE,
                                                   stderr=asyncio.subprocess.PIPE, env=env)
    out: list[str] = []
    err: list[str] = []

    async def pump(stream, sink: list[str], pipe, label: str) -> None:
        while line := await stream.readline():
            text = line.decode("utf-8").rstrip()
            sink.append(text)
            if not quiet:
                print(label, text, file=pipe)

    try:
        await asyncio.wait_for(asyncio.gather(pump(process.stdout, out, sys.stdout, "stdout:"),
                                              pump(process.stderr, err, sys.stderr, "stderr:")), timeout)
    except asyncio.TimeoutError:
        process.kill()
        await process.wait()
        raise RuntimeError(f"'{' '.join(cmd)}' did not finish within {timeout} s; it was killed") from None
    return _RunOutput(await process.wait(), out, err)


def execute_subprocess_async(cmd: list, env=None, stdin=None, timeout: float = 180, quiet: bool = False,
                             echo: bool = True) -> _RunOutput:
    """Run `cmd` (e.g. `get_launch_command(...) + [script]`), streaming its output; RuntimeError with the
    workers' stderr when it fails, or when it runs past `timeout` seconds (then it is killed)."""
    cmd = [str(part) for part in cmd]
    result = asyncio.run(_stream(cmd, env, stdin, timeout, quiet, echo))
    if result.returncode != 0:
        stderr = "\n".join(result.stderr)
        raise RuntimeError(f"'{' '.join(cmd)}' failed with returncode {result.returncode}\n\n"
                           f"The combined stderr from workers follows:\n{stderr}")
    return result


def pytest_xdist_worker_id() -> int:
    """The pytest-xdist worker number (0 without xdist)."""
    return int(re.sub(r"^gw", "", os.environ.get("PYTEST_XDIST_WORKER", "gw0")))


def get_torch_dist_unique_port() -> int:
    """29500 plus the xdist worker number: a port per concurrent test worker."""
    return 29500 + pytest_xdist_worker_id()


class SubprocessCallException(Exception):
    """`run_command` failed; the message holds the command's output."""


def run_command(command: list, return_stdout: bool = False, env=None):
    """Run `command`, raising SubprocessCallException with its output when it fails; its stdout when asked."""
    command = [str(part) for part in command]
    try:
        output = subprocess.check_output(command, stderr=subprocess.STDOUT, env=env or os.environ.copy())
    except subprocess.CalledProcessError as error:
        raise SubprocessCallException(f"Command `{' '.join(command)}` failed with the following error:\n\n"
                                      f"{error.output.decode()}") from error
    return output.decode("utf-8") if return_stdout else None


def path_in_accelerate_package(*components: str) -> Path:
    """A path inside the installed nbaccel package (e.g. the bundled test scripts)."""
    return Path(__file__).resolve().parent.parent.joinpath(*components)


@contextmanager
def assert_exception(exception_class: type[Exception], msg: str | None = None):
    """Assert that the block raises `exception_class` (with `msg` in its message, when given)."""
    try:
        yield
    except Exception as error:  # noqa: BLE001 - the point is to inspect any exception
        assert isinstance(error, exception_class), f"Expected exception of type {exception_class} but got {type(error)}"
        if msg is not None:
            assert msg in str(error), f"Expected message '{msg}' to be in exception but got '{error}'"
        return
    raise AssertionError(f"Expected exception of type {exception_class} but ran without issue.")


def capture_call_output(func: Callable, *args: Any, **kwargs: Any) -> str:
    """What `func(*args, **kwargs)` prints to stdout."""
    buffer = io.StringIO()
    with redirect_stdout(buffer):
        func(*args, **kwargs)
    return buffer.getvalue()
