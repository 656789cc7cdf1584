"""Refresh tests/file_seconds.json, each test file's seconds in a full run, from pytest's `--durations=0` report.

tests/conftest.py starts the heaviest files first, so that no long file starts last on a worker:

    ./run.sh test --durations=0 | tee run.log
    .venv/bin/python scripts/test_file_seconds.py run.log
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path

TABLE = Path(__file__).resolve().parent.parent / "tests" / "file_seconds.json"
DURATION = re.compile(r"^([\d.]+)s (?:setup|call|teardown)\s+([^:\s]+)::")


def file_seconds(report: str) -> dict[str, float]:
    seconds: Counter[str] = Counter()
    for line in report.splitlines():
        match = DURATION.match(line)
        if match:
            seconds[match.group(2)] += float(match.group(1))
    return {name: round(total, 1) for name, total in sorted(seconds.items())}


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} LOG (the output of ./run.sh test --durations=0)")
    table = file_seconds(Path(sys.argv[1]).read_text())
    if not table:
        sys.exit(f"{sys.argv[1]} holds no durations: run the tests with --durations=0")
    TABLE.write_text(json.dumps(table, indent=1) + "\n")
    print(f"{TABLE}: {len(table)} files, {sum(table.values()):.0f} s in all")


if __name__ == "__main__":
    main()
