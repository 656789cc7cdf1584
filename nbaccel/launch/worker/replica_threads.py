"""Several ranks in one process, one thread each: how torch_xla runs the devices of TPU v2/v3 and its CPU device.

Each rank still gets its own channel and its own stdout/stderr pipes, so the kernel sees the same messages
and `[rank N]` lines as from one process per rank. What a process shares is set up once, by whichever of
its threads comes first: the launcher environment (without RANK/LOCAL_RANK/NBACCEL_LAUNCH_DEVICE, which
differ per thread; the state reads ranks from torch_xla), fds 1/2 pointed at the pipes of its first rank, and `sys.stdout` /
`sys.stderr` routing each rank thread's writes to its own pipes (output.ThreadRoutedStream). Telemetry is
attached per thread.
"""

from __future__ import annotations

import os
import sys
import threading
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from ..channel import WorkerSink, close_quietly
from ..output import ThreadRoutedStream, flush_std, redirect_std_fds, text_stream
from .entry import DEVICE_ENV, execute

if TYPE_CHECKING:
    from ..serialize import Payload

THREAD_ENV_KEYS = ("RANK", "LOCAL_RANK", DEVICE_ENV)  # per rank: not written to the process environment

_setup_lock = threading.Lock()
_set_up_for: int | None = None  # the pid whose process-wide setup is done (a fork child redoes it)


def run_worker_thread(payload: Payload, local: int, own: range, channels: list[Connection],
                      stdouts: list[Connection], stderrs: list[Connection], env: dict[str, str]) -> None:
    """Run rank `local` (one of the local ordinals `own` of this process) in the calling thread."""
    _set_up_process(own, channels, stdouts, stderrs, env)
    pairs = ((sys.stdout, text_stream(stdouts[local].fileno())), (sys.stderr, text_stream(stderrs[local].fileno())))
    routes = [(routed, stream) for routed, stream in pairs if isinstance(routed, ThreadRoutedStream)]
    for routed, stream in routes:
        routed.bind(stream)
    sink = WorkerSink(channels[local], int(env.get("RANK", local)), local)
    try:
        execute(payload, sink, thread_rank=True, device=env.get(DEVICE_ENV))
    finally:
        flush_std()
        for routed, _ in routes:
            routed.bind(None)
        sink.close()
        close_quietly(stdouts[local], stderrs[local])  # the first rank's pipes stay open as fds 1/2


def _set_up_process(own: range, channels: list[Connection], stdouts: list[Connection],
                    stderrs: list[Connection], env: dict[str, str]) -> None:
    global _set_up_for
    with _setup_lock:
        if _set_up_for == os.getpid():
            return
        os.environ.update({key: value for key, value in env.items() if key not in THREAD_ENV_KEYS})
        for i in range(len(channels)):
            if i not in own:  # another process's ranks: let their pipes end when that process is done
                close_quietly(channels[i], stdouts[i], stderrs[i])
        redirect_std_fds(stdouts[own.start].fileno(), stderrs[own.start].fileno())
        sys.stdout = ThreadRoutedStream(sys.stdout)
        sys.stderr = ThreadRoutedStream(sys.stderr)
        _set_up_for = os.getpid()
