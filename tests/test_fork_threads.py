"""A rank forked after the kernel ran a multi-threaded torch op must not hang in its own first op.

libgomp cannot run a parallel region in a child forked after the parent ran one: it waits forever for the
parent's pool threads. torch reads OMP_NUM_THREADS only when it starts, so a forked rank kept the kernel's
thread count (2 here) and hung; the quickstart notebook did exactly this (`./run.sh demo`)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(120)

KERNEL = textwrap.dedent("""
    import torch
    torch.set_num_threads(2)
    (torch.randn(1000, 1000) / 16.0).sum()  # a multi-threaded op: the kernel's OpenMP pool starts

    def rank_work():
        y = torch.randn(1000, 1000)
        return [torch.get_num_threads(), bool((y / 16.0).sum() != 0)]

    from nbaccel import notebook_launcher
    from nbaccel.launch.pool import RankPool

    print("launch", notebook_launcher(rank_work, num_processes=2, dashboard=False), flush=True)
    with RankPool(2) as pool:
        print("pool", pool.run(rank_work), flush=True)
""")


def test_forked_ranks_use_their_thread_count_and_do_not_hang_after_the_kernels_openmp(tmp_path):
    script = tmp_path / "kernel.py"
    script.write_text(KERNEL)
    env = dict(os.environ, OMP_NUM_THREADS="1")  # what each rank asks for (the plan's default on 2 cores)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=100, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("launch", "pool"))]
    assert lines == ["launch [[1, True], [1, True]]", "pool [[1, True], [1, True]]"], proc.stdout
