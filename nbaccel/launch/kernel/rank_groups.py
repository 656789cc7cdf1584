"""Every process group a launch's ranks lead, whoever started the ranks: the one way every launcher tracks
what its ranks started.

Each rank leads a process group of its own (worker/parent_death.py `lead_own_group`; torch elastic's
`nbaccel launch` ranks are session leaders) and registers it, as an empty file named by its number, in the
launch's owner-only folder that RANK_GROUPS_ENV names (a rank without nbaccel's Python, `--no_python`, through
worker/exec_entry.py). So the launcher knows the group of every rank that ever ran, also of one torch elastic
started, saw die and restarted, and of one that died before the launcher saw it. `RankGroups`:
- `stop_orphans()`: while the launch runs, SIGTERM the group of each registered rank that has ended (what it
  left running, holding its output pipes, ends with it);
- `end()` then `close()`: when the launch ends, stop every registered group (SIGTERM, SIGKILL after `grace`),
  then signal the keeper; `close` removes the folder and reaps the keeper (the caller's own cleanup can run
  in between, while the keeper exits);
- the keeper (kernel/group_keeper.sh), a small shell process started first: when the kernel dies before `close`
  (SIGKILL, the OOM killer), it stops the registered groups itself.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from concurrent.futures import Future

from ...utils.constants import RANK_GROUPS_ENV
from ..private_dirs import GROUPS_PREFIX, KEEPER_PREFIX, NO_KEEPER, make_user_dir, remove_dir
from .fork_thread import run_soon
from .interrupts import interrupts_held
from .process_trees import STOP_GRACE, process_running, signal_groups, stop_groups

KEEPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "group_keeper.sh")


class RankGroups:
    """The registry of one launch's (or pool's) rank groups and its keeper. Make it before any rank starts.

    `keeper_now=False`: the keeper is started by `start_keeper_soon` instead, while the ranks start (ranks that
    wait for it before they run user code: worker/parent_death.py `wait_for_keeper`)."""

    def __init__(self, keeper_now: bool = True) -> None:
        self.folder = make_user_dir(GROUPS_PREFIX)
        self._stopped: set[int] = set()  # groups of ended ranks already sent SIGTERM by stop_orphans
        self._keeper: subprocess.Popen | None = None
        self._ended = False  # `end` ran: the groups were stopped and the keeper signalled
        self._starting: Future | None = None  # `start_keeper_soon`'s job in the fork thread
        try:
            if keeper_now:
                self._start_keeper()
        except BaseException:  # interrupted: the keeper must not outlive the launch that never got this object
            self.close()
            raise

    def start_keeper_soon(self) -> None:
        """Start the keeper from the fork thread (kernel/fork_thread.py), after the ranks' forks: waiting for its
        exec (~0.3 ms on a quiet machine, 4-13 ms on a busy one, all of it before the first fork when it came
        first) overlaps the ranks' start instead. Not from a thread of its own: a rank forked while `Popen` waits
        for the keeper's exec would inherit, and hold, the pipe it waits on. Each rank waits for the keeper's
        name in the folder before its function runs (worker/parent_death.py `wait_for_keeper`): nothing a rank
        starts can outlive a kernel killed in between."""
        if self._starting is None and self._keeper is None:
            self._starting = run_soon(self._start_keeper)

    @property
    def keeper_asked(self) -> bool:
        """Whether the keeper was started or asked for (`start_keeper_soon`)."""
        return self._starting is not None or self._keeper is not None

    def _keeper_started(self) -> None:
        """Wait until `start_keeper_soon`'s job is done (the keeper's handle is known, or there is none), through
        interrupts (it takes milliseconds): raised afterwards, with the keeper known to `close`."""
        started = self._starting
        interrupted: BaseException | None = None
        while started is not None and not started.done():
            try:
                started.exception()
            except BaseException as exc:  # noqa: BLE001 - raised below
                interrupted = exc
        self._starting = None
        if interrupted is not None:
            raise interrupted

    def _start_keeper(self) -> None:
        # an interrupt waits meanwhile: a KeyboardInterrupt inside Popen would leave the keeper running unknown
        with interrupts_held():
            try:
                self._keeper = subprocess.Popen(
                    ["/bin/sh", KEEPER, str(os.getpid()), self.folder], stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
            except OSError:  # no keeper: the launch still stops every group, unless the kernel itself is killed
                self._keeper = None
                _touch(self.folder, NO_KEEPER)  # the ranks waiting for a keeper go on without one
                return
            # named in the folder: another launch that sweeps dead kernels' folders (private_dirs.py) leaves
            # this one to its keeper, which still has to read it after this kernel's death; the ranks that wait
            # for a keeper see it there
            _touch(self.folder, f"{KEEPER_PREFIX}{self._keeper.pid}")

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

    def end(self, grace: float = STOP_GRACE) -> None:
        """Stop every registered group and signal the keeper to end (it is reaped by `close`: the caller can
        do its own cleanup meanwhile, while the keeper exits)."""
        self._ended = True
        try:
            self._keeper_started()
            self.stop(grace)
        finally:
            self._signal_keeper()

    def close(self, grace: float = STOP_GRACE) -> None:
        """Stop every registered group, end the keeper and remove the folder (`end` first, if not yet)."""
        try:
            if not self._ended:
                self.end(grace)
        finally:
            self._keeper_started()  # (`end` waited already, unless it was interrupted first)
            self._signal_keeper()
            remove_dir(self.folder)
            if self._keeper is not None:
                self._keeper.wait()
                self._keeper = None


    def _signal_keeper(self) -> None:
        if self._keeper is not None:  # the script and its `sleep`: the session it leads (not reaped yet)
            with contextlib.suppress(OSError):
                os.killpg(self._keeper.pid, signal.SIGKILL)


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

