"""Every public name and parameter name of Accelerate 1.15 exists in nbaccel under the same spelling.

The lists are frozen in tests/compat/accelerate_surface.py (generated once by tests/compat/freeze_surface.py from
the installed Accelerate), so this test does not need Accelerate. What is left out on purpose, and why, is in
tests/compat/freeze_surface.py (EXCLUDED) and docs/compat.md.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging

import pytest
from compat import accelerate_surface as surface

import nbaccel

# Names Accelerate has that nbaccel deliberately does not provide, with the reason an engineer gave for it.
# Empty means: every frozen name is expected. Add here only what another area's report declared out of scope.
KNOWN_MISSING: dict[str, str] = {}


def _missing(module_name: str, names: list[str]) -> list[str]:
    module = importlib.import_module(module_name)
    missing = []
    for name in names:
        if f"{module_name}.{name}" in KNOWN_MISSING:
            continue
        try:
            getattr(module, name)
        except (AttributeError, ImportError) as error:
            missing.append(f"{name} ({type(error).__name__}: {error})")
    return missing


@pytest.mark.parametrize(
    ("module_name", "names"),
    [
        ("nbaccel", surface.TOP_LEVEL),
        ("nbaccel.utils", surface.UTILS),
        ("nbaccel.state", surface.STATE),
        ("nbaccel.utils.dataclasses", surface.DATACLASSES),
        ("nbaccel.logging", surface.LOGGING),
    ],
    ids=["accelerate", "accelerate.utils", "accelerate.state", "accelerate.utils.dataclasses", "accelerate.logging"],
)
def test_accelerate_names_exist(module_name: str, names: list[str]) -> None:
    missing = _missing(module_name, names)
    assert not missing, f"{module_name} lacks {len(missing)} Accelerate name(s):\n" + "\n".join(missing)


@pytest.mark.parametrize("submodule", sorted(surface.SUBMODULES))
def test_accelerate_submodule_names_exist(submodule: str) -> None:
    """`from accelerate.<submodule> import X` keeps working after the rename (tracking, data_loader, hooks, ...)."""
    try:
        missing = _missing(f"nbaccel.{submodule}", surface.SUBMODULES[submodule])
    except ImportError as error:
        pytest.fail(f"nbaccel.{submodule} cannot be imported ({error}); Accelerate users import from it")
    assert not missing, f"nbaccel.{submodule} lacks {len(missing)} Accelerate name(s):\n" + "\n".join(missing)


def test_accelerator_members_exist() -> None:
    missing = [name for name in surface.ACCELERATOR_MEMBERS if not hasattr(nbaccel.Accelerator, name)
               and f"Accelerator.{name}" not in KNOWN_MISSING]
    assert not missing, f"nbaccel.Accelerator lacks Accelerate member(s): {missing}"


def test_lazy_maps_are_listed_in_all() -> None:
    """`from nbaccel import *` and dir() show the same names that attribute access resolves."""
    for module_name in ["nbaccel", "nbaccel.utils"]:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            assert hasattr(module, name), f"{module_name}.__all__ lists {name!r} but it does not resolve"


def _resolve(path: str):
    """`Accelerator.save_state`, `utils.gather`, `state.PartialState.print`, `logging.get_logger`, `notebook_launcher`."""
    *owner_parts, name = path.split(".")
    module = nbaccel
    owner = None
    for part in owner_parts:
        if owner is None and part in ("utils", "state", "logging"):
            module = importlib.import_module(f"{module.__name__}.{part}")
        else:
            owner = getattr(owner if owner is not None else module, part)
    if owner is None:
        return getattr(module, name)
    return inspect.getattr_static(owner, name)


def _parameter_names(fn) -> set[str] | None:
    """Parameter names of `fn`; None when it takes **kwargs only (so any name is accepted, and the check is moot)."""
    if isinstance(fn, (staticmethod, classmethod)):
        fn = fn.__func__
    fn = inspect.unwrap(fn)
    parameters = inspect.signature(fn).parameters.values()
    return {p.name for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}


@pytest.mark.parametrize("path", sorted(surface.SIGNATURES))
def test_parameter_names_match_accelerate(path: str) -> None:
    if path in KNOWN_MISSING:
        pytest.skip(KNOWN_MISSING[path])
    expected = surface.SIGNATURES[path]
    try:
        fn = _resolve(path)
    except (AttributeError, ImportError) as error:
        pytest.fail(f"{path} does not exist in nbaccel ({error})")
    names = _parameter_names(fn)
    missing = [name for name in expected if name not in names]
    assert not missing, f"{path}: Accelerate's parameter(s) {missing} are missing (nbaccel has {sorted(names)})"


@pytest.mark.parametrize("class_name", sorted(surface.CONFIG_FIELDS))
def test_config_class_fields_match_accelerate(class_name: str) -> None:
    cls = getattr(nbaccel.utils, class_name)
    if dataclasses.is_dataclass(cls):
        names = {field.name for field in dataclasses.fields(cls) if field.init}
    else:
        names = _parameter_names(cls.__init__)
    missing = [name for name in surface.CONFIG_FIELDS[class_name] if name not in names]
    assert not missing, f"{class_name}: Accelerate's field(s) {missing} are missing"


# --- nbaccel.logging behaves as accelerate.logging -------------------------------------------------------------


@pytest.fixture(autouse=True)
def _keep_root_log_level():
    """`get_logger(log_level=...)` also sets the root logger's level (as Accelerate does): put it back, so later
    tests (e.g. caplog at INFO in test_checkpointing) still see their records."""
    level = logging.getLogger().level
    yield
    logging.getLogger().setLevel(level)


def test_get_logger_without_state_refuses_clearly() -> None:
    from nbaccel.logging import get_logger
    from nbaccel.state import isolated_states

    with isolated_states():
        logger = get_logger("nbaccel.compat.test")
        with pytest.raises(RuntimeError, match="PartialState"):
            logger.info("before any state")


def test_get_logger_logs_on_main_process(caplog: pytest.LogCaptureFixture) -> None:
    from nbaccel.logging import MultiProcessAdapter, get_logger
    from nbaccel.state import PartialState, isolated_states

    with isolated_states():
        PartialState(cpu=True)
        logger = get_logger("nbaccel.compat.test", log_level="DEBUG")
        assert isinstance(logger, MultiProcessAdapter)
        assert logger.logger.level == logging.DEBUG
        with caplog.at_level(logging.DEBUG, logger="nbaccel.compat.test"):
            logger.debug("one %s", "arg")
            logger.info("everywhere", main_process_only=False)
            logger.info("ordered", in_order=True)
            logger.warning_once("once")
            logger.warning_once("once")
        assert [r.getMessage() for r in caplog.records] == [
            "[RANK 0] one arg", "[RANK 0] everywhere", "[RANK 0] ordered", "[RANK 0] once"]


def test_get_logger_reads_accelerate_log_level_env(monkeypatch: pytest.MonkeyPatch) -> None:
    from nbaccel.logging import get_logger

    monkeypatch.setenv("ACCELERATE_LOG_LEVEL", "ERROR")
    logger = get_logger("nbaccel.compat.env_level")
    assert logger.logger.level == logging.ERROR


def test_multi_process_adapter_quiet_off_main_process() -> None:
    """On a rank other than 0 `main_process_only=True` (the default) drops the record; False keeps it."""
    from ranks_helper import run_ranks

    results = run_ranks(_log_on_each_rank, world_size=2)
    assert results[0] == ["[RANK 0] main only", "[RANK 0] all ranks", "[RANK 0] in order"]
    assert results[1] == ["[RANK 1] all ranks", "[RANK 1] in order"]


def _log_on_each_rank(rank: int) -> list[str]:
    from nbaccel.logging import get_logger
    from nbaccel.state import PartialState

    PartialState(cpu=True)
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    logger = get_logger("nbaccel.compat.ranks", log_level="INFO")
    logger.logger.addHandler(Keep())
    logger.info("main only")
    logger.info("all ranks", main_process_only=False)
    logger.info("in order", in_order=True)  # every rank, one after the other (barriers in between)
    return seen


def test_tqdm_only_on_local_main_process(monkeypatch: pytest.MonkeyPatch) -> None:
    from nbaccel.utils import tqdm

    monkeypatch.setenv("LOCAL_RANK", "1")
    assert tqdm(range(3)).disable
    assert not tqdm(range(3), main_process_only=False).disable
    monkeypatch.setenv("LOCAL_RANK", "0")
    bar = tqdm(range(3))
    assert not bar.disable and list(bar) == [0, 1, 2]
    with pytest.raises(ValueError, match="main_process_only"):
        tqdm(True, range(3))
