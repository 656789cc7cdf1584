"""`nbaccel launch`'s rank when nbaccel's Python does not run in it (`--no_python`, or a launch without its
collective watch): `python -m nbaccel.launch.worker.exec_entry PROGRAM ARGS...` registers the process group
the rank leads (torch elastic starts each rank in a session of its own) in the launch's folder, then becomes
PROGRAM (exec: the same pid, the same group). What the program starts is then stopped with the launch, the
program dead or alive, as a Python rank's (kernel/rank_groups.py).
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

from ...utils.constants import RANK_GROUPS_ENV
from .parent_death import die_with_parent, register_group


def main(argv: list[str]) -> NoReturn:
    if not argv:
        sys.exit("usage: python -m nbaccel.launch.worker.exec_entry PROGRAM [ARGS...]")
    die_with_parent()  # the death signal survives the exec: a SIGKILLed launch leaves no rank running
    register_group(os.environ.get(RANK_GROUPS_ENV))  # kept in the environment: it marks what the program starts
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:  # as torchrun's own start would fail: the rank ends with the reason
        sys.exit(f"nbaccel launch: cannot run {argv[0]!r}: {exc.strerror}")


if __name__ == "__main__":
    main(sys.argv[1:])
