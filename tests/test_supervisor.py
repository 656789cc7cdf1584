"""The kernel's supervisor against a fake backend: no process starts. Pipes stand in for the workers.

Each test plays the workers' side by hand (messages through a real `WorkerSink`, output written to the
pipes, exits reported by the backend) and checks what the supervisor makes of it.
"""

from __future__ import annotations

import io
import multiprocessing
import os
import time

import pytest

from nbaccel.launch import serialize
from nbaccel.launch.channel import WorkerSink, close_quietly, open_channel
from nbaccel.launch.errors import LaunchError, LaunchTimeout
from nbaccel.launch.hang_report import Diagnosis
from nbaccel.launch.kernel.collective_watch import ExitHang
from nbaccel.launch.kernel.placement_base import StartedRank
from nbaccel.launch.kernel.supervisor import Supervisor

pytestmark = pytest.mark.timeout(60)


class FakeBackend:
    """Implements the Backend protocol; the test decides when ranks exit and with which code."""

    fail_fast = True
    workers_may_not_start = False

    def __init__(self, count: int, lost: str | None = None) -> None:
        self.count = count
        self.exits: list[tuple[int, int]] = []  # queued for the next poll_exits
        self.exited: set[int] = set()
        self.stopped = 0
        self.lost = lost
        self.done: bool | None = None  # set: like elastic/xla, which report no exits, only that they are done
        self.judged = None  # a Diagnosis or an ExitHang: the backend's watch asks for a stop

    def start(self, plan, payload):  # pragma: no cover - the tests build handles themselves
        raise NotImplementedError

    def exit(self, local_rank: int, code: int = 0) -> None:
        self.exits.append((local_rank, code))

    def wait_objects(self):
        return []

    def poll_exits(self):
        exits, self.exits = self.exits, []
        self.exited.update(rank for rank, _ in exits)
        return exits

    def finished(self):
        return self.done if self.done is not None else len(self.exited) == self.count

    def verdict(self):
        return self.judged  # what a backend's own watch decided (TorchrunBackend's collective watch)

    def stop(self):
        self.stopped += 1
        for rank in range(self.count):
            if rank not in self.exited:
                self.exit(rank, -15)

    def exit_failures(self):
        return {}

    def lost_reason(self):
        return self.lost

    def close(self):
        pass


class FakeWorker:
    """The worker ends of one rank's channel and output pipes."""

    def __init__(self, rank: int) -> None:
        self.kernel_channel, channel = open_channel(multiprocessing.get_context("fork"))
        self.sink = WorkerSink(channel, rank, rank)
        self.out_read, self.out_write = os.pipe()
        self.err_read, self.err_write = os.pipe()
        self.handle = StartedRank(rank, rank, self.kernel_channel, self.out_read, self.err_read)

    def result(self, value) -> None:
        self.sink.queue({"kind": "result", "rank": self.sink.rank, "time": time.time(),
                         "value": serialize.dumps_value(value)})
        self.sink.send("status", state="finished", device="cpu")

    def error(self, exc_type: str, message: str) -> None:
        self.sink.send("error", exc_type=exc_type, message=message, traceback=f"Traceback...\n{exc_type}: {message}")

    def print(self, text: str, stream: str = "stdout") -> None:
        os.write(self.out_write if stream == "stdout" else self.err_write, text.encode())

    def end(self) -> None:
        self.sink.close()
        close_quietly(self.out_write, self.err_write)


@pytest.fixture
def workers():
    made: list[FakeWorker] = []

    def make(count: int) -> list[FakeWorker]:
        made.extend(FakeWorker(rank) for rank in range(count))
        return made

    yield make
    for worker in made:
        close_quietly(worker.out_write, worker.err_write, worker.out_read, worker.err_read, worker.kernel_channel)


def supervisor_for(ranks, backend, **options):
    seen: list[dict] = []
    out, err = io.StringIO(), io.StringIO()
    supervisor = Supervisor([w.handle for w in ranks], backend, [seen.append], stdout=out, stderr=err, **options)
    return supervisor, seen, out, err


def test_results_come_back_by_local_rank_with_output_drained(workers):
    ranks = workers(2)
    backend = FakeBackend(2)
    for w in ranks:
        w.print(f"hello from {w.sink.rank}\nno newline at the end")
        w.print("a warning\n", "stderr")
        w.result({"rank": w.sink.rank})
        w.end()
        backend.exit(w.sink.rank, 0)
    supervisor, seen, out, err = supervisor_for(ranks, backend)
    assert supervisor.run() == [{"rank": 0}, {"rank": 1}]
    for rank in (0, 1):  # every line reaches the cell once, the unterminated last one too
        assert out.getvalue().count(f"[rank {rank}] hello from {rank}\n") == 1
        assert out.getvalue().count(f"[rank {rank}] no newline at the end\n") == 1
        assert err.getvalue().count(f"[rank {rank}] a warning\n") == 1
    lines = [(m["rank"], m["stream"], m["text"]) for m in seen if m["kind"] == "output"]
    assert sorted(lines) == sorted([(r, "stdout", f"hello from {r}") for r in (0, 1)]
                                   + [(r, "stdout", "no newline at the end") for r in (0, 1)]
                                   + [(r, "stderr", "a warning") for r in (0, 1)])
    assert [m["value"] for m in seen if m["kind"] == "result"] == [{"rank": 0}, {"rank": 1}]
    assert backend.stopped == 0


