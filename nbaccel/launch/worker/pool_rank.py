"""The persistent rank: what each process of a `RankPool` runs until the pool stops it.

A rank sets the launcher environment (docs/internals.md), builds `PartialState` (which creates the process
group), then serves commands from the kernel over its duplex pipe, one at a time, in its main thread:
`exec` (a cell's source, run in the rank's own namespace like a kernel runs a cell), `run` (a cloudpickled
function), `push`/`pull` (one variable), `telemetry` (report to an attached dashboard, or stop). Each command gets exactly one `reply`. Output goes to the kernel
through the fd-level pipes of `output.py`; the reply is sent after stdout/stderr are flushed, so the kernel
has every byte of a cell's output once it holds the reply.

A helper thread answers `status` queries on a second pipe while the main thread is busy (or stuck in a
collective): which collective it is in (`collective_trace.current()`), how long, and where the main thread
is (its stack). When that pipe reaches end-of-file the kernel is gone and the rank exits at once, even if
its main thread is stuck in a collective: a rank never outlives its kernel.
"""

from __future__ import annotations

import ast
import builtins
import linecache
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from types import CodeType
from typing import Any

from ...utils.constants import LAUNCH_HOST_ENV, RANK_GROUPS_ENV
from ...utils.process_group_exit import destroy_default_group
from ..channel import close_quietly
from ..messages import MessageKind, PoolCommand, Ready
from ..output import flush_std, redirect_std_fds, show_fatal_signals
from . import rank_display, rank_prompts
from .entry import apply_cpu_threads
from .parent_death import die_with_parent, lead_own_group

# the commands by their wire strings, and the members the loop compares with: module constants, because an Enum
# call (PoolCommand("exec")) and a member or `.value` lookup on the class cost 0.1-0.3 us each, per call and rank
_COMMANDS = {command.value: command for command in PoolCommand}
_STOP, _EXEC, _RUN, _PUSH, _TELEMETRY, _PULL, _DEBUG = (PoolCommand.STOP, PoolCommand.EXEC, PoolCommand.RUN,
                                                        PoolCommand.PUSH, PoolCommand.TELEMETRY, PoolCommand.PULL,
                                                        PoolCommand.DEBUG)
_REPLY = MessageKind.REPLY.value
PREVIEW_CHARS = 2000

_busy: tuple[int, float] | None = None  # (command id, start time) while the main thread runs a command
_inherited_exception: BaseException | None = None  # what the kernel was handling when it forked this rank
_telemetry_conn: Connection | None = None  # the write end of this rank's telemetry pipe
_interruptible = False  # True while the main thread runs a command: only then does SIGINT interrupt it
_last_failure: BaseException | None = None  # the exception of the last failed exec/run: `debug` opens pdb there


def pool_worker(commands: Connection, status: Connection, stdout: Connection, stderr: Connection,
                env: dict[str, str], inherited_fds: list[int], parent_death_signal: bool,
                telemetry: Connection | None = None) -> None:
    """Multiprocessing target of one rank: set up, then serve commands until `stop` or the kernel leaves."""
    global _inherited_exception, _telemetry_conn
    _inherited_exception = sys.exc_info()[1]
    _telemetry_conn = telemetry  # used once an observer attaches to the pool (pool_telemetry.py)
    if parent_death_signal:
        die_with_parent()  # the kernel's death (even SIGKILL) kills this rank too
    for fd in inherited_fds:  # a forked rank holds copies of the kernel's pipe ends: drop them (EOF detection)
        close_quietly(fd)
    lead_own_group(env.get(RANK_GROUPS_ENV))  # a terminal's or Jupyter's SIGINT reaches the kernel only (the pool forwards it); the
    # rank's children stay in its group, stopped with it
    signal.signal(signal.SIGINT, _on_interrupt)  # an interrupt only counts while a command runs (_handle)
    redirect_std_fds(stdout.fileno(), stderr.fileno())
    close_quietly(stdout, stderr)
    show_fatal_signals()  # a rank killed by a signal shows its stack
    os.environ.update(env)
    apply_cpu_threads()  # a forked rank keeps the kernel's torch threads otherwise (and can hang in OpenMP)
    rank = int(os.environ.get("RANK", "0"))
    rank_display.install(lambda message: _send(commands, dict(message, rank=rank, time=time.time())), mark=False)
    rank_prompts.install(lambda message: _send(commands, message), commands.recv, rank)  # input()/pdb in the cell
    _start_status_thread(status)
    try:
        device = _set_up()
    except BaseException as exc:
        flush_std()
        _send(commands, Ready(rank, error=_error_info(exc)).to_wire())
        os._exit(1)
    flush_std()
    _send(commands, Ready(rank, device=device, pid=os.getpid()).to_wire())
    namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
    serve(commands, namespace, rank)
    # a plain destroy (no collection: the rank may be a fork of the kernel); os._exit skips finalization
    destroy_default_group()
    flush_std()
    os._exit(0)  # skip interpreter teardown: gloo threads and the kernel's inherited atexit hooks


