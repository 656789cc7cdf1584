"""Run a notebook top to bottom in a real Jupyter kernel and print what its cells printed.

Used by `./run.sh demo` (the quickstart). The executed copy, with outputs, is written next to the
run's other artefacts in test-output/ so the notebook in notebooks/ stays without outputs.
Usage: python scripts/run_notebook.py notebooks/01_quickstart.ipynb [--timeout SECONDS]

A cell that asks for input (a rank's pdb prompt, `input()`) is answered with the lines of its metadata's
`nbaccel.input` list, in order, as a person would type them into Jupyter's input box (`ScriptedInputClient`);
other cells run without stdin, as nbclient runs them.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import queue
import re
import shutil
import sys
import tempfile
from pathlib import Path

import nbformat
from jupyter_client.manager import AsyncKernelManager
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


class ScriptedInputClient(NotebookClient):
    """nbclient's client that answers a cell's input requests with its `nbaccel.input` metadata lines."""

    async def async_execute_cell(self, cell, cell_index, execution_count=None, store_history=True):  # type: ignore[override]
        lines = list(cell.get("metadata", {}).get("nbaccel", {}).get("input", []))
        if not lines or self.kc is None:
            return await super().async_execute_cell(cell, cell_index, execution_count, store_history)
        self.kc.allow_stdin = True
        answering = asyncio.ensure_future(self._answer(lines))
        try:
            return await super().async_execute_cell(cell, cell_index, execution_count, store_history)
        finally:
            answering.cancel()
            self.kc.allow_stdin = False
            if lines:
                raise RuntimeError(f"cell {cell_index}: the scripted input {lines} was not asked for")

    async def _answer(self, lines: list[str]) -> None:
        while True:
            try:
                msg = await self.kc.get_stdin_msg(timeout=0.1)
            except (queue.Empty, asyncio.TimeoutError):
                continue
            if msg["msg_type"] != "input_request":
                continue
            if not lines:
                raise RuntimeError(f"unexpected input request {msg['content']['prompt']!r}: no scripted line left")
            self.kc.input(lines.pop(0))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebook", type=Path)
    parser.add_argument("--timeout", type=int, default=600, help="seconds per cell (default 600)")
    args = parser.parse_args(argv)
    if not args.notebook.is_file():
        parser.error(f"no notebook at {args.notebook}")
    notebook = nbformat.read(args.notebook, as_version=4)
    # the kernel's sockets as files in a private folder (IPC), not TCP ports that any local user could reach
    sockets = tempfile.mkdtemp(prefix="nbaccel-kernel-")
    manager = AsyncKernelManager(kernel_name="python3", transport="ipc", ip=os.path.join(sockets, "kernel"))
    client = ScriptedInputClient(
        notebook, km=manager, timeout=args.timeout, kernel_name="python3",
        resources={"metadata": {"path": str(args.notebook.parent.resolve())}},
    )
    failed = None
    try:
        # the client shuts the kernel down at the end (given a manager, nbclient leaves it running otherwise: the
        # kernel outlived this script and said "Parent appears to have exited" on the terminal after it)
        client.execute(cleanup_kc=True)
    except CellExecutionError as error:
        failed = error
    finally:
        shutil.rmtree(sockets, ignore_errors=True)
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
