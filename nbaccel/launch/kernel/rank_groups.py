"""Every process group a launch's ranks lead, whoever started the ranks: the one way every launcher tracks
what its ranks started.

Each rank leads a process group of its own (worker/parent_death.py `lead_own_group`; torch elastic's
`nbaccel launch` ranks are session leaders) and registers it, as an empty file named by its number, in the
launch's owner-only folder that RANK_GROUPS_ENV names (a rank without nbaccel's Python, `--no_python`, through
worker/exec_entry.py). So the launcher knows the group of every rank that ever ran, also of one torch elastic
started, saw die and restarted, and of one that died before the launcher saw it. `RankGroups`:
- `stop_orphans()`: while the launch runs, SIGTERM the group of each registered rank that has ended (what it
  left running, holding its output pipes, ends with it);
- `close()`: when the launch ends, stop every registered group (SIGTERM, SIGKILL after `grace`), then end the
  keeper and remove the folder;
- the keeper (kernel/group_keeper.sh), a small shell process started first: when the kernel dies before `close`
  (SIGKILL, the OOM killer), it stops the registered groups itself.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess

from ...utils.constants import RANK_GROUPS_ENV
from ..private_dirs import GROUPS_PREFIX, KEEPER_PREFIX, make_user_dir, remove_dir
from .interrupts import interrupts_held
from .process_trees import STOP_GRACE, process_running, signal_groups, stop_groups

KEEPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "group_keeper.sh")


class RankGroups:
    """The registry of one launch's (or pool's) rank groups and its keeper. Make it before any rank starts."""

    def __init__(self) -> None:
        self.folder = make_user_dir(GROUPS_PREFIX)
        self._stopped: set[int] = set()  # groups of ended ranks already sent SIGTERM by stop_orphans
        self._keeper: subprocess.Popen | None = None
        try:
            self._start_keeper()
        except BaseException:  # interrupted: the keeper must not outlive the launch that never got this object
            self.close()
            raise

    def _start_keeper(self) -> None:
        # an interrupt waits meanwhile: a KeyboardInterrupt inside Popen would leave the keeper running unknown
        with interrupts_held():
            try:
                self._keeper = subprocess.Popen(
                    ["/bin/sh", KEEPER, str(os.getpid()), self.folder], stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
            except OSError:  # no keeper: the launch still stops every group, unless the kernel itself is killed
                self._keeper = None
                return
            # named in the folder: another launch that sweeps dead kernels' folders (private_dirs.py) leaves
            # this one to its keeper, which still has to read it after this kernel's death
            with contextlib.suppress(OSError):
                os.close(os.open(os.path.join(self.folder, f"{KEEPER_PREFIX}{self._keeper.pid}"),
                                 os.O_WRONLY | os.O_CREAT, 0o600))

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
        """Stop every registered group (its rank, if still alive, with it): SIGTERM, SIGKILL after `grace` s."""
        stop_groups(self.leaders(), grace)

    def close(self, grace: float = STOP_GRACE) -> None:
        """Stop every registered group, end the keeper and remove the folder."""
        try:
            self.stop(grace)
        finally:
            if self._keeper is not None:  # the script and its `tail`: the session it leads
                with contextlib.suppress(OSError):
                    os.killpg(self._keeper.pid, signal.SIGKILL)
                self._keeper.wait()
                self._keeper = None
            remove_dir(self.folder)


def registered(folder: str | None) -> list[int]:
    """The groups registered in a launch's folder (none when there is no folder)."""
    if not folder:
        return []
    try:
        return [int(name) for name in os.listdir(folder) if name.isdigit()]
    except OSError:
        return []