def _set_up() -> str:
    """Build PartialState (it creates the process group); return the device string for the status."""
    from ...state import PartialState
    from ...utils import collective_trace

    # with a listener registered, every traced collective records its call site ("cell line 4"); the hang
    # report builds the record when it asks (`current()`), so the listener asks for none
    collective_trace.add_listener(_ignore, with_record=False)
    state = PartialState()
    return str(state.device)


def _ignore(event: str, record: Any) -> None:
    return None


def serve(commands: Connection, namespace: dict[str, Any], rank: int) -> None:
    """Answer commands until `stop` (or end of file)."""
    global _busy
    while True:
        try:
            message = commands.recv()
        except (EOFError, OSError):
            return
        command = _COMMANDS.get(message[0], message[0])  # an unknown one is answered with an error (_dispatch)
        if command is _STOP:
            return
        call_id = message[1]
        _busy = (call_id, time.time())
        reply = _handle(command, message, namespace, rank)
        rank_display.finish()  # figures a cell left open are shown, as Jupyter does at the end of a cell
        _busy = None
        flush_std()
        reply.update(kind=_REPLY, id=call_id, rank=rank)
        if not _send(commands, reply):
            return


def _load_sent(data: bytes) -> Any:
    """Unpickle what the kernel sent (`run`'s function and arguments, `push`'s value). On another host, a module
    the kernel has and this host lacks is named with the host and what to do: cloudpickle sends what an
    importable module defines by name, so it must be importable here too."""
    try:
        return _loads(data)
    except ModuleNotFoundError as exc:
        host = os.environ.get(LAUNCH_HOST_ENV)
        if not host:
            raise
        raise ModuleNotFoundError(
            f"{exc} on host {host!r}: what was sent refers to that module by name (a .py file next to the "
            f"notebook, a package installed in the kernel's environment); install it on {host!r} or make it "
            "importable there, or define the function in the notebook (or call "
            "cloudpickle.register_pickle_by_value(module) in the kernel) so that it travels by value",
            name=exc.name) from exc


def _loads(data: bytes) -> Any:
    """serialize.loads, imported at the first `run`/`push` (cloudpickle is not needed before) and then bound
    here: an import statement at every call costs a `run` ~1 us of the rank's side."""
    global _loads
    from ..serialize import loads

    _loads = loads
    return loads(data)


def _handle(command: PoolCommand, message: tuple, namespace: dict[str, Any], rank: int) -> dict[str, Any]:
    global _interruptible
    started = time.perf_counter()
    reply: dict[str, Any] = {}
    try:
        _interruptible = True
        try:
            _dispatch(command, message, namespace, rank, reply)
        finally:  # never between pipe reads/writes: a half-sent message would desynchronize the pipe
            _interruptible = False
    except BaseException as exc:
        reply["error"] = _error_info(exc)
        reply["pg_broken"] = _breaks_process_group(exc)
        if command is _EXEC or command is _RUN:  # kept for a post-mortem (`%ranks debug`), as IPython keeps sys.last_exc
            global _last_failure
            _last_failure = exc
    reply["duration"] = time.perf_counter() - started
    return reply


