"""`nbaccel.launchers`: where Accelerate keeps its launchers (`accelerate.launchers`), so that
`from accelerate.launchers import notebook_launcher, debug_launcher` works after the rename.

The launchers themselves live in `nbaccel.launch` (launcher.py); this module only re-exports them.
"""

from __future__ import annotations

from .launch.kernel.launcher import debug_launcher, notebook_launcher

__all__ = ["debug_launcher", "notebook_launcher", "test_launch"]


def test_launch() -> None:
    """Check that a `PartialState` can be created in this process (what a launched worker does first)."""
    from .state import PartialState

    PartialState()
