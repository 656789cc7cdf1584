"""Hand the training function and its arguments to the workers: by fork's inheritance, or cloudpickled once.

`make_payload` decides by the start method. Under `fork` the workers inherit the objects themselves, as with
Accelerate's fork path, so what only inheritance can share (a fork-context Queue, Lock, Event or Value,
Manager proxies, open files) reaches them, and every elastic restart inherits the same objects again. Under
`spawn` and `forkserver` they are cloudpickled once, in the kernel: cloudpickle pickles objects defined in
`__main__` (notebook cells) by value, so closures, lambdas and cell-defined functions and classes work. When
something cannot be pickled, `find_culprit` walks closures, referenced globals, defaults, containers and
attributes to name the object and the path that led to it (e.g. "train -> closure variable 'lock' ->
_thread.lock").

What cloudpickle takes from an importable module (a function of `mytrain.py` next to the notebook, a class of an
installed package) travels by reference: its module's name, imported where it is unpickled. On one machine the
ranks have the kernel's path; on other hosts (`hosts=`) `referenced_modules` lists those names from the pickle
and each host's agent checks them with `missing_modules` before any rank starts.

A function defined in a notebook cell keeps its cell's file name (ipykernel's `/tmp/ipykernel_<pid>/<hash>.py`),
but that file exists only in the kernel's `linecache`. cloudpickle renames every code object's file `<dynamic-code>`; the payload
keeps the cell's name and carries its lines (only for code whose file the kernel holds in memory only) and the
rank puts them in its own `linecache` as it unpickles the function, so pdb's `l`, `ll`, `w` and tracebacks show the cell's source under
spawn and on other hosts as under fork.
"""

from __future__ import annotations

import importlib.util
import io
import linecache
import pickle
import sys
import types
from collections import ChainMap
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import cloudpickle

from .errors import UnpicklableError

_MAX_DEPTH = 8


@dataclass(frozen=True)
class Payload:
    """`(function, args, kwargs)` on their way to the workers: cloudpickled bytes (spawn, forkserver), or the
    objects themselves, which a forked worker inherits (never pickled)."""

    data: bytes | None = None
    call: tuple[Callable[..., Any], tuple, dict] | None = None

    def load(self) -> tuple[Callable[..., Any], tuple, dict]:
        """In the worker: the function, its positional and its keyword arguments."""
        if self.data is not None:
            return loads(self.data)
        assert self.call is not None
        return self.call

    def __reduce__(self) -> Any:
        if self.data is None:  # only a forked worker may receive the objects themselves
            raise TypeError("the training function and its arguments are handed over by fork's inheritance; "
                            "they were about to be pickled instead (a start method other than fork?)")
        return (Payload, (self.data,))


def make_payload(function: Callable[..., Any], args: tuple, kwargs: dict, inherit: bool) -> Payload:
    """The payload: inherited when the workers are forked with their arguments (`inherit`), cloudpickled
    otherwise (raising UnpicklableError, naming the object, before any process starts)."""
    if inherit:
        return Payload(call=(function, tuple(args), dict(kwargs)))
    return Payload(data=dumps_payload(function, args, kwargs))


def dumps_payload(function: Any, args: tuple, kwargs: dict) -> bytes:
    """cloudpickle `(function, args, kwargs)`, a notebook cell's code with its file name and lines (see
    `_SourcePickler`); raise UnpicklableError naming the offending object."""
    try:
        with io.BytesIO() as file:
            _SourcePickler(file).dump((function, tuple(args), dict(kwargs)))
            return file.getvalue()
    except Exception as exc:  # pickling raises many types: TypeError, PicklingError, AttributeError, ...
        roots = [(_name_of(function), function)]
        roots += [(f"args[{i}]", value) for i, value in enumerate(args)]
        roots += [(f"kwargs[{key!r}]", value) for key, value in kwargs.items()]
        for label, value in roots:
            path = find_culprit(value, label)
            if path is not None:
                raise UnpicklableError(
                    f"cannot send {path} to the workers: it cannot be pickled ({type(exc).__name__}: {exc}). "
                    "Create it inside the training function instead of passing or capturing it."
                ) from exc
        raise UnpicklableError(
            f"cannot serialize the training function and its arguments: {type(exc).__name__}: {exc}"
        ) from exc


