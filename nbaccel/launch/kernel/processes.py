"""Worker processes: pick a safe start method, find free ports, and stop process trees without leftovers."""

from __future__ import annotations

import contextlib
import gc
import importlib
import multiprocessing as mp
import os
import signal
import socket
import sys
import time
from collections.abc import Iterable, Iterator
from multiprocessing.context import BaseContext
from typing import Any

from ...utils.constants import START_METHODS
from ..errors import PortInUseError
from ..messages import PRELOADABLE_MODULES

STOP_GRACE = 1.0  # seconds between SIGTERM and SIGKILL


def accelerator_initialized() -> str | None:
    """Name the accelerator runtime already initialized in this process (which makes fork unsafe), or None.

    Only looks at modules already imported: it never imports torch or initializes a device itself.
    """
    torch = sys.modules.get("torch")
    if torch is not None:
        cuda = getattr(torch, "cuda", None)
        if cuda is not None and _call(getattr(cuda, "is_initialized", None)):
            return "ROCm (HIP)" if getattr(torch.version, "hip", None) else "CUDA"
        xpu = getattr(torch, "xpu", None)
        if xpu is not None and _call(getattr(xpu, "is_initialized", None)):
            return "XPU"
        npu = getattr(torch, "npu", None)
        if npu is not None and _call(getattr(npu, "is_initialized", None)):
            return "NPU"
    if "torch_xla" in sys.modules:
        runtime = sys.modules.get("torch_xla.runtime")
        if runtime is not None and _call(getattr(runtime, "is_initialized", None)):
            return "XLA"
    return None


def _call(fn: Any) -> bool:
    try:
        return bool(fn()) if callable(fn) else False
    except Exception:
        return False


def check_start_method(requested: str | None) -> None:
    if requested is not None and requested not in START_METHODS:
        raise ValueError(f"start_method={requested!r} is not one of {START_METHODS} (or None to choose automatically)")


def choose_start_method(requested: str | None) -> tuple[str, str | None]:
    """Return (start method, note for the user or None).

    None picks fork where it is safe: not on macOS (system libraries are not fork-safe there) and not after
    an accelerator runtime was initialized in this process (a forked child cannot use it). Otherwise spawn,
    with a one-line note saying why. An explicit "fork" in an unsafe state raises ValueError.
    """
    check_start_method(requested)
    if sys.platform == "win32":
        raise RuntimeError(
            "notebook_launcher needs Linux or macOS to run more than one process (it captures each worker's "
            "output at the file-descriptor level); on Windows use WSL, or num_processes=1."
        )
    runtime = accelerator_initialized()
    reason = None
    if runtime:
        reason = f"{runtime} is already initialized in this kernel"
    elif sys.platform == "darwin":
        reason = "fork is not safe on macOS"
    if requested == "fork" and reason:
        hint = (
            "Restart the kernel and keep device calls (e.g. .cuda(), torch.cuda.*) inside the training function, "
            if runtime
            else ""
        )
        raise ValueError(
            f"start_method='fork' is unsafe here: {reason}, and a forked worker cannot use it. "
            f"{hint}or pass start_method='spawn' (or None to choose automatically)."
        )
    if requested is not None:
        return requested, None
    if reason:
        return "spawn", f"Using start_method='spawn' because {reason} (fork would break the workers)."
    return "fork", None


def get_context(start_method: str) -> BaseContext:
    return mp.get_context(start_method)


