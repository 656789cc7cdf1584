"""Worker side: a rank's rich output goes to the kernel over nbaccel's channel, never over the kernel's sockets.

A worker forked from a Jupyter kernel inherits its IPython shell: `display()`, `plt.show()`, `tqdm.auto`,
`tqdm.notebook`, rich and ipywidgets would all try to send on the kernel's ZMQ sockets, which ipykernel
refuses from a fork ("attempted to send message from fork", once per message, in the kernel's log) and the
cell shows nothing. `install(send)` rewires them in this process only:

- the shell's display publisher becomes `ChannelDisplayPublisher`: every display (any rich repr: HTML,
  Markdown, images, pandas tables, matplotlib figures under the inline backend) and `clear_output` becomes
  a `display` / `clear_output` message, sent after the rank's stdout/stderr are flushed (so the kernel
  shows it in order with the rank's text);
- widgets get a comm that sends nothing (the kernel shows their text form);
- `tqdm.notebook` / `tqdm.auto` bars become plain text bars and rich draws as on a terminal: their
  carriage-return redraws are shown live by the kernel (screen.py, notebook/live_output.py);
- logging handlers that wrote to the kernel's streams write to this process's stdout/stderr.

A spawned worker has no shell; when the kernel asked for it (`NBACCEL_RICH_DISPLAY=1`, set by the launcher
in a notebook) it gets a bare `InteractiveShell` whose publisher is the channel one when it first imports
`IPython.display`, so `display()` works there too. `finish()` (after the function or cell) shows the figures pyplot still holds, as the inline
backend does at the end of a cell. Nothing here imports ipywidgets.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import itertools
import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

from ...utils.constants import RICH_DISPLAY_ENV
from ..messages import MessageKind
from ..screen import MARK

Send = Callable[[dict[str, Any]], None]

_send: Send | None = None
_mark = False
_lock = threading.Lock()
_count = itertools.count(1)


def install(send: Send, mark: bool = True) -> None:
    """Route this worker's displays, widgets, progress bars and log handlers as the module doc says.
    `mark`: also write a marker into stdout where each display goes (the kernel shows it there, in order
    with the text; `DisplayOrder`)."""
    global _send, _mark
    _send, _mark = send, mark
    os.environ.setdefault("TTY_COMPATIBLE", "1")  # rich: draw progress and live views with cursor moves
    _ImportHooks.install()
    for name in list(_ImportHooks.after):
        if name in sys.modules:
            _ImportHooks.after[name](sys.modules[name])
    _rebind_log_handlers()
    _close_inherited_figures()
    shell = _shell()
    if shell is not None:
        shell.display_pub = publisher_class()(shell=shell)
    elif os.environ.get(RICH_DISPLAY_ENV) == "1":  # spawned from a notebook: a shell once display is imported
        _ImportHooks.after["IPython.display"] = _shell_on_first_display
        if "IPython.display" in sys.modules:
            _shell_on_first_display(sys.modules["IPython.display"])


def finish() -> None:
    """Show the figures pyplot still holds (the inline backend's end-of-cell flush)."""
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is None or _send is None:
        return
    try:
        backend = str(pyplot.get_backend()).lower()
        if "inline" not in backend:
            return
        from matplotlib_inline.backend_inline import flush_figures

        flush_figures()
    except Exception:
        pass


def send(message: dict[str, Any]) -> None:
    """Send a display message to the kernel, after this rank's pending text."""
    if _send is None:
        return
    from ..output import flush_std

    flush_std()
    with _lock:
        seq = next(_count)
        _send(dict(message, seq=seq))
        if _mark:
            try:
                sys.__stdout__.write(MARK.format(seq))
                sys.__stdout__.flush()
            except Exception:
                pass


# ---------------------------------------------------------------------------------------------- displays
_publisher: type | None = None


def publisher_class() -> type:
    """`ChannelDisplayPublisher`: IPython's DisplayPublisher for a rank, whose output goes over the channel
    (made on first use, so importing this module does not import IPython)."""
    global _publisher
    if _publisher is None:
        from IPython.core.displaypub import DisplayPublisher

        class ChannelDisplayPublisher(DisplayPublisher):
            def publish(self, data: dict, metadata: dict | None = None, source: Any = None, *,
                        transient: dict | None = None, update: bool = False, **kwargs: Any) -> None:
                send({"kind": MessageKind.DISPLAY.value, "data": _plain(data), "metadata": _plain(metadata or {}),
                      "transient": dict(transient or {}), "update": bool(update)})

            def clear_output(self, wait: bool = False) -> None:
                send({"kind": MessageKind.CLEAR_OUTPUT.value, "wait": bool(wait)})

        _publisher = ChannelDisplayPublisher
    return _publisher


def _plain(value: Any) -> Any:
    """Display data as plain containers (bytes kept: the kernel's publisher encodes images)."""
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, (str, bytes, int, float, bool)) or value is None:
        return value
    return str(value)


