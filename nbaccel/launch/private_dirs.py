"""Owner-only folders of one launch or pool (its FileStore, its large results) that no killed kernel leaves.

A folder's name carries the pid of the kernel that made it. A kernel killed with SIGKILL cannot remove its
folders, so making a folder first removes those whose kernel no longer runs. The FileStore folders live in
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
ELASTIC_LOGS_PREFIX = "elastic-"  # torch elastic's log folder of one launch (torch's own is /tmp/torchelastic_*)


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


def make_user_dir(prefix: str) -> str:
    """A new 0700 folder `<tmp>/nbaccel-<uid>/<prefix><pid>-<random>` (`<tmp>/nbaccel-<prefix>...` where the
    per-user parent cannot be had), after removing the orphans of dead processes."""
    root = _user_root()
    if root is None:
        return tempfile.mkdtemp(prefix=f"nbaccel-{prefix}")
    return make_private_dir(prefix, root)


def _user_root() -> str | None:
    """`<tmp>/nbaccel-<uid>`, made 0700; None where it is not this user's alone (or there are no uids)."""
    if not hasattr(os, "getuid"):
        return None
    path = os.path.join(tempfile.gettempdir(), f"nbaccel-{os.getuid()}")
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
