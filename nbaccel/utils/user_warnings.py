"""Warnings about how the user called nbaccel, shown at the user's own line.

A fixed `stacklevel` points at the right frame only for one call path: `reduce` is reached from the user's
code directly, through `Accelerator.reduce`, or through `gather_for_metrics`, so a fixed level named
nbaccel's own files for some of them. Python 3.12's `skip_file_prefixes` does this; this package supports
3.10 and 3.11 too, hence the walk here.
"""

from __future__ import annotations

import os
import sys
import warnings

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def warn_at_caller(message: str, category: type[Warning] = UserWarning) -> None:
    """`warnings.warn(message, category)` attributed to the nearest frame outside nbaccel (the user's call)."""
    level, frame = 2, sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level if frame is not None else 2)
