"""`LaunchResults`: what `notebook_launcher` and `debug_launcher` return, a list of the ranks' values.

It is a `list` (equal to, and used as, the plain list of values). One difference, for the notebook: when every
rank returned None, a cell ending with the launch shows no `Out[n]:` line, as with Accelerate's launchers
(which return None). IPython asks an object for `_ipython_display_` (a callable, or nothing) before it
formats it; here the attribute is a no-op callable only when every value is None, and absent otherwise, so a
launch that returns values shows them as any list does.
"""

from __future__ import annotations

from typing import Any


class LaunchResults(list):
    """The per-rank return values of a launch, by rank (a `list`; see the module docstring)."""

    __slots__ = ()

    @property
    def _ipython_display_(self) -> Any:
        if self and all(value is None for value in self):
            return _show_nothing
        return None  # IPython falls back to its usual formatting (`Out[n]: [...]`)


def _show_nothing() -> None:
    """Displays nothing: the ranks returned nothing to show."""
