"""Prepared loaders built on torchdata's `StatefulDataLoader` (`use_stateful_dataloader=True`).

`DataLoaderShard(..., use_stateful_dataloader=True)` (and `DataLoaderDispatcher`, `SkipDataLoader`) makes an
instance of a subclass that also derives from `StatefulDataLoader`, so `isinstance(loader, StatefulDataLoader)`
holds and its `state_dict()` / `load_state_dict()` are torchdata's, as in Accelerate. Prepared loaders look one
batch ahead (to know the last batch while it is used), so the state a loader reports is the one torchdata had
right after the batch in use was read, not after the look-ahead: a restored loader continues with the next
batch, exactly as a `StatefulDataLoader` would.
"""

from __future__ import annotations

import functools
from typing import Any


def require_torchdata() -> type:
    """torchdata's `StatefulDataLoader`; ImportError saying what to install when it is missing."""
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError as error:
        raise ImportError("use_stateful_dataloader=True needs torchdata's StatefulDataLoader: "
                          "pip install 'torchdata>=0.8.0'.") from error
    return StatefulDataLoader


class StatefulPosition:
    """What the stateful variants add: torchdata's position, taken when the batch in use was read."""

    use_stateful_dataloader = True
    _position: dict[str, Any] | None = None

    def _note_position(self) -> None:
        self._position = self._base.state_dict(self)  # type: ignore[attr-defined]

    def __getstate__(self) -> dict[str, Any]:
        """Picklable (to send a prepared loader to other processes): without the iterator it made for its first
        pass, which cannot be pickled; the copy makes its own when iterated."""
        state = self.__dict__.copy()
        state["_iterator"] = None
        state["_initial_iter_for_state_dict"] = False
        return state

    def state_dict(self) -> dict[str, Any]:
        """torchdata's state of this loader after the batch in use (before any batch was used: its own)."""
        return self._position if self._position is not None else self._base.state_dict(self)  # type: ignore[attr-defined]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state` (a `StatefulDataLoader` state) at the next pass; until then it is the state
        this loader reports (torchdata would replay the data up to it to report it, and fails when the state
        is at the end of an iterable dataset)."""
        if state:
            self._position = dict(state)
        self._base.load_state_dict(self, state)  # type: ignore[attr-defined]


class StatefulThroughBase:
    """For `SkipDataLoader`, which reads through its `base_dataloader` (a `StatefulDataLoader` here)."""

    use_stateful_dataloader = True

    def state_dict(self) -> dict[str, Any]:
        return self.base_dataloader.state_dict()  # type: ignore[attr-defined]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.base_dataloader.load_state_dict(state)  # type: ignore[attr-defined]


@functools.cache
def stateful_variant(loader_class: type, reads_through_base: bool = False) -> type:
    """`loader_class` with torchdata's `StatefulDataLoader` as its DataLoader (created once, picklable)."""
    stateful = require_torchdata()
    name = f"Stateful{loader_class.__name__}"
    mixin = StatefulThroughBase if reads_through_base else StatefulPosition
    variant = type(name, (mixin, loader_class, stateful), {"_base": stateful, "__module__": __name__})
    globals()[name] = variant  # pickle finds the class by its module and name
    return variant
