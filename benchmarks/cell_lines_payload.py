"""The spawn payload's pickling: `dumps_payload` (which sends a notebook cell's lines with its code) against
plain `cloudpickle.dumps` of the same `(function, args, kwargs)`, in one process, interleaved round by round.

  cell function            a function (with a nested one) compiled under an ipykernel-style file name whose
                           lines are only in linecache: dumps_payload adds the cell's lines once
  function without source  the same function compiled from "<string>": the bytes are cloudpickle's own
  2000 objects argument    that function with a list of 2000 instances of a cell class (per-object cost)
Goal: no cost when there is nothing to add; a few microseconds for a cell's lines.
Run: python benchmarks/cell_lines_payload.py [rounds]
"""

from __future__ import annotations

import functools
import linecache
import statistics
import sys
import time
from collections.abc import Callable

import cloudpickle

from nbaccel.launch.serialize import dumps_payload

SOURCE = "def train(base):\n    x = base + 1\n    def inner():\n        return x\n    return inner()\n"
CELL = "/tmp/ipykernel_0/nbaccel-bench-cell.py"


def define(filename: str) -> Callable[..., int]:
    namespace = {"__name__": "__main__"}
    exec(compile(SOURCE, filename, "exec"), namespace)
    return namespace["train"]


class Item:
    def __init__(self, i: int) -> None:
        self.i = i


Item.__module__ = "__main__"  # pickled by value, as a cell's class


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main(rounds: int) -> None:
    linecache.cache[CELL] = (len(SOURCE), None, SOURCE.splitlines(True), CELL)
    in_cell, no_source = define(CELL), define("<string>")
    many = [Item(i) for i in range(2000)]
    cases = {"cell function": (in_cell, (10,), 3000), "function without source": (no_source, (10,), 3000),
             "2000 objects argument": (no_source, (many,), 30)}
    print(f"payload bytes, cell function: dumps_payload {len(dumps_payload(in_cell, (10,), {}))}, "
          f"cloudpickle {len(cloudpickle.dumps((in_cell, (10,), {})))}")
    for label, (function, args, calls) in cases.items():
        plain, ours = [], []
        for _ in range(rounds):  # interleaved, round by round
            call = (function, args, {})
            plain.append(per_call_us(functools.partial(cloudpickle.dumps, call), calls))
            ours.append(per_call_us(functools.partial(dumps_payload, *call), calls))
        ratios = [b / a for a, b in zip(plain, ours)]
        print(f"{label}: cloudpickle.dumps min {min(plain):.1f} us, dumps_payload min {min(ours):.1f} us, "
              f"ratio median {statistics.median(ratios):.2f}x (min {min(ratios):.2f}x)")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 15)
