"""Let go of what a caught error's traceback keeps alive.

An error keeps its traceback, the traceback its frames, and the frames their local variables: a pool (`self`),
a writer's open file. IPython keeps the last error (`sys.last_traceback`) until the next one, and a reference
cycle keeps an error until a garbage collection; meanwhile those objects stay. `release_frames` clears the
variables of the finished frames of an error and of the errors it chains; the traceback keeps its lines.
"""

from __future__ import annotations

import contextlib
import os

PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # nbaccel's own folder


def release_frames(error: BaseException, under: str | None = None) -> None:
    """Clear the local variables of the finished frames in the tracebacks of `error`, its cause and its context
    (those whose file is under the folder `under` only, when given). A frame still running is left as it is."""
    seen: set[int] = set()
    chain: list[BaseException | None] = [error]
    while chain:
        current = chain.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        entry = current.__traceback__
        while entry is not None:
            if under is None or entry.tb_frame.f_code.co_filename.startswith(under):
                with contextlib.suppress(RuntimeError):  # still running
                    entry.tb_frame.clear()
            entry = entry.tb_next
        chain += [current.__cause__, current.__context__]
