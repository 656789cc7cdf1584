"""The dashboard and the config widget rendered by JupyterLab in headless Chromium (Playwright).

One JupyterLab server per module (127.0.0.1, random port, token, temporary root dir). The test notebook's
first cell runs a 2-rank launch with the dashboard on; the test waits until the rendered widget shows
both ranks "finished" and its chart has points, and saves a screenshot under test-output/browser/. The
second cell shows `config_widget()`: the test types a value, clicks Save and reads the YAML back.

Chromium comes from the Debian package (/usr/bin/chromium, installed by .ci/run); Playwright drives it
through `executable_path`, no browser download. Without it the tests are skipped, saying so.
"""

from __future__ import annotations

import copy
import os
import shutil
import time
from pathlib import Path

import nbformat
import pytest
import yaml

pytestmark = [pytest.mark.browser, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent
OUTPUT = ROOT / "test-output" / "browser"
CHROMIUM = os.environ.get("NBACCEL_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run", "--disable-sync"]

if not (os.path.exists(CHROMIUM) or shutil.which(CHROMIUM)):
    pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium; .ci/run does)", allow_module_level=True)
playwright_sync = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")

from jupyterlab_server import (  # noqa: E402
    ACTIVE_NOTEBOOK,
    open_in_lab,
    run_until_started,
    start_all_cells,
    start_jupyterlab,
    wait_for_kernel,
)

TRAIN_WITH_LAUNCHER = """\
from nbaccel import notebook_launcher

def train(steps=80):
    import time
    from nbaccel import telemetry
    telemetry.report_total_steps(steps)
    for step in range(1, steps + 1):
        time.sleep(0.05)
        telemetry.report_step(step, steps)
        telemetry.log_metrics({"loss": 1.0 / step}, step=step)
    return step

results = notebook_launcher(train, num_processes=2)
print("results", results)
"""

