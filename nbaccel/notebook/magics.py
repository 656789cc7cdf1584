"""IPython magics for persistent ranks (`%load_ext nbaccel`).

    %ranks start [-n N] [--spawn] [--timeout S]   start N ranks (a RankPool) with the process group ready
    %%ranks [--ranks 0,1] [--timeout S]           run the cell on the ranks; show them side by side
    %ranks status | restart | stop
    %ranks debug [RANK]                           pdb's post-mortem at the failed rank's exception (the
                                                  first failed rank of the last %%ranks cell by default)
    %ranks push NAME [NAME ...]                   copy kernel variables to every rank
    %ranks pull NAME [NAME ...]                   copy rank variables to the kernel: the value when it is
                                                  equal on every rank, else a list with one value per rank

Errors are raised as the pool's exceptions (CollectiveMismatchError, RankTimeoutError, RankFailedError), whose
message is the report; IPython shows the message without the magic's own frames.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import Any

from IPython.core.magic import Magics, line_cell_magic, magics_class

from ..launch.pool import RankFailedError, RankPool, RankPoolError, RankResults, results_equal

USAGE = """%ranks start [-n N] [--spawn] [--timeout S] [--hosts A,B] | status | restart | stop | push NAME... | pull NAME... | debug [RANK]
%%ranks [--ranks 0,1] [--timeout S]  (cell magic: run the cell on the ranks)"""


class MagicUsageError(ValueError):
    """Bad %ranks arguments: the message says what is allowed."""

    def _render_traceback_(self) -> list[str]:
        return [f"UsageError: {self}"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise MagicUsageError(f"{message}\nusage: {USAGE}")


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"the timeout must be > 0 seconds, got {text}")
    return value


def _rank_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--ranks takes comma-separated rank numbers like 0,1; got {text!r}") from None


def _start_parser() -> _Parser:
    parser = _Parser(prog="%ranks start", add_help=False)
    parser.add_argument("-n", "--num_processes", "--num-processes", type=int, default=2)
    parser.add_argument("--spawn", action="store_true", help="start the ranks with spawn instead of fork")
    parser.add_argument("--timeout", type=_positive, default=30.0)
    parser.add_argument("--mixed_precision", "--mixed-precision", default="no")
    # several machines: -n ranks on each, started over SSH (names as ssh knows them, comma-separated, or slurm)
    parser.add_argument("--hosts", default=None)
    return parser


def _cell_parser() -> _Parser:
    parser = _Parser(prog="%%ranks", add_help=False)
    parser.add_argument("--ranks", type=_rank_list, default=None)
    parser.add_argument("--timeout", type=_positive, default=None)
    return parser


@magics_class
class RankMagics(Magics):
    """`%ranks` / `%%ranks`: one RankPool per kernel."""

    def __init__(self, shell: Any) -> None:
        super().__init__(shell)
        self.pool: RankPool | None = None

    @line_cell_magic
    def ranks(self, line: str, cell: str | None = None) -> Any:
        if cell is not None:
            return self._run_cell(line, cell)
        words = shlex.split(line)
        if not words:
            raise MagicUsageError(f"%ranks needs a subcommand\nusage: {USAGE}")
        command, rest = words[0], words[1:]
        handlers = {"start": self._start, "status": self._status, "restart": self._restart, "stop": self._stop,
                    "push": self._push, "pull": self._pull, "debug": self._debug}
        if command not in handlers:
            raise MagicUsageError(f"unknown subcommand {command!r}\nusage: {USAGE}")
        return handlers[command](rest)

    # ------------------------------------------------------------------------------------------ lifecycle
    def _start(self, args: list[str]) -> None:
        options = _start_parser().parse_args(args)
        if self.pool is not None and self.pool.running:
            print(f"Stopping the running ranks first ({self.pool.world_size} ranks).")
            self.pool.shutdown()
        self.pool = RankPool(options.num_processes, start_method="spawn" if options.spawn else None,
                             mixed_precision=options.mixed_precision, timeout=options.timeout, hosts=options.hosts)
        where = f" on {', '.join(self.pool.hosts.names)}" if self.pool.hosts else ""
        print(f"Started {self.pool.world_size} ranks{where} ({self.pool.start_method}, devices "
              f"{', '.join(self.pool.devices)}, timeout {self.pool.timeout:g} s). Run a cell on them with %%ranks.")

    def _status(self, args: list[str]) -> None:
        if self.pool is None or not self.pool.running:
            print("No ranks running. Start them with %ranks start -n 2.")
            return
        pool = self.pool
        print(f"{pool.world_size} ranks running ({pool.start_method}, timeout {pool.timeout:g} s, "
              f"restarted {pool.restarts} time(s))")
        for info in pool.status():
            print(f"  rank {info['rank']}: pid {info['pid']}, {info['device']}, "
                  f"{'alive' if info['alive'] else 'not running'}")

    def _restart(self, args: list[str]) -> None:
        pool = self._require()
        pool.restart()
        print(f"Restarted {pool.world_size} ranks: their variables are gone, the process group is new.")

    def _stop(self, args: list[str]) -> None:
        if self.pool is None or not self.pool.running:
            print("No ranks running.")
            return
        count = self.pool.world_size
        self.pool.shutdown()
        self.pool = None
        print(f"Stopped {count} ranks.")

    def _debug(self, args: list[str]) -> None:
        """%ranks debug [RANK]: pdb at the exception of the rank's last failed cell (worker/pool_rank.py)."""
        if len(args) > 1 or (args and not args[0].isdigit()):
            raise MagicUsageError(f"%ranks debug takes at most one rank number, got {' '.join(args)!r}\nusage: {USAGE}")
        pool = self._require()
        rank = int(args[0]) if args else None
        if rank is not None and rank >= pool.num_processes:
            raise MagicUsageError(f"rank {rank} does not exist: the ranks are 0..{pool.num_processes - 1}")
        pool.debug(rank)

    def _require(self) -> RankPool:
        if self.pool is None or not self.pool.running:
            raise MagicUsageError("no ranks are running: start them with %ranks start -n 2")
        return self.pool

    # ------------------------------------------------------------------------------------------ variables
    def _push(self, names: list[str]) -> None:
        pool = self._require()
        if not names:
            raise MagicUsageError("%ranks push needs variable names, e.g. %ranks push model data")
        missing = [name for name in names if name not in self.shell.user_ns]
        if missing:
            raise MagicUsageError(f"not defined in the kernel: {', '.join(missing)}")
        for name in names:
            pool.push(name, self.shell.user_ns[name])
        print(f"Pushed {', '.join(names)} to {pool.world_size} ranks.")

    def _pull(self, names: list[str]) -> Any:
        """Assign each name in the kernel; with one name also return it (`loss = %ranks pull loss`)."""
        pool = self._require()
        if not names:
            raise MagicUsageError("%ranks pull needs variable names, e.g. %ranks pull loss")
        value = None
        for name in names:
            values = pool.pull(name)
            if results_equal(values):
                value = values[0]
                print(f"{name}: equal on all ranks, assigned the value")
            else:
                value = values
                print(f"{name}: differs between ranks, assigned a list with one value per rank")
            self.shell.user_ns[name] = value
        return value if len(names) == 1 else None

    # ------------------------------------------------------------------------------------------ cells
    def _run_cell(self, line: str, cell: str) -> RankResults | None:
        options = _cell_parser().parse_args(shlex.split(line))
        pool = self._require()
        live = _LiveView()
        try:
            # a blank first line stands for the `%%ranks` line: line numbers in reports and tracebacks are the
            # ones the user sees in the cell
            results = pool.exec("\n" + cell, ranks=options.ranks, timeout=options.timeout,
                                on_progress=live.update, name=self._cell_label())
        except RankPoolError as exc:
            shown = RankResults(exc.results)
            if live.handle is not None or any(r.stdout or r.stderr or r.text is not None for r in shown):
                live.show(shown)
            raise
        failed = results.failed
        if failed:
            live.show(results)
            first = failed[0].error
            raise RankFailedError(
                f"rank{'s' if len(failed) > 1 else ''} {', '.join(str(r.rank) for r in failed)} raised; first: "
                f"{first.exc_type}: {first.message}".rstrip(": ") + " (remote traceback above)",
                list(results), failures={r.rank: r.error for r in failed})
        if live.handle is not None:  # a long cell: its live view becomes the final one
            live.show(results)
            return None
        if any(result.stdout or result.stderr or result.text is not None for result in results):
            return results
        return None

    def _cell_label(self) -> str | None:
        """The running cell as the user sees it, `Cell In[7]` (JupyterLab's `[7]`; IPython's name for it in
        tracebacks): IPython counts the cell before running it, so its number is the count less one, as
        IPython's displayhook (`Out[7]`) takes it. None (the pool's `<rank-cell-N>`) outside a counted cell."""
        count = getattr(self.shell, "execution_count", None)
        if not isinstance(count, int) or count < 2:
            return None
        return f"Cell In[{count - 1}]"

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()
            self.pool = None


class _LiveView:
    """The side-by-side view of a running cell, updated in place as the ranks print (long cells only)."""

    def __init__(self) -> None:
        self.handle: Any = None

    def update(self, partial: RankResults) -> None:
        self.show(partial)

    def show(self, results: RankResults) -> None:
        try:
            from IPython.display import display

            if self.handle is None:
                self.handle = display(results, display_id=True)
            else:
                self.handle.update(results)
        except Exception:
            print(repr(results), file=sys.stdout)


_magics: RankMagics | None = None


def load_ipython_extension(ipython: Any) -> None:
    """Register %ranks / %%ranks in `ipython` (called by `%load_ext nbaccel`)."""
    global _magics
    if _magics is None or _magics.shell is not ipython:
        _magics = RankMagics(ipython)
    ipython.register_magics(_magics)


def unload_ipython_extension(ipython: Any) -> None:
    """`%unload_ext nbaccel`: stop the ranks."""
    global _magics
    if _magics is not None:
        _magics.close()
        _magics = None
