"""Regenerate the screenshots of docs/dashboard.md: notebooks 01 and 08 live in JupyterLab, then reopened.

    python scripts/dashboard_screenshots.py [--out docs/images] [--chromium /usr/bin/chromium]

For each notebook: a JupyterLab server on a temporary copy (127.0.0.1, random port, token), Chromium driven by
Playwright runs every cell; a screenshot of the dashboard while the ranks train (`*_live.png`), then the
notebook is saved, its kernel shut down, the page reloaded and the launch cell shot again
(`*_reopened.png`: what a saved notebook keeps). Notebook 01 trains 20 epochs instead of 8 here (SLOWER). Needs Chromium (the Debian package) and the playwright
package; takes a few minutes on a CPU machine (the notebooks train for real).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = {"01_quickstart": "dashboard_01", "08_live_output": "dashboard_08"}
ACTIVE = ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook"
# The quickstart trains for 3-5 s: too short for the browser to still show the live view when it gets to it
# on a loaded machine. Its copy trains for more epochs (the cell shot live is unchanged).
SLOWER = {"01_quickstart": {"def train(epochs: int = 8,": "def train(epochs: int = 20,"}}


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
            text = (ROOT / "notebooks" / f"{name}.ipynb").read_text()
            for old, new in SLOWER.get(name, {}).items():
                assert old in text, f"{name} no longer has {old!r}: update SLOWER"
                text = text.replace(old, new)
            (root / f"{name}.ipynb").write_text(text)
        with jupyterlab(root, home) as (base, token):
            from playwright.sync_api import sync_playwright

            with sync_playwright() as playwright:
                browser = playwright.chromium.launch(executable_path=args.chromium, headless=True,
                                                     args=["--no-sandbox", "--disable-gpu"])
                for name, stem in NOTEBOOKS.items():
                    context = browser.new_context(viewport={"width": 1400, "height": 1100})
                    page = context.new_page()
                    page.set_default_timeout(120_000)
                    shoot(page, base, token, name, out / stem)
                    delete_kernels(base, token)
                    context.close()
                browser.close()
    print(f"screenshots written to {out}")


def shoot(page, base: str, token: str, name: str, stem: Path) -> None:
    """Run all cells of `name`; shoot the live dashboard, then the launch cell after save + reopen."""
    page.goto(f"{base}/lab/workspaces/{name}/tree/{name}.ipynb?token={token}")
    page.wait_for_selector(f"{ACTIVE} .jp-Cell", timeout=120_000)
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=120_000)
    for attempt in range(3):  # the quickstart trains for seconds: on a loaded machine the moment can pass
        run_all(page)
        try:
            shoot_live(page, stem)
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
    delete_kernels(base, token)
    page.reload()
    page.locator(".nbaccel-summary").first.wait_for(timeout=120_000)
    cell = page.locator(f"{ACTIVE} .jp-Cell:has(.nbaccel-summary)").first
    cell.scroll_into_view_if_needed()
    time.sleep(1)
    cell.screenshot(path=f"{stem}_reopened.png")


def shoot_live(page, stem: Path) -> None:
    """The dashboard with both ranks running and past their first steps (its chart drawn, if it has one)."""
    page.wait_for_function(
        """() => [...document.querySelectorAll(".nbaccel-dashboard tr.nbaccel-rank")]
                  .filter(row => row.dataset.state === "running"
                          && /^[1-9]/.test(row.children[5].textContent)).length === 2
                 && (document.querySelectorAll(".nbaccel-dashboard .nbaccel-chart").length === 0
                     || [...document.querySelectorAll(".nbaccel-dashboard .nbaccel-chart path.line")]
                          .some(path => (path.getAttribute("d") || "").split("L").length > 8))""",
        timeout=120_000, polling=50,
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


def run_all(page) -> None:
    prompt = page.locator(f"{ACTIVE} .jp-CodeCell .jp-InputPrompt").first
    for _attempt in range(4):
        page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
        page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
        try:
            page.wait_for_function("(node) => /\\[[*0-9]+\\]/.test(node.textContent)",
                                   arg=prompt.element_handle(), timeout=10_000)
            return
        except Exception:
            page.keyboard.press("Escape")
    raise RuntimeError("JupyterLab did not start running the notebook")


class jupyterlab:
    """A JupyterLab server on `root` for the duration of a `with` block: (base url, token)."""

    def __init__(self, root: Path, home: Path) -> None:
        self.root, self.home = root, home

    def __enter__(self) -> tuple[str, str]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.token = secrets.token_hex(16)
        settings = self.home / "settings" / "@jupyterlab"
        for plugin, values in {"notebook-extension/tracker": {"autoStartDefaultKernel": True},
                               "apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False}
                               }.items():
            path = settings / f"{plugin}.jupyterlab-settings"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(values))
        env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(self.home / "runtime"),
                   JUPYTER_CONFIG_DIR=str(self.home / "config"), JUPYTERLAB_SETTINGS_DIR=str(self.home / "settings"),
                   JUPYTERLAB_WORKSPACES_DIR=str(self.home / "ws"),
                   PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        self.log = open(self.home / "lab.log", "w")
        self.server = subprocess.Popen(
            [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1",
             f"--ServerApp.port={port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={self.token}",
             f"--ServerApp.root_dir={self.root}", "--LabApp.news_url=",
             "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
             *(["--allow-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else [])],
            cwd=self.root, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{self.base}/api/status?token={self.token}", timeout=2):
                    return self.base, self.token
            except OSError:
                if self.server.poll() is not None or time.monotonic() > deadline:
                    self.__exit__()
                    sys.exit("JupyterLab did not start:\n" + (self.home / "lab.log").read_text()[-3000:])
                time.sleep(0.5)

    def __exit__(self, *exc: object) -> None:
        try:
            delete_kernels(self.base, self.token)
        except OSError:
            pass
        self.server.terminate()
        try:
            self.server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.server.kill()
            self.server.wait()
        self.log.close()


def delete_kernels(base: str, token: str) -> None:
    for kernel in json.load(urllib.request.urlopen(f"{base}/api/kernels?token={token}", timeout=5)):
        urllib.request.urlopen(urllib.request.Request(f"{base}/api/kernels/{kernel['id']}?token={token}",
                                                      method="DELETE"), timeout=10)


if __name__ == "__main__":
    main()
