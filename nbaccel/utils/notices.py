"""The launcher's notices (what a launch took from the config file, why it chose a start method, what it
restarted) are records of the `nbaccel.launch` logger tree, at WARNING, as Accelerate's launch notes are.

By default one handler on `nbaccel.launch` writes them, bare, to `sys.stderr` as it is at each record (in a
notebook: the running cell's stderr; under rich's Live: above the table), and they do not propagate, so a
root handler does not show them twice (the convention of the Hugging Face libraries' `*_VERBOSITY`).
Silence or route them with the standard library: `logging.getLogger("nbaccel").setLevel(logging.ERROR)`, or
`NBACCEL_VERBOSITY=error` (debug, info, warning, error, critical: the level of the `nbaccel` logger, read
when nbaccel.launch is imported); `logging.getLogger("nbaccel.launch").propagate = True` plus removing
`DEFAULT_HANDLER` sends them to your own handlers. A problem in the user's own code (an observer that raised)
is a `warnings.warn`, as Python's conventions say.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

ROOT_NAME = "nbaccel"
NOTICES_NAME = "nbaccel.launch"
VERBOSITY_ENV = "NBACCEL_VERBOSITY"
LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR,
          "critical": logging.CRITICAL}


class CurrentStderrHandler(logging.StreamHandler):
    """A StreamHandler on whatever `sys.stderr` is when a record comes (ipykernel rebinds it per cell)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)
        self.setFormatter(logging.Formatter("%(message)s"))

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:  # StreamHandler.__init__ sets it; the current stderr always wins
        pass


DEFAULT_HANDLER = CurrentStderrHandler()


def install() -> None:
    """Attach the default handler to `nbaccel.launch` (once) and apply NBACCEL_VERBOSITY to `nbaccel`."""
    notices = logging.getLogger(NOTICES_NAME)
    if DEFAULT_HANDLER not in notices.handlers:
        notices.addHandler(DEFAULT_HANDLER)
        notices.propagate = False
    verbosity = os.environ.get(VERBOSITY_ENV, "").strip().lower()
    if not verbosity:
        return
    if verbosity not in LEVELS:
        warnings.warn(f"{VERBOSITY_ENV}={verbosity!r} is not one of {', '.join(LEVELS)}; ignored", stacklevel=2)
        return
    logging.getLogger(ROOT_NAME).setLevel(LEVELS[verbosity])
