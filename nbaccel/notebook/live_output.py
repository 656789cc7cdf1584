"""The ranks' rich output in the cell that launched them: live progress rows, display() output, figures.

Kernel side. The supervisor hands `CellOutput` three things besides the final text lines it writes itself:
- the rows each rank is redrawing in place (progress bars, from `launch/screen.py`): shown together, one
  line per rank and row, in one display output updated in place at most `LIVE_INTERVAL` apart; emptied
  when no rank has a live row, so the next bar appears below the text printed meanwhile;
- `display` messages (a rank's `display()`, `plt.show()`, rich reprs): published into the cell with the
  rank in their metadata and labels (text/plain "[rank r] ...", HTML under a "rank r" caption), each with
  a display id of its own;
- `clear_output` messages: clear what that rank displayed (not the other ranks' output or the text), at
  once or, with `wait=True`, when the rank displays its next output (which then takes the place of its
  first cleared one), as Jupyter does for a cell.

Outside an IPython kernel (a script, a terminal) displays become "[rank r] <text/plain>" lines and live rows
are not drawn (the final state of each bar is still printed as a line).
"""

from __future__ import annotations

import base64
import html
import sys
import time
import uuid
from typing import Any

LIVE_INTERVAL = 0.2  # seconds between redraws of the live rows (at least 2 per second as asked)
# A live row is cut to this many characters: a rank redrawing a megabyte-long line with \r (no newline) sent all of
# it to the browser twice (text and HTML) five times a second; its final state is still printed whole, once.
MAX_LIVE_ROW = 1000
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def in_kernel() -> bool:
    """Whether this process is an IPython kernel with a display publisher (Jupyter, Colab, VS Code)."""
    if "IPython" not in sys.modules:
        return False
    from IPython import get_ipython

    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


