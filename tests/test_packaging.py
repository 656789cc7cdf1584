"""pyproject.toml says what nbaccel needs: every package nbaccel imports is a declared dependency (core or an
extra) or an integration docs/libraries.md lists as loaded only when used; every declared package has a row
in docs/libraries.md; dev tools stay out of the published extras; the version has one source."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+
ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
LIBRARIES = (ROOT / "docs" / "libraries.md").read_text()
# import name -> distribution name, where they differ
DISTRIBUTIONS = {"yaml": "pyyaml", "IPython": "ipython"}
# imported only inside a kernel that has them (IPython brings traitlets and matplotlib_inline with it)
WITH_THE_KERNEL = {"IPython", "traitlets", "matplotlib_inline"}


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _imported() -> set[str]:
    found = set()
    for path in (ROOT / "nbaccel").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return found - set(sys.stdlib_module_names) - {"nbaccel", "__future__"}


def test_every_imported_package_is_declared_or_a_listed_integration():
    declared = {_name(r) for r in PROJECT["project"]["dependencies"]}
    declared |= {_name(r) for extra in PROJECT["project"]["optional-dependencies"].values() for r in extra}
    integrations = LIBRARIES.split("## Integrations loaded only when used", 1)[1].split("##", 1)[0]
    undeclared = sorted(module for module in _imported() - WITH_THE_KERNEL
                        if _name(DISTRIBUTIONS.get(module, module)) not in declared and module not in integrations)
    assert not undeclared, f"imported but neither declared in pyproject.toml nor listed in docs/libraries.md: {undeclared}"


def test_every_dependency_has_a_row_in_the_libraries_table():
    table = LIBRARIES.lower().replace("_", "-")
    required = [*PROJECT["project"]["dependencies"], *PROJECT["project"]["optional-dependencies"]["notebook"]]
    missing = [_name(r) for r in required if _name(r) not in table]
    assert not missing, f"docs/libraries.md has no row for {missing}"


def test_dev_tools_are_groups_not_extras_and_the_version_has_one_source():
    extras = PROJECT["project"]["optional-dependencies"]
    published = {_name(r) for extra in extras.values() for r in extra}
    assert not published & {"pytest", "ruff", "accelerate", "jupyterlab", "playwright", "nbclient"}, extras
    assert {"dev", "bench"} <= set(PROJECT["dependency-groups"])
    assert "version" not in PROJECT["project"] and PROJECT["project"]["dynamic"] == ["version"]
    assert PROJECT["tool"]["hatch"]["version"]["path"] == "nbaccel/__init__.py"
    assert "ipykernel" not in {_name(r) for r in PROJECT["project"]["dependencies"]}  # never imported


def test_run_sh_installs_every_extra_and_the_dev_group():
    run = (ROOT / "run.sh").read_text()
    installed = re.search(r'pip install -q -c constraints\.txt -e "\.\[([^\]]*)\]" --group dev', run)
    assert installed, "run.sh must install the extras and the dev group"
    assert set(installed.group(1).split(",")) >= set(PROJECT["project"]["optional-dependencies"]) - {"tpu"}
    assert "cat pyproject.toml constraints.txt run.sh" in run  # the install stamp covers what it installs
