"""A rank's sys.stdin read as data (`cmd | nbaccel launch script.py`): a text file over the launching process's
stdin, as under `accelerate launch` ("" at the end of input, read() to the end, iteration, .buffer)."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nbaccel.launch.kernel import prompt_relay
from nbaccel.launch.kernel.prompt_relay import NO_MORE_INPUT, PromptRelay
from nbaccel.launch.messages import Answer, Prompt
from nbaccel.launch.worker.rank_prompts import STDIN_READ, PromptStdin, RankInputUnavailable


class _Pieces:
    """A PromptLine stand-in: read_stdin() gives the pieces, then "" (the end of input)."""

    def __init__(self, *pieces: str) -> None:
        self.pieces = list(pieces)
        self.reads = 0

    def read_stdin(self) -> str:
        self.reads += 1
        return self.pieces.pop(0) if self.pieces else ""


def _stdin(*pieces: str) -> PromptStdin:
    return PromptStdin(_Pieces(*pieces))  # type: ignore[arg-type]


def test_readline_gives_empty_string_at_the_end_of_input():
    stdin = _stdin("a\n", "b")
    assert [stdin.readline(), stdin.readline(), stdin.readline(), stdin.readline()] == ["a\n", "b", "", ""]


def test_read_reads_to_the_end_of_input_and_read_n_reads_n_characters():
    assert _stdin('{"a":\n', " 1}\n").read() == '{"a":\n 1}\n'
    stdin = _stdin("abc\n", "de\n")
    assert [stdin.read(2), stdin.read(4), stdin.readline(), stdin.read(5), stdin.read()] == ["ab", "c\nde", "\n", "", ""]
    assert _stdin("abc\n").readline(2) == "ab"


def test_iteration_readlines_and_json_load():
    assert list(_stdin("a\n", "b\n")) == ["a\n", "b\n"]
    assert _stdin("a\n", "b\n").readlines() == ["a\n", "b\n"]
    assert json.load(_stdin('{"a":\n', " 1}\n")) == {"a": 1}


def test_buffer_reads_the_same_stream_as_bytes():
    stdin = _stdin("é\n", "x\n", "yz\n")
    assert stdin.buffer.read(1) == "é".encode()[:1]
    assert stdin.buffer.read(2) == "é".encode()[1:] + b"\n"
    assert stdin.readline() == "x\n"
    assert stdin.buffer.readline() == b"yz\n"
    assert stdin.buffer.read() == b"" and stdin.read() == ""
    assert _stdin("a\n", "b").buffer.read() == b"a\nb"
    assert list(_stdin("a\n", "b").buffer) == [b"a\n", b"b"]
    assert stdin.encoding == "utf-8" and not stdin.isatty()


def _serve(relay: PromptRelay, *, read: bool, prompt: str = "") -> Answer:
    wire = Prompt(0, prompt, 1).to_wire()
    if read:
        wire[STDIN_READ] = True
    replies: list = []
    relay.serve("rank 0", wire, replies.append)
    return Answer.from_wire(replies[0])


def test_relay_reads_a_pipe_as_is_then_the_end_of_input(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("a\nlast"))  # not a terminal; builtins.input is Python's
    relay = PromptRelay()
    assert _serve(relay, read=True).text == "a\n"
    assert _serve(relay, read=True).text == "last"  # no newline added where the input has none
    assert _serve(relay, read=True).eof and _serve(relay, read=True).eof
    assert _serve(relay, read=False, prompt="(Pdb) ").unavailable == NO_MORE_INPUT  # input()/pdb: as before
    assert "[rank 0]" not in capsys.readouterr().out  # no prompt printed into the data's output


def test_relay_at_the_end_of_input_after_an_input_prompt_gives_eof_to_reads(monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    relay = PromptRelay()
    assert _serve(relay, read=False).unavailable == NO_MORE_INPUT
    assert _serve(relay, read=True).eof


def test_relay_read_when_nobody_can_answer_stays_unavailable(monkeypatch):
    monkeypatch.setattr(sys, "stdin", None)
    assert _serve(PromptRelay(), read=True).unavailable == prompt_relay.NO_STDIN

    def notebook_without_input(prompt=""):
        raise type("StdinNotImplementedError", (Exception,), {})()

    monkeypatch.setattr("builtins.input", notebook_without_input)
    assert _serve(PromptRelay(), read=True).unavailable == prompt_relay.NO_INPUT_REQUESTS


def test_relay_read_in_a_notebook_asks_the_input_box_for_a_line(monkeypatch):
    def kernel_input(prompt=""):
        return "typed"

    monkeypatch.setattr("builtins.input", kernel_input)
    assert _serve(PromptRelay(), read=True).text == "typed\n"


def test_relay_read_of_text_that_is_not_utf8_says_what_to_do(monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"\xff\xfe\n"), encoding="utf-8"))
    why = _serve(PromptRelay(), read=True).unavailable
    assert why and "as a file" in why


def test_rank_raises_when_nobody_can_answer_a_read():
    from nbaccel.launch.worker.rank_prompts import PromptLine

    sent: list = []
    line = PromptLine(lambda m: sent.append(m), lambda: Answer(0, 1, unavailable="no one").to_wire(), 0)
    with pytest.raises(RankInputUnavailable, match="no one"):
        PromptStdin(line).read()
    assert sent[0][STDIN_READ] is True


# End to end: `nbaccel launch --cpu` against `accelerate launch --cpu` (1 process), the same stdin.

SCRIPT = """
import json, os, sys
mode = os.environ["RMODE"]
try:
    if mode == "iter": data = [line for line in sys.stdin]
    elif mode == "readlines": data = sys.stdin.readlines()
    elif mode == "buffer": data = sys.stdin.buffer.read()
    elif mode == "json": data = json.load(sys.stdin)
    elif mode == "read": data = sys.stdin.read()
