"""Run one function under real Accelerate and under nbaccel, on 1 or 2 gloo ranks, and bring back its results.

`run_both(fn, num_processes)` starts `num_processes` fresh interpreters per library (torchrun's environment:
RANK, WORLD_SIZE, MASTER_ADDR/PORT), each calls `fn(lib, *args)` with `lib` the imported top-level module
(`accelerate` or `nbaccel`), and returns `{"accelerate": [rank0, rank1], "nbaccel": [...]}`. A fresh process
per run keeps the two libraries' global states apart: each rank is forked from a zygote of its library
(_zygote_main.py), a process that imported torch and the library and did nothing else, so a rank starts as
a fresh interpreter would without paying torch's import (~2.7 s of CPU here) again. `fn` must be a module-level function of a module in
tests/parity/ (the ranks import it by name). Accelerate needs `cpu=True` (`Accelerator(cpu=True)` or
`PartialState(cpu=True)`) to run several processes on a machine without an accelerator; the scenarios pass it
to both libraries.
"""

from __future__ import annotations

import atexit
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from nbaccel.utils.other import get_free_port

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
LIBRARIES = ("accelerate", "nbaccel")


class RankFailure(AssertionError):
    """A rank raised, exited non-zero or ran past the time limit; carries every rank's output."""


def run_ranks(fn: Callable, lib: str, num_processes: int = 2, args: tuple = (), timeout: float = 180) -> list:
    """Run `fn(lib_module, *args)` on `num_processes` ranks of library `lib`; the per-rank return values."""
    if lib not in LIBRARIES:
        raise ValueError(f"lib must be one of {LIBRARIES}, got {lib!r}")
    with tempfile.TemporaryDirectory(prefix=f"parity-{lib}-") as tmp:
        spec = Path(tmp) / "spec.pkl"
        spec.write_bytes(pickle.dumps({"module": fn.__module__, "name": fn.__name__, "lib": lib, "args": args}))
        port = get_free_port("127.0.0.1")
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
            procs.append(_zygote(lib, env).fork(env, str(Path(tmp) / f"rank{rank}.log"), tmp))
        deadline = time.monotonic() + timeout
        try:
            while any(p.poll() is None for p in procs):
                if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
                    time.sleep(1.0)  # let a failing rank's peers report too
                    break
                time.sleep(0.05)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        codes = [p.poll() for p in procs]
        if any(codes):
            logs = "\n".join(f"--- {lib} rank {r} (exit {c}) ---\n" + (Path(tmp) / f"rank{r}.log").read_text(
                errors="replace")[-6000:] for r, c in enumerate(codes))
            raise RankFailure(f"{fn.__name__} failed under {lib}:\n{logs}")
        return [pickle.loads((Path(tmp) / f"rank{r}.pkl").read_bytes()) for r in range(num_processes)]


# Variables that differ from run to run and that no library reads at import: a zygote serves any values.
# (pytest sets PYTEST_CURRENT_TEST for each test: kept in the base, it cost a fresh zygote, ~2.5 s of imports
# per library, in every test.)
PER_RUN = frozenset({"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                     "PARITY_OUT", "PARITY_SPEC", "PYTEST_CURRENT_TEST"})
ZYGOTE_START_TIMEOUT = 120.0  # seconds for its imports (under a loaded suite) and its first fork


class _ForkedRank:
    """A rank forked by a zygote: its pid, and its exit code once the zygote reported it."""

    def __init__(self, zygote: _Zygote, pid: int) -> None:
        self.zygote, self.pid = zygote, pid

    def poll(self) -> int | None:
        return self.zygote.exit_code(self.pid, wait=0.0)

    def wait(self) -> int:
        code = self.zygote.exit_code(self.pid, wait=30.0)
        if code is None:
            raise RankFailure(f"rank pid {self.pid} did not exit 30 s after SIGKILL")
        return code


class _Zygote:
    """One warm parent per library and base environment (see _zygote_main.py)."""

    def __init__(self, lib: str, env: dict[str, str]) -> None:
        # imported here: ranks import this module (through their scenario's) without tests/ on their path
        from process_helpers import SESSION_HELPERS

        ours, theirs = socket.socketpair()
        self.process = subprocess.Popen([sys.executable, str(HERE / "_zygote_main.py"), lib, str(theirs.fileno())],
                                        env=env, cwd=HERE, pass_fds=[theirs.fileno()])
        SESSION_HELPERS.add(self.process.pid)
        theirs.close()
        self.conn = Connection(ours.detach())
        self.exits: dict[int, int] = {}
        self.requests = 0

    def alive(self) -> bool:
        return self.process.poll() is None

    def fork(self, env: dict[str, str], log: str, cwd: str) -> _ForkedRank:
        self.requests += 1
        self.conn.send({"id": self.requests, "env": env, "log": log, "cwd": cwd})
        deadline = time.monotonic() + ZYGOTE_START_TIMEOUT
        while self._receive(deadline - time.monotonic()):
            kind, key, value = self._last
            if kind == "started" and key == self.requests:
                return _ForkedRank(self, value)
        raise RankFailure(f"the parity zygote (pid {self.process.pid}) did not fork a rank within "
                          f"{ZYGOTE_START_TIMEOUT:g} s (exit code {self.process.poll()})")

    def exit_code(self, pid: int, wait: float) -> int | None:
        deadline = time.monotonic() + wait
        while pid not in self.exits and self._receive(max(0.0, deadline - time.monotonic())):
            pass
        return self.exits.get(pid)

    def _receive(self, timeout: float) -> bool:
        """Read one message (within `timeout` s); exits are recorded. False when none came."""
        try:
            if timeout < 0 or not self.conn.poll(timeout):
                return False
            self._last = self.conn.recv()
        except (EOFError, OSError):
            return False
        if self._last[0] == "exited":
            self.exits[self._last[1]] = self._last[2]
        return True

    def stop(self) -> None:
        self.conn.close()
        self.process.kill()
        self.process.wait()
        from process_helpers import SESSION_HELPERS

        SESSION_HELPERS.discard(self.process.pid)


_ZYGOTES: dict[str, tuple[tuple, _Zygote]] = {}


def _zygote(lib: str, env: dict[str, str]) -> _Zygote:
    """The live zygote of `lib` whose environment is `env` but for PER_RUN; a new one when that changed."""
    base = {key: value for key, value in env.items() if key not in PER_RUN}
    key = tuple(sorted(base.items()))
    if lib in _ZYGOTES:
        held_key, zygote = _ZYGOTES[lib]
        if held_key == key and zygote.alive():
            return zygote
        zygote.stop()
    zygote = _Zygote(lib, base)
    _ZYGOTES[lib] = (key, zygote)
    return zygote


@atexit.register
def _stop_zygotes() -> None:
    for _, zygote in _ZYGOTES.values():
        zygote.stop()
    _ZYGOTES.clear()


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


def assert_ranks_same(results: dict[str, list], label: str) -> None:
    """`run_both`'s results rank by rank (`assert_same`), each failure named `label[rank N]` and the path below."""
    theirs, ours = results["accelerate"], results["nbaccel"]
    assert len(theirs) == len(ours), f"{label}: {len(theirs)} ranks under Accelerate, {len(ours)} under nbaccel"
    for rank, (accelerate_value, nbaccel_value) in enumerate(zip(theirs, ours)):
        assert_same(accelerate_value, nbaccel_value, f"{label}[rank {rank}]")
