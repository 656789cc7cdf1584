"""A rank's `input()`, `breakpoint()` and pdb, answered by the user in the notebook (or `nbaccel launch`'s terminal).

A rank has no terminal of its own: its stdin is the kernel's (a pipe the kernel's client holds) or /dev/null.
`install` points every way a rank asks for a line at the kernel instead:
- `builtins.input`: sends a `prompt` message over the rank's channel and waits for the `answer`; the kernel
  (kernel/prompt_relay.py) asks the user with its own `input()`, i.e. Jupyter's input box, labelled with the
  rank. pdb's command loop reads through `input()`, so pdb, `breakpoint()`, `pdb.post_mortem()` and
  `torch.distributed.breakpoint()` (a pdb whose stdin it points at /dev/stdin) all ask this way;
- `getpass.getpass`: the same, asked without echo (the kernel's own getpass: Jupyter's password box), in place
  of the one a forked rank inherits from ipykernel, which would write to the kernel's own sockets;
- `sys.stdin`: a text stream over the launching process's stdin, read through the kernel the same way
  (`PromptStdin`): `readline()`, `read()`, iteration, `json.load(sys.stdin)`, `sys.stdin.buffer.read()`, and
  `pdb.Pdb(stdin=sys.stdin)`; "" at the end of input (a pipe or a file that ran dry, Ctrl-D on a terminal;
  a notebook's input box has no end of input). fd 0 becomes /dev/null, so no C code of the rank reads the
  kernel's (or the terminal's) stdin behind the relay's back (`os.read(0, n)` gives b"");
- `sys.breakpointhook`: the standard library's pdb (ipykernel makes `pdb.Pdb` IPython's in the kernel), as Python's default hook, instead of the hook a forked rank inherits from the
  kernel (ipykernel's debugpy hook returns at once when no debugger client is attached: `breakpoint()` was
  skipped). PYTHONBREAKPOINT is honoured as Python does: "0" turns `breakpoint()` off, another
  "module.function" is called (a debugpy/pydevd one, set for the kernel, is not: the rank has no client).
pdb's output goes to the rank's stdout, which the kernel shows under the rank's label: the rank flushes it
before it asks, and the kernel reads it before it shows the prompt, so the two stay in order.
"""

from __future__ import annotations

import bdb
import builtins
import getpass
import io
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

from ..messages import Answer, MessageKind, Prompt
from ..output import flush_std

_ANSWER = MessageKind.ANSWER.value
STDIN_READ = "stdin"  # a prompt's wire key: a read of sys.stdin (PromptStdin), not input()
_KERNEL_HOOKS = ("debugpy", "pydevd", "ipykernel")  # breakpoint hooks that need a client the rank does not have


class RankInputUnavailable(RuntimeError):
    """A rank asked for input and nobody can answer (the notebook client sends no input requests, the kernel
    has no stdin, the launch is over). Not an EOFError: pdb takes that for the end of input and quits in a
    silent BdbQuit instead of saying why (docs/debugging.md)."""


