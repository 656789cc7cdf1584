"""Benchmark: what the collective trace costs a worker per collective (no communication, just the trace).

    python benchmarks/collective_trace.py [--calls 5000] [--reps 5]

Times `collective_trace.in_collective` around an empty body, three ways, interleaved in each repetition:
no listener (a script without a launcher), an empty listener that asks for no record (RankPool's ranks: the
call site is looked up), and a launcher's telemetry sink on a pipe read by another process (a
notebook_launcher worker: each collective queues an `enter` and an `exit` tuple, made into messages and sent
in batches by the sink's thread; that work counts, since the CPU time of the whole process is measured).
Median CPU microseconds per collective. A warm loop: inside a training loop each step costs several times
more (benchmarks/telemetry_path.py).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from nbaccel import telemetry  # noqa: E402
from nbaccel.launch.channel import WorkerSink  # noqa: E402
from nbaccel.utils import collective_trace  # noqa: E402


def _read(conn, other) -> None:
    """The kernel's side: read everything until the worker end closes."""
    other.close()
    try:
        while True:
            conn.recv()
    except (EOFError, OSError):
        pass


def _per_call(calls: int) -> float:
    tensors = [torch.ones(1024)]
    start = time.process_time()
    for _ in range(calls):
        with collective_trace.in_collective("gather", "all_gather_into_tensor", tensors):
            pass
    return (time.process_time() - start) / calls * 1e6


def _ignore(event: str, record: collective_trace.CollectiveRecord) -> None:
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    ctx = mp.get_context("fork")
    kernel_end, worker_end = ctx.Pipe(duplex=False)
    reader = ctx.Process(target=_read, args=(kernel_end, worker_end))
    reader.start()
    kernel_end.close()
    sink = WorkerSink(worker_end, 0)
    samples: dict[str, list[float]] = {"no listener": [], "empty listener (RankPool)": [],
                                       "launcher sink (notebook_launcher)": []}
    try:
        for _ in range(args.reps):
            samples["no listener"].append(_per_call(args.calls))
            collective_trace.add_listener(_ignore, with_record=False)  # as a RankPool rank registers it
            samples["empty listener (RankPool)"].append(_per_call(args.calls))
            collective_trace.remove_listener(_ignore)
            telemetry.attach(sink, 0)
            samples["launcher sink (notebook_launcher)"].append(_per_call(args.calls))
            telemetry.detach()
    finally:
        sink.close()
        reader.join(timeout=30)
        if reader.is_alive():
            reader.kill()
    print(f"CPU per traced collective, median of {args.reps} x {args.calls} (load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")
    for name, values in samples.items():
        print(f"  {name:<36} {statistics.median(values):6.1f} us")


if __name__ == "__main__":
    main()
