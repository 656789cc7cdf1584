"""How rank processes start: pick a safe start method (fork where no accelerator runtime is initialized), the
multiprocessing context, gc frozen and `__main__` hidden around the starts, and multiprocessing's helper processes
(resource tracker, fork server) stopped after the launch that started them."""

from __future__ import annotations

import contextlib
import gc
import multiprocessing as mp
import sys
from collections.abc import Iterator
from multiprocessing.context import BaseContext
from typing import Any

from ...utils.constants import START_METHODS


def accelerator_initialized() -> str | None:
    """Name the accelerator runtime already initialized in this process (which makes fork unsafe), or None.

    Only looks at modules already imported: it never imports torch or initializes a device itself.
    """
    torch = sys.modules.get("torch")
    if torch is not None:
        cuda = getattr(torch, "cuda", None)
        if cuda is not None and _call(getattr(cuda, "is_initialized", None)):
            return "ROCm (HIP)" if getattr(torch.version, "hip", None) else "CUDA"
        xpu = getattr(torch, "xpu", None)
        if xpu is not None and _call(getattr(xpu, "is_initialized", None)):
            return "XPU"
        npu = getattr(torch, "npu", None)
        if npu is not None and _call(getattr(npu, "is_initialized", None)):
            return "NPU"
    if "torch_xla" in sys.modules:
        runtime = sys.modules.get("torch_xla.runtime")
        if runtime is not None and _call(getattr(runtime, "is_initialized", None)):
            return "XLA"
    return None


def _call(fn: Any) -> bool:
    try:
        return bool(fn()) if callable(fn) else False
    except Exception:
        return False


def check_start_method(requested: str | None) -> None:
    if requested is not None and requested not in START_METHODS:
        raise ValueError(f"start_method={requested!r} is not one of {START_METHODS} (or None to choose automatically)")


def choose_start_method(requested: str | None) -> tuple[str, str | None]:
    """Return (start method, note for the user or None).

    None picks fork where it is safe: not on macOS (system libraries are not fork-safe there) and not after
    an accelerator runtime was initialized in this process (a forked child cannot use it). Otherwise spawn,
    with a one-line note saying why. An explicit "fork" in an unsafe state raises ValueError.
    """
    check_start_method(requested)
    if sys.platform == "win32":
        raise RuntimeError(
            "notebook_launcher needs Linux or macOS to run more than one process (it captures each worker's "
            "output at the file-descriptor level); on Windows use WSL, or num_processes=1."
        )
    runtime = accelerator_initialized()
    reason = None
    if runtime:
        reason = f"{runtime} is already initialized in this kernel"
    elif sys.platform == "darwin":
        reason = "fork is not safe on macOS"
    if requested == "fork" and reason:
        hint = (
            "Restart the kernel and keep device calls (e.g. .cuda(), torch.cuda.*) inside the training function, "
            if runtime
            else ""
        )
        raise ValueError(
            f"start_method='fork' is unsafe here: {reason}, and a forked worker cannot use it. "
            f"{hint}or pass start_method='spawn' (or None to choose automatically)."
        )
    if requested is not None:
        return requested, None
    if reason:
        return "spawn", f"Using start_method='spawn' because {reason} (fork would break the workers)."
    return "fork", None


def get_context(start_method: str) -> BaseContext:
    return mp.get_context(start_method)


@contextlib.contextmanager
def gc_frozen(start_method: str) -> Iterator[None]:
    """Fork workers with the kernel's objects in gc's permanent generation (gc.freeze), thawed afterwards.

    A garbage collection walks every tracked object and writes to its header: after a fork that copies
    the shared memory pages, in each worker (a training loop collects often) and in the kernel. Frozen
    objects are skipped, so the workers keep sharing the kernel's memory (what the Python docs advise for
    fork). The launch benchmark shows no speed change; the gain is memory with a large kernel heap.
    """
    if start_method != "fork":
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@contextlib.contextmanager
def main_module_hidden(start_method: str) -> Iterator[None]:
    """While starting spawn/forkserver workers, keep multiprocessing from re-running `__main__` in them.

    The payload is cloudpickled by value, so workers never need the kernel's `__main__` (a notebook's is
    ipykernel's launcher; a script's would re-run its top level without an `if __name__` guard).
    """
    main = sys.modules.get("__main__")
    if start_method == "fork" or main is None:
        yield
        return
    saved = {key: main.__dict__[key] for key in ("__file__", "__spec__") if key in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


@contextlib.contextmanager
def resource_tracker_scope() -> Iterator[None]:
    """Stop multiprocessing's helper processes afterwards if this launch started them: the resource
    tracker (spawn and forkserver start it) and the fork server.

    Otherwise every such launch would leave a helper process behind for the life of the kernel.
    """
    from multiprocessing import forkserver, resource_tracker

    helpers = [(getattr(resource_tracker, "_resource_tracker", None), "_pid"),
               (getattr(forkserver, "_forkserver", None), "_forkserver_pid")]
    running = [getattr(helper, attr, None) is not None for helper, attr in helpers]
    try:
        yield
    finally:
        started = [helper for (helper, attr), was_running in zip(reversed(helpers), reversed(running))
                   if helper is not None and not was_running and getattr(helper, attr, None) is not None]
        if started:
            # The tracker unlinks, as leaked, every semaphore still registered when it stops: collect what the
            # launch left unreferenced first (torch elastic's spawn-context queues and event), or their
            # finalizers fail later on names already gone ("Exception ignored ... sem_unlink ..."). Interrupted
            # (the session closes while a KeyboardInterrupt propagates), only the young generations (the
            # launch's own objects): a full collection of a kernel's heap took seconds on a busy machine.
            gc.collect(1 if isinstance(sys.exc_info()[1], KeyboardInterrupt) else 2)
        for helper in started:
            try:
                helper._stop()
            except Exception:
                pass
