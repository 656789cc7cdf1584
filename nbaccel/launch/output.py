"""Worker stdout/stderr captured at the file-descriptor level and forwarded line by line to the kernel.

Worker side: `redirect_std_fds` points fds 1 and 2 at pipes the kernel reads (os.dup2), so output from C
extensions and subprocesses is caught too, and rebinds `sys.stdout`/`sys.stderr` to line-buffered text
files on those fds (in a kernel fork they were ipykernel streams that must not be used from a child).
Kernel side: `LineForwarder` turns the bytes read from one pipe into whole lines, each delivered exactly
once and in order (carriage-return redraws of progress bars collapsed, their live state reported apart); the pipe survives the worker, so whatever it wrote before dying is still read.
"""

from __future__ import annotations

import faulthandler
import io
import os
import sys
import threading
from typing import Any, TextIO

from .screen import Screen

READ_SIZE = 65536


def show_fatal_signals() -> None:
    """Have a fatal signal (gloo's abort on a size mismatch, a segfault) print every thread's Python stack to fd
    2, the rank's stderr: a rank killed that way shows where it was, as a raised error would."""
    faulthandler.enable(2, all_threads=True)


def redirect_std_fds(stdout_fd: int, stderr_fd: int) -> None:
    """Make fds 1/2 (and sys.stdout/sys.stderr) write into the given pipe ends (the caller closes those)."""
    for stream in (sys.stdout, sys.stderr):
        # A forked Jupyter worker inherits the kernel's ipykernel streams: flushing one from the child
        # would send the kernel's own buffered text to the notebook a second time. Only flush plain files.
        if stream is None or type(stream).__module__.startswith("ipykernel"):
            continue
        try:
            stream.flush()
        except Exception:
            pass
    os.dup2(stdout_fd, 1)
    os.dup2(stderr_fd, 2)
    sys.stdout = sys.__stdout__ = text_stream(1)
    sys.stderr = sys.__stderr__ = text_stream(2)


def text_stream(fd: int) -> TextIO:
    """A line-buffered UTF-8 text file writing to `fd` (which stays open when the stream is dropped)."""
    raw = io.FileIO(fd, "w", closefd=False)
    return io.TextIOWrapper(raw, encoding="utf-8", errors="backslashreplace", line_buffering=True,
                            write_through=False)


class ThreadRoutedStream:
    """`sys.stdout`/`sys.stderr` of a process that runs several ranks as threads (torch_xla on TPU v2/v3 and
    on its CPU device): each rank's thread writes to its own rank's pipe (`bind`); any other thread writes
    to `fallback`. Output written at the file-descriptor level (C extensions, subprocesses) cannot be told
    apart by thread: it goes to fds 1/2, the first rank of the process."""

    def __init__(self, fallback: TextIO) -> None:
        self.fallback = fallback
        self._local = threading.local()

    def bind(self, stream: TextIO | None) -> None:
        """Route the calling thread's writes to `stream` (None: back to the fallback)."""
        self._local.stream = stream

    def _target(self) -> TextIO:
        return getattr(self._local, "stream", None) or self.fallback

    def write(self, text: str) -> int:
        return self._target().write(text)

    def writelines(self, lines: Any) -> None:
        self._target().writelines(lines)

    def flush(self) -> None:
        self._target().flush()

    def __getattr__(self, name: str) -> Any:  # fileno, encoding, isatty, buffer, ...: the thread's stream
        return getattr(self._target(), name)


def flush_std() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


LineForwarder = Screen  # one worker stream -> its final lines, live rows and display marks (screen.py)


def read_available(fd: int) -> tuple[bytes, bool]:
    """Read what the pipe holds without blocking: (data, at_end). Sets `fd` non-blocking."""
    os.set_blocking(fd, False)
    chunks = []
    while True:
        try:
            chunk = os.read(fd, READ_SIZE)
        except BlockingIOError:
            return b"".join(chunks), False
        except OSError:
            return b"".join(chunks), True
        if not chunk:
            return b"".join(chunks), True
        chunks.append(chunk)
