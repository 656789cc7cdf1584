"""The store of a launcher's private rendezvous (`NBACCEL_INIT_METHOD=file://PATH`): torch's FileStore, waited on
without its 10 ms polls.

torch's FileStore checks for a missing key every 10 ms. gloo's full-mesh connect waits in the store for each
peer's address, and the first rank there waits for the last one: the last rank's `init_process_group` then took
2-13 ms on 2 cores (one poll period at random on the launch's path, ~5 ms on average), where it takes 2-5 ms
when the wait ends as soon as the key is written. `QuickFileStore` keeps the FileStore (an owner-only file:
nothing listens on the network) and waits by checking for the keys itself, every 0.2-0.5 ms during the first
0.1 s of a wait, backing off to every 10 ms after that (one check reads a small file in memory: ~30 us).
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch.distributed as dist

FIRST_PAUSE = 0.0002  # seconds between the first checks for a missing key, growing by half each time up to
SHORT_WAIT_PAUSE = 0.0005  # ... this during the first SHORT_WAIT seconds of a wait (the ranks of a launch
SHORT_WAIT = 0.1  # arrive within milliseconds of each other: ~5% of a core while a rank waits), then up to
LONG_WAIT_PAUSE = 0.01  # this, the FileStore's own pause (a rank that waits long for a slow peer costs little)
# every store made here, kept for the process's life: torch keeps only the C++ part of a Python store, whose
# overrides (these methods) went with the Python object when it was freed ("Not implemented" in a new group)
_KEPT: list[QuickFileStore] = []


class QuickFileStore(dist.Store):
    """torch's `FileStore(path, world_size)`, whose `wait` and `get` of a key not yet written wait by checking
    (`check`) with short pauses instead of its 10 ms sleeps. Everything else is the FileStore's."""

    def __init__(self, path: str, world_size: int, timeout: timedelta | None = None) -> None:
        super().__init__()
        self.path, self.world_size = path, world_size
        self._store = dist.FileStore(path, world_size)
        if timeout is not None:
            self.set_timeout(timeout)
        _KEPT.append(self)

    def set_timeout(self, timeout: timedelta) -> None:
        super().set_timeout(timeout)
        self._store.set_timeout(timeout)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        limit = (timeout if timeout is not None else self._store.timeout).total_seconds()
        deadline = time.monotonic() + limit if limit > 0 else None  # 0: no limit (torch's meaning)
        pause, short_until = FIRST_PAUSE, time.monotonic() + SHORT_WAIT
        while not self._store.check(keys):
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise dist.DistStoreError(f"timed out after {limit:g} s waiting for the keys {keys} in the "
                                          f"rendezvous file {self.path}")
            time.sleep(pause)
            pause = min(pause * 1.5, SHORT_WAIT_PAUSE if now < short_until else LONG_WAIT_PAUSE)

    def get(self, key: str) -> bytes:
        self.wait([key])
        return self._store.get(key)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self.wait(keys)
        return self._store.multi_get(keys)

    def set(self, key: str, value: str | bytes) -> None:
        self._store.set(key, value)

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        self._store.multi_set(keys, values)

    def add(self, key: str, value: int) -> int:
        return self._store.add(key, value)

    def append(self, key: str, value: str | bytes) -> None:
        self._store.append(key, value)

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        return self._store.compare_set(key, expected_value, desired_value)

    def check(self, keys: list[str]) -> bool:
        return self._store.check(keys)

    def delete_key(self, key: str) -> bool:
        return self._store.delete_key(key)

    def num_keys(self) -> int:
        return self._store.num_keys()

    def list_keys(self) -> list[str]:
        return self._store.list_keys()

    def has_extended_api(self) -> bool:
        return self._store.has_extended_api()

    def clone(self) -> QuickFileStore:
        return QuickFileStore(self.path, self.world_size, self._store.timeout)


def store_for(init_method: str, world_size: int, timeout: timedelta) -> QuickFileStore | None:
    """The store of a `file://PATH` rendezvous URL without query parameters (what nbaccel's launchers give); None
    for any other URL (torch's own handler takes it)."""
    if not init_method.startswith("file://") or "?" in init_method:
        return None
    return QuickFileStore(init_method[len("file://"):], world_size, timeout)
