"""`get_logger`: a standard-library logger that speaks once for all processes, as `accelerate.logging` does.

Accelerate scripts start with `from accelerate.logging import get_logger`; after the rename they import this.
Records go to the main process only unless the call passes `main_process_only=False`; `in_order=True` makes every
process log in turn (rank 0 first), separated by barriers. Each message starts with `[RANK n] `, as in Accelerate.
The log level defaults to `NBACCEL_LOG_LEVEL`, then Accelerate's `ACCELERATE_LOG_LEVEL`.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import MutableMapping
from typing import Any

from .state import PartialState

__all__ = ["MultiProcessAdapter", "get_logger"]


class MultiProcessAdapter(logging.LoggerAdapter):
    """A `logging.LoggerAdapter` that drops records on processes other than the main one, unless asked not to.

    Extra keyword arguments of every logging call: `main_process_only` (default True) and `in_order` (default
    False: when True every process logs, one after the other, and `main_process_only` is ignored).
    """

    @staticmethod
    def _should_log(main_process_only: bool) -> bool:
        state = PartialState()
        return not main_process_only or state.is_main_process

    def log(self, level: int, msg: object, *args: Any, **kwargs: Any) -> None:
        if not PartialState._shared_state:  # before the state exists we cannot know which process this is
            raise RuntimeError(
                "nbaccel.logging: create the Accelerator (or PartialState()) before logging with get_logger(), "
                "so the logger knows which process is the main one."
            )
        main_process_only = kwargs.pop("main_process_only", True)
        in_order = kwargs.pop("in_order", False)
        kwargs.setdefault("stacklevel", 2)  # point at the caller, not at this adapter
        if not self.isEnabledFor(level):
            return
        if not in_order:
            if self._should_log(main_process_only):
                msg, kwargs = self.process(msg, kwargs)
                self.logger.log(level, msg, *args, **kwargs)
            return
        state = PartialState()
        for index in range(state.num_processes):
            if index == state.process_index:
                msg, kwargs = self.process(msg, kwargs)
                self.logger.log(level, msg, *args, **kwargs)
            state.wait_for_everyone()

    def process(self, msg: object, kwargs: MutableMapping[str, Any]) -> tuple[object, MutableMapping[str, Any]]:
        """Prefix the message with the process index, `[RANK 0] ...`, as Accelerate's adapter does (so a log
        read from several processes, or compared with Accelerate's, says who wrote each line)."""
        return f"[RANK {PartialState().process_index}] {msg}", kwargs

    @functools.lru_cache(None)  # noqa: B019 - one warning per (adapter, message) for the life of the process
    def warning_once(self, *args: Any, **kwargs: Any) -> None:
        """`warning`, but a repeated call with the same arguments logs nothing."""
        self.warning(*args, **kwargs)


def get_logger(name: str, log_level: str | int | None = None) -> MultiProcessAdapter:
    """The logger `name` wrapped so that it logs on the main process only (see `MultiProcessAdapter`).

    `log_level` (e.g. "INFO", "DEBUG" or a `logging` constant) sets the underlying logger's level; when None,
    `NBACCEL_LOG_LEVEL` or `ACCELERATE_LOG_LEVEL` is used if set, else the level is left as it is.
    """
    if log_level is None:
        log_level = os.environ.get("NBACCEL_LOG_LEVEL") or os.environ.get("ACCELERATE_LOG_LEVEL")
    logger = logging.getLogger(name)
    if log_level is not None:
        level = log_level.upper() if isinstance(log_level, str) else log_level
        try:
            logger.setLevel(level)
        except (ValueError, TypeError) as error:
            raise ValueError(
                f"get_logger(log_level={log_level!r}): not a logging level; use DEBUG, INFO, WARNING, ERROR or CRITICAL"
            ) from error
        logger.root.setLevel(level)
    return MultiProcessAdapter(logger, {})
