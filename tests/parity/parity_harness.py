"""Run one function under real Accelerate and under nbaccel, on 1 or 2 gloo ranks, and bring back its results.

`run_both(fn, num_processes)` starts `num_processes` fresh interpreters per library (torchrun's environment:
RANK, WORLD_SIZE, MASTER_ADDR/PORT), each calls `fn(lib, *args)` with `lib` the imported top-level module
(`accelerate` or `nbaccel`), and returns `{"accelerate": [rank0, rank1], "nbaccel": [...]}`. A fresh process
per run keeps the two libraries' global states apart. `fn` must be a module-level function of a module in
tests/parity/ (the ranks import it by name). Accelerate needs `cpu=True` (`Accelerator(cpu=True)` or
`PartialState(cpu=True)`) to run several processes on a machine without an accelerator; the scenarios pass it
to both libraries.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
LIBRARIES = ("accelerate", "nbaccel")


class RankFailure(AssertionError):
    """A rank raised, exited non-zero or ran past the time limit; carries every rank's output."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_ranks(fn: Callable, lib: str, num_processes: int = 2, args: tuple = (), timeout: float = 180) -> list:
    """Run `fn(lib_module, *args)` on `num_processes` ranks of library `lib`; the per-rank return values."""
    if lib not in LIBRARIES:
        raise ValueError(f"lib must be one of {LIBRARIES}, got {lib!r}")
    with tempfile.TemporaryDirectory(prefix=f"parity-{lib}-") as tmp:
        spec = Path(tmp) / "spec.pkl"
        spec.write_bytes(pickle.dumps({"module": fn.__module__, "name": fn.__name__, "lib": lib, "args": args}))
        port = _free_port()
        procs = []
        for rank in range(num_processes):
            env = dict(os.environ)
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(num_processes),
                       LOCAL_WORLD_SIZE=str(num_processes), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE)]),
                       PARITY_OUT=str(Path(tmp) / f"rank{rank}.pkl"), PARITY_SPEC=str(spec))
            if num_processes == 1:
                for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
                    env.pop(name)
            log = open(Path(tmp) / f"rank{rank}.log", "wb")  # noqa: SIM115  (closed below)
            procs.append((subprocess.Popen([sys.executable, str(HERE / "_rank_main.py")], env=env, cwd=tmp,
                                           stdout=log, stderr=subprocess.STDOUT, start_new_session=True), log))
        deadline = time.monotonic() + timeout
        try:
            while any(p.poll() is None for p, _ in procs):
                if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p, _ in procs):
                    time.sleep(1.0)  # let a failing rank's peers report too
                    break
                time.sleep(0.05)
        finally:
            for proc, log in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                log.close()
        codes = [p.returncode for p, _ in procs]
        if any(codes):
            logs = "\n".join(f"--- {lib} rank {r} (exit {c}) ---\n" + (Path(tmp) / f"rank{r}.log").read_text(
                errors="replace")[-6000:] for r, c in enumerate(codes))
            raise RankFailure(f"{fn.__name__} failed under {lib}:\n{logs}")
        return [pickle.loads((Path(tmp) / f"rank{r}.pkl").read_bytes()) for r in range(num_processes)]


def run_both(fn: Callable, num_processes: int = 2, args: tuple = (), timeout: float = 180) -> dict[str, list]:
    """`run_ranks` under Accelerate, then under nbaccel."""
    return {lib: run_ranks(fn, lib, num_processes, args, timeout) for lib in LIBRARIES}


def assert_same(accelerate_value: Any, nbaccel_value: Any, path: str = "result") -> None:
    """Exact equality of nested results (tensors compared bit for bit, with dtype and shape)."""
    import torch

    if isinstance(accelerate_value, torch.Tensor):
        assert isinstance(nbaccel_value, torch.Tensor), f"{path}: nbaccel gave {type(nbaccel_value).__name__}"
        assert accelerate_value.dtype == nbaccel_value.dtype, f"{path}: dtype {accelerate_value.dtype} vs {nbaccel_value.dtype}"
        assert accelerate_value.shape == nbaccel_value.shape, f"{path}: shape {tuple(accelerate_value.shape)} vs {tuple(nbaccel_value.shape)}"
        assert torch.equal(accelerate_value, nbaccel_value), f"{path}: {accelerate_value} vs {nbaccel_value}"
    elif isinstance(accelerate_value, dict):
        assert isinstance(nbaccel_value, dict), f"{path}: nbaccel gave {nbaccel_value!r}"
        assert accelerate_value.keys() == nbaccel_value.keys(), f"{path}: keys {sorted(accelerate_value)} vs {sorted(nbaccel_value)}"
        for key in accelerate_value:
            assert_same(accelerate_value[key], nbaccel_value[key], f"{path}[{key!r}]")
    elif isinstance(accelerate_value, (list, tuple)):
        assert isinstance(nbaccel_value, (list, tuple)), f"{path}: nbaccel gave {nbaccel_value!r}"
        assert len(accelerate_value) == len(nbaccel_value), (
            f"{path}: {len(accelerate_value)} items vs {len(nbaccel_value)}:\n  accelerate {accelerate_value!r}\n"
            f"  nbaccel    {nbaccel_value!r}")
        for index, (a, b) in enumerate(zip(accelerate_value, nbaccel_value)):
            assert_same(a, b, f"{path}[{index}]")
    else:
        assert accelerate_value == nbaccel_value, f"{path}: accelerate {accelerate_value!r} vs nbaccel {nbaccel_value!r}"


def assert_parity(results: dict[str, list]) -> None:
    assert_same(results["accelerate"], results["nbaccel"])
