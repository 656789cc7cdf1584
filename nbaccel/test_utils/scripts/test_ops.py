"""Check nbaccel's distributed operations on every process of this launch (gather, reduce, broadcast, pad, ...).

`nbaccel launch --num_processes 2 --cpu test_ops.py`; exits non-zero when a check fails on any rank. The checks
live in `check_operations.py` beside this file.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__" and __package__ in (None, ""):  # run as a file: make this checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))


def main() -> int:
    """Run every operation check; 0 when all pass on every rank."""
    import torch.distributed as dist

    from nbaccel.test_utils.scripts.check_operations import main as check

    code = check()
    if dist.is_initialized():
        dist.barrier()
    return code


if __name__ == "__main__":
    sys.exit(main())
