"""Worker side, `nbaccel launch`: each line a rank writes reaches the launch's stdout/stderr whole.

torchrun runs every rank with `python -u` on the launch's own stdout and stderr. When those are a pipe (a
notebook's `!nbaccel launch`, `subprocess`, `| tee`), the ranks' writes interleave byte-wise: `print()`
writes its text and its newline separately, and a write longer than the pipe's atomic size (PIPE_BUF) can be
split, so lines of two ranks mix (`epoch 2: loss 0.435rank 1 of 2 done on cpu`). `relay_whole_lines()`
points the rank's fds 1 and 2 at pipes of its own, read by a small relay process forked from the rank, which
writes only whole lines (a progress bar's carriage-return redraws count as line ends) to the real
destination, under an exclusive lock on a file the launch shares with every rank (`LINE_LOCK_ENV`), so no
other rank writes between the bytes of one line. A partial line is held until its end arrives, at most
`PARTIAL_WAIT` seconds (then written as it is: a prompt or a `print(..., end="", flush=True)` still shows).
The rank's sys.stdout and sys.stderr are line-buffered into the relay, as on a terminal, so a `print()` is one
write: under `python -u` its pieces were separate writes, and on a busy machine a rank could stall between two
of them for longer than PARTIAL_WAIT (`error file:error file: /tmp/.../1/error.json`, seen with the suite and
an interrupt stress run on 2 cores).

The relay forks before the rank starts any thread or imports torch, imports nothing after the fork,
ignores the signals sent to the rank's process group (it must outlive the rank to write its last lines) and
exits when every writer of its pipes has closed them: the rank (at exit it closes them and waits for the
relay, so its last lines come before the launch's own report) and any child the rank left running.
On a terminal there is no relay (the rank keeps its TTY: colours, progress bars), but `python -u` would still
send `print("done", rank)` as several writes, between which another rank's line or the launch's prompt for a
rank at a `breakpoint()` lands (`done[rank 1] (Pdb)  0`). So a TTY stream is line-buffered, as in a plain
`python` on a terminal: each line, or `\r` redraw, is one write (`print(..., flush=True)` still shows at once).
"""

from __future__ import annotations

import atexit
import os
import select
import signal
import sys
import time
from collections.abc import Iterable

from ...utils.constants import LINE_LOCK_ENV

try:
    import fcntl
except ImportError:  # not POSIX: no relay (it needs fork and flock)
    fcntl = None  # type: ignore[assignment]

PARTIAL_WAIT = 1.0  # seconds a line without its end is held before it is written as it is
MAX_PARTIAL = 1 << 20  # bytes of one unfinished line held at most
EXIT_WAIT = 5.0  # seconds the exiting rank waits for the relay to write what it still holds
READ_SIZE = 65536


def relay_whole_lines() -> int | None:
    """Route fds 1 and 2 (those that are not a terminal) through a line relay; returns its pid, or None
    when there is nothing to relay (both terminals, closed) or no relay can be started."""
    lock_path = os.environ.pop(LINE_LOCK_ENV, "")  # the rank's own children write through the rank's relay
    _line_buffer(fd for fd in (1, 2) if _is_terminal(fd))
    if fcntl is None or not hasattr(os, "fork"):
        return None
    targets = [fd for fd in (1, 2) if _relayable(fd)]
    if not targets:
        return None
    _line_buffer(targets)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    pipes = {fd: os.pipe() for fd in targets}
    originals = {fd: os.dup(fd) for fd in targets}
    try:
        pid = os.fork()
    except OSError:
        for fd, (read_end, write_end) in pipes.items():
            os.close(read_end)
            os.close(write_end)
            os.close(originals[fd])
        return None
    if pid == 0:  # the relay
        code = 0
        try:
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
                signal.signal(sig, signal.SIG_IGN)
            for _, write_end in pipes.values():  # hold no writer of its own pipes
                os.close(write_end)
            relay({read_end: originals[fd] for fd, (read_end, _) in pipes.items()}, lock_path)
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    for fd, (read_end, write_end) in pipes.items():
        os.close(read_end)
        os.dup2(write_end, fd)
        os.close(write_end)
    atexit.register(_close_and_wait, pid, originals)
    return pid


def _line_buffer(fds: Iterable[int]) -> None:
    """sys.stdout/sys.stderr, where they write to one of `fds`, write each line in one write (see the module
    docstring): on a terminal, and into a relay, where a line sent in pieces could otherwise wait past
    PARTIAL_WAIT between two of them on a busy machine and go out cut."""
    wanted = set(fds)
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream.fileno() in wanted:
                stream.reconfigure(line_buffering=True, write_through=False)
        except (AttributeError, OSError, ValueError):  # replaced by the script's runner, or closed
            pass


def _is_terminal(fd: int) -> bool:
    try:
        return os.isatty(fd)
    except OSError:
        return False


def _relayable(fd: int) -> bool:
    try:
        return not _is_terminal(fd) and os.fstat(fd) is not None
    except OSError:  # closed
        return False


def _close_and_wait(pid: int, originals: dict[int, int]) -> None:
    """At the rank's exit: its last output through the relay, then fds 1/2 straight to the destination (for
    what Python writes while shutting down), and the relay given time to write what it holds."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    for fd, original in originals.items():
        try:
            os.dup2(original, fd)
            os.close(original)
        except OSError:
            pass
    deadline = time.monotonic() + EXIT_WAIT
    while time.monotonic() < deadline:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return
        if done:
            return
        time.sleep(0.005)


def relay(sources: dict[int, int], lock_path: str = "") -> None:
    """Copy each source fd to its destination fd ({source: destination}) in whole lines, until every source
    is at its end (see the module docstring)."""
    lock = os.open(lock_path, os.O_RDWR) if lock_path else None
    pending = {source: b"" for source in sources}
    since: dict[int, float] = {}  # when the partial line of a source began to wait
    open_sources = list(sources)
    while open_sources:
        timeout = None
        if since:
            timeout = max(0.0, min(since.values()) + PARTIAL_WAIT - time.monotonic())
        ready, _, _ = select.select(open_sources, [], [], timeout)
        for source in ready:
            data = os.read(source, READ_SIZE)
            if not data:
                open_sources.remove(source)
                os.close(source)
                _write(sources[source], pending[source], lock)
                pending[source] = b""
                since.pop(source, None)
                continue
            buffered = pending[source] + data
            cut = max(buffered.rfind(b"\n"), buffered.rfind(b"\r")) + 1
            whole, rest = buffered[:cut], buffered[cut:]
            if len(rest) > MAX_PARTIAL:
                whole, rest = buffered, b""
            _write(sources[source], whole, lock)
            pending[source] = rest
            if not rest:
                since.pop(source, None)
            elif whole or source not in since:
                since[source] = time.monotonic()
        now = time.monotonic()
        for source, started in list(since.items()):
            if now - started >= PARTIAL_WAIT:
                _write(sources[source], pending[source], lock)
                pending[source] = b""
                del since[source]


def _write(fd: int, data: bytes, lock: int | None) -> None:
    """Write `data` whole, holding the launch's line lock (every rank's relay takes it for its writes)."""
    if not data:
        return
    if lock is not None:
        fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    except OSError:  # the reader went away (a closed pipe): the output has nowhere to go
        pass
    finally:
        if lock is not None:
            fcntl.flock(lock, fcntl.LOCK_UN)
