"""The kernel's side of a rank's `input()`, `breakpoint()` and pdb (worker/rank_prompts.py): ask the user.

A rank's `prompt` message reaches the kernel's loop that watches the ranks (the supervisor of a launch, a
RankPool call), in the thread that runs the cell. `PromptRelay.serve` asks the user with the kernel's own
`input()`: in Jupyter that is the kernel's input request, so JupyterLab, Notebook, VS Code and Colab show
their input box; in a script (`nbaccel launch`, a plain `python`), the terminal. The prompt is labelled with
the rank ("[rank 1] (Pdb) "). The loop blocks while the user types, so several ranks that stop are served one
after the other, and the other ranks wait. The line goes back to the rank as an `answer`; so does the end of
input (EOFError in the rank), or why nobody can answer (the client sends no input requests: nbclient without
allow_stdin, a kernel without stdin), which the rank raises as `RankInputUnavailable` instead of a silent
`BdbQuit`. A KeyboardInterrupt (the kernel's interrupt) goes up to the loop, which stops the launch. A prompt
whose answer became moot while the user is asked (the rank died at it, another rank failed) is withdrawn
(interrupts.withdrawable), and the loop goes on to report what happened instead of waiting for a line.

The relay keeps the time spent at prompts: the loop's timeouts and hang watch count time without it
(`clock`, `wall`), so a rank at a prompt is never taken for a hang; they say so once per launch.
"""

from __future__ import annotations

import builtins
import contextlib
import getpass
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TextIO

from ..messages import Answer, Prompt
from ..worker.rank_prompts import STDIN_READ
from .interrupts import Withdrawn, withdrawable

NOTICE = ("[nbaccel] {label} waits for input: the timeout and the hang watch are paused while a rank is at a "
          "prompt, and resume when it goes on")
NO_INPUT_REQUESTS = (
    "this notebook client does not send input requests (e.g. nbclient/nbconvert/papermill without "
    "allow_stdin); run the cell in JupyterLab, Notebook, VS Code or Colab, or remove the breakpoint()/input()")
NO_MORE_INPUT = ("the stdin of the process that launched the ranks is not a terminal and has no more input; run "
                 "it on a terminal (or in a notebook) to answer, or remove the breakpoint()/input()")
NO_STDIN = ("the process that launched the ranks has no stdin to read from; run it on a terminal or in a "
            "notebook, or remove the breakpoint()/input()")


_READERS: set[int] = set()  # threads other than the main one waiting in input() now (their idents)


def stdin_held_by_a_thread() -> bool:
    """Whether a thread other than the main one waits in input() now (`nbaccel launch`: the collective watch's,
    at a rank's prompt). On a pipe it holds stdin's buffer lock while it waits, and an interpreter that finalizes
    meanwhile aborts ("Fatal Python error: _enter_buffered_busy ... <stdin>"): the process must end with
    os._exit instead (commands/main.py)."""
    return bool(_READERS)