class CellOutput:
    """Live rows, displays and clear_output of every rank, drawn into the current cell (see module doc)."""

    def __init__(self, kernel: bool | None = None) -> None:
        self.kernel = in_kernel() if kernel is None else kernel
        self._live: dict[tuple[int, str], list[str]] = {}
        self._live_handle: Any = None
        self._shown_text: str | None = None
        self._dirty = False
        self._last_draw = 0.0
        self._shown: dict[int, list[str]] = {}  # per rank: display ids it showed since its last clear
        self._pending_clear: dict[int, list[str]] = {}  # clear_output(wait=True): ids to replace / clear
        self.draws = 0

    # ------------------------------------------------------------------------------------------ live rows
    def live(self, rank: int, stream: str, rows: list[str]) -> None:
        """Rank `rank`'s `stream` now redraws `rows` (empty: nothing live there any more)."""
        key = (rank, stream)
        if rows:
            self._live[key] = list(rows)
        else:
            self._live.pop(key, None)
        self._dirty = True
        self.tick()

    def tick(self) -> None:
        """Draw the live rows if they changed and the last draw is LIVE_INTERVAL old (call it often)."""
        if not self._dirty or time.monotonic() - self._last_draw < LIVE_INTERVAL:
            return
        self._draw()

    def flush(self) -> None:
        """Draw the live rows now (before text or a display that must come after them)."""
        if self._dirty:
            self._draw()

    def close(self) -> None:
        """The launch is over: the live area is emptied (every bar's final state was printed as a line)."""
        self._live.clear()
        self._dirty = True
        self._draw()

    def live_text(self) -> str:
        return "\n".join(f"[rank {rank}] {_cut(row)}" for (rank, _), rows in sorted(self._live.items()) for row in rows)

    def _draw(self) -> None:
        self._dirty = False
        self._last_draw = time.monotonic()
        if not self.kernel:
            return
        text = self.live_text()
        if text == self._shown_text:
            return
        self._shown_text = text
        bundle = {"text/plain": text,
                  "text/html": f"<pre class='nbaccel-live' style='margin:0'>{html.escape(text)}</pre>" if text else ""}
        try:
            if self._live_handle is None:
                if not text:
                    return
                from IPython.display import display

                _flush_std()
                self._live_handle = display(bundle, raw=True, display_id=True)
            else:
                self._live_handle.update(bundle, raw=True)
                if not text:  # nothing live: the next bar gets a new area below the text printed until then
                    self._live_handle = None
            self.draws += 1
        except Exception:
            self.kernel = False  # no usable display: keep printing lines

    # ------------------------------------------------------------------------------------------ displays
    def display(self, rank: int, message: dict[str, Any]) -> None:
        """Show a rank's `display` message (data, metadata, transient, update) in the cell."""
        data = {key: value for key, value in (message.get("data") or {}).items() if key != WIDGET_VIEW}
        if not data:
            return
        if not self.kernel:
            text = data.get("text/plain", "")
            target = sys.stdout
            for line in str(text).splitlines() or [""]:
                target.write(f"[rank {rank}] {line}\n")
            return
        data = label(rank, data)
        metadata = dict(message.get("metadata") or {})
        metadata["nbaccel"] = {"rank": rank}
        rank_id = (message.get("transient") or {}).get("display_id")
        self.flush()
        _flush_std()
        from IPython.display import publish_display_data

        if rank_id and message.get("update"):  # a rank's handle.update(...): the output it named
            publish_display_data(data, metadata, transient={"display_id": f"nbaccel-{rank}-{rank_id}"}, update=True)
            return
        waiting = self._pending_clear.pop(rank, None)
        if waiting:  # clear_output(wait=True) then display: the new output takes the first cleared place
            target, rest = waiting[0], waiting[1:]
            publish_display_data(data, metadata, transient={"display_id": target}, update=True)
            for display_id in rest:
                publish_display_data({"text/plain": ""}, {}, transient={"display_id": display_id}, update=True)
            self._shown[rank] = [target]
            return
        display_id = f"nbaccel-{rank}-{rank_id}" if rank_id else f"nbaccel-{uuid.uuid4().hex}"
        publish_display_data(data, metadata, transient={"display_id": display_id})
        self._shown.setdefault(rank, []).append(display_id)

    def clear_output(self, rank: int, wait: bool = False) -> None:
        """A rank's `clear_output(wait)`: clear what it displayed (text lines stay)."""
        shown = self._shown.pop(rank, [])
        if not self.kernel or not shown:
            return
        if wait:
            self._pending_clear[rank] = self._pending_clear.get(rank, []) + shown
            return
        from IPython.display import publish_display_data

        for display_id in shown:
            publish_display_data({"text/plain": ""}, {}, transient={"display_id": display_id}, update=True)


IMAGES = ("image/png", "image/jpeg", "image/gif")


def label(rank: int, data: dict[str, Any]) -> dict[str, Any]:
    """The bundle with the rank named in every form a frontend may pick: its text/plain, a caption above
    its HTML, above an image (a figure from `plt.show()`: an HTML form of the bundle shows the caption and
    the image, which stays in the bundle too) and above Markdown."""
    data = dict(data)
    if isinstance(data.get("text/plain"), str):
        data["text/plain"] = f"[rank {rank}] {data['text/plain']}"
    if not isinstance(data.get("text/html"), str):
        image = next((kind for kind in IMAGES if isinstance(data.get(kind), (str, bytes))), None)
        if image is not None:
            encoded = data[image]  # raw bytes, or base64 text as Jupyter stores images
            encoded = base64.b64encode(encoded).decode("ascii") if isinstance(encoded, bytes) else encoded.strip()
            data["text/html"] = f"<img src='data:{image};base64,{encoded}' alt='rank {rank} image'>"
        elif isinstance(data.get("text/markdown"), str):
            data["text/markdown"] = f"<sub>rank {rank}</sub>\n\n{data['text/markdown']}"
    if isinstance(data.get("text/html"), str):
        data["text/html"] = (f"<div class='nbaccel-display' data-rank='{rank}'><div style='font-size:11px;"
                             f"color:#666;font-family:monospace'>rank {rank}</div>{data['text/html']}</div>")
    return data


def _cut(row: str) -> str:
    return row if len(row) <= MAX_LIVE_ROW else row[:MAX_LIVE_ROW - 1] + "…"


def _flush_std() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
