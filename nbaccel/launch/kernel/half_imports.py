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
import itertools
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def imports_left_whole() -> Iterator[None]:
    """On a KeyboardInterrupt out of the block, forget the half-imported packages' orphaned submodules."""
    # sys.modules is a dict: what is imported from now on comes after its last entry. Remembering that entry costs
    # nothing; a copy of the names cost ~50 us a launch
    last = next(reversed(sys.modules), None)
    try:
        yield
    except KeyboardInterrupt:
        forget_orphans(last)
        raise


def forget_orphans(last: str | None) -> list[str]:
    """Remove from `sys.modules` the modules imported after `last` that a missing package would own; their
    names. (Were `last` itself removed meanwhile, every module counts as new: an orphan is never whole.)"""
    present = sys.modules.keys()
    new = list(itertools.takewhile(lambda name: name != last, reversed(list(present))))
    orphans = [name for name in new if any(parent not in present for parent in _packages_of(name))]
    for name in orphans:
        sys.modules.pop(name, None)
    return orphans


def _packages_of(name: str) -> Iterator[str]:
    """`a.b.c` -> `a`, `a.b`."""
    parts = name.split(".")
    for end in range(1, len(parts)):
        yield ".".join(parts[:end])
