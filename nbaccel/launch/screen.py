"""A worker's output stream read as a terminal shows it: lines that are final, and lines still redrawn.

Progress bars (tqdm, rich) redraw their line with a carriage return, or move the cursor up over several
lines and rewrite them. Forwarding such a stream line by line would hold a bar back until its newline and
then print its whole `\\r` history. `Screen` keeps the rows the cursor can still come back to: a row is
*final* once the cursor is further below it than it ever moved up on this stream (for plain output: as soon
as its newline arrives), and is delivered then, as the terminal last showed it. The rows not final yet are
the *live* rows: the bars as they look right now.

Understood: `\\r`, `\\n`, `\\b`, cursor up/down (ESC[nA, ESC[nB, ESC[nF, ESC[nE), erase in line (ESC[K, ESC[2K),
show cursor (ESC[?25h: a redraw is over). Colour codes pass through on plain lines and are dropped from
redrawn ones; other escape sequences are dropped, except `MARK`: a rank writes it where one of its
displays belongs, and `DisplayOrder` shows that display message (sent over the channel) there.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Callable
from typing import Any

MARK = "\x1b]5150;nbaccel:{}\x07"  # an OSC sequence a rank writes where a display of its goes (rank_display.py)
_CONTROL = re.compile(r"(\r|\n|\x08|\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07|\x1b[()][0-9A-Za-z]|\x1b[=>78])")
_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07|\x1b[()][0-9A-Za-z]|\x1b[=>78]")
_UNFINISHED = re.compile(r"\x1b(\[[0-9;?]*|\][^\x07]*|[()])?$")  # an escape sequence cut by a read
_SGR_ONLY = re.compile(r"\x1b\[[0-9;]*m")


class Screen:
    """Feed a stream's text; `on_line(text)` gets each final line once, in order, and `on_live(rows)` the
    rows still being redrawn (an empty list once there are none) whenever they change."""

    def __init__(self, on_line: Callable[[str], None], on_live: Callable[[list[str]], None] | None = None,
                 on_mark: Callable[[str], None] | None = None) -> None:
        self._on_line = on_line
        self._on_live = on_live
        self._on_mark = on_mark  # called with the id of each MARK, after the lines written before it
        self._held = ""  # an escape sequence whose end has not been read yet
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._rows: list[str] = [""]  # rows not delivered yet; the last one may be partial
        self._row = 0  # cursor row (index into _rows)
        self._col = 0
        self._reach = 0  # the furthest the cursor ever moved up: rows this close above it may still change
        self._delivered = 0  # rows delivered so far (the row numbers of _rows start here)
        self._hold: int | None = None  # cursor hidden (a redraw starts) at this row: nothing below it is final yet
        self._redrawn = False  # the cursor went back on the current line (a partial plain line is not live)
        self._downs = 0  # newlines since the cursor last moved up
        self._live: list[str] = []

    # ------------------------------------------------------------------------------------------ input
    def feed(self, data: bytes) -> None:
        self.write(self._decoder.decode(data))

    def write(self, text: str) -> None:
        text = self._held + text
        self._held = ""
        if "\x1b" in text[-64:]:
            cut = _UNFINISHED.search(text)
            if cut is not None and len(text) - cut.start() < 4096:
                text, self._held = text[:cut.start()], text[cut.start():]
        if not text:
            return
        if self._plain_state() and not _has_control(text):
            self._write_plain(text)
        else:
            for piece in _CONTROL.split(text):
                if piece:
                    self._apply(piece)
            self._commit()
        self._report_live()

    def finish(self) -> None:
        """End of stream: every row is final."""
        text = self._decoder.decode(b"", final=True) + self._held
        self._held = ""
        if text:
            self.write(text)
            self._held = ""  # an escape sequence the stream never finished: dropped
        last = len(self._rows) - 1
        for index, row in enumerate(self._rows):
            if index < last or row.strip():
                self._on_line(row.rstrip())
        self._delivered += len(self._rows)
        self._rows, self._row, self._col, self._reach, self._hold = [""], 0, 0, 0, None
        self._redrawn = False
        self._report_live()

    @property
    def live(self) -> list[str]:
        return list(self._live)

    # ------------------------------------------------------------------------------------------ internals
    def _plain_state(self) -> bool:
        return self._reach == 0 and self._hold is None and self._row == len(self._rows) - 1 and self._col == len(self._rows[-1])

    def _write_plain(self, text: str) -> None:
        """Plain lines at the end of the stream (the common case): no cursor bookkeeping."""
        *lines, rest = (self._rows[-1] + text).split("\n")
        for line in lines:
            self._on_line(line)
        self._delivered += len(lines)
        self._rows = [rest]
        self._row, self._col = 0, len(rest)

    def _apply(self, piece: str) -> None:
        if piece == "\n":
            self._row += 1
            self._col = 0
            self._redrawn = False
            self._downs += 1
            if self._reach and self._hold is None and self._downs > self._reach + 1:
                self._reach = 0  # it went on printing below its bars for a while: the redrawing is over
            if self._row == len(self._rows):
                self._rows.append("")
        elif piece == "\r":
            self._col = 0
            self._redrawn = True
        elif piece == "\x08":
            self._col = max(0, self._col - 1)
            self._redrawn = True
        elif piece[0] == "\x1b":
            self._escape(piece)
        else:
            row = self._rows[self._row]
            if self._col > len(row):
                row += " " * (self._col - len(row))
            self._rows[self._row] = row[:self._col] + piece + row[self._col + len(piece):]
            self._col += len(piece)

    def _escape(self, code: str) -> None:
        if code.startswith("\x1b]5150;nbaccel:"):
            self._commit_all_above()
            if self._on_mark is not None:
                self._on_mark(code[len("\x1b]5150;nbaccel:"):-1])
            return
        final, params = code[-1], code[2:-1]
        if final == "m":
            return  # colours: dropped on redrawn rows
        count = int(params) if params.isdigit() and int(params) > 0 else 1
        if final in "AF":
            self._downs = 0
            self._row = max(0, self._row - count)
            self._reach = max(self._reach, count)
            if final == "F":
                self._col = 0
        elif final in "BE":
            self._row += count
            while self._row >= len(self._rows):
                self._rows.append("")
            if final == "E":
                self._col = 0
        elif not code.startswith("\x1b[") or len(code) < 3:
            return
        elif final == "K":
            self._redrawn = True
            row = self._rows[self._row]
            if params in ("", "0"):
                self._rows[self._row] = row[:self._col]
            elif params == "1":
                self._rows[self._row] = " " * min(self._col, len(row)) + row[self._col:]
            else:
                self._rows[self._row] = ""
        elif final == "G":
            self._col = max(0, count - 1)
        elif final == "h" and params == "?25":  # the cursor is shown again: whatever redrew its rows is done
            self._reach = 0
            self._hold = None
        elif final == "l" and params == "?25":  # hidden: a live display (rich) starts redrawing from here
            self._hold = self._delivered + self._row

    def _commit(self) -> None:
        """Deliver the rows the cursor can no longer come back to."""
        final = self._row - self._reach
        if self._hold is not None and self._reach == 0:  # how far up it will redraw is not known yet
            final = min(final, self._hold - self._delivered)
        if final <= 0:
            return
        for row in self._rows[:final]:
            self._on_line(row.rstrip())
        del self._rows[:final]
        self._row -= final
        self._delivered += final

    def _commit_all_above(self) -> None:
        """A display comes here: the lines written before it are final (the one the cursor is on, if empty)."""
        if self._reach == 0 and self._hold is None:
            self._commit()

    def _report_live(self) -> None:
        if self._on_live is None:
            return
        rows = [row.rstrip() for row in self._rows]
        while rows and not rows[-1]:
            rows.pop()
        if self._reach == 0 and self._hold is None and not self._redrawn:
            rows = []  # a line still being written (no newline yet) is not a live row
        if rows != self._live:
            self._live = rows
            self._on_live(list(rows))


def _has_control(text: str) -> bool:
    if "\r" in text or "\x08" in text:
        return True
    return "\x1b" in text and _ESCAPE.search(_SGR_ONLY.sub("", text)) is not None


def resolve(text: str) -> str:
    """`text` as a terminal shows it at the end: carriage-return histories and redraws collapsed."""
    if not _has_control(text):
        return text
    lines: list[str] = []
    screen = Screen(lines.append)
    screen.write(text)
    screen.finish()
    return "\n".join(lines) + ("\n" if text.endswith("\n") else "")


class DisplayOrder:
    """Kernel side: show each display message where its marker is in the rank's stdout (after the text
    printed before it), whichever of the two arrives first; `flush()` shows what never got its marker."""

    def __init__(self, show: Callable[[int, dict[str, Any]], None]) -> None:
        self._show = show
        self._waiting: dict[tuple[int, str], dict[str, Any]] = {}
        self._marked: set[tuple[int, str]] = set()

    def arrived(self, rank: int, message: dict[str, Any]) -> None:
        key = (rank, str(message.get("seq")))
        if message.get("seq") is None or key in self._marked:
            self._marked.discard(key)
            self._show(rank, message)
        else:
            self._waiting[key] = message

    def has_waiting(self, rank: int, seq: str) -> bool:
        """Whether the display message of this marker has arrived and waits to be shown."""
        return (rank, seq) in self._waiting

    def marked(self, rank: int, seq: str) -> None:
        message = self._waiting.pop((rank, seq), None)
        if message is None:
            self._marked.add((rank, seq))
        else:
            self._show(rank, message)

    def flush(self) -> None:
        waiting, self._waiting = self._waiting, {}
        for (rank, _), message in sorted(waiting.items(), key=lambda item: (item[0][0], int(item[0][1]))):
            self._show(rank, message)
