"""`nbaccel launch`'s worker entry: run the user's script as Python would, reporting the rank's collectives.

torchrun starts each rank as `python -u -m nbaccel.launch.worker.script_entry [--module] TARGET ARGS...`.
When NBACCEL_COLLECTIVE_WATCH names the launching process's socket (kernel/collective_watch.py), the entry
connects to it and reports every nbaccel collective the rank enters and leaves (batched: a deque append
per collective, one socket write per 50 ms), then how the script ended. Then it runs TARGET as `__main__`
with the `sys.argv`, `__file__` and `sys.path[0]` that `python TARGET ARGS` (or `python -m TARGET ARGS`) gives, and
prints an uncaught exception's traceback without this entry's frames. If the socket cannot be reached the
script runs all the same, unwatched. Read through a pipe, the rank's output goes through a line relay first
(line_relay.py): its lines never mix with another rank's. The rank dies with the launching process, even a SIGKILLed one (torch
elastic starts each rank in a session of its own, out of reach of a signal to the launch's group).
"""

from __future__ import annotations

import atexit
import builtins
import functools
import importlib.machinery
import importlib.util
import os
import runpy
import sys
import types
import zipfile
from multiprocessing.connection import Client
from typing import NoReturn

from ... import telemetry
from ...utils import collective_trace
from ...utils.constants import COLLECTIVE_WATCH_ENV, RANK_GROUPS_ENV
from ...utils.process_group_exit import before_groups_end
from ..channel import WorkerSink
from ..messages import MessageKind, RankState, Status
from ..output import show_fatal_signals
from . import rank_prompts
from .line_relay import relay_whole_lines
from .parent_death import die_with_parent, register_group
from .raw_calls import RawCollectiveWatch, watch_raw_collectives


def main(argv: list[str] | None = None) -> None:
    """Run `[--module] TARGET ARGS...` (the command line torchrun passes) as the rank's `__main__`."""
    relay_whole_lines()  # through a pipe, each line the rank writes arrives whole (line_relay.py)
    show_fatal_signals()  # a rank killed by a signal shows its stack
    die_with_parent()  # torch elastic starts each rank in its own session: a SIGKILLed launch would leave it running
    # its session: stopped with the launch, dead or alive. The variable stays: what the rank starts inherits it, so
    # the launch also finds a leftover that made a session of its own (kernel/rank_groups.py)
    register_group(os.environ.get(RANK_GROUPS_ENV))
    argv = list(sys.argv[1:] if argv is None else argv)
    as_module = argv[:1] == ["--module"]
    if as_module:
        argv = argv[1:]
    ending = _Ending(*_connect())
    atexit.register(ending.at_exit)  # registered first, so it runs after every exit function the script adds
    try:
        _run(argv[0], argv[1:], as_module)
    except SystemExit as exc:
        ending.report(exc.code in (None, 0), f"SystemExit: {exc.code}")
        raise
    except Exception as exc:
        ending.report(False, _describe(exc), exc)
        _print_uncaught(exc)
    except BaseException as exc:  # KeyboardInterrupt: Python's own ending (exit by the signal)
        ending.report(False, type(exc).__name__)
        raise
    else:
        ending.report(True)


class _Ending:
    """Tells the watch how the script ended: a failure at once; a success at exit, after the threads the
    script left running (Python joins them first, and they may still enter collectives) and after every exit
    function it registered (a tracker's upload), so that what follows `finished` is only the interpreter's
    own teardown, which the launcher then gives a few seconds (kernel/collective_watch.py)."""

    def __init__(self, sink: WorkerSink | None, raw_watch: RawCollectiveWatch | None) -> None:
        self.sink = sink
        self.raw_watch = raw_watch
        self.succeeded = False

    def report(self, ok: bool, error: str = "", exc: BaseException | None = None) -> None:
        if self.sink is None:
            return
        if ok:
            self.succeeded = True
            return
        if exc is not None and self.raw_watch is not None:
            self.raw_watch.report_failure(exc)  # a raw collective it came out of: sent just before the failure
        self.sink(Status(self.sink.rank, RankState.FAILED, error=error).to_wire())
        self.sink.close()
        self.sink = None

    def at_exit(self) -> None:
        if self.raw_watch is not None:  # no look holds the script's frames (a group of its own) past this
            self.raw_watch.stop()
        if self.sink is not None and self.succeeded:
            self.sink(Status(self.sink.rank, RankState.FINISHED).to_wire())  # sent at once
            # the socket stays open: the watch reads its end of file as this process's exit
            self.sink.closed = True


