"""`nbaccel launch` read through a pipe: every line a rank writes arrives whole, however fast both ranks print.

torchrun runs the ranks with `python -u` on the launch's stdout/stderr: `print()` writes its text and its
newline apart, so without nbaccel's line relay (nbaccel/launch/worker/line_relay.py) two ranks printing at
once mix their lines (`epoch 2: loss 0.435rank 1 of 2 done on cpu`). The script below prints thousands of
lines of varying length from 2 ranks at once, some written in pieces, some longer than the pipe's atomic
write size (PIPE_BUF, 4096 bytes), on stdout and stderr; the test reads both through pipes and checks every
line: whole, each rank's in order, none lost.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parent.parent
LINES = 3000

SCRIPT = """
    import os, sys

    rank = int(os.environ["RANK"])
    lines = int(sys.argv[1])

    def body(i):
        size = 6000 if i % 500 == 7 else (i * 37 + rank * 11) % 300  # a few longer than PIPE_BUF
        return f"rank {rank} line {i} " + "x" * size + f" size {size} end {rank}.{i}"

    for i in range(lines):
        text = body(i)
        if i % 3 == 0:
            print(text)  # text, then its newline: two writes under python -u
        elif i % 3 == 1:  # in pieces, the line's end a write of its own
            half = len(text) // 2
            sys.stdout.write(text[:half]); sys.stdout.flush()
            sys.stdout.write(text[half:]); sys.stdout.flush()
            sys.stdout.write("\\n"); sys.stdout.flush()
        else:
            print(text, file=sys.stderr)
    print(f"rank {rank} done", flush=True)
"""

LINE = re.compile(r"rank (\d) line (\d+) (x*) size (\d+) end (\d)\.(\d+)")


def test_each_line_of_two_ranks_printing_at_once_arrives_whole_through_a_pipe(tmp_path):
    script = tmp_path / "print_lines.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    run = subprocess.run([sys.executable, "-m", "nbaccel", "launch", "--num_processes", "2", "--cpu", "-q",
                          str(script), str(LINES)],
                         capture_output=True, env=env, cwd=tmp_path, timeout=200)
    out, err = run.stdout.decode(), run.stderr.decode()
    assert run.returncode == 0, err[-3000:]
    seen: dict[tuple[int, str], list[int]] = {(rank, name): [] for rank in (0, 1) for name in ("out", "err")}
    for name, text in (("out", out), ("err", err)):
        for line in text.splitlines():
            if not line.startswith("rank ") or re.fullmatch(r"rank \d done", line):
                continue  # torch's or the launcher's own lines
            found = LINE.fullmatch(line)
            assert found, f"a mixed or cut line on std{name}: {line[:200]!r}"
            rank, index, xs, size, end_rank, end_index = found.groups()
            assert (rank, index) == (end_rank, end_index) and len(xs) == int(size), line[:200]
            seen[(int(rank), name)].append(int(index))
    for rank in (0, 1):
        assert seen[(rank, "out")] == [i for i in range(LINES) if i % 3 != 2], f"rank {rank}'s stdout lines"
        assert seen[(rank, "err")] == [i for i in range(LINES) if i % 3 == 2], f"rank {rank}'s stderr lines"
        assert f"rank {rank} done" in out.splitlines()


STALLED = """
    import os, sys, time
    from nbaccel.launch.worker.line_relay import PARTIAL_WAIT

    flag = sys.argv[1]
    if os.environ["RANK"] == "0":
        sys.stdout.write("part one, ")  # a print's first piece; then the rank stalls (a busy machine)
        open(flag, "w").close()
        time.sleep(PARTIAL_WAIT + 1.0)
        print("part two")
    else:
        while not os.path.exists(flag):
            time.sleep(0.01)
        time.sleep(PARTIAL_WAIT + 0.4)  # after the relay would have given up on rank 0's first piece
        print("rank one's line")
"""


def test_a_rank_that_stalls_in_the_middle_of_a_line_still_sends_it_whole(tmp_path):
    """The window behind a line seen cut under load (`error file:error file: ...`): a rank stalls between two
    pieces of one line for longer than the relay holds a partial line, while another rank prints. The rank's
    stdout is line-buffered into its relay, so the pieces leave it as one write."""
    script = tmp_path / "stall.py"
    script.write_text(textwrap.dedent(STALLED))
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    run = subprocess.run([sys.executable, "-m", "nbaccel", "launch", "--num_processes", "2", "--cpu", "-q",
                          str(script), str(tmp_path / "flag")],
                         capture_output=True, env=env, cwd=tmp_path, timeout=120)
    assert run.returncode == 0, run.stderr.decode()[-3000:]
    lines = run.stdout.decode().splitlines()
    assert "part one, part two" in lines and "rank one's line" in lines, lines
    assert lines.index("rank one's line") < lines.index("part one, part two"), lines


ON_A_TERMINAL = """
import os, sys
from nbaccel.launch.worker.line_relay import relay_whole_lines
relay_whole_lines()
print("done", 0, end="")  # the line's first pieces, each a write of its own under python -u
os.write(1, b"<prompt>")  # another writer on the same terminal: a rank, or the launch asking for a rank
print(" user0")
print("tty", sys.stdout.isatty())
"""


def test_on_a_terminal_a_rank_writes_each_line_in_one_write():
    """No relay on a TTY (the rank keeps its terminal), yet a line is one write: another writer's bytes come
    before or after it, never inside (`done[rank 1] (Pdb)  0 user0` was seen on a launch's terminal)."""
    import pty

    main, terminal = pty.openpty()
    try:
        subprocess.run([sys.executable, "-u", "-c", ON_A_TERMINAL], stdout=terminal, stderr=terminal, timeout=60,
                       cwd=ROOT, check=True)
        os.close(terminal)
        output = b""
        while True:
            try:
                data = os.read(main, 4096)
            except OSError:  # the terminal's other end is closed: everything was read
                break
            if not data:
                break
            output += data
    finally:
        os.close(main)
    assert output.decode().replace("\r\n", "\n") == "<prompt>done 0 user0\ntty True\n", output