@pytest.fixture(autouse=True)
def no_process_left_behind():
    """Replaces conftest's per-test check: the server and browser live for the module (see `lab`)."""
    yield


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A JupyterLab server on a temporary root (tests/jupyterlab_server.py), for the module."""
    root = tmp_path_factory.mktemp("lab-root")
    server = start_jupyterlab(root, tmp_path_factory.mktemp("lab-home"), timeout=90,
                              env={"NBACCEL_CONFIG_FILE": str(root / "nbaccel-config.yaml")})
    try:
        yield server
    finally:
        server.stop()
        _check_no_children()


def _check_no_children() -> None:
    """What conftest checks per test, once for the module: nothing it started (kernels, browser) is left."""
    from process_helpers import live_children

    deadline = time.monotonic() + 15
    while True:
        alive = live_children()
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    if alive:
        described = "; ".join(f"pid {c.pid}: {' '.join(c.cmdline()[:3])}" for c in alive)
        for child in alive:
            child.kill()
        pytest.fail(f"the browser test left processes running: {described}")


@pytest.fixture(scope="module")
def page(lab):
    with playwright_sync.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        context = browser.new_context(viewport={"width": 1400, "height": 1000})
        yield context.new_page()
        context.close()
        browser.close()


def _write_notebook(root: Path, config_path: Path) -> str:
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [
        nbformat.v4.new_code_cell(TRAIN_WITH_LAUNCHER),
        nbformat.v4.new_code_cell(f"from nbaccel import config_widget\nconfig_widget({str(config_path)!r})"),
    ]
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(notebook, root / "dashboard.ipynb")
    return "dashboard.ipynb"


def test_dashboard_and_config_widget_in_jupyterlab(lab, page):
    try:
        _drive_notebook(lab, page)
    except Exception as error:
        OUTPUT.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(OUTPUT / "failure.png"), full_page=True)
        outputs = page.locator(".jp-OutputArea").all_inner_texts()
        raise AssertionError(f"browser check failed; screenshot {OUTPUT / 'failure.png'}; outputs: {outputs}") from error


def _drive_notebook(lab, page) -> None:
    base, token, root = lab.base, lab.token, lab.root
    OUTPUT.mkdir(parents=True, exist_ok=True)
    config_path = root / "saved-config.yaml"
    name = _write_notebook(root, config_path)
    page.set_default_timeout(60_000)
    page.goto(f"{base}/lab/tree/{name}?token={token}")
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=90_000)
    wait_for_kernel(page)
    _run_cell_from_the_keyboard(page, 0)
    # The live widget while the ranks run: its chart has a line with points.
    dashboard = page.locator(".nbaccel-dashboard")
    dashboard.first.wait_for(timeout=90_000)
    page.wait_for_function(
        """() => [...document.querySelectorAll(".nbaccel-dashboard .nbaccel-chart path.line")]
                  .some(path => (path.getAttribute("d") || "").split("L").length > 5)""",
        timeout=60_000,
    )
    page.screenshot(path=str(OUTPUT / "dashboard_live.png"), full_page=True)
    # At the end the live view becomes the summary: its table, then its chart (a PNG), and no widget left.
    page.wait_for_function(
        """() => document.querySelectorAll(
               ".nbaccel-summary[data-state='finished'] tr.nbaccel-rank[data-state='finished']").length === 2""",
        timeout=90_000,
    )
    first_cell = page.locator(".jp-Notebook .jp-Cell").first
    _check_summary(first_cell)
    assert first_cell.locator(".nbaccel-dashboard").count() == 0
    page.screenshot(path=str(OUTPUT / "dashboard.png"), full_page=True)
    assert "results" in first_cell.locator(".jp-OutputArea-output pre").last.inner_text()

    # The config widget: a bad value is refused next to its field, a good one saved.
    _run_cell_from_the_keyboard(page, 1)
    form = page.locator(".nbaccel-config")
    form.wait_for(timeout=60_000)
    processes = form.locator(".nbaccel-config-num_processes input")
    processes.fill("many")
    form.get_by_role("button", name="Save").click()
    page.wait_for_function(
        """() => (document.querySelector(".nbaccel-config-error-num_processes")?.textContent || "")
                  .includes("not a whole number")""",
        timeout=20_000,
    )
    assert not config_path.exists()
    processes.fill("3")
    form.locator(".nbaccel-config-main_process_port input").fill("29517")
    form.get_by_role("button", name="Save").click()
    page.wait_for_function(
        """() => (document.querySelector(".nbaccel-config")?.textContent || "").includes("saved to")""",
        timeout=20_000,
    )
    page.screenshot(path=str(OUTPUT / "config_widget.png"), full_page=True)
    data = yaml.safe_load(config_path.read_text())
    assert data["num_processes"] == 3 and data["main_process_port"] == 29517
    # the table kept for a reopened notebook is not shown under the live form, nor its output row
    config_cell = page.locator(".jp-Notebook .jp-Cell").nth(1)
    assert config_cell.locator(".nbaccel-config-saved").count() == 1
    assert not config_cell.locator(".jp-OutputArea-child:has(.nbaccel-config-saved)").is_visible()
    assert config_cell.locator(".jp-OutputArea-child:has(.nbaccel-config)").is_visible()

    # Saved, its kernel gone, reopened: the static summary (HTML + SVG) still renders.
    page.keyboard.press("Control+s")
    deadline = time.monotonic() + 30
    while "nbaccel-summary" not in (root / name).read_text() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert "nbaccel-summary" in (root / name).read_text(), "the notebook was not saved"
    lab.delete_kernels()
    page.reload()
    page.wait_for_selector(".jp-Notebook .nbaccel-summary[data-state='finished']", timeout=60_000)
    first_cell = page.locator(".jp-Notebook .jp-Cell").first
    _check_summary(first_cell)
    assert "model not found" not in first_cell.inner_text()  # the live view left no dead widget behind
    # the form, saved without widget state (JupyterLab's default): no "model not found" box (hidden once
    # ipywidgets gives up on the model, ~2 s), the configuration as a table instead
    config_cell = page.locator(".jp-Notebook .jp-Cell").nth(1)
    config_cell.locator(".nbaccel-config-saved table").wait_for(state="visible", timeout=30_000)
    text = config_cell.inner_text()
    assert "model not found" not in text and "num_processes" in text and "Run this cell to edit" in text, text
    assert "29517" in text, text  # what the Save button wrote last, not the form as it was first shown
    assert not config_cell.locator(".jp-OutputArea-child:has(> .jp-OutputArea-output.jupyter-widgets)").is_visible()
    config_cell.scroll_into_view_if_needed()
    page.screenshot(path=str(OUTPUT / "config_reopened.png"))
    page.locator(".nbaccel-summary").first.scroll_into_view_if_needed()
    page.screenshot(path=str(OUTPUT / "reopened.png"))


def _run_cell_from_the_keyboard(page, index: int) -> None:
    """Shift+Enter in the cell's editor, again until the kernel started the cell (a key press that lands
    while the page is still wiring the kernel up is dropped)."""
    cell = page.locator(".jp-Notebook .jp-Cell").nth(index)

    def press() -> None:
        cell.locator(".cm-content").click()
        page.keyboard.press("Shift+Enter")

    run_until_started(cell, press)


def _check_summary(cell) -> None:
    """The run's summary in this cell: the table, the chart right below it as a loaded PNG image, and no
    text a sanitizer leaves of inline SVG."""
    summary = cell.locator(".nbaccel-summary")
    summary.locator("table.nbaccel-summary-ranks").wait_for(state="visible", timeout=30_000)
    chart = cell.locator(".jp-OutputArea-child:has(.nbaccel-summary) + .jp-OutputArea-child img")
    chart.wait_for(state="visible", timeout=30_000)
    assert chart.evaluate("(img) => img.complete && img.naturalWidth > 300")
    text = cell.inner_text()
    assert "image/svg+xml" not in text and "Matplotlib v" not in text and "VBox(" not in text


def test_live_bars_and_figure_from_the_ranks_in_jupyterlab(lab, page):
    """Notebook 08's launch: both ranks' tqdm bars drawn live mid-run, then rank 0's figure and the tables."""
    base, token, root = lab.base, lab.token, lab.root
    OUTPUT.mkdir(parents=True, exist_ok=True)
    source = nbformat.read(ROOT / "notebooks" / "08_live_output.ipynb", as_version=4)
    cells = [cell for cell in source.cells if cell.cell_type == "code"][:3]  # data, train, launch
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(cell.source) for cell in cells])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(notebook, root / "live_output.ipynb")
    # a page of its own, in a workspace of its own: no tab of the test before
    context, page = open_in_lab(page, f"{base}/lab/workspaces/live-output/tree/live_output.ipynb?token={token}")
    try:
        start_all_cells(page)
        # mid-run: the live area shows both ranks' bars at a position strictly between 0 and 100 %
        page.wait_for_function(
            r"""() => [...document.querySelectorAll(".nbaccel-live")].some(node =>
                   /rank 0\] rank 0 training: +[1-9]\d?%/.test(node.textContent)
                   && /rank 1\] rank 1 training: +[1-9]\d?%/.test(node.textContent))""",
            timeout=120_000,
        )
        # scrolled in one step in the page: the live area is redrawn as the bars move, and a located element
        # can be replaced between Playwright's look-up and its scroll ("not attached to the DOM")
        page.evaluate("() => document.querySelector('.nbaccel-live').scrollIntoView({block: 'center'})")
        page.screenshot(path=str(OUTPUT / "live_bars.png"), full_page=True)
        # the end: rank 0's confusion matrix (a PNG image), a table from each rank, the final bar lines
        page.wait_for_selector(".jp-OutputArea-output img", timeout=120_000)
        page.wait_for_function(
            """() => document.querySelectorAll(".nbaccel-display table").length >= 2
                     && document.body.textContent.includes("accuracy per rank")""",
            timeout=60_000,
        )
        page.locator(".jp-OutputArea-output img").first.scroll_into_view_if_needed()
        page.screenshot(path=str(OUTPUT / "rank_figure.png"), full_page=True)
        text = page.locator(ACTIVE_NOTEBOOK).inner_text()
        assert "[rank 0] rank 0 training: 100%" in text and "[rank 1] rank 1 training: 100%" in text
        assert "\r" not in text
    except Exception as error:
        page.screenshot(path=str(OUTPUT / "live_failure.png"), full_page=True)
        outputs = page.locator(".jp-OutputArea").all_inner_texts()
        raise AssertionError(f"browser check failed ({error}); screenshot {OUTPUT / 'live_failure.png'}; "
                             f"outputs: {outputs}") from error
    finally:
        lab.delete_kernels()
        context.close()