def _on_interrupt(signum: int, frame: Any) -> None:
    """SIGINT's handler for the rank's life: KeyboardInterrupt while a command runs, nothing otherwise. A
    flag instead of switching handlers around each command (two signal.signal calls cost ~20 us a call)."""
    if _interruptible:
        raise KeyboardInterrupt


def _dispatch(command: PoolCommand, message: tuple, namespace: dict[str, Any], rank: int, reply: dict[str, Any]) -> None:
    """Run one command; what goes back to the kernel is written into `reply`."""
    if command is _EXEC:
        _, _, source, filename, ends_with_expression = message
        if "get_ipython" not in namespace and "get_ipython()" in source:  # a %%ranks cell with !cmd / %magic
            from .rank_display import bind_shell

            bind_shell(namespace)
        value, shown = run_cell(source, filename, namespace, ends_with_expression)
        if shown:
            reply.update(describe(value))
            reply["value"] = _dumps_value(value, reply)
    elif command is _RUN:
        function, args, kwargs = _load_sent(message[2])
        try:
            value = function(*args, **kwargs)  # run() hands back values only: no preview text to make
        except SystemExit as exc:
            if exc.code not in (None, 0):
                raise
            value = None  # sys.exit() / sys.exit(0) ends a function successfully, as under notebook_launcher
        reply["value"] = _dumps_value(value, reply, required=True)
    elif command is _PUSH:
        namespace[message[2]] = _load_sent(message[3])
    elif command is _TELEMETRY:
        from .pool_telemetry import set_worker_telemetry

        set_worker_telemetry(_telemetry_conn, bool(message[2]), rank)
    elif command is _DEBUG:
        _post_mortem(rank)
    elif command is _PULL:
        name = message[2]
        if name not in namespace:
            raise NameError(f"name {name!r} is not defined on rank {rank}")
        reply["value"] = _dumps_value(namespace[name], reply, required=True)
    else:
        raise ValueError(f"unknown command {command!r}")


def _post_mortem(rank: int) -> None:
    """pdb at the exception of this rank's last failed cell or function (its prompts go to the cell)."""
    import pdb

    exc = _last_failure
    if exc is None:
        raise RuntimeError(f"rank {rank} has no failed cell or function to debug (nothing failed on it since it "
                           "started)")
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next  # start at the user's code
    print(f"{type(exc).__name__}: {exc}".splitlines()[0])
    pdb.post_mortem(tb)


def run_cell(source: str, filename: str, namespace: dict[str, Any],
             ends_with_expression: bool = True) -> tuple[Any, bool]:
    """Run `source` like IPython: every statement, then the last one's value if it is an expression.

    Returns (value, shown); `shown` is False when the cell does not end with an expression, its value is None, or it ends with a
    semicolon (IPython's way to hide the value). `ends_with_expression=False` (the kernel parsed the cell)
    compiles the source without building its syntax tree here: half the cost of a new cell.
    """
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)  # tracebacks show lines
    if not filename.startswith("<"):  # pdb looks a file up by its absolute path ("Cell In[7]" is relative)
        linecache.cache[os.path.abspath(filename)] = linecache.cache[filename]
    body, last = _compiled_cell(source, filename, ends_with_expression)
    if body is not None:
        exec(body, namespace)
    if last is None:
        return None, False
    value = eval(last, namespace)
    return value, value is not None and not source.rstrip().endswith(";")


CELLS_KEPT = 256  # compiled cells a rank keeps (the kernel names a source it sends again with the same name)
_compiled: dict[str, tuple[str, CodeType | None, CodeType | None]] = {}  # filename -> source, body, last