@contextlib.contextmanager
def gc_frozen(start_method: str) -> Iterator[None]:
    """Fork workers with the kernel's objects in gc's permanent generation (gc.freeze), thawed afterwards.

    A garbage collection walks every tracked object and writes to its header: after a fork that copies
    the shared memory pages, in each worker (a training loop collects often) and in the kernel. Frozen
    objects are skipped, so the workers keep sharing the kernel's memory (what the Python docs advise for
    fork). The launch benchmark shows no speed change; the gain is memory with a large kernel heap.
    """
    if start_method != "fork":
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@contextlib.contextmanager
def main_module_hidden(start_method: str) -> Iterator[None]:
    """While starting spawn/forkserver workers, keep multiprocessing from re-running `__main__` in them.

    The payload is cloudpickled by value, so workers never need the kernel's `__main__` (a notebook's is
    ipykernel's launcher; a script's would re-run its top level without an `if __name__` guard).
    """
    main = sys.modules.get("__main__")
    if start_method == "fork" or main is None:
        yield
        return
    saved = {key: main.__dict__[key] for key in ("__file__", "__spec__") if key in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def check_port_free(port: int, host: str = "127.0.0.1") -> None:
    """Raise PortInUseError naming `port` if something listens on it (or it cannot be bound) on `host`."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise PortInUseError(
                f"use_port={port} is already in use on {host} ({exc.strerror}). Another launch or program holds "
                "it: pass a different use_port, or use_port=None to pick a free one."
            ) from None


def is_loopback_address(host: str) -> bool:
    """Whether `host` names this machine's loopback interface (127.x, ::1, localhost)."""
    if host in ("localhost", "::1") or host.startswith("127."):
        return True
    try:
        return socket.gethostbyname(host).startswith("127.")
    except OSError:
        return False


def interface_addresses() -> set[str]:
    """The addresses of this machine's network interfaces (IPv4 and IPv6), via psutil."""
    try:
        import psutil

        return {entry.address.split("%")[0] for entries in psutil.net_if_addrs().values() for entry in entries
                if entry.family in (socket.AF_INET, socket.AF_INET6)}
    except Exception:
        return set()


def is_local_address(host: str) -> bool:
    """Whether `host` is this machine: loopback, the wildcard, its host name or one of its interfaces'
    addresses (e.g. its LAN address), so a port on it can be checked before anything starts."""
    if host in ("0.0.0.0", socket.gethostname()) or is_loopback_address(host):
        return True
    try:
        address = socket.gethostbyname(host)
    except OSError:
        return False
    return address in interface_addresses()


def bind_address(host: str) -> str:
    """The address to test a port on for a local `host`: loopback for names of it and the wildcard, else the
    host's own address (a port can be busy on the LAN address only)."""
    if host in ("localhost", "0.0.0.0") or is_loopback_address(host):
        return "127.0.0.1"
    try:
        return socket.gethostbyname(host)
    except OSError:
        return host


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


def stop_processes(processes: Iterable[Any], grace: float = STOP_GRACE) -> None:
    """Stop every rank (multiprocessing.Process-like) and everything it started: SIGTERM to each live rank,
    to each rank's process group (worker/parent_death.py `lead_own_group`: its children are there, also
    those of a rank already dead) and to live descendants that left it; SIGKILL what is left after `grace`
    seconds; reap the ranks."""
    processes = list(processes)
    leaders = [proc.pid for proc in processes if proc.pid is not None]
    alive = [proc for proc in processes if proc.is_alive()]
    if not alive and not groups_alive(leaders):
        return
    extra = descendants(proc.pid for proc in alive)  # e.g. a child that made a session of its own
    try:
        for proc in alive:
            _signal(proc.pid, signal.SIGTERM)
        signal_groups(leaders, signal.SIGTERM)
        for pid in extra:
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


def kill_pids(pids: Iterable[int], grace: float = STOP_GRACE) -> None:
    """Like stop_processes for bare pids (workers another launcher started, e.g. torch elastic)."""
    leaders = list(pids)
    pids = leaders + descendants(leaders)
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    signal_groups(leaders, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and (any(process_running(pid) for pid in pids) or groups_alive(leaders)):
        time.sleep(0.02)
    for pid in pids:
        _signal(pid, signal.SIGKILL)
    signal_groups(leaders, signal.SIGKILL)
    _reap(pids)


def stop_groups(leaders: Iterable[int], grace: float = STOP_GRACE) -> None:
    """SIGTERM the process groups these ranks led (the ranks themselves are gone), SIGKILL what is left of
    them after `grace` seconds."""
    leaders = list(leaders)
    if not groups_alive(leaders):
        return
    signal_groups(leaders, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and groups_alive(leaders):
        time.sleep(0.02)
    signal_groups(leaders, signal.SIGKILL)


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


_learned_imports: set[str] = set()  # PRELOADABLE_MODULES that ranks of this kernel's launches imported


def learn_rank_imports(names: Iterable[str]) -> None:
    """Remember which PRELOADABLE_MODULES a launch's rank imported (from its `result` message)."""
    _learned_imports.update(name for name in names if name in PRELOADABLE_MODULES)


def preload_worker_modules(start_method: str, *, launch: bool = False) -> None:
    """Under fork, import in the kernel what every rank imports before the user's code runs: the ranks
    inherit the loaded modules instead of each importing them again (`nbaccel.state` and what it pulls in
    cost 0.3-0.9 s per rank on a loaded 2-core machine; see docs/internals.md "Where the time goes").

    `launch`: a launch's ranks are new processes each time, so what they import they paid at every launch.
    Also `nbaccel.accelerator` (~50 ms), and the PRELOADABLE_MODULES an earlier launch's ranks imported:
    torch._dynamo, which every torch optimizer imports when the first one is built (2.3 s of CPU and 69 MiB
    here). Only once a launch showed it is needed: a launch that builds no optimizer never pays for it, and the
    kernel's import takes what the ranks' took at the same time. RankPool leaves these out: its ranks live
    on and pay them once, and its start stays fast.
    """
    if start_method != "fork":
        return
    from ... import state  # noqa: F401
    from ...utils import collective_trace  # noqa: F401

    if launch:
        from ... import accelerator  # noqa: F401

        for name in sorted(name for name in _learned_imports if name not in sys.modules):
            with contextlib.suppress(Exception):  # a broken module: the ranks import it or fail as before
                importlib.import_module(name)


@contextlib.contextmanager
def resource_tracker_scope() -> Iterator[None]:
    """Stop multiprocessing's helper processes afterwards if this launch started them: the resource
    tracker (spawn and forkserver start it) and the fork server.

    Otherwise every such launch would leave a helper process behind for the life of the kernel.
    """
    from multiprocessing import forkserver, resource_tracker

    helpers = [(getattr(resource_tracker, "_resource_tracker", None), "_pid"),
               (getattr(forkserver, "_forkserver", None), "_forkserver_pid")]
    running = [getattr(helper, attr, None) is not None for helper, attr in helpers]
    interrupted = False
    try:
        yield
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:
        started = [helper for (helper, attr), was_running in zip(reversed(helpers), reversed(running))
                   if helper is not None and not was_running and getattr(helper, attr, None) is not None]
        if started:
            # The tracker unlinks, as leaked, every semaphore still registered when it stops: collect what the
            # launch left unreferenced first (torch elastic's spawn-context queues and event), or their
            # finalizers fail later on names already gone ("Exception ignored ... sem_unlink ..."). Interrupted,
            # only the young generations (the launch's own objects): a full collection of a kernel's heap took
            # seconds on a busy machine, and an interrupt ends the launch within seconds.
            gc.collect(1 if interrupted else 2)
        for helper in started:
            try:
                helper._stop()
            except Exception:
                pass
