"""Run a notebook top to bottom in a real Jupyter kernel and print what its cells printed.

Used by `./run.sh demo` (the quickstart). The executed copy, with outputs, is written next to the
run's other artefacts in test-output/ so the notebook in notebooks/ stays without outputs.
Usage: python scripts/run_notebook.py notebooks/01_quickstart.ipynb [--timeout SECONDS]
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

ANSI_ESCAPES = re.compile(r"\x1b\[[0-9;]*m")


def printable_outputs(cell) -> list[str]:
    """The text a person would read under `cell`: streams, plain-text results, errors."""
    texts, previous_stream = [], None
    for output in cell.get("outputs", []):
        if output.output_type == "stream" and output.name == previous_stream:
            texts[-1] += output.text  # the kernel can send one print as two messages
        elif output.output_type == "stream":
            texts.append(output.text)
        elif output.output_type in ("execute_result", "display_data"):
            data = output.get("data", {})
            if "text/plain" in data and not data["text/plain"].startswith(("<Figure", "HBox(", "VBox(", "<IPython.core.display")):
                texts.append(data["text/plain"])
        elif output.output_type == "error":
            texts.append(ANSI_ESCAPES.sub("", "\n".join(output.traceback)))
        previous_stream = output.name if output.output_type == "stream" else None
    return [text.rstrip("\n") for text in texts]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebook", type=Path)
    parser.add_argument("--timeout", type=int, default=600, help="seconds per cell (default 600)")
    args = parser.parse_args(argv)
    if not args.notebook.is_file():
        parser.error(f"no notebook at {args.notebook}")
    notebook = nbformat.read(args.notebook, as_version=4)
    client = NotebookClient(
        notebook, timeout=args.timeout, kernel_name="python3",
        resources={"metadata": {"path": str(args.notebook.parent.resolve())}},
    )
    failed = None
    try:
        client.execute()
    except CellExecutionError as error:
        failed = error
    for index, cell in enumerate(notebook.cells, start=1):
        if cell.cell_type == "code" and cell.get("outputs"):
            print(f"--- cell {index}")
            print("\n".join(printable_outputs(cell)))
    executed = Path("test-output") / args.notebook.name
    executed.parent.mkdir(exist_ok=True)
    nbformat.write(notebook, executed)
    print(f"--- executed notebook with outputs: {executed}")
    if failed is not None:
        print(f"the notebook failed: {str(failed).splitlines()[0] if str(failed) else failed!r}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
