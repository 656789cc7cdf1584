"""Container types the operations must keep: a namedtuple and a read-only Mapping subclass."""

from __future__ import annotations

import collections
from collections.abc import Mapping

Pair = collections.namedtuple("Pair", "left right")


class Record(Mapping):
    """A read-only Mapping subclass (constructor takes a dict), like transformers' model outputs."""

    def __init__(self, data):
        self._data = dict(data)

    def __getitem__(self, key):
        return self._data[key]

    def __iter__(self):
        return iter(self._data)

    def __len__(self):
        return len(self._data)