except BaseException as exc:
    data = f"EXC {type(exc).__name__}"
print("RESULT", repr(data), flush=True)
"""


def _launch(tool: str, tmp_path: Path, mode: str, stdin: bytes | None) -> tuple[str, int]:
    home = tmp_path / f"home-{Path(tool).name}"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HOME", "XDG_CACHE_HOME", "NBACCEL_CONFIG_FILE")}
    env.update(HOME=str(home), RMODE=mode)
    proc = subprocess.run([tool, "launch", "--cpu", "script.py"], cwd=tmp_path, env=env, timeout=180,
                          input=stdin, stdin=subprocess.DEVNULL if stdin is None else None, capture_output=True)
    lines = [line for line in proc.stdout.decode().splitlines() if "RESULT" in line]
    return (lines[0] if lines else proc.stdout.decode() + proc.stderr.decode()[-2000:]), proc.returncode


@pytest.mark.slow
# (readlines is iteration: test_iteration_readlines_and_json_load above)
@pytest.mark.parametrize("mode,stdin", [("iter", b'{"a":\n 1}\n'), ("buffer", b'{"a":\n 1}\n'),
                                        ("json", b'{"a":\n 1}\n'), ("read", b"no newline"), ("read", None)])
def test_piped_stdin_reads_as_under_accelerate_launch(tmp_path, mode, stdin):
    ours = shutil.which("nbaccel", path=str(Path(sys.executable).parent))
    theirs = shutil.which("accelerate", path=str(Path(sys.executable).parent))
    if ours is None or theirs is None:
        pytest.skip("needs the nbaccel and accelerate launchers of this environment")
    (tmp_path / "script.py").write_text(SCRIPT)
    expected = _launch(theirs, tmp_path, mode, stdin)
    assert expected[1] == 0 and "EXC" not in expected[0], expected
    assert _launch(ours, tmp_path, mode, stdin) == expected
