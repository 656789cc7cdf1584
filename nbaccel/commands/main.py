"""Entry point of the `nbaccel` command: one argparse subcommand per module of `nbaccel.commands`.

A module of this package joins the command line by defining `register(subparsers) -> None`, which adds its
subparser and sets `func=<callable(args) -> int>` as default (see `add_command`). Modules are discovered, so
adding a subcommand (e.g. `estimate-memory`) needs no edit here. Command modules import heavy libraries
(torch) inside their functions, so `nbaccel --help` stays fast.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import pkgutil
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence

from .utils import CustomArgumentParser

# Listed first, in this order, in `nbaccel --help`; any other module with `register` follows alphabetically.
_PREFERRED_ORDER = ("config", "env", "launch", "test")
_NOT_COMMANDS = {"main", "parser", "accelerate_cli", "utils", "launch_options"}


class CommandParser(CustomArgumentParser):
    """An ArgumentParser whose errors are one line (`nbaccel launch: error: ...`) and exit with status 2, and
    whose long options answer to both spellings (`--config_file`, `--config-file`), on every subcommand as
    under the `accelerate` command."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def add_command(subparsers, name: str, func: Callable[[argparse.Namespace], int], help: str,
                **kwargs) -> argparse.ArgumentParser:
    """Add subcommand `name` running `func(args)`; returns its parser for the caller to add arguments."""
    parser = subparsers.add_parser(name, help=help, description=help, **kwargs)
    parser.set_defaults(func=func)
    return parser


def command_parser(subparsers, name: str, func: Callable[[argparse.Namespace], int], description: str,
                   help: str | None = None, **kwargs) -> argparse.ArgumentParser:
    """The parser of command `name` running `func(args)`: a subcommand of `nbaccel` when `subparsers` is given,
    else a standalone `nbaccel <name>` parser (Accelerate's `*_command_parser(subparsers=None)` form)."""
    if subparsers is not None:
        parser = add_command(subparsers, name, func, help=help or description, **kwargs)
        parser.description = description
        return parser
    parser = CommandParser(prog=f"nbaccel {name}", description=description, **kwargs)
    parser.set_defaults(func=func)
    return parser


def command_modules() -> list[str]:
    """Names of the modules of nbaccel.commands that may register a subcommand, in help order."""
    from . import __path__ as package_path

    found = sorted(m.name for m in pkgutil.iter_modules(package_path) if m.name not in _NOT_COMMANDS)
    ordered = [m for m in _PREFERRED_ORDER if m in found]
    return ordered + [m for m in found if m not in ordered]


def build_parser() -> CommandParser:
    parser = CommandParser(prog="nbaccel", description="nbaccel command line: configure, check and launch runs.")
    subparsers = parser.add_subparsers(dest="command", metavar="{" + ",".join(_PREFERRED_ORDER) + ",...}",
                                       parser_class=CommandParser)
    for name in command_modules():
        module = importlib.import_module(f"{__package__}.{name}")
        register = getattr(module, "register", None)
        if callable(register):
            register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `nbaccel` command with `argv` (default: sys.argv[1:]); returns the exit status."""
    try:
        code = _run_command(argv)
    except KeyboardInterrupt:
        # Ctrl-C outside a launch, which holds the signals itself (it stops its ranks and exits 130): while
        # torch and the commands import, or at a `config` question. One line, not a traceback of the import.
        print("nbaccel: interrupted", file=sys.stderr)
        code = 130
    relay = sys.modules.get("nbaccel.launch.kernel.prompt_relay")
    if relay is not None and relay.stdin_held_by_a_thread():
        # a launch stopped while a rank's prompt was being read in another thread: finalizing would abort the
        # process over stdin's lock, which that thread holds (prompt_relay.py); everything is stopped already
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def run_as(command: str, argv: Sequence[str] | None = None) -> int:
    """`python -m nbaccel.commands.<module>` (and the `nbaccel-<command>` scripts): `nbaccel <command> ARGS`
    through `main`, so its errors, Ctrl-C and exit status are the same (`argv` default: sys.argv[1:])."""
    return main([command, *(sys.argv[1:] if argv is None else argv)])


@contextlib.contextmanager
def _ctrl_c_held() -> Iterator[None]:
    """SIGINT held back (blocked) in the block, and delivered at its end. torch's import runs Python inside
    its C extension, which does not expect an interrupt there: it drops an exception out of its numpy
    import, so a Ctrl-C landing there was lost and `nbaccel launch` went on to start the ranks (about 1 in
    10 signals sent 0.3-0.45 s in), and one out of pybind11 code aborted the process ("terminate called
    after throwing an instance of 'pybind11::error_already_set'"). Held, it arrives once the imports are
    done, as an ordinary KeyboardInterrupt. (Only the main thread receives it; elsewhere nothing is held.)"""
    if not hasattr(signal, "pthread_sigmask") or threading.current_thread() is not threading.main_thread():
        yield
        return
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def _run_command(argv: Sequence[str] | None) -> int:
    with _ctrl_c_held():
        parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))  # --help and bad options end here
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 1
    with _ctrl_c_held():
        import torch  # noqa: F401  (the commands use it; imported here, where a Ctrl-C in its import is held)
    args._from_cli = True  # errors a caller of the command function gets as exceptions are one line here
    status = func(args)  # an exit status; Accelerate's commands may return something else (env: its report)
    return status if isinstance(status, int) else 0


if __name__ == "__main__":
    raise SystemExit(main())
