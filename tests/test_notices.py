"""The launcher's notices are `logging` records of `nbaccel.launch` (utils/notices.py): shown on stderr by
default, silenced by `logging.getLogger("nbaccel").setLevel(...)` or NBACCEL_VERBOSITY, routed to the user's
own handlers when asked. Each one runs a real launch whose saved config makes the launcher take a note."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest

from nbaccel import notebook_launcher

NOTE = "takes from"


def _one() -> int:
    return 1


@pytest.fixture
def saved_config(tmp_path, monkeypatch):
    path = tmp_path / "default_config.yaml"
    path.write_text("num_processes: 1\nmixed_precision: 'no'\ngradient_accumulation_steps: 3\n")
    monkeypatch.setenv("NBACCEL_CONFIG_FILE", str(path))
    return path


@pytest.fixture
def nbaccel_level():
    logger = logging.getLogger("nbaccel")
    level = logger.level
    yield logger
    logger.setLevel(level)


def test_a_notice_is_a_record_of_the_nbaccel_launch_logger(saved_config, capfd, caplog):
    launch = logging.getLogger("nbaccel.launch")
    launch.addHandler(caplog.handler)  # the default handler stays; the test listens next to it
    try:
        assert notebook_launcher(_one, dashboard=False) == [1]
    finally:
        launch.removeHandler(caplog.handler)
    records = [record for record in caplog.records if NOTE in record.getMessage()]
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    assert records[0].name.startswith("nbaccel.launch.")
    assert sum(NOTE in line for line in capfd.readouterr().err.splitlines()) == 1  # shown once, bare


def test_setlevel_on_nbaccel_silences_the_notices(saved_config, capfd, nbaccel_level):
    nbaccel_level.setLevel(logging.ERROR)
    assert notebook_launcher(_one, dashboard=False) == [1]
    assert NOTE not in capfd.readouterr().err
    nbaccel_level.setLevel(logging.NOTSET)
    assert notebook_launcher(_one, dashboard=False) == [1]
    assert NOTE in capfd.readouterr().err


def test_propagation_routes_the_notices_to_the_users_handlers(saved_config, capfd, caplog):
    from nbaccel.utils.notices import DEFAULT_HANDLER

    launch = logging.getLogger("nbaccel.launch")
    launch.removeHandler(DEFAULT_HANDLER)
    launch.propagate = True
    try:
        with caplog.at_level(logging.WARNING):
            assert notebook_launcher(_one, dashboard=False) == [1]
    finally:
        launch.propagate = False
        launch.addHandler(DEFAULT_HANDLER)
    assert any(NOTE in record.getMessage() for record in caplog.records)  # the root's handler got it
    assert NOTE not in capfd.readouterr().err  # and the default handler did not write it


@pytest.mark.parametrize(("verbosity", "shown"), [("error", False), ("warning", True), ("", True)])
def test_nbaccel_verbosity(saved_config, tmp_path, verbosity, shown):
    script = textwrap.dedent('''
        import json, logging
        from nbaccel import notebook_launcher
        print(json.dumps([notebook_launcher(int, dashboard=False), logging.getLogger("nbaccel").level]))
    ''')
    env = {**os.environ, "NBACCEL_VERBOSITY": verbosity}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    results, level = json.loads(done.stdout.strip().splitlines()[-1])
    assert results == [0] and level == {"error": logging.ERROR, "warning": logging.WARNING, "": 0}[verbosity]
    assert (NOTE in done.stderr) is shown, done.stderr


def test_a_bad_verbosity_is_named(saved_config, tmp_path):
    env = {**os.environ, "NBACCEL_VERBOSITY": "loud"}
    done = subprocess.run([sys.executable, "-c", "import nbaccel.launch"], env=env, capture_output=True, text=True,
                          timeout=60, cwd=tmp_path)
    assert done.returncode == 0 and "NBACCEL_VERBOSITY='loud' is not one of debug, info, warning" in done.stderr