class _SourcePickler(cloudpickle.Pickler):
    """cloudpickle's pickler, except for the code of a notebook cell: cloudpickle names every code object's file
    `<dynamic-code>`; this one keeps a cell's file name and sends the cell's lines with it (see `_code_in_cell`).
    Nothing changes for code whose file is on disk or unknown, and only code objects pay for the check (a
    dispatch table entry, not a call per pickled object)."""

    # cloudpickle's table (its own reducers, then copyreg's), its own reducers copied with code's replaced: as
    # many maps as cloudpickle's, so that a type without a reducer costs no extra lookup
    dispatch_table = ChainMap(dict(cloudpickle.Pickler.dispatch_table.maps[0]),
                              *cloudpickle.Pickler.dispatch_table.maps[1:])


_cloudpickle_code_reduce = cloudpickle.Pickler.dispatch_table[types.CodeType]


def _reduce_code(code: types.CodeType) -> tuple:
    lines = memory_only_lines(code.co_filename)
    if lines is None:
        return _cloudpickle_code_reduce(code)
    # nested code objects (co_consts) come here too
    return _code_in_cell, (code.replace(co_filename="<dynamic-code>"), code.co_filename, lines)


_SourcePickler.dispatch_table[types.CodeType] = _reduce_code


def memory_only_lines(filename: str) -> list[str] | None:
    """The lines of `filename` if this process keeps them only in linecache (mtime None: a notebook cell's, as
    IPython's compiler stores them), else None."""
    entry = linecache.cache.get(filename)
    if entry is None or len(entry) != 4 or entry[1] is not None:
        return None
    return entry[2]


def _code_in_cell(code: types.CodeType, filename: str, lines: list[str]) -> types.CodeType:
    """In the rank, as the payload is unpickled: the cell's code under its own file name, the cell's lines in
    linecache (mtime None, so that `linecache.checkcache` keeps them, as IPython does) unless it has that file.
    The kernel pickles one cell's lines once (linecache's list, memoized by the pickle) for all its code."""
    entry = linecache.cache.get(filename)
    if entry is None or len(entry) != 4:
        linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)
    return code.replace(co_filename=filename)


def dumps_value(value: Any) -> bytes:
    """cloudpickle `value` (a cell's function keeps its file name and lines, as in `dumps_payload`)."""
    with io.BytesIO() as file:
        _SourcePickler(file).dump(value)
        return file.getvalue()


def loads(data: bytes) -> Any:
    return cloudpickle.loads(data)


_SUBIMPORT = ("cloudpickle.cloudpickle", "subimport")  # how cloudpickle sends a module object by reference


def referenced_modules(data: bytes) -> list[str]:
    """The modules a pickle imports when it is loaded, in order: those of every global it refers to by name
    (functions and classes of importable modules) and every module object it refers to (cloudpickle's
    `subimport`), at any depth. The pickle is run by the standard library's own unpickler, so its memo, marks
    and frames are followed as a load would; but every global resolves to a stand-in that records its calls,
    so nothing is imported and no code of the pickle runs."""
    reader = _ModuleReader(io.BytesIO(data))
    reader.load()
    reader.modules.pop("__main__", None)  # what a notebook defines travels by value
    return list(reader.modules)


