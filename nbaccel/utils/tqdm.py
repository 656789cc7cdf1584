"""`nbaccel.utils.tqdm`: a progress bar shown by one process per machine, as `accelerate.utils.tqdm` does.

Accelerate scripts write `from accelerate.utils import tqdm` and `for batch in tqdm(loader): ...`; with several
processes only local rank 0 draws the bar unless `main_process_only=False`. The rank comes from `LOCAL_RANK`, which
every launcher sets (docs/internals.md), so this module needs nothing of nbaccel above `utils`.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["tqdm"]


def tqdm(*args: Any, main_process_only: bool = True, **kwargs: Any) -> Any:
    """`tqdm.auto.tqdm(*args, **kwargs)`, disabled on processes other than local rank 0 when `main_process_only`."""
    try:
        from tqdm.auto import tqdm as _tqdm
    except ImportError as error:
        raise ImportError("nbaccel.utils.tqdm needs the tqdm package: pip install tqdm") from error
    if args and isinstance(args[0], bool):
        raise ValueError(
            "tqdm(True/False, ...): the first argument is the iterable; pass main_process_only=True/False as a keyword"
        )
    disable = kwargs.pop("disable", False)
    if main_process_only and not disable:
        disable = int(os.environ.get("LOCAL_RANK", "0") or 0) != 0
    return _tqdm(*args, disable=disable, **kwargs)
