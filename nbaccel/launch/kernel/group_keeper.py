"""The keeper of one launch's rank groups: a small process that outlives the kernel by a moment.

`python -I -S group_keeper.py KERNEL_PID FOLDER`, started by kernel/rank_groups.py before any rank. It waits
for the kernel's end and nothing else (a pidfd where Linux has them, else its parent checked every half
second). The kernel ends it first when the launch ends as it should; when the kernel dies instead (SIGKILL,
the OOM killer, a test's timeout) the ranks die with it (worker/parent_death.py), but not what they started:
the keeper then stops every process group registered in FOLDER (SIGTERM, SIGKILL after a second) and
removes the folder. Run by path, with the standard library only: it starts in milliseconds and imports
nothing of nbaccel or torch.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import sys
import time

GRACE = 1.0  # seconds between SIGTERM and SIGKILL
WATCH_INTERVAL = 0.5  # seconds between checks of the parent where there is no pidfd


def main(argv: list[str]) -> None:
    kernel, folder = int(argv[0]), argv[1]
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the kernel's to handle
    wait_for_exit(kernel)
    stop_groups(folder)
    shutil.rmtree(folder, ignore_errors=True)


def wait_for_exit(kernel: int) -> None:
    if os.getppid() != kernel:  # it died before this process got here
        return
    try:
        pidfd = os.pidfd_open(kernel)
    except (AttributeError, OSError):
        pidfd = -1
    if pidfd >= 0:
        select.select([pidfd], [], [])  # readable once the kernel has ended
        return
    while os.getppid() == kernel:
        time.sleep(WATCH_INTERVAL)


def stop_groups(folder: str) -> None:
    try:
        leaders = [int(name) for name in os.listdir(folder) if name.isdigit()]
    except OSError:
        return
    own = os.getpgrp()
    leaders = [pid for pid in leaders if pid > 1 and pid != own]
    _signal(leaders, signal.SIGTERM)
    deadline = time.monotonic() + GRACE
    while time.monotonic() < deadline and _signal(leaders, 0):
        time.sleep(0.05)
    _signal(leaders, signal.SIGKILL)


def _signal(leaders: list[int], sig: int) -> bool:
    """Send `sig` to each group; whether any of them still exists."""
    found = False
    for pid in leaders:
        try:
            os.killpg(pid, sig)
            found = True
        except OSError:
            pass
    return found


if __name__ == "__main__":
    main(sys.argv[1:])
