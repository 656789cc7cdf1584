"""The message kinds and rank states: one module (nbaccel/launch/messages.py), the docs' table matches it."""

from __future__ import annotations

import re
from pathlib import Path

from nbaccel.launch import messages
from nbaccel.launch.messages import LaunchState, MessageKind, RankState

ROOT = Path(__file__).resolve().parent.parent


def _table_rows() -> dict[str, str]:
    """kind -> its row, from the channel table of docs/internals.md."""
    text = (ROOT / "docs" / "internals.md").read_text(encoding="utf-8")
    section = text[text.index("## The channel (kernel <-> worker)"):]
    section = section[: section.index("\n## ", 1)]
    rows = {}
    for line in section.splitlines():
        match = re.match(r"\| `(\w+)` \|", line)
        if match:
            rows[match.group(1)] = line
    return rows


def test_docs_message_table_lists_every_kind_and_only_those():
    assert set(_table_rows()) == {kind.value for kind in MessageKind}


def test_docs_status_row_lists_every_rank_state():
    row = _table_rows()["status"]
    states = re.search(r"`state` in ([\w/]+)", row).group(1).split("/")
    assert states == [state.value for state in messages.REPORTED_STATES]
    judged = [state for state in RankState if state not in messages.REPORTED_STATES]
    text = (ROOT / "docs" / "internals.md").read_text(encoding="utf-8")
    assert judged and all(f"`{state.value}`" in text for state in judged)


def test_docs_launch_row_lists_every_launch_state():
    row = _table_rows()["launch"]
    states = re.search(r"`state` \(([\w/]+)\)", row).group(1).split("/")
    assert states == [state.value for state in LaunchState]


def test_enums_equal_todays_strings_so_observers_keep_working():
    assert MessageKind.STATUS == "status" and RankState.FAILED == "failed" and f"{RankState.STOPPED}" == "stopped"
    message = messages.status(3, 1, RankState.STOPPED)
    assert message["kind"] == "status" and message["state"] == "stopped" and type(message["state"]) is str
    assert (message["rank"], message["local_rank"]) == (3, 1) and isinstance(message["time"], float)
    assert messages.launch(LaunchState.TIMEOUT)["rank"] is None
    line = messages.output(0, 0, "stderr", "text")
    assert (line["kind"], line["stream"], line["text"]) == ("output", "stderr", "text")


def test_typed_messages_make_the_wire_dicts_and_read_them_back():
    wire = messages.Status(2, RankState.RUNNING, device="cpu", pid=7).to_wire()
    assert {key: wire[key] for key in ("kind", "rank", "state", "device", "pid")} == {
        "kind": "status", "rank": 2, "state": "running", "device": "cpu", "pid": 7}
    assert type(wire["state"]) is str and "error" not in wire and "restart" not in wire and "host" not in wire
    on_host = messages.Status(3, RankState.RUNNING, device="cpu", host="gpu-b").to_wire()
    assert on_host["host"] == "gpu-b" and messages.Status.from_wire(on_host).host == "gpu-b"
    assert messages.status(3, 1, RankState.STOPPED, host="gpu-b")["host"] == "gpu-b"
    back = messages.Status.from_wire(dict(wire, local_rank=1, extra_field="kept"))
    assert back.state is RankState.RUNNING and back.local_rank == 1 and back.extra == {"extra_field": "kept"}
    failure = messages.Failure(0, "ValueError", "bad value\nsecond line", "tb")
    assert messages.Failure.from_wire(failure.to_wire()) == failure
    assert failure.first_line == "ValueError: bad value" and messages.Failure(0, "KeyError").first_line == "KeyError"
    ready = messages.Ready(1, device="cpu", pid=3).to_wire()
    assert ready == {"kind": "ready", "rank": 1, "device": "cpu", "pid": 3}
    assert messages.PoolCommand("exec") is messages.PoolCommand.EXEC


def test_telemetry_emits_only_known_kinds():
    source = (ROOT / "nbaccel" / "telemetry.py").read_text(encoding="utf-8")
    emitted = set(re.findall(r"""_?emit\([^"']*["'](\w+)["']""", source))
    assert emitted and emitted <= {kind.value for kind in MessageKind}, emitted


_WORDS = {kind.value for kind in MessageKind} | {state.value for state in RankState}
# the views and a rank's display publisher (nbaccel/telemetry.py, below launch/, keeps its strings)
_VIEW_FILES = [*sorted((ROOT / "nbaccel" / "notebook").glob("*.py")),
               ROOT / "nbaccel" / "launch" / "worker" / "rank_display.py"]


def literal_vocabulary(source: str) -> list[tuple[int, str]]:
    """(line, word) for each message kind or rank state written as a string literal where the enums are
    meant: compared (`state == "running"`, `in ("failed", ...)`), as the keys of a table of states or kinds,
    or as the value of a dict's `kind`/`state`."""
    import ast

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            for side in (node.left, *node.comparators):
                items = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
                found += [(node.lineno, item.value) for item in items
                          if isinstance(item, ast.Constant) and item.value in _WORDS]
        elif isinstance(node, ast.Dict):
            keys = [key for key in node.keys if isinstance(key, ast.Constant)]
            if len(keys) >= 2 and all(key.value in _WORDS for key in keys):
                found += [(node.lineno, key.value) for key in keys]
            found += [(node.lineno, value.value) for key, value in zip(node.keys, node.values)
                      if isinstance(key, ast.Constant) and key.value in ("kind", "state")
                      and isinstance(value, ast.Constant) and value.value in _WORDS]
    return found


def test_the_views_name_states_and_kinds_through_the_enums():
    found = {path.name: hits for path in _VIEW_FILES if (hits := literal_vocabulary(path.read_text(encoding="utf-8")))}
    assert not found, f"use RankState / MessageKind instead of these literals: {found}"


def test_the_literal_checker_finds_each_form():
    source = ('if s.state == "running": pass\nok = kind in ("display", "x")\n'
              'STYLES = {"failed": 1, "finished": 2}\nsend({"kind": "clear_output"})\n'
              'fine = {"rank": 0, "device": "cpu"} if s.state == RankState.RUNNING else None\n')
    assert literal_vocabulary(source) == [(1, "running"), (2, "display"), (3, "failed"), (3, "finished"),
                                          (4, "clear_output")]