HEADLESS_LAUNCH = TRAIN_WITH_LAUNCHER.replace("    return step\n", """\
    from nbaccel import PartialState
    if PartialState().process_index == 0:
        import matplotlib.pyplot as plt
        figure, axes = plt.subplots(figsize=(3, 2))
        axes.plot([0, 1, 2], [2, 0, 1])
        plt.show()  # rank 0's figure: shown in the cell with its rank named
    return step
""")


def test_a_notebook_run_headless_reads_well_untrusted_in_jupyterlab_and_exported(lab, page):
    """What a colleague gets: a notebook executed headless (nbclient) and saved, opened untrusted in
    JupyterLab, and exported to HTML by nbconvert: the summary's table and chart, rank 0's figure under
    its rank, the configuration as a table; no dead widget box, no raw widget repr, no SVG metadata text."""
    from nbclient import NotebookClient
    from nbconvert import HTMLExporter

    base, token, root = lab.base, lab.token, lab.root
    OUTPUT.mkdir(parents=True, exist_ok=True)
    config_path = root / "headless-config.yaml"
    yaml.safe_dump({"compute_environment": "LOCAL_MACHINE", "num_processes": 2, "use_cpu": True},
                   config_path.open("w"))
    notebook = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell(HEADLESS_LAUNCH),
        nbformat.v4.new_code_cell(f"from nbaccel import config_widget\nconfig_widget({str(config_path)!r})"),
    ])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    NotebookClient(notebook, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(root)}}).execute()
    nbformat.write(notebook, root / "headless.ipynb")  # not signed: JupyterLab opens it untrusted

    context, view = open_in_lab(page, f"{base}/lab/workspaces/headless/tree/headless.ipynb?token={token}")
    try:
        cells = view.locator(f"{ACTIVE_NOTEBOOK} .jp-Cell")
        _check_saved_page(cells.nth(0), cells.nth(1))
        view.locator(f"{ACTIVE_NOTEBOOK} .nbaccel-summary").first.scroll_into_view_if_needed()
        view.screenshot(path=str(OUTPUT / "headless_untrusted.png"), full_page=True)

        # nbconvert's HTML: with the widget state nbclient saved, the form is a widget script (drawn by the
        # widget manager from a CDN, so nothing here offline: check only that no raw repr shows); without it
        # (a notebook saved by JupyterLab with its default settings) the form's HTML fallback.
        for name, keep_state in (("with-state", True), ("without-state", False)):
            saved = copy.deepcopy(notebook)
            if not keep_state:
                saved.metadata.pop("widgets", None)
            exported, _ = HTMLExporter().from_notebook_node(saved)
            (root / f"headless-{name}.html").write_text(exported)
            view.goto((root / f"headless-{name}.html").as_uri())
            cells = view.locator(".jp-Cell")
            _check_saved_page(cells.nth(0), cells.nth(1), config_fallback=not keep_state)
            if keep_state:  # the widget's output (a script here) hidden, the configuration's table shown
                cells.nth(1).locator(".nbaccel-config-saved table").wait_for(state="visible", timeout=30_000)
            view.screenshot(path=str(OUTPUT / f"headless_nbconvert_{name}.png"), full_page=True)
    except Exception as error:
        view.screenshot(path=str(OUTPUT / "headless_failure.png"), full_page=True)
        raise AssertionError(f"saved notebook check failed ({error}); screenshot "
                             f"{OUTPUT / 'headless_failure.png'}") from error
    finally:
        lab.delete_kernels()
        context.close()


