"""IPython magics for persistent ranks (`%load_ext nbaccel`): `%ranks SUBCOMMAND ...` and `%%ranks`.

Each subcommand is a method registered with `@subcommand`, its arguments declared with IPython's own
`magic_arguments`, so `%ranks?` shows every subcommand's help, `%ranks start?` (or `%ranks start -h`) the
help of one, and a bad argument is IPython's `UsageError`. Adding a subcommand is one decorated method:

    @subcommand
    @magic_arguments.magic_arguments("ranks debug")
    @magic_arguments.argument("rank", type=int, nargs="?", help="...")
    def debug(self, args: argparse.Namespace) -> None:
        # a docstring: what it does (its first line is the summary in `%ranks?`)

A `%%ranks` cell goes through the kernel's own input transformer (`shell.transform_cell`, as a cell would)
before it is sent, so `!cmd`, `%magic` and `name?` lines work in it: on a rank they call that rank's
`get_ipython()`, an IPython shell whose namespace is the rank's (launch/worker/rank_display.py).

Errors are raised as the pool's exceptions (CollectiveMismatchError, RankTimeoutError, RankFailedError), whose
message is the report; IPython shows the message without the magic's own frames.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from typing import Any

from IPython.core import magic_arguments
from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class

from ..launch.pool import RankFailedError, RankPool, RankPoolError, RankResults, results_equal

MagicUsageError = UsageError  # the name earlier versions raised; IPython's own class now
SUBCOMMANDS: dict[str, Callable[..., Any]] = {}  # name -> the method, in the order they are defined
_HELP_LINE = re.compile(r"^\s*%ranks\s+(\w+)\s*\?{1,2}\s*$")  # `%ranks start?`: IPython would ask about `start`


def subcommand(method: Callable[..., Any]) -> Callable[..., Any]:
    """Register a `%ranks` subcommand: a method taking the parsed `argparse.Namespace` (see the docstring)."""
    SUBCOMMANDS[method.__name__] = method
    return method


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


def help_lines(lines: list[str]) -> list[str]:
    """An input transformer (input_transformers_cleanup): `%ranks start?` becomes `%ranks start --help`."""
    if len(lines) == 1:
        match = _HELP_LINE.match(lines[0])
        if match and match.group(1) in SUBCOMMANDS:
            return [f"%ranks {match.group(1)} --help\n"]
    return lines


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
        command, _, rest = line.strip().partition(" ")
        if not command:
            raise UsageError(f"%ranks needs a subcommand: {', '.join(SUBCOMMANDS)} (%ranks? shows their help)")
        method = SUBCOMMANDS.get(command)
        if method is None:
            raise UsageError(f"unknown subcommand {command!r}: use one of {', '.join(SUBCOMMANDS)} "
                             "(%ranks? shows their help)")
        if re.search(r"(^|\s)(-h|--help)(\s|$)", rest):
            self._page(method.__doc__ or "")
            return None
        return method(self, magic_arguments.parse_argstring(method, rest))

    def _page(self, text: str) -> None:
        from IPython.core import page

        page.page(text)

    # ------------------------------------------------------------------------------------------ lifecycle
    @subcommand
    @magic_arguments.magic_arguments("ranks start")
    @magic_arguments.argument("-n", "--num_processes", "--num-processes", type=int, default=2,
                              help="ranks to start (on each host with --hosts); default 2")
    @magic_arguments.argument("--spawn", action="store_true", help="start the ranks with spawn instead of fork")
    @magic_arguments.argument("--timeout", type=_positive, default=30.0,
                              help="seconds a cell may wait in a collective before the hang report; default 30")
    @magic_arguments.argument("--mixed_precision", "--mixed-precision", default="no", help="no, fp16, bf16 or fp8")
    @magic_arguments.argument("--hosts", default=None,
                              help="several machines: names as ssh knows them, comma-separated, or slurm")
    def start(self, options: argparse.Namespace) -> None:
        """Start the ranks (a RankPool) with the process group ready; a running pool is stopped first."""
        if options.num_processes < 1:
            raise UsageError(f"-n must be at least 1, got {options.num_processes}")
        running = self.pool if self.pool is not None and self.pool.running else None
        try:  # the running ranks are stopped once the arguments passed (a mistyped one leaves them running)
            self.pool = RankPool(options.num_processes, start_method="spawn" if options.spawn else None,
                                 mixed_precision=options.mixed_precision, timeout=options.timeout, hosts=options.hosts,
                                 replacing=running)
        except ValueError as exc:  # an argument RankPool refuses before anything starts: a misuse of the magic
            raise UsageError(str(exc)) from None
        if running is not None:
            print(f"Stopped the {running.world_size} ranks that ran before.")
        where = f" on {', '.join(self.pool.hosts.names)}" if self.pool.hosts else ""
        print(f"Started {self.pool.world_size} ranks{where} ({self.pool.start_method}, devices "
              f"{', '.join(self.pool.devices)}, timeout {self.pool.timeout:g} s). Run a cell on them with %%ranks.")

    @subcommand
    @magic_arguments.magic_arguments("ranks status")
    def status(self, options: argparse.Namespace) -> None:
        """Say how many ranks run, their processes and devices."""
        if self.pool is None or not self.pool.running:
            print("No ranks running. Start them with %ranks start -n 2.")
            return
        pool = self.pool
        print(f"{pool.world_size} ranks running ({pool.start_method}, timeout {pool.timeout:g} s, "
              f"restarted {pool.restarts} time(s))")
        for info in pool.status():
            print(f"  rank {info['rank']}: pid {info['pid']}, {info['device']}, "
                  f"{'alive' if info['alive'] else 'not running'}")

    @subcommand
    @magic_arguments.magic_arguments("ranks restart")
    def restart(self, options: argparse.Namespace) -> None:
        """Start the ranks anew: their variables are gone, the process group is new."""
        pool = self._require()
        pool.restart()
        print(f"Restarted {pool.world_size} ranks: their variables are gone, the process group is new.")

    @subcommand
    @magic_arguments.magic_arguments("ranks stop")
    def stop(self, options: argparse.Namespace) -> None:
        """Stop the ranks."""
        if self.pool is None or not self.pool.running:
            print("No ranks running.")
            return
        count = self.pool.world_size
        self.pool.shutdown()
        self.pool = None
        print(f"Stopped {count} ranks.")

    @subcommand
    @magic_arguments.magic_arguments("ranks debug")
    @magic_arguments.argument("rank", type=int, nargs="?", default=None,
                              help="the rank whose exception to debug; default: the first failed rank")
    def debug(self, options: argparse.Namespace) -> None:
        """pdb's post-mortem at a rank's exception in the last %%ranks cell (the first failed rank by default;
        worker/pool_rank.py)."""
        pool = self._require()
        rank = options.rank
        if rank is not None and not 0 <= rank < pool.world_size:
            raise UsageError(f"rank {rank} does not exist: the ranks are 0..{pool.world_size - 1}")
        if rank is None and not pool.failed_ranks:  # one line, as for any misuse of a magic
            raise UsageError(pool.nothing_to_debug("%ranks debug 1"))
        pool.debug(rank)

    def _require(self) -> RankPool:
        if self.pool is None or not self.pool.running:
            raise UsageError("no ranks are running: start them with %ranks start -n 2")
        return self.pool

    # ------------------------------------------------------------------------------------------ variables
    @subcommand
    @magic_arguments.magic_arguments("ranks push")
    @magic_arguments.argument("names", nargs="+", metavar="NAME", help="kernel variables, e.g. model data")
    def push(self, options: argparse.Namespace) -> None:
        """Copy kernel variables to every rank."""
        pool = self._require()
        names = options.names
        missing = [name for name in names if name not in self.shell.user_ns]
        if missing:
            raise UsageError(f"not defined in the kernel: {', '.join(missing)}")
        for name in names:
            pool.push(name, self.shell.user_ns[name])
        print(f"Pushed {', '.join(names)} to {pool.world_size} ranks.")

    @subcommand
    @magic_arguments.magic_arguments("ranks pull")
    @magic_arguments.argument("names", nargs="+", metavar="NAME", help="rank variables, e.g. loss")
    def pull(self, options: argparse.Namespace) -> Any:
        """Copy rank variables to the kernel: the value when it is equal on every rank, else a list with one
        value per rank; with one name also return it (`loss = %ranks pull loss`)."""
        pool = self._require()
        names = options.names
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
    @magic_arguments.magic_arguments("%ranks")
    @magic_arguments.argument("--ranks", type=_rank_list, default=None, help="only these ranks, e.g. 0,1")
    @magic_arguments.argument("--timeout", type=_positive, default=None,
                              help="seconds this cell may wait in a collective (default: the pool's)")
    def _run_cell(self, line: str, cell: str) -> RankResults | None:
        """Run the cell on every rank (each in its own namespace) and show the ranks side by side."""
        options = magic_arguments.parse_argstring(RankMagics._run_cell, line)
        pool = self._require()
        if options.ranks is not None:  # checked here, so that a wrong rank is one line, not a traceback
            unknown = [rank for rank in options.ranks if not 0 <= rank < pool.world_size]
            if unknown or not options.ranks:
                raise UsageError(f"--ranks {','.join(map(str, options.ranks))}: "
                                 f"{'no rank ' + ', '.join(map(str, unknown)) if unknown else 'no rank given'}; "
                                 f"the ranks are 0..{pool.world_size - 1}")
        # the kernel's own transformer, as for a cell: `!cmd`, `%magic`, `x?` become get_ipython() calls
        cell = self.shell.transform_cell(cell)
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
        if results.failed:
            live.show(results)
            raise _cell_failed(results)
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


def _cell_failed(results: RankResults) -> RankFailedError:
    """The error of a cell that failed on some ranks, its tracebacks shown above it. Headed by the first cause:
    a rank that died or raised an error of its own, not one whose collective failed because of it (gloo's
    `Connection closed by peer`), as `RankResults.raise_if_failed` orders them."""
    failed = results.failed
    first = min(failed, key=lambda result: (result.group_broken, result.rank))
    error = first.error
    head = f"rank {first.rank}: {error.exc_type}: {error.message}".rstrip(": ")
    ranks = ", ".join(str(result.rank) for result in failed)
    return RankFailedError(f"rank{'s' if len(failed) > 1 else ''} {ranks} failed; first: {head} "
                           "(remote traceback above)", list(results),
                           failures={result.rank: result.error for result in failed})


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


def _ranks_help() -> str:
    """`%ranks?`: the cell magic's help, then every subcommand's (built by magic_arguments)."""
    parts = ["Persistent ranks: `%ranks SUBCOMMAND ...` (line) and `%%ranks` (cell). `%ranks SUBCOMMAND?` shows "
             "one subcommand's help.", RankMagics._run_cell.__doc__ or ""]
    parts += [method.__doc__ or "" for method in SUBCOMMANDS.values()]
    return "\n\n".join(part.strip() for part in parts)


RankMagics.ranks.__doc__ = _ranks_help()

_magics: RankMagics | None = None


def load_ipython_extension(ipython: Any) -> None:
    """Register %ranks / %%ranks in `ipython` (called by `%load_ext nbaccel`)."""
    global _magics
    if _magics is None or _magics.shell is not ipython:
        _magics = RankMagics(ipython)
    ipython.register_magics(_magics)
    if help_lines not in ipython.input_transformers_cleanup:
        ipython.input_transformers_cleanup.append(help_lines)


def unload_ipython_extension(ipython: Any) -> None:
    """`%unload_ext nbaccel`: stop the ranks."""
    global _magics
    if help_lines in ipython.input_transformers_cleanup:
        ipython.input_transformers_cleanup.remove(help_lines)
    if _magics is not None:
        _magics.close()
        _magics = None
