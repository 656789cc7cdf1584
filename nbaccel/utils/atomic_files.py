"""One way to write a file a user keeps (config, checkpoint shards and manifest, offload index): whole or not
at all, even with two writers at once or a crash mid-write.

The bytes go to a temporary file of a unique name (`tempfile.mkstemp`) in the target's own folder (so the
rename stays on one filesystem), which is fsynced, renamed over the target with `os.replace` (atomic on POSIX
and Windows) and the folder fsynced (so the rename itself survives a power loss). Two concurrent writers each
have their own temporary file; the last rename wins and a reader sees one whole file, never a mix. The
temporary file gets the permissions a plain `open()` would give (the umask's), not mkstemp's 0600.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from .tracebacks import release_frames

PARTIAL_SUFFIX = ".partial"  # temporary files are `.<name>.<random>.partial`, beside the target


def fsync_file(path: str | os.PathLike) -> None:
    """Flush a written file's data to the disk."""
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def fsync_dir(path: str | os.PathLike) -> None:
    """Flush a folder's entries (a rename into it) to the disk, where the platform allows it."""
    with contextlib.suppress(OSError):  # not every platform/filesystem lets a directory be fsynced
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _umask() -> int:
    """The process's umask, read without changing it where Linux says it (/proc), else set and restored."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, durable: bool = True) -> Iterator[Path]:
    """A temporary path beside `path` for a writer that takes a file name (safetensors, torch.save); when
    the block ends without an error it becomes `path` (fsynced first when `durable`); on an error it is
    removed and `path` is left as it was."""
    target = Path(path)
    if not target.parent.is_dir():
        # nothing can be written there: the writer is handed the target itself and fails in its own words, as
        # it would without nbaccel (torch.save's RuntimeError "Parent directory ... does not exist", ...)
        yield target
        return
    fd, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=PARTIAL_SUFFIX)
    os.close(fd)
    partial = Path(name)
    try:
        os.chmod(partial, 0o666 & ~_umask())
        yield partial
        if durable:
            fsync_file(partial)
        os.replace(partial, target)
    except BaseException as error:
        with contextlib.suppress(OSError):
            partial.unlink()
        # the writer's finished frames hold its open file (torch.save's zip writer in `_save`): cleared, the file
        # closes now, not at the next garbage collection, and a full disk gets the partial file's space back
        release_frames(error)
        raise
    if durable:
        fsync_dir(target.parent)


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "w", *, encoding: str | None = None,
                 durable: bool = True) -> Iterator[IO[Any]]:
    """`open(path, mode)` for writing, made atomic: the handle writes a temporary file that replaces `path`
    when the block ends without an error (see the module docstring)."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_write writes a whole file: mode must be 'w' or 'wb', got {mode!r}")
    if encoding is None and mode == "w":
        encoding = "utf-8"
    with atomic_path(path, durable=durable) as partial, open(partial, mode, encoding=encoding) as handle:
        yield handle
        handle.flush()


def write_text(path: str | os.PathLike, text: str, *, durable: bool = True) -> Path:
    """Write `text` (UTF-8) to `path` atomically; returns the path."""
    with atomic_write(path, "w", durable=durable) as handle:
        handle.write(text)
    return Path(path)
