"""Reading truth values and setting variables of the process environment: the part of `utils.environment`
that `utils.imports` needs too (both import it from here; `utils.environment` re-exports every name), so
the two do not import each other.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_TRUE = ("y", "yes", "t", "true", "on", "1")
_FALSE = ("n", "no", "f", "false", "off", "0")


def str_to_bool(value: str, to_bool: bool = False) -> int | bool:
    """Read a truth value: `1`/`True` for y, yes, t, true, on, 1; `0`/`False` for n, no, f, false, off, 0.

    Returns an int like Accelerate unless `to_bool=True`. Anything else raises ValueError listing both sets.
    """
    text = str(value).strip().lower()
    if text in _TRUE:
        return True if to_bool else 1
    if text in _FALSE:
        return False if to_bool else 0
    raise ValueError(f"invalid truth value {value!r}: use one of {', '.join(_TRUE)} or {', '.join(_FALSE)}")


def parse_flag_from_env(key: str, default: bool | str = False) -> bool:
    """The truth value of environment variable `key`, or of `default` when it is unset or empty.

    A string default is read as a truth value, as Accelerate reads it (`default="no"` is False).
    """
    value = os.environ.get(key, "")
    if value.strip() == "":
        # bool("no") would be True: a text default goes through the same reading as the variable
        return str_to_bool(default) == 1 if isinstance(default, str) else bool(default)
    try:
        return str_to_bool(value) == 1
    except ValueError:
        raise ValueError(f"environment variable {key}={value!r} is not a truth value: use 1/0, true/false, yes/no") from None


@contextmanager
def patch_environment(**kwargs: Any) -> Iterator[None]:
    """Set each keyword as an environment variable (key upper-cased, value `str()`-ed) for the body.

    On exit each key gets back its previous value, or is removed if it was unset before, even when the body
    changed or deleted it.
    """
    previous: dict[str, str | None] = {}
    for key, value in kwargs.items():
        name = key.upper()
        previous.setdefault(name, os.environ.get(name))
        os.environ[name] = str(value)
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


_TPU_ENV_KEYS = ("TPU_NAME", "TPU_ACCELERATOR_TYPE", "COLAB_TPU_ADDR", "XRT_TPU_CONFIG", "TPU_WORKER_ID")


def tpu_requested() -> bool:
    """Whether this environment asks for TPU cores: PJRT_DEVICE=TPU, or a TPU VM / Colab / Kaggle TPU variable.

    `USE_TORCH_XLA=0` turns TPU use off, like in Accelerate.
    """
    if not parse_flag_from_env("USE_TORCH_XLA", True):
        return False
    if os.environ.get("PJRT_DEVICE", "").upper() == "TPU":
        return True
    return any(os.environ.get(key) for key in _TPU_ENV_KEYS)