class _ModuleReader(pickle.Unpickler):
    """An unpickler whose globals are all one stand-in: `find_class` records the module, cloudpickle's
    `subimport(name)` the module's name."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file)
        self.modules: dict[str, None] = {}

    def find_class(self, module: str, name: str) -> Any:
        self.modules[module] = None
        return self._subimport if (module, name) == _SUBIMPORT else _StandIn

    def _subimport(self, name: Any = None, *_: Any) -> type:
        if isinstance(name, str):
            self.modules[name] = None
        return _StandIn

    def persistent_load(self, pid: Any) -> type:
        return _StandIn


class _StandInKind(type):
    """The stand-in's type: calling it, building it (BUILD), filling it as a list, set or dict (APPENDS,
    ADDITEMS, SETITEMS) all give or leave the stand-in. Values are not needed, only the names the loader meets;
    being a class, it is also accepted where the unpickler wants one (NEWOBJ)."""

    def __call__(cls, *args: Any, **kwargs: Any) -> type:
        return _StandIn

    def __setstate__(cls, state: Any) -> None:
        pass

    def __setitem__(cls, key: Any, value: Any) -> None:
        pass

    def append(cls, value: Any) -> None:
        pass

    def extend(cls, values: Any) -> None:
        pass

    def add(cls, value: Any) -> None:
        pass


class _StandIn(metaclass=_StandInKind):
    def __new__(cls, *args: Any, **kwargs: Any) -> type:  # NEWOBJ calls cls.__new__(cls, *args)
        return _StandIn


def missing_modules(names: Iterable[str]) -> list[tuple[str, str]]:
    """(module, why) for each of `names` that this Python cannot import, found without importing anything:
    a top-level name its path does not have, or a submodule its already imported package does not have.
    Where that cannot be told without running the module's code, the module counts as present."""
    missing = []
    for name in names:
        if name in sys.modules:
            continue
        top = name.split(".", 1)[0]
        parent = name.rpartition(".")[0]
        try:
            if top not in sys.modules and importlib.util.find_spec(top) is None:
                missing.append((name, f"no module named {top!r} on its Python path"))
            elif parent in sys.modules and importlib.util.find_spec(name) is None:
                missing.append((name, f"{parent!r} has no module {name!r}"))
        except (ImportError, ValueError, AttributeError):
            continue
    return missing


def find_culprit(obj: Any, label: str) -> str | None:
    """Return "label -> ... -> type" for the innermost part of `obj` that cannot be pickled, or None."""
    if _pickles(obj):
        return None
    return _descend(obj, label, set(), 0)


def _pickles(obj: Any) -> bool:
    try:
        cloudpickle.dumps(obj)
        return True
    except Exception:
        return False
    except RecursionError:
        return False


def _descend(obj: Any, path: str, seen: set[int], depth: int) -> str:
    seen.add(id(obj))
    if depth < _MAX_DEPTH:
        for label, child in _children(obj):
            if id(child) in seen or _pickles(child):
                continue
            joined = f"{path}{label}" if label.startswith("[") else f"{path} -> {label}"
            return _descend(child, joined, seen, depth + 1)
    return f"{path} -> {_type_name(obj)}"


def _children(obj: Any) -> Iterator[tuple[str, Any]]:
    """The parts of `obj` that pickling it would pickle too, with a label for each."""
    if isinstance(obj, types.MethodType):
        yield "bound object", obj.__self__
        yield "method", obj.__func__
        return
    if isinstance(obj, types.FunctionType):
        code = obj.__code__
        for name, cell in zip(code.co_freevars, obj.__closure__ or ()):
            try:
                yield f"closure variable {name!r}", cell.cell_contents
            except ValueError:  # empty cell
                continue
        for name in sorted(_global_names(code)):
            if name in obj.__globals__:
                yield f"global {name!r}", obj.__globals__[name]
        for i, value in enumerate(obj.__defaults__ or ()):
            yield f"default #{i}", value
        for name, value in (obj.__kwdefaults__ or {}).items():
            yield f"default {name!r}", value
        return
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield f"[{key!r}]", value
        return
    if isinstance(obj, (list, tuple, set, frozenset)):
        for i, value in enumerate(obj):
            yield f"[{i}]", value
        return
    if isinstance(obj, type):
        for name, value in vars(obj).items():
            if not name.startswith("__"):
                yield f"class attribute {name!r}", value
        return
    state = getattr(obj, "__dict__", None)
    if isinstance(state, dict):
        for name, value in state.items():
            yield f"attribute {name!r}", value


def _global_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def _name_of(function: Any) -> str:
    return getattr(function, "__qualname__", None) or getattr(function, "__name__", None) or "function"


def _type_name(obj: Any) -> str:
    kind = type(obj)
    return f"{kind.__module__}.{kind.__qualname__}" if kind.__module__ != "builtins" else kind.__qualname__
