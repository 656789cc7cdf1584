"""The pipes between the kernel and each local rank: its channel and its stdout/stderr pipes."""

from __future__ import annotations

import os
from multiprocessing.connection import Connection
from typing import Any

from ..channel import close_quietly, open_channel
from .placement_base import StartedRank


class Pipes:
    """Channel and stdout/stderr pipes of each local rank: kernel ends (read) and worker ends (write)."""

    def __init__(self, ctx: Any, count: int) -> None:
        self.channels: list[Connection] = []
        self.worker_channels: list[Connection] = []
        self.out_fds: list[int] = []
        self.err_fds: list[int] = []
        self.worker_out: list[Connection] = []
        self.worker_err: list[Connection] = []
        for _ in range(count):
            self.add(ctx)

    def add(self, ctx: Any) -> None:
        kernel_end, worker_end = open_channel(ctx, duplex=True)  # duplex: answers to a rank's prompts (pdb)
        self.channels.append(kernel_end)
        self.worker_channels.append(worker_end)
        for fds, ends in ((self.out_fds, self.worker_out), (self.err_fds, self.worker_err)):
            read_fd, write_fd = os.pipe()
            fds.append(read_fd)
            ends.append(Connection(write_fd, readable=False))

    def worker_ends(self, i: int | None = None) -> list[Any]:
        if i is None:
            return [*self.worker_channels, *self.worker_out, *self.worker_err]
        return [self.worker_channels[i], self.worker_out[i], self.worker_err[i]]

    def handles(self, first_rank: int, processes: list[Any] | None = None) -> list[StartedRank]:
        """The kernel's handle of each rank; with its `processes` (multiprocessing), by local rank, when it has
        them: their exit codes can then be read from any thread (a prompt's watch: prompt_relay.py)."""
        return [StartedRank(i, first_rank + i, self.channels[i], self.out_fds[i], self.err_fds[i],
                            process=processes[i] if processes else None)
                for i in range(len(self.channels))]

    def close_all(self) -> None:
        close_quietly(*self.channels, *self.worker_ends(), *self.out_fds, *self.err_fds)
