"""A rank's prompt whose answer became moot is withdrawn (kernel/interrupts.py `withdrawable`, prompt_relay.py):
the kernel's input() waits where only a signal can wake it, so before this a rank that died at its prompt, or a
rank that failed while another sat at pdb, left the cell waiting for a line nobody needed."""

from __future__ import annotations

import builtins
import os
import signal
import threading
import time

import pytest

from nbaccel import LaunchError, notebook_launcher
from nbaccel.launch.kernel.interrupts import Withdrawn, withdrawable

pytestmark = pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                                reason="signals are handled in the main thread only")


def _wait_for_input(stop: threading.Event, seconds: float = 30) -> None:
    """A wait like ipykernel's input(): polls in short sleeps until answered (or a signal ends it)."""
    deadline = time.monotonic() + seconds
    while not stop.is_set():
        assert time.monotonic() < deadline, "the wait was not withdrawn"
        time.sleep(0.01)


def test_a_moot_wait_ends_with_withdrawn_and_the_handler_is_put_back():
    before = signal.getsignal(signal.SIGINT)
    checks = []

    def moot():
        checks.append(1)
        return "rank 0 failed" if len(checks) >= 3 else None

    with pytest.raises(Withdrawn, match="rank 0 failed"):
        with withdrawable(moot, every=0.01):
            _wait_for_input(threading.Event())
    assert signal.getsignal(signal.SIGINT) is before


def test_the_users_interrupt_stays_a_keyboard_interrupt():
    with pytest.raises(KeyboardInterrupt):
        with withdrawable(lambda: None, every=0.01):
            os.kill(os.getpid(), signal.SIGINT)
            _wait_for_input(threading.Event())


def test_a_wait_answered_as_it_becomes_moot_ends_normally_and_leaves_no_interrupt_behind():
    """The window: the watch finds the wait moot just as the answer arrives. Its SIGINT, sent or not, is taken
    at the end of the wait; nothing is raised later as if the user had interrupted."""
    for _ in range(40):
        answered = threading.Event()

        def moot(answered=answered):
            answered.wait(1)
            return "too late"

        with withdrawable(moot, every=0.001):
            time.sleep(0.003)
            answered.set()
        time.sleep(0.005)  # a stray SIGINT would raise KeyboardInterrupt here


@pytest.fixture
def unanswered_input(monkeypatch):
    """The kernel's input(), as nobody answers it: it waits until a signal ends it."""
    asked = []

    def kernel_input(prompt=""):
        asked.append(prompt)
        _wait_for_input(threading.Event(), seconds=60)

    monkeypatch.setattr(builtins, "input", kernel_input)
    return asked


def _fails_while_the_other_is_at_pdb():
    if os.environ["RANK"] == "1":
        breakpoint()
    else:
        time.sleep(0.5)
        raise ValueError("rank 0 broke")
    return 1


def _dies_at_its_prompt():
    if os.environ["RANK"] == "1":
        pid = os.getpid()
        threading.Timer(0.5, os.kill, (pid, signal.SIGKILL)).start()
        input("name? ")
    return 1


def _asks():
    return input("who? ")


def test_a_failure_of_another_rank_withdraws_the_pdb_prompt(unanswered_input, capfd):
    with pytest.raises(LaunchError) as info:
        notebook_launcher(_fails_while_the_other_is_at_pdb, num_processes=2, dashboard=False, timeout=120)
    assert info.value.first_rank == 0 and "ValueError: rank 0 broke" in str(info.value)
    assert unanswered_input == ["[rank 1] (Pdb) "]
    err = capfd.readouterr().err
    assert "the question of rank 1 was withdrawn: rank 0 failed (exited with code 1)" in err, err


def test_a_rank_killed_at_its_prompt_withdraws_it(unanswered_input, capfd):
    with pytest.raises(LaunchError) as info:
        notebook_launcher(_dies_at_its_prompt, num_processes=2, dashboard=False, timeout=120)
    assert info.value.first_rank == 1 and "SIGKILL" in str(info.value)
    assert unanswered_input == ["[rank 1] name? "]
    # in the same words as a RankPool's (nbaccel.launch.errors.ended_how), the OOM killer's hint included
    assert ("the question of rank 1 was withdrawn: rank 1 ended (killed by SIGKILL (out of memory? the OOM killer "
            "sends SIGKILL))") in capfd.readouterr().err


def test_an_interrupt_at_one_prompt_asks_no_other_rank_on_the_way_out(monkeypatch):
    """Both ranks ask; the user interrupts at the first question. The second rank's prompt, read while the
    ranks are stopped, is not asked (before: a second input box, to be interrupted again or answered)."""
    asked = []

    def interrupted_input(prompt=""):
        asked.append(prompt)
        time.sleep(1.0)  # the other rank's prompt arrives meanwhile
        raise KeyboardInterrupt

    monkeypatch.setattr(builtins, "input", interrupted_input)
    with pytest.raises(KeyboardInterrupt):
        notebook_launcher(_asks, num_processes=2, dashboard=False, timeout=120)
    assert len(asked) == 1, asked


def test_a_pool_rank_killed_at_its_prompt_withdraws_it(unanswered_input, capfd):
    """RankPool and %%ranks serve prompts the same way: a rank that dies at its prompt ends the call."""
    from nbaccel import RankPool

    with RankPool(2, timeout=20) as pool:
        with pytest.raises(Exception) as info:
            pool.run(_dies_at_its_prompt)
    assert "rank 1" in str(info.value) and "SIGKILL" in str(info.value), str(info.value)
    assert unanswered_input == ["[rank 1] name? "]
    assert "the question of rank 1 was withdrawn: rank 1 ended (killed by SIGKILL" in capfd.readouterr().err


def _dies_at_its_prompt_once():
    if os.environ["RANK"] == "1" and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        pid = os.getpid()
        threading.Timer(0.5, os.kill, (pid, signal.SIGKILL)).start()
        input("name? ")
    return int(os.environ["RANK"])


def test_an_elastic_restart_withdraws_the_prompt_and_the_restarted_ranks_finish(unanswered_input, capfd):
    """max_restarts: torch elastic's agent restarts the ranks after the one at the prompt died; the question is
    withdrawn and the launch goes on to the restarted ranks' results (before: it waited at the prompt)."""
    assert notebook_launcher(_dies_at_its_prompt_once, num_processes=2, dashboard=False, max_restarts=1,
                             timeout=120) == [0, 1]
    assert unanswered_input == ["[rank 1] name? "]
    assert "the question of rank 1 was withdrawn: rank 1: killed by SIGKILL" in capfd.readouterr().err
