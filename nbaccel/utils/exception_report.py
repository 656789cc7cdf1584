"""Describe a worker's exception for the kernel, whatever the exception's own methods do.

A rank reports its failure as three strings: the type's name, the message and the formatted traceback. An
exception whose `__str__` (or `__repr__`, or a note) raises must still arrive with its type and traceback:
otherwise the kernel only learns that the process "exited with code 1".
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from types import TracebackType


@dataclass(frozen=True)
class ExceptionReport:
    """What the kernel shows of a remote exception: `exc_type: message`, then `traceback`."""

    exc_type: str
    message: str
    traceback: str


def safe_message(exc: BaseException) -> str:
    """`str(exc)`, or a placeholder naming what went wrong when `__str__` itself raises."""
    try:
        text = str(exc)
        if isinstance(text, str):
            return text
    except BaseException as failure:  # noqa: BLE001 - any error of user code must not hide the original one
        return f"<str() of the exception raised {_type_name(failure)}>"
    return "<str() of the exception did not return a string>"


def report_exception(exc: BaseException, tb: TracebackType | None = None) -> ExceptionReport:
    """Type name, message and traceback text of `exc` (from `tb`, default its own), never raising."""
    if tb is None:
        tb = exc.__traceback__
    try:
        text = "".join(traceback.format_exception(type(exc), exc, tb))
    except BaseException:  # noqa: BLE001 - e.g. a note or a chained exception whose methods raise
        text = "Traceback (most recent call last):\n" + "".join(traceback.format_tb(tb))
        text += f"{_type_name(exc)}: {safe_message(exc)}\n"
    return ExceptionReport(_type_name(exc), safe_message(exc), text)


def _type_name(exc: BaseException) -> str:
    try:
        return type(exc).__name__
    except BaseException:  # noqa: BLE001 - a metaclass with a raising __getattribute__
        return "<unknown exception type>"
