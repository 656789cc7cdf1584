"""Which child processes of this test process are still running (zombies waiting to be reaped do not count)."""

from __future__ import annotations

import psutil


def live_children() -> list[psutil.Process]:
    """Children (recursively) that are alive; one that exits while being looked at is left out."""
    alive = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                alive.append(child)
        except psutil.NoSuchProcess:
            pass
    return alive