def _shell() -> Any:
    if "IPython" not in sys.modules:
        return None
    try:
        from IPython.core.interactiveshell import InteractiveShell

        return InteractiveShell._instance if InteractiveShell.initialized() else None
    except Exception:
        return None


def _shell_on_first_display(module: Any) -> None:
    """After IPython.display is imported in a spawned rank: its display functions make the shell first."""
    targets = [module, sys.modules.get("IPython.core.display_functions")]
    for target in filter(None, targets):
        for name in ("display", "clear_output", "publish_display_data", "update_display"):
            original = getattr(target, name, None)
            if callable(original) and not getattr(original, "_nbaccel_shell", False):
                setattr(target, name, _after_shell(original))


def _after_shell(function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        _start_bare_shell()
        return function(*args, **kwargs)

    call._nbaccel_shell = True  # type: ignore[attr-defined]
    return call


def _start_bare_shell() -> None:
    """A minimal IPython shell in a spawned rank (no history file), made at its first display() (it costs
    most of a second), so display() formats rich reprs (figures too) and sends them here."""
    if _shell() is not None:
        return
    try:
        from IPython.core.interactiveshell import InteractiveShell
        from traitlets.config import Config

        config = Config()
        config.HistoryManager.enabled = False
        shell = InteractiveShell.instance(config=config)
        shell.display_pub = publisher_class()(shell=shell)
        inline = sys.modules.get("matplotlib_inline.backend_inline")
        if inline is not None:  # imported before the shell existed: register its figure formatter now
            inline._enable_matplotlib_integration()
    except Exception:
        pass


def bind_shell(namespace: dict[str, Any]) -> None:
    """Give a RankPool rank's namespace `get_ipython()`: the code of a `%%ranks` cell went through the kernel's
    input transformer, so `!cmd`, `%magic` and `x?` lines are `get_ipython().system(...)`,
    `.run_line_magic(...)` calls. The shell is the one a forked rank inherited from the kernel (its display
    publisher already rewired by `install`) or, spawned, a bare one (as for `display()`); its namespace
    becomes the rank's, so `%time y = 1` defines `y` there, and its pager prints (the kernel's pager answers
    a request of the kernel's own, which a rank has none of)."""
    _start_bare_shell()
    shell = _shell()
    if shell is None:
        raise RuntimeError("this rank has no IPython (pip install ipython): its cell has !cmd or %magic lines")
    shell.user_ns = namespace
    shell.set_hook("show_in_pager", _print_page)
    namespace["get_ipython"] = shell.get_ipython


def _print_page(_shell: Any, data: Any, start: int = 0, screen_lines: int = 0, pager_cmd: Any = None) -> None:
    """The pager of a rank's shell: the text form, to stdout (the kernel shows it as the rank's output)."""
    text = data.get("text/plain", "") if isinstance(data, dict) else str(data)
    print("\n".join(text.splitlines()[start:]))


def _close_inherited_figures() -> None:
    """Figures a forked rank inherited from the kernel are not the rank's: `finish` must not show them."""
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is None:
        return
    try:
        pyplot.close("all")
    except Exception:
        pass


def _quiet_comms(comm: Any = None) -> None:
    """Widgets made in a rank get a comm that sends nothing: the kernel shows their text form. (When the
    `comm` package is not imported yet this runs when it is, from the import hook.)"""
    comm = comm or sys.modules.get("comm")
    if comm is None:
        return
    dummy = getattr(comm, "DummyComm", None)
    if dummy is not None:
        comm.create_comm = lambda *args, **kwargs: dummy(*args, **kwargs)
        comm.get_comm_manager = lambda: _NoComms()


class _NoComms:
    def register_target(self, *args: Any, **kwargs: Any) -> None:
        return None

    def unregister_target(self, *args: Any, **kwargs: Any) -> None:
        return None

    def register_comm(self, comm: Any) -> str:
        return getattr(comm, "comm_id", "")

    def unregister_comm(self, comm: Any) -> None:
        return None

    def get_comm(self, comm_id: str) -> None:
        return None


_kernel_stream_handlers: tuple[int, list[logging.Handler]] | None = None  # (kernel's pid, handlers): note_...


def note_kernel_stream_handlers() -> None:
    """In the launching process, right before it forks ranks: note the log handlers bound to the kernel's
    streams, so that each forked rank rebinds those instead of walking every logger itself (~130 with torch
    loaded: ~0.8 ms in a fresh fork, whose every touched object is a copied page, on the way to the function)."""
    global _kernel_stream_handlers
    _kernel_stream_handlers = (os.getpid(), _handlers_on_kernel_streams())


def _handlers_on_kernel_streams() -> list[logging.Handler]:
    if "ipykernel" not in sys.modules:
        return []  # no stream of ipykernel's without ipykernel
    loggers = [logging.getLogger()] + [logger for logger in logging.Logger.manager.loggerDict.values()
                                       if isinstance(logger, logging.Logger)]
    return [handler for logger in loggers for handler in logger.handlers
            if type(getattr(handler, "stream", None)).__module__.startswith("ipykernel")
            and not _follows_sys_stderr(handler)]


def _follows_sys_stderr(handler: logging.Handler) -> bool:
    """A handler whose `stream` is a read-only property reads `sys.stderr` at each record (logging's
    `_StderrHandler`, which dill puts on its logger, and torch.utils.data imports dill where it is installed):
    it writes to the rank's stderr by itself, and setting its stream would raise AttributeError in every rank."""
    stream = getattr(type(handler), "stream", None)
    return isinstance(stream, property) and stream.fset is None


def _rebind_log_handlers() -> None:
    """Log handlers bound to the kernel's streams (a fork inherits them) write to this rank's fds."""
    noted = _kernel_stream_handlers
    # noted by the process that forked this rank, right before: the handlers it had at the fork
    handlers = noted[1] if noted is not None and noted[0] == os.getppid() else _handlers_on_kernel_streams()
    for handler in handlers:
        name = getattr(handler.stream, "name", "stderr")  # type: ignore[attr-defined]
        handler.stream = sys.stdout if name == "stdout" else sys.stderr  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------------------- progress bars
def _plain_tqdm_notebook(module: Any) -> None:
    """tqdm.notebook's bar becomes tqdm's text bar in this process (no widget, no kernel socket)."""
    cls = getattr(module, "tqdm_notebook", None)
    if cls is None or getattr(cls, "_nbaccel_plain", False):
        return
    from tqdm.std import tqdm as std_tqdm

    for name in ("status_printer", "display", "colour", "__iter__", "update", "close", "clear", "reset"):
        if name in cls.__dict__:
            delattr(cls, name)

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs.pop("display", None)  # tqdm.notebook's own keyword
        std_tqdm.__init__(self, *args, **kwargs)

    cls.__init__ = __init__
    cls._nbaccel_plain = True


def _plain_rich(module: Any) -> None:
    """rich in a forked rank would see the kernel's shell and draw with widgets: draw as on a terminal."""
    module._is_jupyter = lambda: False
    console = getattr(module, "_console", None)
    if console is not None:
        console.is_jupyter = False


def _without_kernel_shell(action: Callable[[], None]) -> None:
    """Run `action` (an import) while `ipykernel.zmqshell` is hidden: tqdm.autonotebook then picks tqdm.std."""
    hidden = sys.modules.pop("ipykernel.zmqshell", None)
    try:
        action()
    finally:
        if hidden is not None:
            sys.modules["ipykernel.zmqshell"] = hidden


class _ImportHooks(importlib.abc.MetaPathFinder):
    """Patch tqdm and rich when a rank imports them (and at install when the kernel had imported them)."""

    after: dict[str, Callable[[Any], None]] = {"tqdm.notebook": _plain_tqdm_notebook, "rich.console": _plain_rich,
                                               "comm": _quiet_comms}
    around: dict[str, Callable[[Callable[[], None]], None]] = {"tqdm.autonotebook": _without_kernel_shell}
    _installed = False

    @classmethod
    def install(cls) -> None:
        if not cls._installed:
            sys.meta_path.insert(0, cls())
            cls._installed = True

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name not in self.after and name not in self.around:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _Loader(spec.loader, self.after.get(name), self.around.get(name))
        return spec


class _Loader(importlib.abc.Loader):
    def __init__(self, loader: Any, after: Callable[[Any], None] | None,
                 around: Callable[[Callable[[], None]], None] | None) -> None:
        self._loader = loader
        self._after = after
        self._around = around

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        if self._around is not None:
            self._around(lambda: self._loader.exec_module(module))
        else:
            self._loader.exec_module(module)
        if self._after is not None:
            try:
                self._after(module)
            except Exception:
                pass
