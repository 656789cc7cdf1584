"""How many rank processes this machine can start: checked before a launch starts any.

`notebook_launcher`, `RankPool` and `nbaccel launch` call `check_process_count(n)` with the number of
processes they would start on this machine. Without the check, `num_processes=10**6` starts processes until
the launcher runs out of file descriptors minutes later. The limits, each from this machine:

- open files: the launcher holds about `DESCRIPTORS_PER_RANK` descriptors per rank (pipes for its output,
  the control channel, the process handle); the soft RLIMIT_NOFILE minus what is open now bounds the ranks;
- processes: the soft RLIMIT_NPROC, when set;
- memory: each rank needs at least `MEMORY_PER_RANK` bytes of the memory available now (a Python process
  with torch imported takes more);
- oversubscription: more than `RANKS_PER_CORE` ranks per CPU core or accelerator (and at least
  `MIN_RANK_LIMIT`) cannot make progress worth having.

`NBACCEL_MAX_PROCESSES=N` replaces these estimates with N: counts up to N start without them, larger ones
are refused. Set it deliberately (e.g. many tiny CPU ranks that do almost nothing).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

MAX_PROCESSES_ENV = "NBACCEL_MAX_PROCESSES"
DESCRIPTORS_PER_RANK = 8  # measured: 6 to 7 per rank in the launcher (notebook_launcher and RankPool)
DESCRIPTORS_RESERVED = 64  # for the launcher's own files, sockets and the dashboard
MEMORY_PER_RANK = 64 << 20
RANKS_PER_CORE = 16
MIN_RANK_LIMIT = 64


class ProcessCountError(ValueError):
    """More processes than this machine can start; the message names the limit and how to override it."""


@dataclass(frozen=True)
class RankLimit:
    """One bound on the number of ranks: at most `ranks`, because of `reason`."""

    ranks: int
    reason: str


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _open_descriptors() -> int:
    for folder in ("/proc/self/fd", "/dev/fd"):
        try:
            return len(os.listdir(folder))
        except OSError:
            continue
    return 0


def _available_memory() -> int | None:
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:  # psutil missing or unsupported here: no memory bound
        return None


def machine_limits(accelerators: int = 0) -> list[RankLimit]:
    """The bounds this machine puts on the number of ranks of one launch, each with its reason."""
    limits = []
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY:
            free = soft - _open_descriptors() - DESCRIPTORS_RESERVED
            limits.append(RankLimit(max(free // DESCRIPTORS_PER_RANK, 1), (
                f"the open-file limit (RLIMIT_NOFILE, `ulimit -n`: {soft}, {_open_descriptors()} open now) "
                f"allows about that many at {DESCRIPTORS_PER_RANK} descriptors per rank")))
        nproc = getattr(resource, "RLIMIT_NPROC", None)
        if nproc is not None:
            soft, _ = resource.getrlimit(nproc)
            if soft != resource.RLIM_INFINITY:
                limits.append(RankLimit(soft, f"the process limit (RLIMIT_NPROC, `ulimit -u`) is {soft}"))
    except ImportError:  # not on POSIX
        pass
    available = _available_memory()
    if available is not None:
        limits.append(RankLimit(max(available // MEMORY_PER_RANK, 1), (
            f"{available >> 20} MiB of memory is available, at least {MEMORY_PER_RANK >> 20} MiB per rank")))
    units = max(_cpu_count(), accelerators)
    what = f"{_cpu_count()} CPU core(s)" + (f" and {accelerators} accelerator(s)" if accelerators else "")
    limits.append(RankLimit(max(RANKS_PER_CORE * units, MIN_RANK_LIMIT),
                            f"{RANKS_PER_CORE} ranks per core or accelerator is the most that progresses ({what})"))
    return limits


def check_process_count(count: int, *, accelerators: int = 0, name: str = "num_processes") -> None:
    """ProcessCountError, before anything starts, when `count` processes on this machine exceed a limit of
    `machine_limits` (or `NBACCEL_MAX_PROCESSES` when set). `name` is how the caller's user spelled the
    argument (`num_processes`, `--num_processes`)."""
    override = os.environ.get(MAX_PROCESSES_ENV, "").strip()
    if override:
        try:
            maximum = int(override)
        except ValueError:
            raise ProcessCountError(f"{MAX_PROCESSES_ENV}={override[:40]!r} is not a whole number of processes: "
                                    "unset it or give the largest number of ranks to accept") from None
        if count > maximum:
            raise ProcessCountError(f"{name}={count} is above {MAX_PROCESSES_ENV}={maximum}: lower {name}, or "
                                    f"raise {MAX_PROCESSES_ENV}.")
        return
    exceeded = [limit for limit in machine_limits(accelerators) if count > limit.ranks]
    if not exceeded:
        return
    reasons = "; ".join(f"at most {limit.ranks}: {limit.reason}" for limit in sorted(exceeded, key=lambda x: x.ranks))
    raise ProcessCountError(
        f"{name}={count} is more processes than this machine can start ({reasons}). Nothing was started. "
        f"Lower {name}, or raise the limit named (`ulimit -n`, `ulimit -u`); or, if you mean it, set {MAX_PROCESSES_ENV}={count} "
        "to skip these estimates."
    )
