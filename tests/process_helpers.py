"""Whether the processes a test started still run (zombies waiting to be reaped count as gone)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

# Helpers meant to live as long as the test session (parity_harness's zygotes): not a test's leftovers.
SESSION_HELPERS: set[int] = set()


def started_children(recursive: bool = False) -> list[psutil.Process]:
    """This process's children, zombies included, but for SESSION_HELPERS: what a test started."""
    return [child for child in psutil.Process().children(recursive=recursive) if child.pid not in SESSION_HELPERS]


def live_children() -> list[psutil.Process]:
    """Children (recursively) that are alive, but for SESSION_HELPERS (their own children do count); one that
    exits while being looked at is left out."""
    return [child for child in started_children(recursive=True) if is_alive(child.pid)]


def is_alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie counts as gone)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def kill_and_reap(processes: list[psutil.Process]) -> None:
    """SIGKILL `processes` and reap those that are this process's children: one killed and left unreaped stays a
    zombie child of the test process, and every later test that counts its children would blame itself for it."""
    for process in processes:
        try:
            process.kill()
        except psutil.Error:  # gone already, or not ours to kill
            pass
    psutil.wait_procs(processes, timeout=10)


def all_gone(pids: list[int], within: float = 10.0) -> bool:
    """Wait up to `within` seconds for every process in `pids` to end; True once none runs."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not any(is_alive(pid) for pid in pids):
            return True
        time.sleep(0.1)
    return False


LIBRARY_PREFIXES = ("ACCELERATE_", "NBACCEL_")


def environment_without(*prefixes: str) -> dict[str, str]:
    """This process's environment without the variables that start with `prefixes` (default: Accelerate's and
    nbaccel's own), for a child that must see neither library's settings from the test run."""
    prefixes = prefixes or LIBRARY_PREFIXES
    return {key: value for key, value in os.environ.items() if not key.startswith(prefixes)}


def run_in_session(command: list[str], env: dict[str, str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """Run `command` in a session of its own, stdout and stderr together; past `timeout` seconds its whole
    process group is killed (a launcher's ranks included) and the test fails with the end of the output."""
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    try:
        out, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, _ = process.communicate()
        pytest.fail(f"{command} ran past {timeout} s:\n{out[-4000:]}")
    return subprocess.CompletedProcess(command, process.returncode, out)


# The first lines of a fresh interpreter whose import of one module is held (in a meta-path finder, the package
# above it half run) until the test opens its gate, while the main thread is interrupted there, as a kernel's
# stop button does. `interrupted_then_again(first, again)` runs `first` with the hold in place, then `again`,
# printing "interrupted" (or "not interrupted") and "again" with `again`'s result.
_HELD_IMPORT = """
import os, signal, sys, threading, time
gate, held = sys.argv[1], sys.argv[2]

def _wait_for(name):
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(gate, name)) and time.monotonic() < deadline:
        time.sleep(0.02)

class _Held:
    def find_spec(self, name, path=None, target=None):
        if name == held:
            open(os.path.join(gate, "reached"), "w").close()
            _wait_for("open")
            sys.meta_path.remove(self)
        return None

def _interrupt_then_open():
    _wait_for("reached")
    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
    time.sleep(0.3)
    open(os.path.join(gate, "open"), "w").close()

def interrupted_then_again(first, again):
    sys.meta_path.insert(0, _Held())
    threading.Thread(target=_interrupt_then_open, daemon=True).start()
    try:
        first()
        print("not interrupted")
    except KeyboardInterrupt:
        print("interrupted")
    print("again", again())
"""


def run_interrupted_in_import(held: str, code: str, gate: Path,
                              env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run `code` (which calls `interrupted_then_again`) in a fresh interpreter whose import of module `held` is
    held and interrupted (`gate`: an empty folder for the hold's files)."""
    return subprocess.run([sys.executable, "-c", _HELD_IMPORT + code, str(gate), held], capture_output=True,
                          text=True, timeout=120, env=env)
