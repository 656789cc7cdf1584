"""`nbaccel launch` on a terminal (a pseudo-terminal here): a rank's breakpoint()/input() prompt on the launch's
terminal, one rank at a time, labelled; without a terminal, a clear error instead of a silent BdbQuit."""

from __future__ import annotations

import os
import pty
import re
import select
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow

SCRIPT = """
from nbaccel import PartialState
state = PartialState()
rank = state.process_index
x = 10 + rank
if rank == 1:
    breakpoint()
    y = x * 2
name = input(f"name of rank {rank}? ")
print("done", rank, name, flush=True)
"""
PROMPT = re.compile(r"\[rank (\d)\] (\(Pdb\)|name of rank \d\?) ")
CTRL_C = "\x03"  # what the terminal turns into SIGINT for the launch
COMMAND = [sys.executable, "-m", "nbaccel", "launch", "--num_processes", "2", "--cpu", "script.py"]


def _drive(tmp_path, answer, timeout: float = 120) -> tuple[str, int, list[str]]:
    """Run `nbaccel launch` on a pseudo-terminal; type `answer(prompt)` at each prompt; (output, exit code, prompts)."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: the launch, with the terminal as its stdin/stdout/stderr
        os.chdir(tmp_path)
        os.execv(sys.executable, COMMAND)
    output, prompts, answered = "", [], 0  # answered: where the output after the last prompt answered starts
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not select.select([fd], [], [], 0.5)[0]:
                continue
            try:
                data = os.read(fd, 4096)
            except OSError:  # the terminal closed: the launch ended
                break
            if not data:
                break
            output += data.decode(errors="replace").replace("\r\n", "\n")
            found = PROMPT.search(output, answered)  # another rank's lines may follow the prompt on the terminal
            if found:
                prompts.append(found.group(0))
                answered = found.end()
                line = answer(found.group(0))
                os.write(fd, (line if line == CTRL_C else line + "\n").encode())
        else:
            os.kill(pid, 9)
            pytest.fail(f"nbaccel launch did not end within {timeout} s:\n{output}")
    finally:
        _, status = os.waitpid(pid, 0)
        os.close(fd)
    return output, os.waitstatus_to_exitcode(status), prompts


def test_breakpoint_and_input_prompt_on_the_launch_terminal(tmp_path):
    (tmp_path / "script.py").write_text(SCRIPT)
    steps = iter(["p x", "n", "p y", "c"])

    def answer(prompt: str) -> str:
        return next(steps) if prompt.endswith("(Pdb) ") else f"user{prompt[6]}"

    output, code, prompts = _drive(tmp_path, answer)
    assert code == 0, output
    assert prompts.count("[rank 1] (Pdb) ") == 4 and "[rank 0] name of rank 0? " in prompts, (prompts, output)
    lines = PROMPT.sub("\n", output).splitlines()  # a rank's line can follow another's prompt on the terminal
    assert "done 0 user0" in lines and "done 1 user1" in lines, output
    assert "11" in lines and "22" in lines, output  # p x, then p y after `n`


def test_ctrl_c_at_a_rank_prompt_stops_the_launch(tmp_path):
    (tmp_path / "script.py").write_text(SCRIPT)
    output, code, prompts = _drive(tmp_path, lambda prompt: CTRL_C)
    assert len(prompts) == 1 and code == 130 and "stopped by SIGINT" in output, (code, output)


def test_without_a_terminal_the_rank_says_why_it_cannot_ask(tmp_path):
    (tmp_path / "script.py").write_text(SCRIPT)
    run = subprocess.run(COMMAND, cwd=tmp_path, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode != 0
    assert "RankInputUnavailable" in run.stderr and "is not a terminal" in run.stderr, run.stderr
    assert "BdbQuit" not in run.stderr


def test_ctrl_c_at_a_rank_prompt_read_from_a_pipe_ends_the_launch_with_130(tmp_path):
    """stdin a pipe nobody writes to, the output into a file (a launch run from a script, logged): the prompt is
    read in the collective watch's thread, which holds stdin's lock while it waits. An interpreter that
    finalized meanwhile aborted ("Fatal Python error: _enter_buffered_busy ... <stdin>", exit -6)."""
    (tmp_path / "script.py").write_text(SCRIPT)
    log = tmp_path / "launch.log"
    with open(log, "w") as out:
        launch = subprocess.Popen(COMMAND, cwd=tmp_path, stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not PROMPT.search(log.read_text(errors="replace")) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert PROMPT.search(log.read_text(errors="replace")), log.read_text(errors="replace")
        time.sleep(0.5)  # the thread is in its read by now
        launch.send_signal(signal.SIGINT)
        launch.wait(60)
    finally:
        if launch.poll() is None:
            os.killpg(launch.pid, signal.SIGKILL)
            launch.wait()
        launch.stdin.close()
    output = log.read_text(errors="replace")
    assert launch.returncode == 130, output
    assert "stopped by SIGINT" in output and "Fatal Python error" not in output, output
