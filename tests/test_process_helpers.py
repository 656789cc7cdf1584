"""The suite's own process bookkeeping: a test that fails by leaving a process behind must not make later tests
in the same worker fail too."""

from __future__ import annotations

import psutil
from process_helpers import kill_and_reap, started_children


def test_what_the_leftover_check_kills_is_reaped_not_left_a_zombie():
    # CI once had one test's leftover kernel killed by the check but never reaped: as a zombie child of the
    # worker it failed the next six tests that count their children
    child = psutil.Popen(["sleep", "300"])
    kill_and_reap([child])
    assert child.pid not in [c.pid for c in started_children(recursive=True)]
