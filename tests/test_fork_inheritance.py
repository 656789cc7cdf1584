"""What forked ranks take from the kernel, and what they must not.

- Not a hang: GNU OpenMP keeps its thread pool in the thread that ran a parallel region, and a child forked
  from that thread waits forever for pool threads the fork did not copy. Each rank applies its own
  OMP_NUM_THREADS (torch reads the variable only when it starts, so a forked rank kept the kernel's count),
  and ranks are forked from a kernel thread that never ran an op (launch/kernel/fork_thread.py). The
  quickstart notebook hung here (`./run.sh demo`); raw torch and Accelerate's fork launchers still do.
- The kernel thread's torch settings (grad mode, default device), as Accelerate's fork launcher gives them.
- The modules a training imports, imported in the kernel instead of in every rank of every launch:
  nbaccel.accelerator always; torch._dynamo (which every optimizer imports when the first is built: ~2 s of
  CPU per process here) once a launch's ranks imported it, so a launch without an optimizer never pays it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(150)

KERNEL = textwrap.dedent("""
    import os
    import sys
    import torch
    torch.set_num_threads(2)
    (torch.randn(1000, 1000) / 16.0).sum()  # a multi-threaded op: the kernel's OpenMP pool starts

    def rank_work():
        inherited = "nbaccel.accelerator" in sys.modules
        y = torch.randn(1000, 1000)
        return [torch.get_num_threads(), bool((y / 16.0).sum() != 0), inherited]

    def train():  # reports whether the rank started with torch._dynamo, which building an optimizer imports
        inherited = "torch._dynamo" in sys.modules
        torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
        return inherited

    def thread_settings():  # written out: Accelerate's debug_launcher returns nothing
        os.write(1, f"settings {torch.is_grad_enabled()} {torch.empty(1).device}\\n".encode())
        # Accelerate's launcher builds the group with a bare init_process_group: a rank that returned at once
        # could close its sockets while its peer still connects ("connectFullMesh ... closed by peer")
        if torch.distributed.is_initialized():
            torch.distributed.barrier()

    import accelerate
    from nbaccel import notebook_launcher
    from nbaccel.launch.pool import RankPool

    def launch(function):
        return notebook_launcher(function, num_processes=2, dashboard=False)

    print("launch", launch(rank_work), flush=True)
    with RankPool(2) as pool:
        print("pool", pool.run(rank_work), flush=True)
    print("dynamo in the kernel", "torch._dynamo" in sys.modules, flush=True)  # no launch built an optimizer
    print("trainings", [launch(train), launch(train), launch(train)], flush=True)
    torch.set_default_device("meta")
    with torch.no_grad():  # per-thread settings of the kernel, inherited by ranks forked from its thread
        launch(thread_settings)
        accelerate.debug_launcher(thread_settings)
""")



def test_forked_ranks_run_multi_threaded_ops_keep_the_thread_settings_and_inherit_the_training_modules(tmp_path):
    script = tmp_path / "kernel.py"
    script.write_text(KERNEL)
    # each rank asks for 3 threads: neither the kernel's 2 nor 1 (with 1, torch never enters an OpenMP region)
    env = dict(os.environ, OMP_NUM_THREADS="3")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("launch", "pool"))]
    assert lines == ["launch [[3, True, True], [3, True, True]]", "pool [[3, True, True], [3, True, True]]"], proc.stdout
    # the kernel imports torch._dynamo only once a launch's ranks did, and the launches after that inherit it
    assert "dynamo in the kernel False" in proc.stdout, proc.stdout
    assert "trainings [[False, False], [True, True], [True, True]]" in proc.stdout, proc.stdout
    nbaccel = sorted(line.split("] ", 1)[1] for line in proc.stdout.splitlines() if line.startswith("[rank"))
    reference = [line for line in proc.stdout.splitlines() if line.startswith("settings")]
    assert nbaccel == reference == ["settings False meta"] * 2, proc.stdout


def test_an_interrupt_while_the_fork_thread_starts_the_ranks_waits_for_it_then_stops_the_launch():
    """A launch's ranks are forked in one hand-off to the fork thread: interrupted while it forks, the caller
    waits for it to finish (so it knows every rank it started, to stop them), then the interrupt ends the call."""
    import signal
    import threading
    import time

    from nbaccel.launch.kernel.fork_thread import run_forks

    finished: list[bool] = []

    def forks() -> None:  # stands for the forks of a launch's ranks
        time.sleep(0.5)
        finished.append(True)

    main = threading.main_thread().ident
    threading.Timer(0.1, signal.pthread_kill, (main, signal.SIGINT)).start()
    with pytest.raises(KeyboardInterrupt):
        run_forks(forks)
    assert finished == [True]