class PromptLine:
    """How this rank asks the user for a line: `send(message)` reaches the kernel, `receive()` returns the
    next message the kernel sends (blocking). One question at a time, whatever thread asks."""

    def __init__(self, send: Callable[[dict[str, Any]], Any], receive: Callable[[], Any], rank: int) -> None:
        self._send = send
        self._receive = receive
        self.rank = rank
        self._lock = threading.Lock()
        self._count = 0

    def ask(self, prompt: str, password: bool = False) -> str:
        """The line the user typed (no newline); EOFError at the end of input; RankInputUnavailable when
        nobody can answer. `password`: asked without showing what is typed (getpass)."""
        what = "asked for a password" if password else f"asked for input ({prompt!r})"
        answer = self._request(str(prompt), what, password=password)
        if answer.eof or answer.text is None:
            raise EOFError(f"rank {self.rank}: end of input")
        return answer.text

    def read_stdin(self) -> str:
        """The next piece of the launching process's stdin, as `sys.stdin.readline()` gives it there (newline
        included; no prompt shown when it is not a terminal); "" at the end of input; RankInputUnavailable
        when nobody can answer."""
        answer = self._request("", "read sys.stdin", stdin=True)
        if answer.eof or not answer.text:
            return ""
        return answer.text

    def _request(self, prompt: str, what: str, stdin: bool = False, password: bool = False) -> Answer:
        """Send one prompt and wait for its answer; `stdin`: a data read of sys.stdin (prompt_relay answers it
        with the line as read, or eof), not an input(). RankInputUnavailable, naming `what`, when nobody can
        answer."""
        with self._lock:
            flush_std()  # what the rank printed (pdb's listing) is in the pipe before the prompt is read
            self._count += 1
            wire = Prompt(self.rank, prompt, self._count, password=password).to_wire()
            if stdin:
                wire[STDIN_READ] = True
            if self._send(wire) is False:
                raise RankInputUnavailable(f"rank {self.rank} {what} but the kernel is gone")
            answer = self._wait(self._count)
        if answer.unavailable:
            raise RankInputUnavailable(f"rank {self.rank} {what} but nobody can answer: {answer.unavailable}")
        return answer

    def _wait(self, count: int) -> Answer:
        while True:
            try:
                message = self._receive()
            except (EOFError, OSError) as exc:
                raise RankInputUnavailable(f"rank {self.rank} waited for input but the kernel closed its channel") from exc
            if isinstance(message, dict) and message.get("kind") == _ANSWER:
                answer = Answer.from_wire(message)
                if answer.id == count:
                    return answer
                continue  # the answer to an earlier prompt given up on (an interrupt): not this one's
            raise RankInputUnavailable(f"rank {self.rank} waited for input but the kernel sent {message!r} instead")


class _Pending:
    """read()/readline() over what a stdin stream read through the kernel and has not returned yet (`_pending`,
    str or bytes); `_more()` reads the next piece into it, False at the end of input."""

    _pending: Any
    _newline: Any

    def _more(self) -> bool:
        raise NotImplementedError

    def _take(self, count: int) -> Any:
        out, self._pending = self._pending[:count], self._pending[count:]
        return out

    def readline(self, size: int | None = -1) -> Any:
        size = -1 if size is None else size
        while self._newline not in self._pending and (size < 0 or len(self._pending) < size) and self._more():
            pass
        end = self._pending.find(self._newline) + 1 or len(self._pending)
        return self._take(end if size < 0 else min(end, size))

    def read(self, size: int | None = -1) -> Any:
        size = -1 if size is None else size
        while (size < 0 or len(self._pending) < size) and self._more():
            pass
        return self._take(len(self._pending) if size < 0 else size)


class PromptStdin(_Pending, io.TextIOBase):
    """sys.stdin of a rank: a text stream over the launching process's stdin, each piece read through the kernel
    (`PromptLine.read_stdin`); "" at the end of input, like a file. `buffer` reads the same stream as bytes."""

    _newline = "\n"

    def __init__(self, line: PromptLine) -> None:
        super().__init__()
        self._line = line
        self._pending = ""  # read from the kernel, not yet returned
        self.buffer = PromptStdinBuffer(self)

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"

    @property
    def errors(self) -> str:  # type: ignore[override]
        return "strict"

    def readable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def _more(self) -> bool:
        piece = self.buffer._take_text() or self._line.read_stdin()
        self._pending += piece
        return bool(piece)


class PromptStdinBuffer(_Pending, io.BufferedIOBase):
    """sys.stdin.buffer of a rank: the same stream as `PromptStdin`, as UTF-8 bytes."""

    _newline = b"\n"

    def __init__(self, text: PromptStdin) -> None:
        super().__init__()
        self._text = text
        self._pending = b""

    def readable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def _take_text(self) -> str:
        """What bytes reads left over, for the text stream (which reads on from there)."""
        out, self._pending = self._pending.decode("utf-8", "surrogateescape"), b""
        return out

    def _more(self) -> bool:
        piece = self._text._take(len(self._text._pending)) or self._text._line.read_stdin()
        self._pending += piece.encode("utf-8", "surrogateescape")
        return bool(piece)

    def read1(self, size: int = -1) -> bytes:
        if not self._pending:
            self._more()
        return self._take(len(self._pending) if size < 0 else size)

    def readinto(self, target: Any) -> int:
        data = self.read(len(target))
        target[: len(data)] = data
        return len(data)