def test_the_first_failure_is_named_first_and_every_worker_is_stopped(workers):
    ranks = workers(3)
    backend = FakeBackend(3)
    ranks[2].error("ValueError", "rank two broke")  # first
    supervisor, seen, _, _ = supervisor_for(ranks, backend)
    supervisor.pump(0.5)  # rank 2's error is read...
    ranks[0].error("RuntimeError", "then rank zero")  # ...before rank 0's
    with pytest.raises(LaunchError) as info:
        supervisor.run()
    text = str(info.value)
    assert text.startswith("ranks 2, 0 failed; first: rank 2") and "rank two broke" in text
    assert "Traceback from rank 2 (remote)" in text
    assert backend.stopped == 1
    stopped = sorted(m["rank"] for m in seen if m["kind"] == "status" and m["state"] == "stopped")
    assert stopped == [1]  # rank 1 did nothing wrong: stopped, not failed


def test_a_rank_killed_by_a_signal_is_reported_with_the_signal(workers):
    ranks = workers(2)
    backend = FakeBackend(2)
    backend.exit(1, -9)
    supervisor, seen, _, _ = supervisor_for(ranks, backend)
    with pytest.raises(LaunchError, match="rank 1: killed by SIGKILL"):
        supervisor.run()
    failed = [m for m in seen if m["kind"] == "status" and m["state"] == "failed"]
    assert [(m["rank"], m["error"].split(" (")[0]) for m in failed] == [(1, "killed by SIGKILL")]


def test_interrupt_stops_every_worker_and_propagates(workers):
    ranks = workers(2)
    backend = FakeBackend(2)

    def interrupt(message):
        if message.get("kind") == "status" and message.get("state") == "running":
            raise KeyboardInterrupt

    ranks[0].sink.send("status", state="running", device="cpu")
    supervisor = Supervisor([w.handle for w in ranks], backend, [interrupt], stdout=io.StringIO(),
                            stderr=io.StringIO())
    with pytest.raises(KeyboardInterrupt):
        supervisor.run()
    assert backend.stopped == 1
    assert all(not w.channel_open and not w.open_fds for w in supervisor.workers)  # kernel ends closed


def test_timeout_names_the_ranks_still_running(workers):
    ranks = workers(2)
    backend = FakeBackend(2)
    ranks[1].sink.send("status", state="starting", device="cpu", pid=None, restart=0)
    ranks[0].result(0)
    supervisor, _, _, _ = supervisor_for(ranks, backend, timeout=0.3)
    with pytest.raises(LaunchTimeout, match=r"timeout=0.3 s; stopped every worker \(ranks still running: \[1\]\)"):
        supervisor.run()
    assert backend.stopped == 1


def test_timeout_before_any_worker_started(workers):
    ranks = workers(1)
    supervisor, _, _, _ = supervisor_for(ranks, FakeBackend(1), timeout=0.2)
    with pytest.raises(LaunchTimeout, match="no worker had started yet"):
        supervisor.run()


def test_a_rank_that_ends_without_a_result_is_lost(workers):
    ranks = workers(2)
    backend = FakeBackend(2, lost="ended without returning a result: the other launcher died")
    backend.fail_fast = False  # as elastic: failures are judged when everything finished
    ranks[0].result("ok")
    for w in ranks:
        w.end()
    backend.done = True
    supervisor, _, _, _ = supervisor_for(ranks, backend)
    with pytest.raises(LaunchError, match="rank 1: .*the other launcher died") as info:
        supervisor.run()
    assert list(info.value.failures) == [1]


def test_ranks_that_never_started_are_dropped_when_the_backend_says_they_may_not(workers):
    ranks = workers(3)  # pipes prepared for 3, the other launcher ran 2
    backend = FakeBackend(3)
    backend.workers_may_not_start = True
    for w in ranks[:2]:
        w.result(w.sink.rank)
    for w in ranks:
        w.end()
    backend.done = True
    supervisor, _, _, _ = supervisor_for(ranks, backend)
    assert supervisor.run() == [0, 1]


def test_a_deadlock_the_backend_saw_stops_every_worker_and_is_reported(workers):
    """`nbaccel launch`'s ranks report their collectives to the backend's own watch; its verdict goes the
    supervisor's way: every worker stopped, the report in the LaunchError."""
    ranks = workers(2)
    backend = FakeBackend(2)
    backend.judged = Diagnosis("mismatch", "rank 0 waits in all_reduce at job.py:3; rank 1 waits in barrier", "")
    supervisor, _, _, _ = supervisor_for(ranks, backend)
    with pytest.raises(LaunchError) as info:
        supervisor.run()
    assert str(info.value).startswith("not every rank entered the same collective:\nrank 0 waits in all_reduce")
    assert backend.stopped == 1 and supervisor.deadlock is backend.judged


def test_ranks_stuck_after_their_work_are_stopped_and_the_results_stand(workers):
    ranks = workers(2)
    backend = FakeBackend(2)
    for w in ranks:
        w.result(w.sink.rank * 10)
    backend.exit(0, 0)  # rank 1's process does not end: the backend's watch says so
    backend.judged = ExitHang((1,), 10.0)
    supervisor, _, _, err = supervisor_for(ranks, backend)
    assert supervisor.run() == [0, 10]
    assert backend.stopped == 1 and supervisor.exit_hang is backend.judged
    assert "did not exit" not in err.getvalue()  # the front door that watched names them (nbaccel launch)
