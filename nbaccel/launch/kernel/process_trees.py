"""Process trees: stop ranks and everything they started (their process groups, their descendants) without
leftovers; name the signal that ended one."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable
from typing import Any

STOP_GRACE = 1.0  # seconds between SIGTERM and SIGKILL
_PROC_STAT = os.path.exists(f"/proc/{os.getpid()}/stat")  # Linux: a process's state is in /proc/<pid>/stat


def signal_name(exitcode: int | None) -> str | None:
    """The signal that ended a process with this multiprocessing exit code (negative), e.g. "SIGKILL"."""
    if exitcode is None or exitcode >= 0:
        return None
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


def descendants(pids: Iterable[int]) -> list[int]:
    """Every live descendant of `pids` (e.g. data loader workers a rank started)."""
    try:
        import psutil
    except ImportError:
        return []
    found = []
    for pid in pids:
        try:
            found += [child.pid for child in psutil.Process(pid).children(recursive=True)]
        except Exception:
            continue
    return found


def started_with(variable: str, value: str) -> list[int]:
    """The processes whose environment, as they were started with it, holds `variable=value` (Linux's
    /proc/<pid>/environ; elsewhere none; never this process). A launch's ranks pass their environment down to
    what they start, so this finds a rank's leftover that left every tree and group of the launch: one started
    in a session of its own, whose rank died (its parent is then pid 1). ~7 us per process of this user."""
    if not _PROC_STAT:
        return []
    entry = b"\0" + f"{variable}={value}".encode() + b"\0"
    own = os.getpid()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == own:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as environ:
                if entry in b"\0" + environ.read() + b"\0":
                    found.append(int(name))
        except OSError:  # another user's, a kernel thread's, or ended since
            continue
    return found


def stop_processes(processes: Iterable[Any], grace: float = STOP_GRACE) -> None:
    """Stop every rank (multiprocessing.Process-like) and everything it started: SIGTERM to each rank's process
    group (worker/parent_death.py `lead_own_group`: its children are there, also those of a rank already dead)
    and to each live rank or descendant outside those groups, once per process; SIGKILL what is left after
    `grace` seconds; reap the ranks."""
    processes = list(processes)
    leaders = [proc.pid for proc in processes if proc.pid is not None]
    alive = [proc for proc in processes if proc.is_alive()]
    if not alive and not groups_alive(leaders):
        return
    extra = descendants(proc.pid for proc in alive)  # e.g. a child that made a session of its own
    try:
        outside = outside_groups([proc.pid for proc in alive] + extra, leaders)  # before: see outside_groups
        signal_groups(leaders, signal.SIGTERM)
        for pid in outside:
            _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in alive:
            proc.join(max(0.0, deadline - time.monotonic()))
        while time.monotonic() < deadline and groups_alive(leaders):
            time.sleep(0.02)
    finally:  # also when interrupted again while waiting: nothing may outlive the launch
        for proc in alive:
            if proc.is_alive():
                _signal(proc.pid, signal.SIGKILL)
        signal_groups(leaders, signal.SIGKILL)
        for pid in extra:
            _signal(pid, signal.SIGKILL)
        for proc in alive:
            proc.join(5)
        _reap(extra)


def kill_pids(pids: Iterable[int], grace: float = STOP_GRACE, sig: int = signal.SIGTERM) -> None:
    """Like stop_processes for bare pids (workers another launcher started, e.g. torch elastic), with `sig`
    first (`nbaccel launch` passes on the signal it got, as torchrun does)."""
    leaders = list(pids)
    pids = leaders + descendants(leaders)
    outside = outside_groups(pids, leaders)
    signal_groups(leaders, sig)
    for pid in outside:
        _signal(pid, sig)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and (any(process_running(pid) for pid in pids) or groups_alive(leaders)):
        time.sleep(0.02)
    for pid in pids:
        _signal(pid, signal.SIGKILL)
    signal_groups(leaders, signal.SIGKILL)
    _reap(pids)


def stop_groups(leaders: Iterable[int], grace: float = STOP_GRACE, strays: Iterable[int] = ()) -> None:
    """SIGTERM the process groups these ranks led (the ranks themselves are gone) and the `strays` (processes
    of the ranks outside those groups), SIGKILL what is left of them after `grace` seconds."""
    leaders = list(leaders)
    strays = [pid for pid in strays if process_running(pid)]
    if not strays and not groups_alive(leaders):
        return
    signal_groups(leaders, signal.SIGTERM)
    for pid in strays:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and (groups_alive(leaders) or any(process_running(pid) for pid in strays)):
        time.sleep(0.02)
    signal_groups(leaders, signal.SIGKILL)
    for pid in strays:
        _signal(pid, signal.SIGKILL)


def outside_groups(pids: Iterable[int], leaders: Iterable[int]) -> list[int]:
    """The live `pids` that a signal to the process groups the `leaders` lead does not reach. Each process gets
    the stop signal once: a rank signalled by pid and again through its group ran its SIGTERM handler (a
    checkpoint save) a second time, from inside the first. Asked before the groups are signalled: a rank that
    makes its group in between then gets the signal twice, rather than not at all."""
    groups = {pid for pid in leaders if pid > 1 and pid != os.getpgrp()}
    found = []
    for pid in pids:
        try:
            if os.getpgid(pid) in groups:
                continue
        except OSError:  # ended
            continue
        found.append(pid)
    return found


def signal_groups(leaders: Iterable[int], sig: int) -> None:
    """Send `sig` to the process group each rank leads (its pid), whether the rank is alive or not: the group
    lives while any process the rank started does. Never this process's own group (a rank that had not made
    its group yet has none: the signal goes nowhere)."""
    own = os.getpgrp()
    for pid in leaders:
        if pid > 1 and pid != own:
            try:
                os.killpg(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


def groups_alive(leaders: Iterable[int]) -> bool:
    """Whether a process of any of these ranks' groups is still running (zombies waiting to be reaped by
    their parent count as gone)."""
    own = os.getpgrp()
    groups = {pid for pid in leaders if pid > 1 and pid != own and _group_exists(pid)}
    if not groups:
        return False
    try:
        import psutil
    except ImportError:  # without psutil: whether the groups still exist at all
        return any(_group_exists(pid) for pid in groups)
    for proc in psutil.process_iter(["status"]):
        try:
            if os.getpgid(proc.pid) in groups and proc.info["status"] != psutil.STATUS_ZOMBIE:
                return True
        except (OSError, psutil.Error):
            continue
    return False


def _group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def process_running(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, ended but not yet reaped by its parent, has ended)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    if _PROC_STAT:  # its state in /proc: the supervisor asks for each rank at every round, psutil took ~0.1 ms
        try:
            with open(f"/proc/{pid}/stat", "rb") as stat:
                return stat.read().rpartition(b")")[2][1:2] not in (b"Z", b"X", b"")
        except FileNotFoundError:  # ended since
            return False
        except OSError:
            pass
    try:
        import psutil

        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except Exception:
        return False


def _reap(pids: Iterable[int]) -> None:
    for pid in pids:
        try:
            os.waitpid(pid, os.WNOHANG)
        except (ChildProcessError, OSError):
            pass


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
