"""Accelerate's module tree under nbaccel (issue 14, items 1 and 2), checked against the installed Accelerate.

Item 1: after a bare `import accelerate`, its submodules are attributes (`accelerate.utils.set_seed(0)`); the
same holds for nbaccel, whose `import nbaccel` stays cheap (no torch).
Item 2: every public module of Accelerate 1.15 (pkgutil over the installed package) exists under nbaccel with
every public name it defines, except the reasoned exceptions below (also in docs/compat.md).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import os
import pkgutil
import subprocess
import sys
import warnings

import pytest

accelerate = pytest.importorskip("accelerate", reason="the walk compares with Accelerate 1.15 (a dev dependency)")


# Modules of Accelerate that nbaccel does not have, with the reason.
EXCLUDED_MODULES: dict[str, str] = {
    "accelerate.commands.menu": "the arrow-key menus of Accelerate's questionnaire; `nbaccel config` asks with "
                                "plain prompts that also work in a notebook terminal",
    "accelerate.commands.config.sagemaker": "SageMaker is not supported: `nbaccel launch` runs on this machine",
    "accelerate.test_utils.examples": "checks Accelerate's own examples folder against its tests",
    "accelerate.test_utils.scripts.external_deps": "Accelerate's CI scripts needing transformers, datasets, "
                                                   "evaluate or DeepSpeed",
    "accelerate.test_utils.scripts.test_cli": "Accelerate's own CI script (its CLI on its hardware matrix)",
}
_RUN_FROM_ACCELERATE = "Accelerate's own CI script: tests/test_accelerate_ci_scripts.py runs Accelerate's copy, renamed"
for _script in ("test_ddp_comm_hook", "test_distributed_data_loop", "test_merge_weights", "test_notebook"):
    EXCLUDED_MODULES[f"accelerate.test_utils.scripts.{_script}"] = _RUN_FROM_ACCELERATE

PLUMBING = "a module's own logger or help text, not API"
SCRIPT_CHECKS = "the bundled test script's internal checks; its entry point main() is what get_launch_command runs"
INTERNAL = "internal to Accelerate's implementation of this class or function"

# (module, name) pairs; "*" as module matches every module.
EXCLUDED_NAMES: dict[tuple[str, str], str] = {
    ("*", "logger"): PLUMBING,
    ("*", "FORMAT"): PLUMBING,
    ("accelerate.state", "SharedDict"): INTERNAL + " (the singletons' shared storage)",
    ("accelerate.state", "ThreadLocalSharedDict"): INTERNAL + " (the singletons' storage under XLA threads)",
    ("accelerate.state", "do_nothing"): INTERNAL,
    ("accelerate.optimizer", "move_to_device"): INTERNAL + " (AcceleratedOptimizer's state loading)",
    ("accelerate.optimizer", "patch_optimizer_step"): INTERNAL + " (AcceleratedOptimizer's step counting)",
    ("accelerate.data_loader", "MpDeviceLoaderWrapper"): "XLA's device loader; data_loader.py is the "
                                                         "parity-data branch's area",
    ("accelerate.commands.config.config_args", "SageMakerConfig"): "SageMaker is not supported",
    ("accelerate", "rich"): "bound only when ACCELERATE_ENABLE_RICH is set; `nbaccel.utils.rich` imports (and turns on "
                            "rich tracebacks) when asked for",
}
for _module in ("accelerate.utils.fsdp_utils", "accelerate.utils"):
    EXCLUDED_NAMES[(_module, "fsdp2_prepare_model")] = ("a step of Accelerator.prepare for FSDP2 "
                                                        "(nbaccel.sharding.apply_fsdp2 does it)")
for _script in ("test_script", "test_ops", "test_sync"):
    EXCLUDED_NAMES[(f"accelerate.test_utils.scripts.{_script}", "*")] = SCRIPT_CHECKS


def _excluded_module(name: str) -> bool:
    return any(name == m or name.startswith(m + ".") for m in EXCLUDED_MODULES)


def _excluded_name(module: str, name: str) -> bool:
    if module.startswith("accelerate.test_utils.scripts.") and name == "main":
        return False
    if _excluded_module(f"{module}.{name}"):  # a package's name for a submodule left out
        return True
    return any(key in EXCLUDED_NAMES for key in ((module, name), ("*", name), (module, "*")))


def defined_names(module) -> set[str]:
    """The public names `module` defines: its `__all__` if it has one; else what its source assigns, defines or
    (for a package's `__init__`) imports from inside Accelerate, plus its submodules. Names it merely imports
    from elsewhere (torch, typing, os) are not its own."""
    if hasattr(module, "__all__"):
        names = set(module.__all__)
    else:
        tree = ast.parse(inspect.getsource(module))
        is_package = hasattr(module, "__path__")
        names = set()

        def visit(body):
            for node in body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(node.name)
                elif isinstance(node, ast.Assign):
                    names.update(n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name))
                elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    names.add(node.target.id)
                elif isinstance(node, (ast.If, ast.Try)):
                    visit(node.body)
                    visit(node.orelse)
                    for handler in getattr(node, "handlers", []):
                        visit(handler.body)
                    visit(getattr(node, "finalbody", []))
                elif is_package and isinstance(node, ast.ImportFrom) and (
                        node.level > 0 or (node.module or "").startswith("accelerate")):
                    names.update(alias.asname or alias.name for alias in node.names)

        visit(tree.body)
    if hasattr(module, "__path__"):
        names.update(info.name for info in pkgutil.iter_modules(module.__path__))
    return {name for name in names if not name.startswith("_")}


def accelerate_modules() -> list[str]:
    found = [info.name for info in pkgutil.walk_packages(accelerate.__path__, "accelerate.", onerror=lambda n: None)]
    return ["accelerate", *sorted(m for m in found if not any(p.startswith("_") for p in m.split(".")))]


def _import_accelerate(name: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return importlib.import_module(name)
        except ImportError as error:  # e.g. external_deps scripts that need transformers; utils.rich without opt-in
            return error


def test_walk_finds_accelerates_modules():
    modules = accelerate_modules()
    assert len(modules) > 60 and "accelerate.commands.config.config_args" in modules and "accelerate.utils.bnb" in modules


@pytest.mark.parametrize("name", [m for m in accelerate_modules() if not _excluded_module(m)])
def test_module_exists_with_accelerates_names(name: str, monkeypatch) -> None:
    monkeypatch.setenv("ACCELERATE_ENABLE_RICH", "1")  # accelerate.utils.rich imports only when asked for
    theirs = _import_accelerate(name)
    ours_name = "nbaccel" + name[len("accelerate"):]
    try:
        ours = importlib.import_module(ours_name)
    except ImportError as error:
        pytest.fail(f"{ours_name} cannot be imported ({error}); Accelerate code imports {name}")
    if isinstance(theirs, ImportError):
        pytest.skip(f"{name} needs a library absent here ({theirs}); its nbaccel module imports")
    missing = sorted(n for n in defined_names(theirs) if not _excluded_name(name, n) and not hasattr(ours, n))
    assert not missing, f"{ours_name} lacks {len(missing)} of {name}'s public names: {missing}"


def test_exceptions_are_in_the_compat_page():
    page = open(os.path.join(os.path.dirname(__file__), "..", "docs", "compat.md"), encoding="utf-8").read()
    for module in EXCLUDED_MODULES:
        assert f"`{module}`" in page, f"docs/compat.md does not list the excluded module {module}"


def test_submodules_are_attributes_after_a_bare_import():
    """`import X; X.utils.set_seed(0); X.state; X.logging; X.commands.launch` on both, and nbaccel's bare import
    loads no torch."""
    source = """
import json, sys, {pkg}
ok = callable({pkg}.utils.set_seed) and {pkg}.state.PartialState is not None and callable({pkg}.logging.get_logger)
names = sorted(n for n in dir({pkg}) if type(getattr({pkg}, n, None)).__name__ == "module")
print(json.dumps([ok, names]))
"""
    cheap = subprocess.run([sys.executable, "-c", "import sys, nbaccel; print('torch' in sys.modules)"],
                           capture_output=True, text=True, timeout=60)
    assert cheap.stdout.strip() == "False", cheap.stderr
    results = {}
    for pkg in ("accelerate", "nbaccel"):
        proc = subprocess.run([sys.executable, "-c", source.format(pkg=pkg)], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr
        results[pkg] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert results["accelerate"][0] and results["nbaccel"][0]
    # every submodule Accelerate shows after a bare import is an attribute of nbaccel too
    check = ("import nbaccel\nmissing = [n for n in %r if not hasattr(nbaccel, n)]\nprint(missing)"
             % [n for n in results["accelerate"][1] if not _excluded_module(f"accelerate.{n}")])
    proc = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "[]", proc.stdout + proc.stderr
