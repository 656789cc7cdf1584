"""Regenerate the screenshots of docs/dashboard.md: notebooks 01 and 08 live in JupyterLab, then reopened.

    python scripts/dashboard_screenshots.py [--out docs/images] [--chromium /usr/bin/chromium]

For each notebook: a JupyterLab server on a temporary copy (127.0.0.1, random port, token), Chromium driven by
Playwright runs every cell; a screenshot of the dashboard while the ranks train (`*_live.png`), then the
notebook is saved, its kernel shut down, the page reloaded and the launch cell shot again
(`*_reopened.png`: what a saved notebook keeps). Notebook 01's steps are slowed here (SLOWER). Needs Chromium (the Debian package) and the playwright
package; takes a few minutes on a CPU machine (the notebooks train for real).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from jupyterlab_server import ACTIVE_NOTEBOOK as ACTIVE  # noqa: E402
from jupyterlab_server import JupyterLab, run_all_cells, start_jupyterlab  # noqa: E402

NOTEBOOKS = {"01_quickstart": "dashboard_01", "08_live_output": "dashboard_08"}
CHARTED = {"01_quickstart"}  # the notebooks that log metrics: their live shot waits for the chart
# The quickstart trains in about 2 s, less than the chart takes to appear (its libraries are imported in the
# background): the browser would catch the end, not the live view. Its copy sleeps a little after each step
# (the launch cell, the one shot live, is unchanged).
SLOWER = {"01_quickstart": {"            optimizer.zero_grad()\n": "            optimizer.zero_grad()\n"
                                                                    "            time.sleep(0.05)  # screenshots only\n",
                            "from torch.utils.data import": "import time\nfrom torch.utils.data import"}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "images"))
    parser.add_argument("--chromium", default=os.environ.get("NBACCEL_CHROMIUM", "/usr/bin/chromium"))
    args = parser.parse_args()
    if not (os.path.exists(args.chromium) or shutil.which(args.chromium)):
        sys.exit(f"no Chromium at {args.chromium}: apt-get install chromium, or pass --chromium PATH")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="nbaccel-shots-") as tmp:
        root, home = Path(tmp, "root"), Path(tmp, "home")
        root.mkdir()
        for name in NOTEBOOKS:
            notebook = json.loads((ROOT / "notebooks" / f"{name}.ipynb").read_text())
            for old, new in SLOWER.get(name, {}).items():
                sources = ["".join(cell["source"]) for cell in notebook["cells"]]
                assert any(old in source for source in sources), f"{name} no longer has {old!r}: update SLOWER"
                for cell, source in zip(notebook["cells"], sources):
                    cell["source"] = source.replace(old, new)
            (root / f"{name}.ipynb").write_text(json.dumps(notebook))
        home.mkdir()
        try:
            lab = start_jupyterlab(root, home, env={"PYTHONPATH": os.pathsep.join(
                filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))})
        except RuntimeError as exc:
            sys.exit(str(exc))
        try:
            from playwright.sync_api import sync_playwright

            with sync_playwright() as playwright:
                browser = playwright.chromium.launch(executable_path=args.chromium, headless=True,
                                                     args=["--no-sandbox", "--disable-gpu"])
                for name, stem in NOTEBOOKS.items():
                    context = browser.new_context(viewport={"width": 1400, "height": 1100})
                    page = context.new_page()
                    page.set_default_timeout(120_000)
                    shoot(page, lab, name, out / stem)
                    lab.delete_kernels()
                    context.close()
                browser.close()
        finally:
            lab.stop()
    print(f"screenshots written to {out}")


def shoot(page, lab: JupyterLab, name: str, stem: Path) -> None:
    """Run all cells of `name`; shoot the live dashboard, then the launch cell after save + reopen."""
    page.goto(f"{lab.base}/lab/workspaces/{name}/tree/{name}.ipynb?token={lab.token}")
    page.wait_for_selector(f"{ACTIVE} .jp-Cell", timeout=120_000)
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=120_000)
    for attempt in range(3):  # the quickstart trains for seconds: on a loaded machine the moment can pass
        run_all_cells(page)
        try:
            shoot_live(page, stem, name in CHARTED)
            break
        except Exception:
            if attempt == 2:
                raise
            wait_idle(page)
    # the end: the summary in its place; every cell done
    page.wait_for_selector(".nbaccel-summary", timeout=600_000)
    wait_idle(page)
    page.keyboard.press("Control+s")
    time.sleep(3)
    lab.delete_kernels()
    page.reload()
    page.locator(".nbaccel-summary").first.wait_for(timeout=120_000)
    cell = page.locator(f"{ACTIVE} .jp-Cell:has(.nbaccel-summary)").first
    cell.scroll_into_view_if_needed()
    time.sleep(1)
    cell.screenshot(path=f"{stem}_reopened.png")


def shoot_live(page, stem: Path, charted: bool) -> None:
    """The dashboard with both ranks running and past their first steps, its chart drawn when the notebook logs
    metrics (`charted`: the chart appears once its libraries, imported in the background, are loaded)."""
    page.wait_for_function(
        """charted => [...document.querySelectorAll(".nbaccel-dashboard tr.nbaccel-rank")]
                  .filter(row => row.dataset.state === "running"
                          && /^[1-9]/.test(row.children[5].textContent)).length === 2
                 && (!charted
                     || [...document.querySelectorAll(".nbaccel-dashboard .nbaccel-chart path.line")]
                          .some(path => (path.getAttribute("d") || "").split("L").length > 8))""",
        arg=charted, timeout=120_000, polling=50,
    )
    cell = page.query_selector(f"{ACTIVE} .jp-Cell:has(.nbaccel-dashboard)")  # this element, while it lasts
    if cell is None:
        raise RuntimeError("the run ended before the screenshot")
    cell.scroll_into_view_if_needed()
    time.sleep(0.3)  # the redraw under way lands
    if not cell.query_selector(".nbaccel-dashboard"):
        raise RuntimeError("the run ended before the screenshot")
    cell.screenshot(path=f"{stem}_live.png", animations="disabled")


def wait_idle(page) -> None:
    """Every cell has run (no `[*]` prompt left)."""
    page.wait_for_function("""() => ![...document.querySelectorAll(".jp-InputPrompt")]
                                        .some(node => node.textContent.includes("*"))""", timeout=600_000)


if __name__ == "__main__":
    main()