_installed: PromptLine | None = None


def sink_sender(sink: Any) -> Callable[[dict[str, Any]], bool]:
    """`send` for `install` through a channel.WorkerSink: False when the sink is closed (the kernel is gone)."""

    def send(message: dict[str, Any]) -> bool:
        sink(message)
        return not sink.closed

    return send


def install(send: Callable[[dict[str, Any]], Any], receive: Callable[[], Any], rank: int) -> PromptLine:
    """Make input(), sys.stdin and breakpoint() of this process ask the kernel (see the module docstring)."""
    global _installed
    line = _installed = PromptLine(send, receive, rank)

    def rank_input(prompt: object = "") -> str:
        return line.ask(str(prompt))

    def rank_getpass(prompt: str = "Password: ", stream: Any = None) -> str:
        return line.ask(str(prompt), password=True)

    builtins.input = rank_input
    # a forked rank inherits ipykernel's getpass, which would send its input request on the kernel's own socket
    getpass.getpass = rank_getpass
    sys.stdin = PromptStdin(line)
    _stdin_to_devnull()
    sys.breakpointhook = _breakpoint
    _standard_pdb()
    return line


def _stdin_to_devnull() -> None:
    try:
        fd = os.open(os.devnull, os.O_RDONLY)
    except OSError:
        return
    try:
        os.dup2(fd, 0)
    except OSError:
        pass
    finally:
        if fd != 0:
            os.close(fd)


def _standard_pdb() -> None:
    """pdb.Pdb and pdb.set_trace back to the standard library's in a rank forked from ipykernel, which made it IPython's
    (colored "ipdb>" under fork, "(Pdb)" under spawn: one debugger for both)."""
    pdb = sys.modules.get("pdb")
    if pdb is None:
        return
    standard = next((cls for cls in pdb.Pdb.__mro__ if cls.__module__ == "pdb" and cls.__name__ == "Pdb"), None)
    if standard is None:
        return
    pdb.Pdb = standard
    if getattr(pdb.set_trace, "__module__", "pdb") != "pdb":  # ipykernel's: IPython's debugger

        def set_trace(*, header: str | None = None) -> None:
            debugger = standard()
            if header is not None:
                debugger.message(header)
            debugger.set_trace(sys._getframe().f_back)

        pdb.set_trace = set_trace


def _breakpoint(*args: Any, **kwargs: Any) -> Any:
    """sys.breakpointhook of a rank: pdb at the caller's frame, or what PYTHONBREAKPOINT names."""
    hook = os.environ.get("PYTHONBREAKPOINT", "")
    if hook == "0":
        return None
    if hook and not any(name in hook for name in _KERNEL_HOOKS):
        return sys.__breakpointhook__(*args, **kwargs)
    import pdb

    pdb.Pdb().set_trace(sys._getframe(1))
    return None


def post_mortem_on_error(function: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """`function(*args, **kwargs)`; on its exception, pdb's post-mortem at it (asked in the cell like any prompt of
    the rank), then the exception goes on as it would have (notebook_launcher(debug=True))."""
    try:
        return function(*args, **kwargs)
    except (KeyboardInterrupt, SystemExit, bdb.BdbQuit, RankInputUnavailable):
        raise
    except BaseException as exc:
        import pdb

        rank = _installed.rank if _installed is not None else os.environ.get("RANK", "0")
        print(f"[nbaccel] rank {rank} failed: {type(exc).__name__}: {exc}".splitlines()[0]
              + "; post-mortem (pdb): 'c' or 'q' ends it and the launch fails as usual", flush=True)
        tb = exc.__traceback__
        pdb.post_mortem(tb.tb_next if tb is not None and tb.tb_next is not None else tb)  # at the function's frames
        raise
