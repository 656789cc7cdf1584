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


def test_nbaccel_launch_s_line_lock_lives_in_a_private_folder_the_launch_removes(monkeypatch, tmp_path):
    """The lock file the ranks' line relays share: in a `lines-<pid>-` folder, which the launch removes and which
    the next launch's sweep removes after a launcher killed with SIGKILL (it was a bare /tmp/nbaccel-lines-*
    file, left by every killed `nbaccel launch`)."""
    from nbaccel.launch.kernel.torchrun import TorchrunScript
    from nbaccel.utils.constants import LINE_LOCK_ENV

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv(LINE_LOCK_ENV, raising=False)
    root = tmp_path / f"nbaccel-{os.getuid()}"
    root.mkdir(mode=0o700)
    orphan = root / f"{private_dirs.LINE_LOCK_PREFIX}{_dead_pid()}-abc"  # a killed launcher's
    orphan.mkdir()
    (orphan / "lock").touch()
    script = TorchrunScript()
    script._share_line_lock()
    path = os.environ[LINE_LOCK_ENV]
    folder = os.path.dirname(path)
    assert os.path.dirname(folder) == str(root) and os.path.isfile(path)
    assert os.path.basename(folder).startswith(f"{private_dirs.LINE_LOCK_PREFIX}{os.getpid()}-")
    assert not orphan.exists()
    script._cleanup.close()
    os.close(script._done_read)
    os.close(script._done_write)
    assert not os.path.exists(folder) and LINE_LOCK_ENV not in os.environ
