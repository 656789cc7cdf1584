"""utils/atomic_files.py: concurrent saves of the config file (threads and processes) leave one whole file,
readers never see half of one, a failed write changes nothing, and the file gets the umask's permissions."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
import threading

import pytest

from nbaccel.utils.atomic_files import atomic_write, write_text
from nbaccel.utils.config_file import LaunchConfig, load_config

ROUNDS = 40
pytestmark = pytest.mark.filterwarnings("ignore:.*unknown key")  # the long `note` that makes each write long


def _config(n: int) -> LaunchConfig:
    # a long value makes each write several buffers long, so an interleaving would show
    return LaunchConfig(num_processes=n, main_process_ip=f"10.0.0.{n}", extra={"note": f"writer {n} " * 400})


def _check_whole(path) -> int:
    config = load_config(path)
    n = config.num_processes
    assert config.main_process_ip == f"10.0.0.{n}" and config.extra["note"] == f"writer {n} " * 400
    return n


def _leftovers(folder) -> list[str]:
    return sorted(name for name in os.listdir(folder) if name != "config.yaml")


def test_concurrent_saves_from_threads_leave_one_whole_file(tmp_path):
    path = tmp_path / "config.yaml"
    _config(1).save(path)
    errors: list[BaseException] = []
    seen: set[int] = set()
    done = threading.Event()

    def writer(n: int) -> None:
        try:
            for _ in range(ROUNDS):
                _config(n).save(path)
        except BaseException as error:  # noqa: BLE001 - reported by the assertion below
            errors.append(error)

    def reader() -> None:
        while not done.is_set():
            try:
                seen.add(_check_whole(path))
            except BaseException as error:  # noqa: BLE001
                errors.append(error)
                return

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(1, 5)]
    watcher = threading.Thread(target=reader)
    watcher.start()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    done.set()
    watcher.join(timeout=30)
    assert not errors, errors[:3]
    assert _check_whole(path) in {1, 2, 3, 4} and seen <= {1, 2, 3, 4}
    assert _leftovers(tmp_path) == []


def test_concurrent_saves_from_processes_leave_one_whole_file(tmp_path):
    path = tmp_path / "config.yaml"
    script = textwrap.dedent(f'''
        import sys
        from nbaccel.utils.config_file import LaunchConfig
        n = int(sys.argv[1])
        config = LaunchConfig(num_processes=n, main_process_ip=f"10.0.0.{{n}}", extra={{"note": f"writer {{n}} " * 400}})
        for _ in range({ROUNDS}):
            config.save(sys.argv[2])
    ''')
    writers = [subprocess.Popen([sys.executable, "-c", script, str(n), str(path)], stderr=subprocess.PIPE, text=True)
               for n in (5, 6, 7)]
    outcomes = [(writer.wait(timeout=120), writer.stderr.read()) for writer in writers]
    for writer in writers:
        writer.stderr.close()
    assert all(code == 0 for code, _ in outcomes), outcomes
    assert _check_whole(path) in {5, 6, 7}
    assert _leftovers(tmp_path) == []


def test_a_failed_write_changes_nothing(tmp_path):
    path = tmp_path / "config.yaml"
    write_text(path, "before\n")
    with pytest.raises(RuntimeError), atomic_write(path) as handle:
        handle.write("half of the new")
        raise RuntimeError("killed mid-write")
    assert path.read_text() == "before\n" and _leftovers(tmp_path) == []


def test_the_file_gets_the_umask_permissions(tmp_path):
    mask = os.umask(0o027)
    try:
        write_text(tmp_path / "config.yaml", "x\n")
    finally:
        os.umask(mask)
    assert stat.S_IMODE((tmp_path / "config.yaml").stat().st_mode) == 0o640
