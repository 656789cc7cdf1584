"""binder/ is what mybinder.org builds: its requirements plus postBuild must be enough to run the notebooks.

The slow test does what mybinder.org does, in a FRESH virtual environment: install binder/requirements.txt
(with the project's constraints; the extra index for CPU torch wheels is left out because this machine
cannot reach it, the local wheel of the same torch is used), run binder/postBuild from a copy of the
repository (it installs nbaccel itself), then execute notebooks/01 with that environment's own nbclient
and ipykernel, and check what it printed, that its kernel ran the venv's Python and imported the nbaccel
installed there.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import nbformat
import pytest
from notebook_outputs import check_quickstart, read_outputs

ROOT = Path(__file__).resolve().parent.parent
BINDER = ROOT / "binder"

# Run by the venv's Python: execute the notebook with the venv's nbclient in its own python3 kernel, after
# appending a cell that reports which interpreter and which nbaccel the kernel used.
RUNNER = textwrap.dedent('''
    import sys, time
    import nbformat
    from nbclient import NotebookClient

    source, target, workdir = sys.argv[1:4]
    nb = nbformat.read(source, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(
        "import sys, json, nbaccel\\nprint('KERNEL ' + json.dumps([sys.executable, nbaccel.__file__]))"))
    started = time.monotonic()
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": workdir}}).execute()
    nb.metadata["nbaccel_seconds"] = time.monotonic() - started
    nbformat.write(nb, target)
''')

# Directories never copied when the checkout is not a git repository.
NOT_SOURCES = shutil.ignore_patterns(".git", ".venv", "venv", "test-output", "__pycache__", "*.egg-info", "build",
                                     "dist", ".ruff_cache", ".pytest_cache")


def _requirement_names(lines: list[str]) -> set[str]:
    names = set()
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-"):
            names.add(re.split(r"[\s<>=!~;\[]", line, maxsplit=1)[0].lower().replace("_", "-"))
    return names


def test_binder_points_at_pyproject():
    """postBuild installs nbaccel with its `notebook` extra from pyproject.toml, so the dependency list lives in
    one place: requirements.txt holds only the CPU torch at CI's version and what the notebooks use besides."""
    requirements = (BINDER / "requirements.txt").read_text().splitlines()
    names = _requirement_names(requirements)
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    repeated = (_requirement_names(project["dependencies"]) - {"torch"}) & names
    assert not repeated, f"binder/requirements.txt repeats pyproject's dependencies {sorted(repeated)}"
    assert "notebook" in project["optional-dependencies"]
    assert {"jupyterlab", "scikit-learn"} <= names
    torch = [line for line in requirements if line.startswith("torch")]
    pinned = re.search(r"^torch==(\S+)", (ROOT / "constraints.txt").read_text(), flags=re.M)
    assert pinned and torch == [f"torch=={pinned.group(1)}"], "binder's torch must be the version CI tests"
    assert any(line.startswith("--extra-index-url") and "/whl/cpu" in line for line in requirements), (
        "mybinder.org must get the CPU build of torch (the default wheel pulls the CUDA libraries)")
    post_build = BINDER / "postBuild"
    assert os.access(post_build, os.X_OK), "binder/postBuild must be executable (mybinder.org runs it as is)"
    assert 'pip install -c constraints.txt ".[notebook]"' in post_build.read_text()


def _copy_sources(target: Path) -> None:
    """The files mybinder.org would see: the tracked files of the checkout (or, without git, its sources)."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, timeout=60)
    if listed.returncode != 0:
        shutil.copytree(ROOT, target, ignore=NOT_SOURCES)
        return
    for name in listed.stdout.decode().split("\0"):
        if name and (ROOT / name).is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, target / name)


def _run(command: list[str], env: dict[str, str], cwd: Path, timeout: int) -> str:
    done = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return done.stdout


@pytest.mark.slow
@pytest.mark.kernel
@pytest.mark.timeout(1200)
def test_binder_environment_runs_the_quickstart(tmp_path):
    venv = tmp_path / "venv"
    python = venv / "bin" / "python"
    repo = tmp_path / "repo"
    workdir = tmp_path / "work"
    jupyter_home = tmp_path / "jupyter"
    for folder in (repo, workdir, jupyter_home):
        folder.mkdir()
    _copy_sources(repo)

    # The venv's tools only: no PYTHONPATH to this checkout, no user-level kernelspecs or Jupyter config.
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PYTHON", "JUPYTER", "VIRTUAL_ENV"))}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(venv),
               JUPYTER_DATA_DIR=str(jupyter_home / "data"), JUPYTER_CONFIG_DIR=str(jupyter_home / "config"),
               JUPYTER_RUNTIME_DIR=str(jupyter_home / "runtime"), PIP_DISABLE_PIP_VERSION_CHECK="1")

    _run([sys.executable, "-m", "venv", str(venv)], env, tmp_path, timeout=300)
    requirements = tmp_path / "requirements.txt"
    requirements.write_text("".join(line for line in (repo / "binder" / "requirements.txt").read_text().splitlines(True)
                                    if not line.startswith(("--extra-index-url", "--index-url"))))
    # --no-compile: the byte-code of 1.5 GB of packages is written lazily, on import, instead of up front.
    _run([str(python), "-m", "pip", "install", "-q", "--no-compile", "-c", str(repo / "constraints.txt"),
          "-r", str(requirements)], env, repo, timeout=900)
    _run(["bash", "binder/postBuild"], env, repo, timeout=300)
    shutil.rmtree(repo / "nbaccel")  # from here on only the installed nbaccel exists

    runner = tmp_path / "execute.py"
    runner.write_text(RUNNER)
    executed = tmp_path / "01_quickstart.executed.ipynb"
    _run([str(python), str(runner), str(repo / "notebooks" / "01_quickstart.ipynb"), str(executed), str(workdir)],
         env, workdir, timeout=600)

    nb = nbformat.read(executed, as_version=4)
    run = read_outputs(nb, nb.metadata["nbaccel_seconds"])
    print(f"01_quickstart in the binder environment: {run.seconds:.1f} s")
    check_quickstart(run)
    kernel = re.search(r"^KERNEL (.*)$", run.cells[-1].text, flags=re.M)
    assert kernel, run.cells[-1].text
    executable, nbaccel_file = json.loads(kernel.group(1))
    assert Path(executable).parent == venv / "bin", f"the kernel ran {executable}, not the binder venv's Python"
    site_packages = next((venv / "lib").glob("python*/site-packages"))
    assert Path(nbaccel_file).is_relative_to(site_packages), f"the kernel imported nbaccel from {nbaccel_file}"