def _check_saved_page(launch_cell, config_cell, config_fallback: bool = True) -> None:
    _check_summary(launch_cell)
    figure = launch_cell.locator(".nbaccel-display img")  # (an untrusted notebook's sanitizer drops data-rank)
    figure.wait_for(state="visible", timeout=30_000)
    assert figure.evaluate("(img) => img.complete && img.naturalWidth > 100")
    assert launch_cell.locator(".nbaccel-display").inner_text().strip() == "rank 0"  # its caption
    assert "model not found" not in launch_cell.inner_text()
    if config_fallback:
        config_cell.locator(".nbaccel-config-fallback table").wait_for(state="visible", timeout=30_000)
        text = config_cell.inner_text()
        assert "num_processes" in text and "Run this cell to edit" in text
        assert not config_cell.locator(".nbaccel-config-saved").is_visible()  # the table once, not twice
    text = config_cell.inner_text()
    assert "VBox(" not in text and "model not found" not in text


BREAKPOINT_LAUNCH = """\
import os
from nbaccel import notebook_launcher

def train(base):
    rank = int(os.environ["RANK"])
    x = base + rank
    if rank == 1:
        breakpoint()
    return x * 2

print("results", notebook_launcher(train, (10,), num_processes=2, dashboard=False))
"""


def _answer_the_prompt(page, prompt: str, command: str, attempts: int = 3) -> None:
    """Type `command` into the notebook's input box labelled `prompt` and submit it, as a person does: until
    JupyterLab echoes it under the prompt. On a busy machine (a CI run, CPUs 93% busy) the typed text was once
    lost with the box still showing, empty, and nothing submitted (no echo; the rank waited on): then it is
    typed again, never twice once echoed."""
    echo = f"{prompt}  {command}"
    cell = page.locator(ACTIVE_NOTEBOOK)
    echoed = cell.inner_text().count(echo)
    for _ in range(attempts):
        box = page.locator(f"{ACTIVE_NOTEBOOK} .jp-Stdin-input").last
        box.wait_for(state="visible", timeout=120_000)
        assert page.locator(f"{ACTIVE_NOTEBOOK} .jp-Stdin-prompt").last.inner_text().startswith(prompt)
        box.fill(command)
        box.press("Enter")
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if cell.inner_text().count(echo) > echoed:
                return
            time.sleep(0.2)
    raise AssertionError(f"{command!r} typed {attempts} times at {prompt!r} was never submitted")


