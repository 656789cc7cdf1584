"""An interrupt that cuts off an import during a launch leaves the kernel's modules as they were.

A launch imports some modules on first use (PyYAML for the saved configuration, psutil, packaging, Ray), in
the kernel's main thread, where the stop button's KeyboardInterrupt lands. When it lands inside such an import,
Python drops the package whose code was running from `sys.modules` but keeps the submodules it had already
imported. The next import of the package then runs its `__init__` again, finds those submodules but not their
names on the new package, and fails with "partially initialized module 'yaml' has no attribute 'error'": every
later launch of the kernel failed until a restart.

`imports_left_whole` wraps a launch: when a KeyboardInterrupt ends it, the modules imported during it whose
package (or any package above it) is gone are forgotten too, so the next import starts afresh. Modules that were
there before the launch are never touched.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def imports_left_whole() -> Iterator[None]:
    """On a KeyboardInterrupt out of the block, forget the half-imported packages' orphaned submodules."""
    before = set(sys.modules)
    try:
        yield
    except KeyboardInterrupt:
        forget_orphans(before)
        raise


def forget_orphans(before: set[str]) -> list[str]:
    """Remove from `sys.modules` the modules not in `before` that a missing package would own; their names."""
    present = set(sys.modules)
    orphans = [name for name in present - before if any(parent not in present for parent in _packages_of(name))]
    for name in orphans:
        sys.modules.pop(name, None)
    return orphans


def _packages_of(name: str) -> Iterator[str]:
    """`a.b.c` -> `a`, `a.b`."""
    parts = name.split(".")
    for end in range(1, len(parts)):
        yield ".".join(parts[:end])