def _connect() -> tuple[WorkerSink | None, RawCollectiveWatch | None]:
    """A sink to the launch's collective watch, with the collective trace reporting into it, and the watch on
    the script's raw collectives; (None, None) when the launch watches nothing (no variable) or the socket
    cannot be reached."""
    address = os.environ.pop(COLLECTIVE_WATCH_ENV, "")  # the rank's own children are not ranks
    if not address:
        return None, None
    try:
        conn = Client(address, family="AF_UNIX")
    except OSError:
        return None, None
    rank = int(os.environ.get("RANK", "0"))
    sink = WorkerSink(conn, rank, int(os.environ.get("LOCAL_RANK", str(rank))))
    sink(Status(rank, RankState.RUNNING, pid=os.getpid(),
                restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))).to_wire())

    def report(event: str, trace: collective_trace.in_collective) -> None:
        sink.defer(telemetry.collective_item(event, trace, rank))  # made into its message when sent

    collective_trace.add_listener(report, with_record=False)
    rank_prompts.install(rank_prompts.sink_sender(sink), conn.recv, rank)  # input()/pdb: asked on the launch's terminal
    # the script's own calls
    raw_watch = watch_raw_collectives(functools.partial(sink.send, MessageKind.COLLECTIVE.value))
    if raw_watch is not None:  # it lets go of the script's frames before PartialState's exit hook ends the group
        before_groups_end(raw_watch.stop)
    # a forked child (a data loader worker) is not the rank, and shares its socket: it stays quiet
    os.register_at_fork(after_in_child=functools.partial(setattr, sink, "closed", True))
    return sink, raw_watch


def _describe(exc: BaseException) -> str:
    try:
        return f"{type(exc).__name__}: {exc}"
    except Exception:  # an exception whose own __str__ raises
        return type(exc).__name__


def _run(target: str, args: list[str], as_module: bool) -> None:
    sys.argv = [target, *args]
    if as_module:  # `python -m TARGET`: sys.path[0] is the working directory already (this entry ran with -m)
        runpy.run_module(target, run_name="__main__", alter_sys=True)
        return
    if not os.path.isfile(target) or zipfile.is_zipfile(target):
        _run_folder(target)
        return
    # `python TARGET`: sys.path[0] is the script's folder (symbolic links resolved), `__file__` the absolute
    # path, sys.argv[0] the path as given (runpy.run_path would put its own argument there)
    sys.path[0] = os.path.dirname(os.path.realpath(target))
    path = os.path.abspath(target)
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=path, __cached__=None, __builtins__=builtins, __spec__=None,
                         __loader__=importlib.machinery.SourceFileLoader("__main__", path))
    with open(path, "rb") as file:
        code = compile(file.read(), path, "exec", dont_inherit=True)  # bytes: the coding cookie is honoured
    sys.modules["__main__"] = main
    exec(code, main.__dict__)


def _run_folder(target: str) -> None:
    """`python TARGET` for a folder or zip with `__main__.py`: Python puts the working directory joined with
    TARGET in sys.path[0] (runpy.run_path would put TARGET as given, relative, and keep the working directory
    behind it), and sys.argv[0] stays TARGET as given."""
    home = os.path.join(os.getcwd(), target)
    spec = importlib.machinery.PathFinder.find_spec("__main__", [home])
    if spec is None:
        raise ImportError(f"can't find '__main__' module in {home!r}")
    sys.path[0] = home
    main = importlib.util.module_from_spec(spec)
    sys.modules["__main__"] = main
    spec.loader.exec_module(main)


def _print_uncaught(exc: Exception) -> NoReturn:
    """What Python does with an uncaught exception (sys.excepthook, exit status 1), without the frames of this
    entry and of runpy, so the traceback starts in the user's script as under `python TARGET`."""
    tb = exc.__traceback__
    while tb is not None and (tb.tb_frame.f_code.co_filename == __file__
                              or tb.tb_frame.f_globals.get("__name__") == "runpy"):
        tb = tb.tb_next
    sys.excepthook(type(exc), exc.with_traceback(tb), tb)  # Python's own hook prints exc.__traceback__
    sys.exit(1)


if __name__ == "__main__":
    main()
