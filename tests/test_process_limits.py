"""A number of processes this machine cannot start is refused before anything starts, by the three front
doors alike (nbaccel.utils.process_limits.check_process_count)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from process_helpers import started_children

from nbaccel.utils.process_limits import (
    MAX_PROCESSES_ENV,
    ProcessCountError,
    check_process_count,
    machine_limits,
)

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parent.parent
HUGE = 10**6


def never_called() -> None:
    raise AssertionError("a rank ran")


def assert_names_limits(message: str, name: str) -> None:
    assert f"{name}={HUGE} is more processes than this machine can start" in message
    assert "RLIMIT_NOFILE" in message and "ranks per core" in message and "Nothing was started" in message
    assert f"{MAX_PROCESSES_ENV}={HUGE}" in message and len(message) < 1000


def test_notebook_launcher_refuses_a_million_processes_before_starting_any(monkeypatch):
    from nbaccel import debug_launcher, notebook_launcher

    monkeypatch.delenv(MAX_PROCESSES_ENV, raising=False)
    before = started_children()
    for launch in (lambda: notebook_launcher(never_called, num_processes=HUGE),
                   lambda: debug_launcher(never_called, num_processes=HUGE)):
        with pytest.raises(ProcessCountError) as info:
            launch()
        assert_names_limits(str(info.value), "num_processes")
        assert isinstance(info.value, ValueError)
        assert {p.pid for p in started_children()} <= {p.pid for p in before}  # started none


def test_rank_pool_refuses_a_million_processes_before_starting_any(monkeypatch):
    from nbaccel.launch.pool.rank_pool import RankPool

    monkeypatch.delenv(MAX_PROCESSES_ENV, raising=False)
    before = started_children()
    with pytest.raises(ProcessCountError) as info:
        RankPool(num_processes=HUGE)
    assert_names_limits(str(info.value), "num_processes")
    assert {p.pid for p in started_children()} <= {p.pid for p in before}  # started none


def test_nbaccel_launch_refuses_a_million_processes_as_a_usage_error(capsys, monkeypatch):
    from nbaccel.commands.main import main

    monkeypatch.chdir(ROOT)
    monkeypatch.delenv(MAX_PROCESSES_ENV, raising=False)
    before = started_children()
    with pytest.raises(SystemExit) as info:
        main(["launch", "--cpu", "--num_processes", str(HUGE), "examples/hello_ranks.py"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.startswith("nbaccel launch: error: "), err
    assert_names_limits(err, "--num_processes")
    assert {p.pid for p in started_children()} <= {p.pid for p in before}  # started none


def test_each_limit_is_named_and_the_override_is_deliberate(monkeypatch):
    """With a low open-file limit (in a child, so this process keeps its own), 40 ranks exceed it; the
    environment variable replaces the estimates, both ways."""
    code = textwrap.dedent("""
        import resource
        from nbaccel.utils.process_limits import ProcessCountError, check_process_count
        resource.setrlimit(resource.RLIMIT_NOFILE, (200, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        try:
            check_process_count(40)
        except ProcessCountError as error:
            print(error)
    """)
    env = {k: v for k, v in __import__("os").environ.items() if k != MAX_PROCESSES_ENV}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=60).stdout
    assert "num_processes=40 is more processes" in out and "RLIMIT_NOFILE, `ulimit -n`: 200" in out, out
    assert "ranks per core" not in out  # only the limits exceeded are named

    monkeypatch.delenv(MAX_PROCESSES_ENV, raising=False)
    check_process_count(2)
    assert min(limit.ranks for limit in machine_limits()) >= 2
    monkeypatch.setenv(MAX_PROCESSES_ENV, str(HUGE))
    check_process_count(HUGE)  # the user said so
    monkeypatch.setenv(MAX_PROCESSES_ENV, "4")
    with pytest.raises(ProcessCountError, match=f"num_processes=5 is above {MAX_PROCESSES_ENV}=4"):
        check_process_count(5)
    monkeypatch.setenv(MAX_PROCESSES_ENV, "lots")
    with pytest.raises(ProcessCountError, match="is not a whole number"):
        check_process_count(2)
