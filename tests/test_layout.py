"""The import direction of docs/internals.md, checked on the source of every module in nbaccel/.

Layers, bottom to top: `utils` (and `_lazy`); `state`, `telemetry`; the training modules; `launch`,
`launchers` (Accelerate's module name, re-exporting `launch`), `notebook`; `commands` (and the package
root, `__main__`). A module may import its own layer and those below, never above. `utils` imports nothing of nbaccel but `utils` (and `_lazy`). Only `nbaccel/notebook`
may import ipywidgets: worker processes never load it. Imports under `if TYPE_CHECKING:` do not count.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "nbaccel"
# Also checked here: nbaccel.launch never imports nbaccel.notebook (the views are handed in), no two modules
# define a top-level class of the same name, and no function takes more than 8 parameters (but Accelerate's).

_LAYERS = {"_lazy": 0, "utils": 0, "state": 1, "telemetry": 1, "launch": 3, "launchers": 3, "notebook": 3,
           "commands": 4, "__init__": 4, "__main__": 4}
_TRAINING_LAYER = 2  # accelerator, data_loader, optimizer, scheduler, checkpointing, tracking, ...
_LAYER_NAMES = {0: "utils", 1: "state/telemetry", 2: "training modules", 3: "launch/notebook", 4: "commands"}


def _component(parts: tuple[str, ...]) -> str:
    """The top-level part of nbaccel a module path (inside the package) belongs to."""
    if not parts:
        return "__init__"
    return parts[0].removesuffix(".py")


def _layer(component: str) -> int:
    return _LAYERS.get(component, _TRAINING_LAYER)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST):
    """Every import statement, at any depth (function-level imports count), except TYPE_CHECKING blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _targets(node: ast.Import | ast.ImportFrom, module_parts: tuple[str, ...], is_package: bool) -> list[list[str]]:
    """Absolute dotted names (as lists) imported by `node` in the module at `module_parts` (inside nbaccel)."""
    if isinstance(node, ast.Import):
        return [alias.name.split(".") for alias in node.names]
    if node.level == 0:
        base = node.module.split(".") if node.module else []
    else:
        package = ["nbaccel", *module_parts] if is_package else ["nbaccel", *module_parts[:-1]]
        base = package[: len(package) - (node.level - 1)] + (node.module.split(".") if node.module else [])
    if node.module is None or (len(base) == 1 and base[0] == "nbaccel"):
        return [base + [alias.name] for alias in node.names]  # `from . import state`, `from nbaccel import x`
    return [base]


# Inside nbaccel/launch, by the process that runs the code: worker/ (a rank) imports nothing of kernel/, pool/ or
# agent/, kernel/ nothing of pool/ (RankPool builds on the launch machinery, not the other way round) nor of agent/
# (the host agent on each machine of a several-host launch starts ranks with kernel/'s backends; the kernel talks
# to it only through launch/host_protocol.py), agent/ nothing of pool/.
_LAUNCH_SIDES_BELOW = {"worker": {"kernel", "pool", "agent"}, "kernel": {"pool", "agent"}, "agent": {"pool"}}


def _launch_side(parts: tuple[str, ...]) -> str | None:
    """"kernel", "worker" or "pool" for a module path inside nbaccel/launch/ of that folder, else None."""
    if len(parts) >= 2 and parts[0] == "launch":
        return parts[1].removesuffix(".py")
    return None