class PromptRelay:
    """Serve rank prompts with the kernel's input(), one at a time; `paused`: seconds spent at prompts."""

    def __init__(self, stderr: Callable[[], TextIO] | None = None) -> None:
        self._stderr = stderr or (lambda: sys.stderr)
        self.paused = 0.0
        self.active = False  # a prompt is being answered now
        self._told = False
        self._unavailable: str | None = None  # once nobody could answer, later prompts get the same answer

    def clock(self) -> float:
        """time.monotonic() less the time spent at prompts: what timeouts count."""
        return time.monotonic() - self.paused

    def wall(self) -> float:
        """time.time() less the time spent at prompts: what the hang watch compares the ranks' times with."""
        return time.time() - self.paused

    def serve(self, label: str, message: dict[str, Any], reply: Callable[[dict[str, Any]], Any],
              moot: Callable[[], str | None] | None = None) -> None:
        """Ask the user for the line `message` (a `prompt`) waits for; send the `answer` with `reply`.

        `moot` (called from another thread while the user is asked): why the prompt no longer needs an answer
        (its rank died, another failed), else None. The question is then withdrawn, as an interrupt takes it
        back, with a line that says why, and the rank gets no answer: the caller ends the launch or the call."""
        prompt = Prompt.from_wire(message)
        started = time.monotonic()
        self.active = True
        try:
            with withdrawable(moot) if moot is not None else contextlib.nullcontext():
                if message.get(STDIN_READ):
                    fields = self._read(label)
                else:
                    fields = self._answer(label, prompt.prompt, prompt.password)
        except Withdrawn as why:
            self._say(f"[nbaccel] the question of {label} was withdrawn: {why}")
            return
        finally:
            self.active = False
            self.paused += time.monotonic() - started
        _send(reply, Answer(prompt.rank, prompt.id, **fields))

    def decline(self, message: dict[str, Any], reply: Callable[[dict[str, Any]], Any]) -> None:
        """Answer the prompt `message` with the end of input, without asking anyone (the call was interrupted:
        the rank's input() raises EOFError, its pdb quits)."""
        prompt = Prompt.from_wire(message)
        _send(reply, Answer(prompt.rank, prompt.id, eof=True))

    def _answer(self, label: str, text: str, password: bool = False) -> dict[str, Any]:
        if self._unavailable is None:
            self._unavailable = _why_no_input()
        if self._unavailable is not None:
            self._say(f"[nbaccel] {label} asked for input ({text.strip() or 'a line'}), but nobody can answer: "
                      f"{self._unavailable}")
            return {"unavailable": self._unavailable}
        if not self._told:
            self._told = True
            self._say(NOTICE.format(label=label))
        ask = getpass.getpass if password else builtins.input  # a kernel's getpass: Jupyter's password box
        try:
            with _reading_stdin():
                return {"text": ask(f"[{label}] {text}")}
        except EOFError:
            if not _on_terminal() and not _kernel_input():  # e.g. `< /dev/null`, a pipe that ran dry
                self._unavailable = NO_MORE_INPUT
                return self._answer(label, text, password)
            # Ctrl-D on a terminal; a kernel's input() raises EOFError when its client sends "\x04"
            self._say(f"[nbaccel] end of input: {label} gets EOFError")
            return {"eof": True}
        except Exception as exc:  # ipykernel: StdinNotImplementedError when the client allows no input
            if type(exc).__name__ != "StdinNotImplementedError":
                raise
            self._unavailable = NO_INPUT_REQUESTS
            return self._answer(label, text, password)

    def _read(self, label: str) -> dict[str, Any]:
        """A rank's read of sys.stdin: the next line of this process's stdin, as read, newline included (the
        data of `cmd | nbaccel launch script.py`); the end of input is `eof` (the rank reads ""), even where an
        input() would be told that nobody can answer."""
        if self._unavailable is None:
            self._unavailable = _why_no_input()
        if self._unavailable == NO_MORE_INPUT:
            return {"eof": True}
        if self._unavailable is not None:
            self._say(f"[nbaccel] {label} read sys.stdin, but nobody can answer: {self._unavailable}")
            return {"unavailable": self._unavailable}
        if _kernel_input() or _on_terminal():
            answer = self._answer(label, "")  # asked like input(): the notebook's input box, the terminal
            if "text" in answer:
                answer["text"] += "\n"
            elif answer.get("unavailable") == NO_MORE_INPUT:
                answer = {"eof": True}
            return answer
        try:
            with _reading_stdin():
                text = sys.stdin.readline()  # a pipe or a file: read as it is, without a prompt, as the rank would
        except UnicodeDecodeError as exc:
            why = (f"the stdin of the process that launched the ranks is not {sys.stdin.encoding} text ({exc}); "
                   "pass binary data to the ranks as a file instead")
            self._say(f"[nbaccel] {label} read sys.stdin, but {why}")
            return {"unavailable": why}
        except (OSError, ValueError):
            self._unavailable = NO_STDIN
            return self._read(label)
        if not text:
            self._unavailable = NO_MORE_INPUT  # as an input() at the end of this stdin would have found
            return {"eof": True}
        return {"text": text}

    def _say(self, line: str) -> None:
        try:
            stream = self._stderr()
            stream.write(line + "\n")
            stream.flush()
        except Exception:
            pass


@contextlib.contextmanager
def _reading_stdin() -> Iterator[None]:
    """This thread reads stdin meanwhile: counted by `stdin_held_by_a_thread` unless it is the main thread."""
    reader = None if threading.current_thread() is threading.main_thread() else threading.get_ident()
    if reader is not None:
        _READERS.add(reader)
    try:
        yield
    finally:
        if reader is not None:
            _READERS.discard(reader)


def _send(reply: Callable[[dict[str, Any]], Any], answer: Answer) -> None:
    try:
        reply(answer.to_wire())
    except (BrokenPipeError, ConnectionError, EOFError, OSError, ValueError):
        pass  # the rank is gone: its exit is reported as such


def _on_terminal() -> bool:
    try:
        return bool(sys.stdin is not None and sys.stdin.isatty())
    except (OSError, ValueError):
        return False


def _kernel_input() -> bool:
    """Whether a kernel put its own input() in place (ipykernel: the notebook's input box)."""
    return getattr(builtins.input, "__module__", None) != "builtins"


def _why_no_input() -> str | None:
    """Why the kernel's input() cannot ask anyone, when that is known before asking."""
    if not _kernel_input():
        stdin = sys.stdin
        if stdin is None or getattr(stdin, "closed", False):
            return NO_STDIN
    return None