def _compiled_cell(source: str, filename: str, ends_with_expression: bool) -> tuple[CodeType | None, CodeType | None]:
    """The cell's statements and its last expression (None if it does not end with one), compiled once."""
    kept = _compiled.get(filename)
    if kept is not None and kept[0] == source:
        return kept[1], kept[2]
    last = None
    if ends_with_expression:
        tree = ast.parse(source, filename, "exec")
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = compile(ast.Expression(tree.body.pop().value), filename, "eval")
        body = compile(tree, filename, "exec") if tree.body else None
    else:
        body = compile(source, filename, "exec")
    if len(_compiled) >= CELLS_KEPT:
        del _compiled[next(iter(_compiled))]
    _compiled[filename] = (source, body, last)
    return body, last


def describe(value: Any) -> dict[str, Any]:
    """What the kernel shows for `value` without unpickling it: a short text, and for tensors their facts."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        meta = {"type": "tensor", "shape": list(value.shape), "dtype": str(value.dtype).replace("torch.", ""),
                "device": str(value.device)}
        try:
            with torch._tensor_str.printoptions(threshold=64, edgeitems=3, linewidth=80):
                text = repr(value)
        except Exception as exc:
            text = f"<tensor, repr failed: {exc}>"
        return {"text": _shorten(text), "meta": meta}
    try:
        text = repr(value)
    except Exception as exc:
        text = f"<{type(value).__name__}, repr failed: {exc}>"
    return {"text": _shorten(text), "meta": {"type": type(value).__name__}}


def _shorten(text: str) -> str:
    return text if len(text) <= PREVIEW_CHARS else text[:PREVIEW_CHARS] + f"... ({len(text)} characters)"


def _dumps_value(value: Any, reply: dict[str, Any], required: bool = False) -> bytes | None:
    """Pickle `value` for the kernel (device tensors arrive on the CPU: the kernel must not touch a GPU)."""
    if value is None:
        return None
    try:
        return _cpu_dumps(value)
    except Exception as exc:
        if required:
            raise TypeError(f"the value ({type(value).__name__}) cannot be pickled for the kernel: {exc}") from exc
        reply["value_error"] = f"{type(exc).__name__}: {exc}"
        return None


_PLAIN_TYPES = (int, float, complex, bool, str, bytes, type(None))  # pickled by the standard pickle as they are


def _cpu_dumps(value: Any) -> bytes:
    import io

    if type(value) in _PLAIN_TYPES:  # most values a cell returns: skip building a cloudpickle pickler
        return pickle.dumps(value, pickle.HIGHEST_PROTOCOL)
    buffer = io.BytesIO()
    _cpu_pickler()(buffer).dump(value)
    return buffer.getvalue()


_CpuPickler: Any = None


def _cpu_pickler() -> Any:
    """cloudpickle's pickler that moves device tensors to the CPU; the class is made once per rank (making
    it at every call cost ~50 us of each `run`)."""
    global _CpuPickler
    if _CpuPickler is None:
        import cloudpickle

        class CpuPickler(cloudpickle.Pickler):
            def reducer_override(self, obj: Any) -> Any:
                torch = sys.modules.get("torch")
                if torch is not None and isinstance(obj, torch.Tensor) and obj.device.type not in ("cpu", "meta"):
                    return obj.detach().cpu().__reduce_ex__(self.proto)
                return super().reducer_override(obj)

        _CpuPickler = CpuPickler
    return _CpuPickler


def _error_info(exc: BaseException) -> dict[str, str]:
    _drop_inherited_context(exc)
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next  # start the remote traceback at the user's code
    from nbaccel.utils.exception_report import report_exception  # type and traceback, whatever __str__ does

    report = report_exception(exc, tb)
    return {"exc_type": report.exc_type, "message": report.message, "traceback": report.traceback}


def _drop_inherited_context(exc: BaseException) -> None:
    """A forked rank starts inside the kernel's stack; if that was handling an exception, Python would chain
    it to every error of the rank ("During handling of the above exception..."): cut that link."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if _inherited_exception is not None and exc.__context__ is _inherited_exception:
            exc.__context__ = None
            return
        exc = exc.__context__


