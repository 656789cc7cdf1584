"""Large tensors in a rank's return value travel through shared memory, not through the pickled pipe.

The worker pickles its result as before (cloudpickle), except that the bytes of every CPU tensor storage of
at least `MIN_BYTES` are copied once into a file of a launch's private folder in /dev/shm (tmpfs: memory,
not disk); the pickle carries only the file's name. The kernel maps that file (`torch.from_file`, shared)
and unlinks it: no copy on the kernel side, and the memory is freed with the tensor. The pickled path costs
a serialization, a pipe transfer and a deserialization of every byte (~10x the memory-bandwidth floor).

Semantics are those of pickling: each tensor gets its own storage (as `torch.save`-based pickling does);
the storages come back not resizable (`resize_` raises, as for tensors received through
torch.multiprocessing). Where the folder is not set (elastic/XLA launches, no /dev/shm) or a file cannot be
made (tmpfs full: `posix_fallocate` fails before any byte is written), the tensor is pickled as before.
The kernel removes the folder when the launch ends, with any file no result was read from.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from typing import Any

import cloudpickle

from .private_dirs import make_private_dir

RESULT_DIR_ENV = "NBACCEL_RESULT_DIR"  # the launch's folder for large results, set in each worker's environment
MIN_BYTES = 1 << 20  # smaller storages are cheaper through the pipe than through a file
SHM_ROOT = "/dev/shm"
DIR_PREFIX = "nbaccel-results-"


def make_result_dir() -> str | None:
    """A private (0700) folder in /dev/shm for one launch's large results; None where there is no tmpfs.

    Its name carries the kernel's pid: folders left by a kernel that was killed (SIGKILL leaves no chance
    to clean up) are removed here, by the next launch on the machine."""
    if not sys.platform.startswith("linux") or not os.path.isdir(SHM_ROOT) or not os.access(SHM_ROOT, os.W_OK):
        return None
    try:
        return make_private_dir(DIR_PREFIX, SHM_ROOT)
    except OSError:
        return None


def remove_result_dir(directory: str | None) -> None:
    if directory:
        shutil.rmtree(directory, ignore_errors=True)


def dumps_value(value: Any) -> bytes:
    """cloudpickle `value`; its large CPU tensor storages go to files of $NBACCEL_RESULT_DIR when set."""
    directory = os.environ.get(RESULT_DIR_ENV)
    torch = sys.modules.get("torch")
    if not directory or torch is None:  # no torch loaded: the value holds no tensor
        return cloudpickle.dumps(value)
    import io

    buffer = io.BytesIO()
    _SharedStoragePickler(buffer, directory, torch).dump(value)
    return buffer.getvalue()


class _SharedStoragePickler(cloudpickle.Pickler):
    def __init__(self, file: Any, directory: str, torch: Any) -> None:
        super().__init__(file)
        self.directory = directory
        self.torch = torch

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is self.torch.storage.TypedStorage:
            reduced = _share(obj, self.directory, self.torch)
            if reduced is not None:
                return reduced
        return super().reducer_override(obj)


def _share(storage: Any, directory: str, torch: Any) -> tuple | None:
    """Write a CPU storage's bytes into a new file of `directory`; the reduce tuple that maps it back, or None.

    write() into tmpfs is the one copy (mapping the file and copying would first have to reserve the pages
    to turn a full tmpfs into an error rather than a SIGBUS, which zeroes them: a second pass)."""
    untyped = storage._untyped_storage  # the public accessors of TypedStorage warn that it is deprecated
    if untyped.device.type != "cpu" or storage.dtype in _unmappable_dtypes(torch):
        return None
    nbytes = untyped.nbytes()
    if nbytes < MIN_BYTES:
        return None
    try:
        data = memoryview(torch.empty(0, dtype=torch.uint8).set_(untyped).numpy())
        fd, path = tempfile.mkstemp(dir=directory, suffix=".storage")
    except Exception:  # no numpy, no space for a file name
        return None
    try:
        with os.fdopen(fd, "wb", buffering=0) as file:
            written = 0
            while written < nbytes:
                written += file.write(data[written:])
    except OSError:  # e.g. tmpfs full: the tensor is pickled instead
        try:
            os.unlink(path)
        except OSError:
            pass
        return None
    return _load_shared_storage, (path, storage.dtype, nbytes // _itemsize(storage.dtype, torch))


def _itemsize(dtype: Any, torch: Any) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _unmappable_dtypes(torch: Any) -> tuple:
    """Dtypes `torch.from_file` cannot map (quantized storages keep the pickled path)."""
    return tuple(getattr(torch, name) for name in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4")
                 if hasattr(torch, name))


def _load_shared_storage(path: str, dtype: Any, size: int) -> Any:
    """Kernel side: map the file as the storage's memory, then unlink it (the mapping keeps the memory)."""
    import torch

    try:
        mapped = torch.from_file(path, shared=True, size=size, dtype=dtype)
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
    return torch.storage.TypedStorage(wrap_storage=mapped.untyped_storage(), dtype=dtype, _internal=True)
