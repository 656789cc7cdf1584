"""Show the per-rank results of a `RankPool` call side by side: HTML (one column per rank) and plain text.

Values are shown from the text each rank made of them (`RankResult.text`): tensors with shape, dtype and
device next to torch's short preview. A value that reads the same on every rank is shown once, as
"all ranks: ...". Only the standard library is used (no ipywidgets), so results render anywhere.
"""

from __future__ import annotations

import html
import re
from collections.abc import Sequence
from typing import Any

from ..messages import RankState
from ..screen import resolve

MAX_LINES = 200  # per rank and stream; the full text stays in RankResult.stdout / .stderr
MAX_CHARS = 32_000  # per rank and stream, of those lines: one long line (dots printed with end="") is cut too
STATUS_LABELS = {RankState.FINISHED: "", RankState.FAILED: "failed", RankState.WAITING: "stuck in a collective",
                 RankState.RUNNING: "running...", RankState.NOT_RUN: "not run"}


def tail(text: str, max_lines: int = MAX_LINES, max_chars: int = MAX_CHARS) -> str:
    """The last `max_lines` lines of `text` as a terminal shows them (a progress bar's carriage-return
    redraws collapsed to its current state), and of those the last `max_chars` characters, saying what was
    left out. The view is sent again at each live update: without the character bound, a line that grows
    (`print(".", end="")`) was sent whole each time, megabytes in seconds."""
    lines = resolve(text).rstrip("\n").splitlines()
    shown = "\n".join(lines[-max_lines:])
    left_out = []
    if len(lines) > max_lines:
        left_out.append(f"{len(lines) - max_lines} earlier lines")
    if len(shown) > max_chars:
        left_out.append(f"{len(shown) - max_chars} earlier characters")
        shown = shown[-max_chars:]
    if not left_out:
        return shown
    return f"... ({' and '.join(left_out)}: see .stdout/.stderr of the results)\n{shown}"


def split_progress(text: str) -> tuple[str, str]:
    """(the lines a progress bar redrew with carriage returns, every other line) of a stream's text."""
    progress, other = [], []
    for line in re.findall(r"[^\n]*\n|[^\n]+$", text):  # not splitlines: it splits at "\r" too
        (progress if "\r" in line.rstrip("\r\n") else other).append(line)
    return "".join(progress), "".join(other)


def value_line(result: Any) -> str | None:
    """The value as text, tensors with their facts: `tensor([0, 1]) (shape [2], int64, cpu)`."""
    if result.text is None:
        return None
    meta = result.meta or {}
    if meta.get("type") == "tensor":
        return f"{result.text}  (shape {meta.get('shape')}, {meta.get('dtype')}, {meta.get('device')})"
    return result.text


def common_value(results: Sequence[Any]) -> str | None:
    """The value text when every rank shows the same one (and there are at least two ranks)."""
    lines = [value_line(result) for result in results]
    if len(results) > 1 and lines[0] is not None and all(line == lines[0] for line in lines):
        return lines[0]
    return None


def render_text(results: Sequence[Any]) -> str:
    """Plain-text view: each rank's output lines prefixed `[rank i]`, then the values (once if equal)."""
    if not results:
        return "(no ranks)"
    out: list[str] = []
    for result in results:
        label = STATUS_LABELS.get(result.status, result.status)
        if label:
            out.append(f"[rank {result.rank}] ({label})")
        for stream in (result.stdout, result.stderr):
            if stream:
                out += [f"[rank {result.rank}] {line}" for line in tail(stream).splitlines()]
        if result.error is not None:
            text = result.error.traceback.rstrip() or f"{result.error.exc_type}: {result.error.message}"
            out += [f"[rank {result.rank}] {line}" for line in text.splitlines()]
    shared = common_value(results)
    if shared is not None:
        out.append(_indent(f"all ranks: {shared}"))
    else:
        for result in results:
            line = value_line(result)
            if line is not None:
                out.append(_indent(f"rank {result.rank}: {line}"))
    return "\n".join(out) if out else "(no output)"


def _indent(text: str) -> str:
    head, *rest = text.splitlines() or [""]
    pad = " " * min(len(head) - len(head.lstrip(" ")) + 4, 12)
    return "\n".join([head, *[pad + line for line in rest]])


_STYLE = ("display:flex;gap:12px;align-items:flex-start;font-family:var(--jp-code-font-family,monospace);"
          "font-size:12px")
_COLUMN = "flex:1 1 0;min-width:0;border:1px solid #ccc;border-radius:4px;padding:4px 6px"
_PRE = "margin:2px 0;white-space:pre-wrap;word-break:break-word"


def render_html(results: Sequence[Any]) -> str:
    """One column per rank (output, error, value); a value shared by all ranks appears once below."""
    shared = common_value(results)
    columns = []
    for result in results:
        label = STATUS_LABELS.get(result.status, result.status)
        head = f"<b>rank {result.rank}</b>"
        if label:
            color = "#b00" if result.status in (RankState.FAILED, RankState.WAITING) else "#666"
            head += f" <span style='color:{color}'>{html.escape(label)}</span>"
        if result.duration:
            head += f" <span style='color:#888'>{result.duration * 1000:.1f} ms</span>"
        parts = [f"<div>{head}</div>"]
        if result.stdout:
            parts.append(f"<pre style='{_PRE}'>{html.escape(tail(result.stdout))}</pre>")
        if result.stderr:  # progress bars (tqdm writes to stderr) look as they did live, not like errors
            progress, other = split_progress(result.stderr)
            if progress:
                parts.append(f"<pre class='nbaccel-progress' style='{_PRE}'>{html.escape(tail(progress))}</pre>")
            if other:
                parts.append(f"<pre style='{_PRE};background:#fdd'>{html.escape(tail(other))}</pre>")
        if result.error is not None:
            text = result.error.traceback.rstrip() or f"{result.error.exc_type}: {result.error.message}"
            parts.append(f"<pre style='{_PRE};color:#b00'>{html.escape(text)}</pre>")
        line = value_line(result)
        if line is not None and shared is None:
            parts.append(f"<pre style='{_PRE};border-top:1px dashed #ccc'>{html.escape(line)}</pre>")
        columns.append(f"<div style='{_COLUMN}'>{''.join(parts)}</div>")
    body = f"<div style='{_STYLE}'>{''.join(columns)}</div>"
    if shared is not None:
        body += f"<pre style='{_PRE};font-size:12px'><b>all ranks:</b> {html.escape(shared)}</pre>"
    return f"<div class='nbaccel-ranks'>{body}</div>"
