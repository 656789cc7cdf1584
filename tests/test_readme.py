"""The README's quickstart runs as printed: its code, pasted into a notebook cell, works in a real kernel.

The quickstart is the first ```python block under a heading that contains "Quickstart" (any level, any
case; the section ends at the next heading of the same or a higher level). It is executed with nbclient
in a fresh `python3` kernel, in a temporary folder, as one cell. A README without such a block fails the
test: the quickstart is the first thing a user copies.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError
from notebook_outputs import ANSI, Executed, read_outputs

README = Path(__file__).resolve().parent.parent / "README.md"
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([^\s`]*)")
PYTHON_INFO = {"python", "py", "python3"}

EXAMPLE_README = textwrap.dedent('''
    # someproject

    ```python
    raise AssertionError("a block before the Quickstart heading is not the quickstart")
    ```

    ## Quickstart

    Install it, then in a notebook cell:

    ```bash
    pip install nbaccel
    ```

    ### On two CPU processes

    ```python
    # ## Not a heading: inside a code block
    from nbaccel import PartialState, notebook_launcher

    def hello():
        state = PartialState()
        return f"rank {state.process_index} of {state.num_processes}"

    print(notebook_launcher(hello, num_processes=2, dashboard=False))
    ```

    ```python
    raise AssertionError("only the first block runs")
    ```

    ## Next steps

    ```python
    raise AssertionError("another section")
    ```
''')


def quickstart_block(markdown: str) -> str | None:
    """The code of the first ```python block under a heading containing 'Quickstart', or None."""
    section_level = None  # level of the Quickstart heading we are under
    fence = None  # the opening fence of the code block we are in, and whether it is the one we want
    collected: list[str] = []
    for line in markdown.splitlines():
        if fence is not None:
            marker, wanted = fence
            if line.strip().startswith(marker[0] * len(marker)) and not line.strip().strip(marker[0]):
                if wanted:
                    return textwrap.dedent("\n".join(collected)) + "\n"
                fence = None
            elif wanted:
                collected.append(line)
            continue
        opening = FENCE.match(line)
        if opening:
            info = opening.group(3).lower().split("{")[0]
            fence = (opening.group(2), section_level is not None and info in PYTHON_INFO)
            continue
        heading = HEADING.match(line)
        if heading:
            level = len(heading.group(1))
            if section_level is not None and level <= section_level:
                section_level = None
            if section_level is None and "quickstart" in heading.group(2).lower():
                section_level = level
    return None


def run_in_kernel(code: str, workdir: Path, timeout: int = 240) -> Executed:
    """Run `code` as the one cell of a notebook in a fresh python3 kernel; fail with its traceback."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(code)])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    try:
        NotebookClient(nb, timeout=timeout, kernel_name="python3",
                       resources={"metadata": {"path": str(workdir)}}).execute()
    except CellExecutionError as error:
        pytest.fail(f"the README's quickstart failed in a kernel:\n{code}\n{ANSI.sub('', str(error))}")
    return read_outputs(nb)


# ------------------------------------------------------------------------------ finding the block


def test_the_first_python_block_of_the_quickstart_section():
    code = quickstart_block(EXAMPLE_README)
    assert code is not None
    assert code.startswith("# ## Not a heading: inside a code block\nfrom nbaccel import PartialState")
    assert "only the first block" not in code and "before the Quickstart" not in code
    compile(code, "<quickstart>", "exec")


@pytest.mark.parametrize("markdown", [
    "# Project\n\n```python\nprint(1)\n```\n",                               # no Quickstart heading
    "## Quickstart\n\n```bash\n./run.sh demo\n```\n",                         # no python block in it
    "## Quickstart\n\nSee below.\n\n## Usage\n\n```python\nprint(1)\n```\n",  # python only in a later section
    "```python\n## Quickstart\n```\n\n```python\nprint(1)\n```\n",            # the "heading" is inside code
])
def test_no_quickstart_block(markdown):
    assert quickstart_block(markdown) is None


def test_headings_and_fences_variants():
    markdown = "# Tool\n\n## 🚀 Quickstart (2 minutes)\n\n~~~py\nx = 1\n~~~\n"
    assert quickstart_block(markdown) == "x = 1\n"
    indented = "### quickstart\n\n- step:\n\n  ```python\n  if True:\n      y = 2\n  ```\n"
    assert quickstart_block(indented) == "if True:\n    y = 2\n"


# ------------------------------------------------------------------------------ running it


@pytest.mark.kernel
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_example_quickstart_runs_in_a_kernel(tmp_path):
    """The runner itself, on the example README above: a real launch on 2 processes from a kernel."""
    run = run_in_kernel(quickstart_block(EXAMPLE_README), tmp_path)
    assert "['rank 0 of 2', 'rank 1 of 2']" in run.cells[0].text


@pytest.mark.kernel
def test_a_failing_quickstart_fails_the_test(tmp_path):
    with pytest.raises(pytest.fail.Exception, match="ZeroDivisionError"):
        run_in_kernel("1 / 0\n", tmp_path)


@pytest.mark.kernel
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_readme_quickstart_runs(tmp_path):
    assert README.is_file(), f"{README} is missing"
    code = quickstart_block(README.read_text(encoding="utf-8"))
    if code is None:
        pytest.fail("README.md has no ```python code block under a heading containing 'Quickstart': "
                    "add a '## Quickstart' section whose first ```python block runs as is in a notebook cell")
    run = run_in_kernel(code, tmp_path)
    assert all(cell.error is None for cell in run.cells)
