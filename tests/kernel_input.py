"""Run code in a real Jupyter kernel (jupyter_client) and answer its input requests as a user types into
Jupyter's input box: the tests of a rank's input()/pdb (tests/test_rank_debugger_kernel.py) and the notebooks
executed with scripted input (tests/test_notebooks.py)."""

from __future__ import annotations

import json
import queue
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Execution:
    """What one execute request produced: stdout/stderr text, the prompts asked (in order), the reply."""

    stdout: str = ""
    stderr: str = ""
    shown: str = ""  # the text/plain of displays and the cell's value (e.g. %%ranks' side-by-side view)
    prompts: list[str] = field(default_factory=list)
    passwords: list[str] = field(default_factory=list)  # the prompts asked as passwords (getpass: no echo)
    error: dict[str, Any] | None = None  # the execute reply's ename/evalue/traceback when it failed
    status: str = ""
    # (stdout length, stderr length) when each prompt arrived: what was shown before it
    seen_at_prompt: list[tuple[int, int]] = field(default_factory=list)


Answer = Callable[[str, Execution], "str | None"]  # prompt -> the line to type (None: answer nothing, e.g. interrupt)


def write_kernelspec(folder: Path, name: str = "nbaccel-debug-test") -> str:
    """A kernelspec running this venv's python with this checkout importable; set JUPYTER_PATH to `folder`."""
    spec = folder / "kernels" / name
    spec.mkdir(parents=True, exist_ok=True)
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "nbaccel debug test", "language": "python", "env": env, "interrupt_mode": "signal",
    }))
    return name


def execute(client: Any, code: str, answer: Answer | None = None, *, allow_stdin: bool = True,
            timeout: float = 180) -> Execution:
    """Run `code`; answer each input request with `answer(prompt, so_far)`; wait for the reply and idle."""
    msg_id = client.execute(code, allow_stdin=allow_stdin, stop_on_error=False)
    result = Execution()
    deadline = time.monotonic() + timeout
    idle = replied = False
    while not (idle and replied):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the cell did not finish within {timeout} s; so far: {result}")
        _read_stdin(client, msg_id, answer, result)
        _read_iopub(client, msg_id, result)
        replied = replied or _read_reply(client, msg_id, result)
        idle = idle or result.status == "idle"
    return result


def _read_stdin(client: Any, msg_id: str, answer: Answer | None, result: Execution) -> None:
    try:
        msg = client.get_stdin_msg(timeout=0.02)
    except queue.Empty:
        return
    if msg["msg_type"] != "input_request" or msg["parent_header"].get("msg_id") != msg_id:
        return
    _read_iopub(client, msg_id, result, settle=0.3)  # the output the kernel flushed before asking
    prompt = msg["content"]["prompt"]
    result.prompts.append(prompt)
    if msg["content"].get("password"):
        result.passwords.append(prompt)
    result.seen_at_prompt.append((len(result.stdout), len(result.stderr)))
    line = answer(prompt, result) if answer is not None else ""
    if line is not None:
        client.input(line)


def _read_iopub(client: Any, msg_id: str, result: Execution, settle: float = 0.02) -> None:
    until = time.monotonic() + settle
    while True:
        try:
            msg = client.get_iopub_msg(timeout=max(0.0, until - time.monotonic()))
        except queue.Empty:
            return
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            if content["name"] == "stdout":
                result.stdout += content["text"]
            else:
                result.stderr += content["text"]
        elif kind in ("display_data", "update_display_data", "execute_result"):
            result.shown += content.get("data", {}).get("text/plain", "") + "\n"
        elif kind == "error":
            result.error = content
        elif kind == "status":
            result.status = content["execution_state"]


def _read_reply(client: Any, msg_id: str, result: Execution) -> bool:
    try:
        msg = client.get_shell_msg(timeout=0.0)
    except queue.Empty:
        return False
    if msg["parent_header"].get("msg_id") != msg_id:
        return False
    if msg["content"]["status"] == "error" and result.error is None:
        result.error = msg["content"]
    return True


def scripted(*lines: str) -> Answer:
    """An `answer` that types `lines` in order, whatever the prompt (fails the test when they run out)."""
    left = list(lines)

    def answer(prompt: str, so_far: Execution) -> str:
        if not left:
            raise AssertionError(f"unexpected prompt {prompt!r} after {so_far.prompts}; output:\n{so_far.stdout}")
        return left.pop(0)

    return answer
