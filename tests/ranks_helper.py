"""Run a test function on N local processes (gloo) without nbaccel's launcher.

The foundation's own tests use this so they do not depend on the code they test. Each rank gets the torch
launcher environment (RANK, WORLD_SIZE, ...); with `init=True` the process group is initialized here,
otherwise `PartialState()` in the function does it. Results come back per rank; any failure is re-raised
with the remote traceback, and no process outlives the call.
"""

from __future__ import annotations

import faulthandler
import gc
import multiprocessing as mp
import os
import signal
import time
import traceback
from collections.abc import Callable
from typing import Any

import cloudpickle

from nbaccel.utils.other import get_free_port


def free_port() -> int:
    return get_free_port("127.0.0.1")  # below the ephemeral range: see get_free_port


def _entry(payload: bytes, rank: int, world_size: int, port: int, init: bool, extra_env: dict, conn) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
        GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **extra_env,
    )
    gc.freeze()  # the test process's heap, as a launch's ranks have it (a collection would finalize its garbage)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a rank that gives no result: its stacks (below)
    try:
        fn = cloudpickle.loads(payload)
        if init:
            import torch.distributed as dist

            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank)
        conn.send(("ok", cloudpickle.dumps(result)))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass
        conn.close()


def _dump_stacks(procs: list[Any]) -> None:
    """Have every live rank write its threads' stacks to stderr (faulthandler, registered in `_entry`)."""
    for proc in procs:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGUSR1)
    time.sleep(1.0)


def run_ranks(
    fn: Callable[[int], Any],
    world_size: int = 2,
    *,
    init: bool = False,
    timeout: float = 60.0,
    env: dict[str, str] | None = None,
    start_method: str = "fork",
) -> list[Any]:
    """Call `fn(rank)` on `world_size` processes and return their results indexed by rank."""
    ctx = mp.get_context(start_method)
    port = free_port()
    payload = cloudpickle.dumps(fn)
    pipes, procs = [], []
    for rank in range(world_size):
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_entry, args=(payload, rank, world_size, port, init, env or {}, child))
        proc.start()
        child.close()
        pipes.append(parent)
        procs.append(proc)
    results: list[Any] = [None] * world_size
    errors = []
    try:
        for rank, conn in enumerate(pipes):
            if not conn.poll(timeout):
                errors.append(f"rank {rank}: no result within {timeout} s (every rank's stacks: the captured stderr)")
                _dump_stacks(procs)
                break
            status, body = conn.recv()
            if status == "ok":
                results[rank] = cloudpickle.loads(body)
            else:
                errors.append(f"rank {rank}:\n{body}")
    except EOFError:
        errors.append(f"rank {rank} died without reporting (exit code {procs[rank].exitcode})")
    finally:
        for proc in procs:
            proc.join(timeout=5 if not errors else 0.5)
            if proc.is_alive():
                proc.kill()
                proc.join()
    if errors:
        raise RuntimeError("distributed test failed on " + "\n".join(errors))
    return results
