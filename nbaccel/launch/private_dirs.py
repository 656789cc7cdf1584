"""Owner-only folders of one launch or pool (its FileStore, its large results) that no killed kernel leaves.

A folder's name carries the pid of the kernel that made it. A kernel killed with SIGKILL cannot remove its
folders, so making a folder first removes those whose kernel no longer runs. The small folders every launch
makes and removes (its FileStore's, its rank groups') live in /dev/shm where the temporary folder is the
default /tmp (`temp_parent`). The FileStore folders live in
one owner-only parent per user (`<tmp>/nbaccel-<uid>`), so that sweep reads nbaccel's entries only, not all
of /tmp (thousands of entries on a busy machine: milliseconds on every launch). A folder that names its keeper
(an empty `keeper-<pid>` file: the process that outlives the kernel to stop what the folder lists and remove it,
kernel/rank_groups.py) is left to that keeper while it runs.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile

STORE_PREFIX = "store-"
WATCH_PREFIX = "watch-"  # `nbaccel launch`'s collective watch (its Unix socket)
GROUPS_PREFIX = "groups-"  # where a launch's ranks register their process groups (kernel/rank_groups.py)
KEEPER_PREFIX = "keeper-"  # in a folder: the pid of the process that removes it after the kernel's death
LINE_LOCK_PREFIX = "lines-"  # `nbaccel launch`'s lock file for the ranks' line relays
ELASTIC_LOGS_PREFIX = "elastic-"  # torch elastic's log folder of one launch (torch's own is /tmp/torchelastic_*)
# a few bytes each, made and removed by every launch and pool: kept in memory (`temp_parent`)
IN_MEMORY_PREFIXES = frozenset({STORE_PREFIX, GROUPS_PREFIX, LINE_LOCK_PREFIX})
SHARED_MEMORY = "/dev/shm"


def make_private_dir(prefix: str, root: str) -> str:
    """A new 0700 folder `<root>/<prefix><pid>-<random>`, after removing the orphans of dead kernels."""
    remove_orphans(prefix, root)
    return tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=root)


def remove_orphans(prefix: str, root: str) -> None:
    """Remove this user's `<prefix><pid>-...` folders of `root` whose pid no longer runs, unless their keeper
    still runs."""
    import psutil  # here: importing nbaccel's launcher does not import psutil

    try:
        names = [name for name in os.listdir(root) if name.startswith(prefix)]
    except OSError:
        return
    for name in names:
        pid = name[len(prefix):].split("-", 1)[0]
        if not pid.isdigit() or psutil.pid_exists(int(pid)):  # another user's process counts as alive
            continue
        path = os.path.join(root, name)
        if _keeper_running(path):  # it stops the dead kernel's rank groups listed there, then removes it
            continue
        try:
            if os.stat(path).st_uid == os.getuid():
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass


def _keeper_running(path: str) -> bool:
    import psutil

    try:
        names = os.listdir(path)
    except OSError:
        return False
    pids = [name[len(KEEPER_PREFIX):] for name in names if name.startswith(KEEPER_PREFIX)]
    return any(pid.isdigit() and psutil.pid_exists(int(pid)) for pid in pids)


def make_store_dir() -> str:
    """The folder of a local launch's or a pool's FileStore (0700)."""
    return make_user_dir(STORE_PREFIX)


def remove_dir(path: str | None) -> None:
    """Remove a private folder and what it holds (None: nothing)."""
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)


def make_user_dir(prefix: str, parent: str | None = None) -> str:
    """A new 0700 folder `<parent>/nbaccel-<uid>/<prefix><pid>-<random>` (`<parent>/nbaccel-<prefix>...` where
    the per-user folder cannot be had), after removing the orphans of dead processes. `<parent>` by default is
    the shared-memory tmpfs for the small folders of every launch (`IN_MEMORY_PREFIXES`), else the temporary
    folder."""
    parent = parent or temp_parent(prefix)
    root = _user_root(parent)
    if root is None:
        return tempfile.mkdtemp(prefix=f"nbaccel-{prefix}", dir=parent)
    return make_private_dir(prefix, root)


def temp_parent(prefix: str) -> str:
    """Where folders named `prefix...` go: /dev/shm for IN_MEMORY_PREFIXES when the temporary folder is the
    system's default /tmp (often a disk: removing a folder there took 0.3-9 ms on a busy machine, ~0.01 ms in
    memory, at the end of every launch) and /dev/shm is a folder this user can write to; else the temporary
    folder (TMPDIR, when set, is where the user wants such files)."""
    default = tempfile.gettempdir()
    if (prefix in IN_MEMORY_PREFIXES and os.path.normpath(default) == "/tmp" and os.path.isdir(SHARED_MEMORY)
            and os.access(SHARED_MEMORY, os.W_OK | os.X_OK)):
        return SHARED_MEMORY
    return default


def _user_root(parent: str) -> str | None:
    """`<parent>/nbaccel-<uid>`, made 0700; None where it is not this user's alone (or there are no uids)."""
    if not hasattr(os, "getuid"):
        return None
    path = os.path.join(parent, f"nbaccel-{os.getuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return None
    try:
        info = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        return None  # made by someone else (a shared /tmp): not a place for this user's stores
    return path