def violations_in(source: str, relative: Path) -> list[str]:
    """The import-direction violations of one module, given its path relative to nbaccel/."""
    parts = relative.with_suffix("").parts
    is_package = relative.name == "__init__.py"
    module_parts = parts[:-1] if is_package else parts
    here = _component(module_parts)
    found = []
    for node in _imports(ast.parse(source, filename=str(relative))):
        for target in _targets(node, module_parts, is_package):
            if target[0] == "ipywidgets" and here != "notebook":
                found.append(f"{relative}:{node.lineno} imports ipywidgets (only nbaccel/notebook may)")
            if target[0] != "nbaccel":
                continue
            other = _component(tuple(target[1:]))
            if other == "__version__":
                continue  # the package root's version string: importing the root loads only `_lazy`
            side = _launch_side(module_parts)
            if side in _LAUNCH_SIDES_BELOW and _launch_side(tuple(target[1:])) in _LAUNCH_SIDES_BELOW[side]:
                found.append(f"{relative}:{node.lineno} launch/{side} imports nbaccel.{'.'.join(target[1:])} (a "
                             "rank's code imports no kernel code; the kernel's none of the pool's)")
            if here == "launch" and other == "notebook":
                found.append(f"{relative}:{node.lineno} launch imports nbaccel.{'.'.join(target[1:])} (the views are "
                             "handed in: nbaccel/launch/views.py)")
            elif here == "utils" and other not in ("utils", "_lazy"):
                found.append(f"{relative}:{node.lineno} utils imports nbaccel.{'.'.join(target[1:])}")
            elif _layer(other) > _layer(here):
                found.append(
                    f"{relative}:{node.lineno} {_LAYER_NAMES[_layer(here)]} module imports "
                    f"nbaccel.{'.'.join(target[1:])} ({_LAYER_NAMES[_layer(other)]}, a layer above)"
                )
    return found


def test_import_direction_of_every_module():
    modules = sorted(PACKAGE.rglob("*.py"))
    assert PACKAGE / "state.py" in modules and PACKAGE / "utils" / "environment.py" in modules
    found = []
    for path in modules:
        found += violations_in(path.read_text(encoding="utf-8"), path.relative_to(PACKAGE))
    assert not found, "import direction broken (see docs/internals.md):\n" + "\n".join(found)


@pytest.mark.parametrize(
    ("path", "source", "expected"),
    [
        ("utils/operations.py", "from ..state import PartialState", "utils imports nbaccel.state"),
        ("utils/operations.py", "def f():\n    import nbaccel.accelerator", "utils imports nbaccel.accelerator"),
        ("utils/__init__.py", "from .. import telemetry", "utils imports nbaccel.telemetry"),
        ("state.py", "from .accelerator import Accelerator", "state/telemetry module imports nbaccel.accelerator"),
        ("telemetry.py", "from nbaccel.launch import channel", "imports nbaccel.launch (launch/notebook"),
        ("tracking.py", "from .launch.worker import report", "training modules module imports nbaccel.launch"),
        ("launch/worker.py", "from ..commands import main", "imports nbaccel.commands (commands"),
        ("launchers.py", "from .commands import main", "launch/notebook module imports nbaccel.commands"),
        ("accelerator.py", "from .launchers import notebook_launcher", "imports nbaccel.launchers (launch/notebook"),
        ("launch/worker.py", "import ipywidgets", "imports ipywidgets"),
        ("accelerator.py", "def f():\n    from ipywidgets import Output", "imports ipywidgets"),
        ("launch/kernel/plan.py", "def f():\n    from ...notebook.live_output import in_kernel",
         "launch imports nbaccel.notebook.live_output"),
        ("launch/pool/rank_pool.py", "from nbaccel.notebook import Dashboard", "launch imports nbaccel.notebook"),
        ("launch/worker/entry.py", "from ..kernel.plan import LaunchPlan", "launch/worker imports nbaccel.launch.kernel"),
        ("launch/kernel/supervisor.py", "from ..pool.hang_report import x", "launch/kernel imports nbaccel.launch.pool"),
    ],
)
def test_checker_finds_violations(path, source, expected):
    found = violations_in(source, Path(path))
    assert len(found) == 1 and expected in found[0], found