def _breaks_process_group(exc: BaseException) -> bool:
    """A backend error (a gloo timeout, a peer gone) leaves the process group unusable: restart the ranks."""
    dist = sys.modules.get("torch.distributed")
    backend_error = getattr(dist, "DistBackendError", None) if dist is not None else None
    if backend_error is not None and isinstance(exc, backend_error):
        return True
    from nbaccel.utils.exception_report import safe_message  # a __str__ that raises must not end the rank

    text = safe_message(exc)
    return isinstance(exc, RuntimeError) and ("gloo" in text or "Connection closed by peer" in text
                                             or "Timed out" in text and "ProcessGroup" in text)


def _send(conn: Connection, message: dict[str, Any]) -> bool:
    """Send a reply or a display message (plain values: pickled with `pickle`, not `Connection.send`'s
    pickler, which copies copyreg's table at each call); False when the kernel is gone."""
    try:
        conn.send_bytes(pickle.dumps(message, pickle.HIGHEST_PROTOCOL))
        return True
    except (BrokenPipeError, ConnectionError, EOFError, OSError):
        return False


# ---------------------------------------------------------------------------------------------- status
def _start_status_thread(conn: Connection) -> None:
    main = threading.main_thread().ident
    thread = threading.Thread(target=_status_loop, args=(conn, main), name="nbaccel-rank-status", daemon=True)
    thread.start()


def _status_loop(conn: Connection, main_ident: int | None) -> None:
    while True:
        try:
            conn.recv()
        except (EOFError, OSError):
            os._exit(1)  # the kernel is gone (or closed the pool): leave now, even from inside a collective
        except Exception:
            continue
        try:
            conn.send(snapshot(main_ident))
        except (BrokenPipeError, ConnectionError, EOFError, OSError):
            os._exit(1)
        except Exception:
            pass


def snapshot(main_ident: int | None) -> dict[str, Any]:
    """Where this rank's main thread is now: the traced collective, a raw torch.distributed call, the line."""
    from ...utils import collective_trace

    record = collective_trace.current()
    busy = _busy
    info: dict[str, Any] = {"kind": MessageKind.STATUS.value, "time": time.time(), "busy": busy is not None,
                            "call_id": busy[0] if busy else None, "since": busy[1] if busy else None,
                            "collective": record.to_dict() if record is not None else None,
                            "raw_call": None, "line": None, "stack": ""}
    frame = sys._current_frames().get(main_ident) if main_ident is not None else None
    if frame is None:
        return info
    stack = traceback.extract_stack(frame)
    for entry in reversed(stack):
        if entry.filename in _compiled:  # a cell run on this rank (`<rank-cell-3>`, or `Cell In[7]` from %%ranks)
            info["line"] = entry.lineno
            break
    for entry in stack:  # the outermost torch.distributed function the user's code called
        path = entry.filename.replace(os.sep, "/")
        if "/torch/distributed/" in path and entry.name not in ("wrapper", "inner"):
            info["raw_call"] = f"torch.distributed.{entry.name}"
            break
    # the user's part: from the first frame below this module's command handler (a cell, or run()'s function)
    start = next((i + 1 for i in range(len(stack) - 1, -1, -1) if stack[i].filename == __file__), 0)
    shown = []
    for entry in stack[start:]:  # ... down to the torch.distributed function it called, not torch's insides
        shown.append(entry)
        if "/torch/distributed/" in entry.filename.replace(os.sep, "/") and entry.name not in ("wrapper", "inner"):
            break
    shown = shown[-10:]
    info["full_stack"] = "".join(traceback.format_list(shown))
    # the report shows the user's frames (nbaccel's and torch's own are on request: hang_report.py)
    user = [entry for entry in shown if not collective_trace.internal_frame(entry.filename)]
    info["stack"] = "".join(traceback.format_list(user)) if user else info["full_stack"]
    info["hidden_frames"] = len(shown) - len(user) if user else 0
    return info
