"""Every process group a launch's ranks lead, whoever started the ranks: the one way every launcher tracks
what its ranks started.

Each rank leads a process group of its own (worker/parent_death.py `lead_own_group`; torch elastic's
`nbaccel launch` ranks are session leaders) and registers it, as an empty file named by its number, in the
launch's owner-only folder that RANK_GROUPS_ENV names (a rank without nbaccel's Python, `--no_python`, through
worker/exec_entry.py). So the launcher knows the group of every rank that ever ran, also of one torch elastic
started, saw die and restarted, and of one that died before the launcher saw it. The variable stays in the rank's
environment: what the rank starts inherits it, which marks a leftover that left the rank's group. `RankGroups`:
- `stop_orphans()`: while the launch runs, SIGTERM the group of each registered rank that has ended (what it
  left running, holding its output pipes, ends with it);
- `end()` then `close()`: when the launch ends, stop every registered group and every process whose environment
  names the folder (what a rank started in a session of its own: SIGTERM, SIGKILL after `grace`), then signal
  the keeper; `close` removes the folder and reaps the keeper (the caller's own cleanup can run
  in between, while the keeper exits);
- the keeper (kernel/group_keeper.sh), a small shell process started first: when the kernel dies before `close`
  (SIGKILL, the OOM killer), it stops the registered groups, and the processes that name the folder, itself.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal

from ...utils.constants import RANK_GROUPS_ENV
from ..private_dirs import GROUPS_PREFIX, KEEPER_PREFIX, make_user_dir, remove_dir
from .interrupts import interrupts_held
from .process_trees import STOP_GRACE, process_running, signal_groups, started_with, stop_groups

KEEPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "group_keeper.sh")


class RankGroups:
    """The registry of one launch's (or pool's) rank groups and its keeper. Make it before any rank starts: the
    keeper starts here (`spawn_keeper`, ~0.1 ms quiet), so it runs before any rank can start anything."""

    def __init__(self) -> None:
        self.folder = make_user_dir(GROUPS_PREFIX)
        self._stopped: set[int] = set()  # groups of ended ranks already sent SIGTERM by stop_orphans
        self._keeper: int | None = None  # its pid
        self._ended = False  # `end` ran: the groups were stopped and the keeper signalled
        try:
            self._start_keeper()
        except BaseException:  # interrupted: the keeper must not outlive the launch that never got this object
            self.close()
            raise

    def _start_keeper(self) -> None:
        # an interrupt waits meanwhile: a KeyboardInterrupt between the spawn and keeping its pid would leave the
        # keeper running unknown
        with interrupts_held():
            try:
                self._keeper = spawn_keeper(self.folder)
            except OSError:  # no keeper: the launch still stops every group, unless the kernel itself is killed
                self._keeper = None
                return
            # named in the folder: another launch that sweeps dead kernels' folders (private_dirs.py) leaves
            # this one to its keeper, which still has to read it after this kernel's death
            _touch(self.folder, f"{KEEPER_PREFIX}{self._keeper}")

    def environ(self) -> dict[str, str]:
        """What the ranks' environment needs to register their groups."""
        return {RANK_GROUPS_ENV: self.folder}

    def leaders(self) -> list[int]:
        """The registered groups (each one's number is its rank's pid)."""
        return registered(self.folder)

    def stop_orphans(self) -> None:
        """SIGTERM the group of every registered rank that has ended, once (its leftovers; the rank's own
        launcher reaps the rank). Cheap enough for every round of the supervisor: one folder listing and a
        signal 0 per rank."""
        ended = [pid for pid in self.leaders() if pid not in self._stopped and not process_running(pid)]
        if ended:
            self._stopped.update(ended)
            signal_groups(ended, signal.SIGTERM)

    def stop(self, grace: float = STOP_GRACE) -> None:
        """Stop every registered group (its rank, if still alive, with it) and every process that still carries
        this launch's folder in the environment it started with (a rank's leftover in a session of its own,
        its rank dead: in no group and no tree of the launch): SIGTERM, SIGKILL after `grace` s."""
        stop_groups(self.leaders(), grace, strays=started_with(RANK_GROUPS_ENV, self.folder))

    def end(self, grace: float = STOP_GRACE) -> None:
        """Stop every registered group and signal the keeper to end (it is reaped by `close`: the caller can
        do its own cleanup meanwhile, while the keeper exits)."""
        self._ended = True
        try:
            self.stop(grace)
        finally:
            self._signal_keeper()

    def close(self, grace: float = STOP_GRACE) -> None:
        """Stop every registered group, end the keeper and remove the folder (`end` first, if not yet)."""
        try:
            if not self._ended:
                self.end(grace)
        finally:
            self._signal_keeper()
            remove_dir(self.folder)
            if self._keeper is not None:
                _reap(self._keeper)
                self._keeper = None

    def _signal_keeper(self) -> None:
        if self._keeper is not None:  # the script and its `sleep`: the session it leads (not reaped yet)
            with contextlib.suppress(OSError):
                os.killpg(self._keeper, signal.SIGKILL)


def spawn_keeper(folder: str) -> int:
    """Start kernel/group_keeper.sh for `folder` in a session of its own, its stdin/stdout/stderr on /dev/null and
    no other file of the kernel open; return its pid. `os.posix_spawn`, not `subprocess.Popen`: none of Popen's
    Python work or exec-status pipe (~0.07 ms quiet; the calling thread, GIL held, waits for the script's exec).
    Before the forks, not alongside them: a fork copying the kernel's page tables holds its memory map, which
    the spawn's stack allocation waits for (8 ms measured)."""
    devnull = os.devnull
    actions = [(os.POSIX_SPAWN_OPEN, 0, devnull, os.O_RDONLY, 0), (os.POSIX_SPAWN_OPEN, 1, devnull, os.O_WRONLY, 0),
               (os.POSIX_SPAWN_DUP2, 1, 2)]
    argv = ["/bin/sh", KEEPER, str(os.getpid()), folder]
    env = {"PATH": os.environ.get("PATH", os.defpath)}
    spawn = functools.partial(os.posix_spawn, argv[0], argv, env, setsid=True, setsigmask=(),
                              setsigdef=(signal.SIGPIPE, signal.SIGXFSZ))
    try:
        return spawn(file_actions=actions + [(os.POSIX_SPAWN_CLOSE, fd) for fd in _inherited_fds()])
    except OSError:  # e.g. one of those closed meanwhile by another thread: without the closes
        return spawn(file_actions=actions)


def _inherited_fds() -> list[int]:
    """This process's file descriptors above 2 that a child would inherit (Python opens its own non-inheritable,
    PEP 446; what the kernel's own parent passed down is not): the keeper, which outlives a killed kernel by a
    second or two, must not hold a pipe someone waits to see closed."""
    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:
        return []
    inherited = []
    for fd in fds:
        try:
            if fd > 2 and os.get_inheritable(fd):
                inherited.append(fd)
        except OSError:  # the listing's own descriptor, closed since
            pass
    return inherited


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


def _touch(folder: str, name: str) -> None:
    with contextlib.suppress(OSError):
        os.close(os.open(os.path.join(folder, name), os.O_WRONLY | os.O_CREAT, 0o600))


def registered(folder: str | None) -> list[int]:
    """The groups registered in a launch's folder (none when there is no folder)."""
    if not folder:
        return []
    try:
        return [int(name) for name in os.listdir(folder) if name.isdigit()]
    except OSError:
        return []