@pytest.mark.parametrize(
    ("path", "source"),
    [
        ("utils/random.py", "from .dataclasses import RNGType\nfrom .. import _lazy, __version__"),
        ("state.py", "from .utils import collective_trace\nfrom .utils.environment import first_env"),
        ("accelerator.py", "from .state import PartialState\nfrom . import telemetry\nfrom .data_loader import x"),
        ("notebook/dashboard.py", "import ipywidgets\nfrom ..launch import RankPool"),
        ("commands/launch.py", "from nbaccel.launch import notebook_launcher"),
        ("launchers.py", "from .launch.launcher import debug_launcher, notebook_launcher"),
        ("utils/operations.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..state import PartialState"),
    ],
)
def test_checker_allows_downward_imports(path, source):
    assert violations_in(source, Path(path)) == []


# ---------------------------------------------------------------------------------------------- cycles
def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(sources: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """Module -> the nbaccel modules it imports (at any depth, function-level imports included).
    `sources`: module name -> (source, is_package)."""
    graph: dict[str, set[str]] = {name: set() for name in sources}
    for name, (source, is_package) in sources.items():
        module_parts = tuple(name.split(".")[1:])
        for node in _imports(ast.parse(source)):
            for target in _targets(node, module_parts, is_package):
                if target[0] != "nbaccel":
                    continue
                dotted = ".".join(target)
                names = [alias.name for alias in node.names] if isinstance(node, ast.ImportFrom) else []
                hits = [f"{dotted}.{n}" for n in names if f"{dotted}.{n}" in sources]
                for hit in hits or ([dotted] if dotted in sources else []):
                    if hit != name:
                        graph[name].add(hit)
    return graph


def cycles_in(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                item = stack.pop()
                on_stack.discard(item)
                component.append(item)
                if item == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycles_among_nbaccel_modules():
    sources = {_module_name(path): (path.read_text(encoding="utf-8"), path.name == "__init__.py")
               for path in sorted(PACKAGE.rglob("*.py"))}
    found = cycles_in(import_graph(sources))
    assert not found, "import cycles (function-level imports count):\n" + "\n".join(" <-> ".join(c) for c in found)


def test_cycle_checker_finds_a_function_level_cycle():
    sources = {
        "nbaccel.launch.worker.entry": ("def f():\n    from .replica_threads import run\n", False),
        "nbaccel.launch.worker.replica_threads": ("from .entry import execute\n", False),
        "nbaccel.launch.worker": ("", True),
        "nbaccel.utils.other": ("from . import modeling\n", False),
        "nbaccel.utils.modeling": ("x = 1\n", False),
    }
    assert cycles_in(import_graph(sources)) == [["nbaccel.launch.worker.entry", "nbaccel.launch.worker.replica_threads"]]


# ---------------------------------------------------------------------------------------------- parameters
MAX_PRIVATE_PARAMETERS = 8


def long_private_signatures(source: str, relative: str) -> list[str]:
    """Private functions (one leading underscore) taking more than MAX_PRIVATE_PARAMETERS parameters
    (self/cls not counted): a value that travels together should be one dataclass."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if not node.name.startswith("_") or node.name.startswith("__"):
            continue
        names = _parameter_names(node)
        if len(names) > MAX_PRIVATE_PARAMETERS:
            found.append(f"{relative}:{node.lineno} {node.name} takes {len(names)} parameters")
    return found


def test_no_private_function_takes_more_than_eight_parameters():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        found += long_private_signatures(path.read_text(encoding="utf-8"), str(path.relative_to(PACKAGE)))
    assert not found, "pass a dataclass instead of a row of parameters:\n" + "\n".join(found)


def test_parameter_checker_counts_without_self():
    source = "def _f(a, b, c, d, e, f, g, h, i): pass\nclass C:\n    def _m(self, a, b, c, d, e, f, g, h): pass\n" \
             "def public(a, b, c, d, e, f, g, h, i, j): pass\n"
    assert long_private_signatures(source, "x.py") == ["x.py:1 _f takes 9 parameters"]


def test_public_functions_take_at_most_eight_parameters_except_accelerates():
    """Every function, public ones too, except those whose signature is Accelerate's API (kept as it is)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        found += [entry for entry in long_signatures(path.read_text(encoding="utf-8"), str(path.relative_to(PACKAGE)))
                  if entry.split(" ")[1] not in ACCELERATE_SIGNATURES]
    assert not found, "pass a dataclass instead of a row of parameters:\n" + "\n".join(found)


# Functions with Accelerate's signature (same names, same parameters): their length is Accelerate's.
ACCELERATE_SIGNATURES = frozenset({
    "save_accelerator_state", "load_accelerator_state", "__init__", "dispatch_model", "load_checkpoint_and_dispatch",
    "prepare_data_loader", "attach_align_device_hook", "attach_align_device_hook_on_blocks", "infer_auto_device_map",
    "load_checkpoint_in_model", "set_module_tensor_to_device", "notebook_launcher",
})


def long_signatures(source: str, relative: str) -> list[str]:
    """Every function (private or public) taking more than MAX_PRIVATE_PARAMETERS parameters (self/cls not
    counted), as `path:line name takes N parameters`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names = _parameter_names(node)
            if len(names) > MAX_PRIVATE_PARAMETERS:
                found.append(f"{relative}:{node.lineno} {node.name} takes {len(names)} parameters")
    return found


def test_long_signature_checker_counts_public_functions():
    source = "def public(a, b, c, d, e, f, g, h, i): pass\ndef ok(a, b, c, d, e, f, g, h): pass\n"
    assert long_signatures(source, "x.py") == ["x.py:1 public takes 9 parameters"]


# ---------------------------------------------------------------------------------------------- class names
def duplicate_class_names(sources: dict[str, str]) -> dict[str, list[str]]:
    """Top-level class name -> the modules defining it, for names defined in more than one module."""
    homes: dict[str, list[str]] = {}
    for relative, source in sources.items():
        for node in ast.parse(source).body:
            if isinstance(node, ast.ClassDef):
                homes.setdefault(node.name, []).append(relative)
    return {name: paths for name, paths in homes.items() if len(paths) > 1}


def test_no_two_modules_define_a_class_of_the_same_name():
    sources = {str(path.relative_to(PACKAGE)): path.read_text(encoding="utf-8") for path in sorted(PACKAGE.rglob("*.py"))}
    found = duplicate_class_names(sources)
    assert not found, "one name, one class (rename one):\n" + "\n".join(f"{n}: {', '.join(p)}" for n, p in found.items())


def test_duplicate_class_checker_finds_a_repeated_name():
    sources = {"a.py": "class RankState:\n    pass\n", "b.py": "class RankState(str):\n    pass\nclass B: pass\n",
               "c.py": "def f():\n    class B: pass\n"}
    assert duplicate_class_names(sources) == {"RankState": ["a.py", "b.py"]}


# ---------------------------------------------------------------------------------------------- process owners
def starts_processes(source: str) -> list[int]:
    """Lines that start a process: a `.Process(...)`, `Popen(...)`, `os.fork()` or `start_process(...)` call."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in ("Process", "Popen", "fork", "start_process", "spawn"):
                lines.append(node.lineno)
    return lines


def test_the_pool_starts_no_process_by_itself():
    """RankPool's ranks are started and owned by the backend of their placement (kernel/local.py, ssh_backend.py), as a launch's."""
    found = [f"{path.relative_to(PACKAGE)}:{line}" for path in sorted((PACKAGE / "launch" / "pool").rglob("*.py"))
             for line in starts_processes(path.read_text(encoding="utf-8"))]
    assert not found, "process started outside the backends:\n" + "\n".join(found)


def test_process_start_checker_finds_a_start():
    assert starts_processes("p = ctx.Process(target=f)\np.start()\nimport os\nos.fork()\nx = f()") == [1, 4]


def _parameter_names(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """A function's parameters as a caller passes them (a method's self/cls left out)."""
    args = node.args
    names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
    return names[1:] if names and names[0] in ("self", "cls") else names


# ---------------------------------------------------------------------------------------------- module names
def shared_module_names(paths: list[Path], root: Path) -> dict[str, list[str]]:
    """File name -> the modules under root that use it, for names of nbaccel/launch that another module of
    nbaccel also uses (`__init__.py` and `__main__.py` aside)."""
    homes: dict[str, list[str]] = {}
    for path in paths:
        if path.name not in ("__init__.py", "__main__.py"):
            homes.setdefault(path.name, []).append(str(path.relative_to(root)))
    return {name: sorted(where) for name, where in homes.items()
            if len(where) > 1 and any(place.startswith("launch/") for place in where)}


def test_module_names_in_launch_are_unique_across_nbaccel():
    """A module of nbaccel/launch is named for its job: no other nbaccel module has its file name."""
    found = shared_module_names(sorted(PACKAGE.rglob("*.py")), PACKAGE)
    assert not found, "one name, one module (rename one):\n" + "\n".join(f"{n}: {', '.join(p)}" for n, p in found.items())


def test_shared_module_name_checker_finds_a_repeated_name():
    root = Path("/x")
    paths = [root / "utils" / "xla.py", root / "launch" / "kernel" / "xla.py", root / "utils" / "a.py",
             root / "notebook" / "a.py", root / "launch" / "__init__.py", root / "__init__.py"]
    assert shared_module_names(paths, root) == {"xla.py": ["launch/kernel/xla.py", "utils/xla.py"]}


# ---------------------------------------------------------------------------------------------- placements
def test_the_backend_registry_is_keyed_by_placement_one_class_each():
    """Every placement but this process has one registry entry, a Backend subclass that states its programs;
    no backend module picks its class by the plan's program (one class per placement serves them all)."""
    from nbaccel.launch.kernel.placement_base import Backend
    from nbaccel.launch.kernel.placements import PLACEMENTS
    from nbaccel.launch.kernel.plan import Placement

    assert set(PLACEMENTS) == set(Placement) - {Placement.IN_PROCESS}
    classes = {placement: load() for placement, load in PLACEMENTS.items()}
    for placement, backend in classes.items():
        assert issubclass(backend, Backend) and backend.programs, f"{placement}: {backend} states no programs"
    source = (PACKAGE / "launch" / "kernel" / "placements.py").read_text(encoding="utf-8")
    registry = next(node for node in ast.parse(source).body
                    if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "PLACEMENTS")
    keys = [ast.unparse(key) for key in registry.value.keys]  # type: ignore[union-attr]
    assert all(key.startswith("Placement.") for key in keys), keys


def test_one_backend_class_per_placement_and_no_other():
    """Every Backend subclass in nbaccel is a registry entry, or a base that two or more placements' classes share
    (ThreadedBackend: torch elastic's and torch_xla's helper thread); and each entry's `for_plan` gives an instance
    of that very class for every program it runs: a program picks parts inside the class, not a second class."""
    from types import SimpleNamespace

    from nbaccel.launch.kernel.placements import PLACEMENTS

    entries = {placement: load() for placement, load in PLACEMENTS.items()}
    bases: dict[str, list[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                bases[node.name] = [ast.unparse(base).rsplit(".", 1)[-1] for base in node.bases]
    backends, grown = {"Backend"}, True
    while grown:  # every class whose bases lead to Backend, by name across the package
        found = {name for name, names in bases.items() if backends & set(names)}
        grown = not found <= backends
        backends |= found
    registered = {cls.__name__ for cls in entries.values()}
    shared = {name for name in backends - registered - {"Backend"}
              if sum(name in {base.__name__ for base in cls.__mro__} for cls in entries.values()) >= 2}
    assert backends - {"Backend"} - registered - shared == set(), "a Backend subclass outside the registry"
    for placement, cls in entries.items():
        for program in cls.programs:
            backend = cls.for_plan(SimpleNamespace(placement=placement, program=program))  # type: ignore[arg-type]
            try:
                assert type(backend) is cls, f"{placement.value} runs a {program.value} with {type(backend)}"
            finally:
                backend.close()