def test_a_rank_breakpoint_is_answered_in_jupyterlabs_input_box(lab, page):
    """rank 1's pdb prompt shows as JupyterLab's input box, labelled; what is typed there reaches the rank."""
    base, token, root = lab.base, lab.token, lab.root
    OUTPUT.mkdir(parents=True, exist_ok=True)
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(BREAKPOINT_LAUNCH)])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(notebook, root / "rank_pdb.ipynb")
    # a page of its own, in a workspace of its own: no tab of the test before
    context, page = open_in_lab(page, f"{base}/lab/workspaces/rank-pdb/tree/rank_pdb.ipynb?token={token}")
    try:
        start_all_cells(page)
        for command, shown in (("p x", "[rank 1] 11"), ("c", "results [20, 22]")):
            _answer_the_prompt(page, "[rank 1] (Pdb)", command)
            page.wait_for_function("(text) => document.body.textContent.includes(text)", arg=shown, timeout=120_000)
        page.screenshot(path=str(OUTPUT / "rank_pdb.png"), full_page=True)
        text = page.locator(ACTIVE_NOTEBOOK).inner_text()
        assert "[rank 1] -> return x * 2" in text, text
    except Exception as error:
        page.screenshot(path=str(OUTPUT / "rank_pdb_failure.png"), full_page=True)
        outputs = page.locator(".jp-OutputArea").all_inner_texts()
        raise AssertionError(f"browser check failed ({error}); screenshot {OUTPUT / 'rank_pdb_failure.png'}; "
                             f"outputs: {outputs}") from error
    finally:
        lab.delete_kernels()
        context.close()
