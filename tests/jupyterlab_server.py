"""A real JupyterLab server for the browser test (tests/test_browser.py) and the screenshot script
(scripts/dashboard_screenshots.py): one on a temporary root, 127.0.0.1, a free port and a random token, with
user settings that start a notebook's kernel without asking and fetch no news (no network, no toast); and
Run All Cells driven through JupyterLab's menu in a Playwright page."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from nbaccel.utils.other import get_free_port

ACTIVE_NOTEBOOK = ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook"  # not another notebook's open tab
_SETTINGS = {"notebook-extension/tracker": {"autoStartDefaultKernel": True},
             "apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False}}


@dataclass
class JupyterLab:
    """A running server: its address and token, and what stops it."""

    process: subprocess.Popen
    base: str  # http://127.0.0.1:PORT
    token: str
    root: Path
    log_path: Path

    def delete_kernels(self) -> None:
        """Shut down every kernel of the server (they are its children)."""
        listing = urllib.request.urlopen(f"{self.base}/api/kernels?token={self.token}", timeout=5)
        for kernel in json.load(listing):
            urllib.request.urlopen(urllib.request.Request(
                f"{self.base}/api/kernels/{kernel['id']}?token={self.token}", method="DELETE"), timeout=10)

    def stop(self) -> None:
        """Kernels first, then the server (SIGTERM, SIGKILL after 20 s)."""
        try:
            self.delete_kernels()
        except OSError:
            pass
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start_jupyterlab(root: Path, home: Path, env: dict[str, str] | None = None, timeout: float = 120) -> JupyterLab:
    """Start JupyterLab on `root`, its configuration, settings and log under `home`; RuntimeError with the
    end of its log if it does not answer within `timeout` seconds."""
    port = get_free_port("127.0.0.1")  # below the ephemeral range: no connection takes it before the server binds
    token = secrets.token_hex(16)
    (home / "config").mkdir(parents=True, exist_ok=True)
    # Server extensions nothing here needs only slow the start-up down.
    (home / "config" / "jupyter_server_config.json").write_text(json.dumps(
        {"ServerApp": {"jpserver_extensions": {"jupyter_lsp": False}}}))
    for plugin, values in _SETTINGS.items():
        path = home / "settings" / "@jupyterlab" / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    server_env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(home / "runtime"), JUPYTER_CONFIG_DIR=str(home / "config"),
                      JUPYTERLAB_SETTINGS_DIR=str(home / "settings"), JUPYTERLAB_WORKSPACES_DIR=str(home / "ws"),
                      **(env or {}))
    log_path = home / "lab.log"
    with open(log_path, "w") as log:  # the server keeps its own copy of the descriptor
        process = subprocess.Popen(
            [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1",
             f"--ServerApp.port={port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
             f"--ServerApp.root_dir={root}", "--LabApp.news_url=",
             "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
             *(["--allow-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else [])],
            cwd=root, env=server_env, stdout=log, stderr=subprocess.STDOUT)
    lab = JupyterLab(process, f"http://127.0.0.1:{port}", token, root, log_path)
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"{lab.base}/api/status?token={token}", timeout=2) as response:
                if response.status == 200:
                    return lab
        except OSError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            lab.stop()
            raise RuntimeError("JupyterLab did not start:\n" + log_path.read_text()[-3000:])
        time.sleep(0.5)


# What a cell shows of its run: output or an execution count once the kernel took it ("started"); [*] while
# JupyterLab waits for the kernel ("queued"); an empty prompt when it never asked, or asked and had the
# request cancelled ("idle"), as when the kernel connection is replaced just after the press.
_CELL_STATE = """(cell) => {
    const prompt = (cell.querySelector('.jp-InputPrompt') || {}).textContent || '';
    if (/\\[[0-9]+\\]/.test(prompt) || cell.querySelector('.jp-OutputArea-output')) return 'started';
    return prompt.includes('[*]') ? 'queued' : 'idle';
}"""


def run_until_started(cell, press, timeout: float = 120) -> None:
    """Call `press` (what asks JupyterLab to run `cell`, a cell without saved output) until the kernel has
    started the cell. A queued cell is waited for; one whose prompt is (or falls back to) empty for 10 s
    was dropped, and is pressed again. RuntimeError if it never starts."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        press()
        idle_since = time.monotonic()
        while time.monotonic() < deadline:
            state = cell.evaluate(_CELL_STATE)
            if state == "started":
                return
            if state == "queued":
                idle_since = time.monotonic()
            elif time.monotonic() - idle_since > 10:
                break
            time.sleep(0.2)
    raise RuntimeError(f"JupyterLab did not start the cell in {timeout:.0f} s")


def run_all_cells(page) -> None:
    """Run > Run All Cells on the notebook on show, again until its last code cell started (the cells run in
    order, so every one before it has run). A click can land before the menu is ready, and JupyterLab can drop
    a queued cell's request after earlier cells ran; pressed again, those earlier cells run once more.
    RuntimeError if the last cell never starts."""
    def press() -> None:
        page.keyboard.press("Escape")  # closes a menu an earlier click left open
        page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
        page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()

    run_until_started(page.locator(f"{ACTIVE_NOTEBOOK} .jp-CodeCell").last, press)


def open_in_lab(page, url: str):
    """A browser context and page of their own (no tab of an earlier test), on `url`, once its cells show;
    the caller closes the context."""
    context = page.context.browser.new_context(viewport={"width": 1400, "height": 1000})
    view = context.new_page()
    view.set_default_timeout(60_000)
    view.goto(url)
    view.wait_for_selector(f"{ACTIVE_NOTEBOOK} .jp-Cell", timeout=90_000)
    return context, view


def wait_for_kernel(page) -> None:
    """Until the notebook's kernel is idle, answering JupyterLab's kernel selection if it asks despite the
    setting."""
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=90_000)
    select_kernel = page.locator(".jp-Dialog button", has_text="Select")
    if select_kernel.count():
        select_kernel.click()


def start_all_cells(page) -> None:
    """Once the kernel is idle, Run All Cells."""
    wait_for_kernel(page)
    run_all_cells(page)
