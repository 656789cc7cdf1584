"""Private folders of launches and pools: owner-only, and a killed kernel's are removed by the next one."""

from __future__ import annotations

import os
import stat
import subprocess
import tempfile

from nbaccel.launch import private_dirs


def _dead_pid() -> int:
    gone = subprocess.Popen(["true"])
    gone.wait()
    return gone.pid


def test_store_folders_live_in_one_owner_only_parent_and_orphans_go(monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    first = private_dirs.make_store_dir()
    root = tmp_path / f"nbaccel-{os.getuid()}"
    assert os.path.dirname(first) == str(root)
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700 and stat.S_IMODE(os.stat(first).st_mode) == 0o700
    orphan = root / f"{private_dirs.STORE_PREFIX}{_dead_pid()}-abc"
    orphan.mkdir()
    (orphan / "store").write_text("left by a killed kernel")
    unknown = root / "store-notapid"  # not named by nbaccel: kept
    unknown.mkdir()
    second = private_dirs.make_store_dir()
    assert not orphan.exists() and unknown.exists()
    assert os.path.isdir(first) and os.path.isdir(second)  # this process's folders stay while it runs


def test_a_parent_others_can_enter_is_not_used(monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    root = tmp_path / f"nbaccel-{os.getuid()}"
    root.mkdir()
    root.chmod(0o777)  # e.g. made by someone else in a shared /tmp: the store goes straight into tmp, 0700
    made = private_dirs.make_store_dir()
    assert os.path.dirname(made) == str(tmp_path) and os.path.basename(made).startswith("nbaccel-store-")
    assert stat.S_IMODE(os.stat(made).st_mode) == 0o700


def test_a_launch_s_small_folders_live_in_memory_unless_a_temporary_folder_was_chosen(monkeypatch, tmp_path):
    if not (os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK | os.X_OK)):
        import pytest

        pytest.skip("no writable /dev/shm here")
    monkeypatch.setattr(tempfile, "tempdir", "/tmp")  # the system's default
    store = private_dirs.make_store_dir()
    try:
        assert os.path.dirname(store) == f"/dev/shm/nbaccel-{os.getuid()}"
        assert stat.S_IMODE(os.stat(store).st_mode) == 0o700
    finally:
        private_dirs.remove_dir(store)
    assert private_dirs.temp_parent(private_dirs.GROUPS_PREFIX) == "/dev/shm"
    assert private_dirs.temp_parent(private_dirs.ELASTIC_LOGS_PREFIX) == "/tmp"  # logs can grow: on disk
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # e.g. TMPDIR set: the user's choice
    assert private_dirs.temp_parent(private_dirs.STORE_PREFIX) == str(tmp_path)


def test_a_rank_runs_its_function_once_the_launch_s_keeper_is_named_in_its_folder(tmp_path):
    """The kernel starts a launch's keeper while the ranks start; a rank waits for it (its `keeper-<pid>` entry,
    or `keeper-none`) before it runs user code, so nothing it starts can outlive a kernel killed meanwhile."""
    import threading
    import time

    from nbaccel.launch.worker.parent_death import wait_for_keeper

    folder = tmp_path / "groups"
    folder.mkdir()
    threading.Timer(0.3, lambda: (folder / f"{private_dirs.KEEPER_PREFIX}123").touch()).start()
    started = time.monotonic()
    wait_for_keeper(str(folder))
    assert 0.25 < time.monotonic() - started < 5
    (folder / "keeper-123").unlink()
    (folder / private_dirs.NO_KEEPER).touch()  # the keeper could not start: the rank goes on
    started = time.monotonic()
    wait_for_keeper(str(folder))
    assert time.monotonic() - started < 0.1
    wait_for_keeper(str(tmp_path / "gone"))  # no folder: nothing to wait for
