"""breakpoint(), pdb and input() on a rank, answered in a real Jupyter kernel's input requests (jupyter_client),
as a user types into Jupyter's input box."""

from __future__ import annotations

import time

import pytest
from kernel_input import Execution, execute, scripted, write_kernelspec

jupyter_client = pytest.importorskip("jupyter_client")

pytestmark = [pytest.mark.kernel, pytest.mark.slow]

SETUP = """
import os, pdb, time
import torch
from nbaccel import notebook_launcher, LaunchError
"""
# rank 1 stops at breakpoint(), then both ranks ask input(); under fork timeout=8 while the user takes longer
BREAK = """
def train(base):
    rank = int(os.environ["RANK"])
    x = base + rank
    if rank == 1:
        breakpoint()
        y = x * 2
    name = input(f"name of rank {{rank}}? ")
    return (rank, name, x)
results = notebook_launcher(train, (10,), num_processes=2, dashboard=False, start_method={method!r},
                             timeout={timeout})
print("results", results)
"""
QUIT = """
def quits():
    if os.environ["RANK"] == "0":
        pdb.set_trace()
        print("not reached")
    return 1
try:
    notebook_launcher(quits, num_processes=2, dashboard=False, start_method={method!r})
except LaunchError as exc:
    print("failed:", exc.failures[0].exc_type)
"""
NO_STDIN = """
try:
    notebook_launcher(lambda: input("who? "), num_processes=2, dashboard=False, start_method={method!r})
except LaunchError as exc:
    print("failed:", str(exc).splitlines()[0])
"""
FAILS = """
def fails():
    values = {{"rank": os.environ["RANK"]}}
    return values["missing key on purpose"]
try:
    notebook_launcher(fails, num_processes=2, dashboard=False, start_method={method!r})
except LaunchError as exc:
    print(exc.failures[exc.first_rank].traceback)
"""
INTERRUPTED = """
def waits():
    breakpoint()
    return 1
notebook_launcher(waits, num_processes=2, dashboard=False, start_method={method!r})
"""
CHILDREN = """
import psutil
print("children", len([c for c in psutil.Process().children(recursive=True) if c.status() != psutil.STATUS_ZOMBIE]))
"""
DIST_BREAKPOINT = """
def dist_break():
    import torch.distributed as dist
    from nbaccel import PartialState
    state = PartialState()
    value = torch.tensor([state.process_index + 1.0])
    dist.breakpoint(rank=1)
    dist.all_reduce(value)
    return value.item()
print("dist", notebook_launcher(dist_break, num_processes=2, dashboard=False, start_method={method!r}))
"""

# getpass() on a forked rank (which inherits ipykernel's getpass) and pdb's `interact` left with the end of input
SECRET_AND_EOF = """
def secret():
    import getpass
    key = getpass.getpass("API key? ") if os.environ["RANK"] == "0" else None
    if os.environ["RANK"] == "1":
        breakpoint()
    return key
print("secret", notebook_launcher(secret, num_processes=2, dashboard=False, start_method="fork"))
"""
# rank 1 waits at pdb, nobody answers; rank 0 fails meanwhile
FAILS_AT_PDB = """
def fails_at_pdb():
    if os.environ["RANK"] == "1":
        breakpoint()
    time.sleep(1)
    raise ValueError("rank 0 broke")
try:
    notebook_launcher(fails_at_pdb, num_processes=2, dashboard=False)
except LaunchError as exc:
    print("failed:", exc.first_rank, exc.failures[exc.first_rank].exc_type)
"""


@pytest.fixture
def kernel(tmp_path, monkeypatch):
    name = write_kernelspec(tmp_path / "jupyter")
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    manager = jupyter_client.KernelManager(kernel_name=name)
    manager.start_kernel(cwd=str(tmp_path))
    client = manager.client()
    client.start_channels()
    try:
        client.wait_for_ready(timeout=60)
        assert execute(client, SETUP).error is None
        yield manager, client
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


def _ok(run: Execution) -> Execution:
    if run.error is not None:  # pytest.fail: an assert's message would be cut to a few lines without -vv
        pytest.fail(f"the cell failed: {run.error['ename']}: {run.error['evalue']}\n--- stdout\n{run.stdout}\n"
                    f"--- stderr\n{run.stderr}\n--- prompts {run.prompts}", pytrace=False)
    return run


def _check_breakpoint_cell(client, method: str) -> None:
    """pdb commands on rank 1 (values checked), input() on both, served one rank at a time, each labelled; the
    user takes longer than the launch's timeout=8 at the prompts, which the timeout does not count (fork: a
    spawned rank's start alone may take longer than that on a busy machine)."""
    pause = method == "fork"

    def answer(prompt: str, so_far: Execution) -> str:
        if prompt.startswith("[rank 1] (Pdb)"):
            pdb_prompts = sum(p.startswith("[rank 1] (Pdb)") for p in so_far.prompts)
            if pdb_prompts == 1:
                time.sleep(9)  # longer than timeout=8: the launch must not give up
            return ["p x", "l", "n", "p y", "c"][pdb_prompts - 1]
        assert prompt in ("[rank 0] name of rank 0? ", "[rank 1] name of rank 1? "), prompt
        return f"user{prompt[6]}"

    run = _ok(execute(client, BREAK.format(method=method, timeout=8 if pause else 120), answer))
    assert "results [(0, 'user0', 10), (1, 'user1', 11)]" in run.stdout, run.stdout
    assert sum(p == "[rank 1] (Pdb) " for p in run.prompts) == 5, run.prompts
    lines = run.stdout.splitlines()
    assert "[rank 1] 11" in lines and "[rank 1] 22" in lines, run.stdout  # p x, then p y after `n`
    # the cell's source, under fork and spawn alike (a spawned rank gets the cell's lines with the function)
    assert "[rank 1] -> y = x * 2" in lines, run.stdout  # where pdb stopped, under the rank
    listed = [line for line in lines if line.startswith("[rank 1]") and "x = base + rank" in line]
    assert listed and listed[0].split()[2].isdigit(), run.stdout  # `l`: the cell's numbered lines
    assert "paused while a rank is at a prompt" in run.stderr, run.stderr


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_breakpoint_and_input_on_ranks_are_answered_in_the_notebook(kernel, method):
    manager, client = kernel
    _check_breakpoint_cell(client, method)

    if method == "fork":  # (the start method plays no part in these two: the suite runs them once)
        quit_run = _ok(execute(client, QUIT.format(method=method), scripted("q")))
        assert quit_run.prompts == ["[rank 0] (Pdb) "] and "failed: BdbQuit" in quit_run.stdout, quit_run

        # a client that sends no input requests (nbclient without allow_stdin): a clear error, not a hang
        no_stdin = _ok(execute(client, NO_STDIN.format(method=method), allow_stdin=False, timeout=120))
        assert "RankInputUnavailable" in no_stdin.stdout and "does not send input requests" in no_stdin.stdout, no_stdin
        assert not no_stdin.prompts
    else:  # a spawned rank's traceback shows the cell's line, as a forked one's does
        failed = _ok(execute(client, FAILS.format(method=method), timeout=120))
        assert 'return values["missing key on purpose"]' in failed.stdout, failed.stdout

    # interrupting the kernel at a prompt ends the launch: every rank stopped, the kernel usable
    def interrupt(prompt: str, so_far: Execution) -> None:
        manager.interrupt_kernel()

    stopped = execute(client, INTERRUPTED.format(method=method), interrupt, timeout=120)
    assert stopped.error is not None and stopped.error["ename"] == "KeyboardInterrupt", stopped
    assert stopped.prompts and stopped.prompts[0].endswith("(Pdb) ")
    deadline = time.monotonic() + 10
    while "children 0" not in _ok(execute(client, CHILDREN)).stdout:
        assert time.monotonic() < deadline, "ranks left running after the interrupt"
        time.sleep(0.3)


def test_torch_distributed_breakpoint_prompts_the_chosen_rank(kernel):
    _, client = kernel
    run = _ok(execute(client, DIST_BREAKPOINT.format(method="spawn"), scripted("up", "p value", "c")))
    assert run.prompts == ["[rank 1] (Pdb) "] * 3, run.prompts
    assert "[rank 1] tensor([2.])" in run.stdout.splitlines() and "dist [3.0, 3.0]" in run.stdout, run.stdout


POOL_START = """
%load_ext nbaccel
%ranks start -n 2 --timeout 3
"""
# rank 0 waits in the all_reduce while rank 1 sits at the prompt longer than the pool's timeout=3
POOL_BREAK = """%%ranks
import torch, torch.distributed as dist
t = torch.tensor([float(dist.get_rank() + 1)])
if dist.get_rank() == 1:
    breakpoint()
dist.all_reduce(t)
print("sum", t.item())
"""
POOL_FAIL = """%%ranks
scale = 7 * (dist.get_rank() + 1)
if dist.get_rank() == 1:
    1 / (scale - 14)
"""
POOL_RUN = """
from nbaccel.notebook.magics import RankMagics
pool = get_ipython().magics_manager.registry["RankMagics"].pool
print("names", pool.run(lambda: input("who? ")))
"""


def test_ranks_cells_breakpoint_input_and_post_mortem(kernel):
    _, client = kernel
    _ok(execute(client, POOL_START))

    def answer(prompt: str, so_far: Execution) -> str:
        if len(so_far.prompts) == 1:
            time.sleep(4)  # longer than the pool's timeout=3: no hang report, the cell goes on
        return ["p t", "c"][len(so_far.prompts) - 1]

    stepped = _ok(execute(client, POOL_BREAK, answer))
    assert stepped.prompts == ["[rank 1] (Pdb) "] * 2, stepped.prompts
    assert "[rank 1] tensor([2.])" in stepped.stdout.splitlines(), stepped.stdout
    assert "[rank 1] -> dist.all_reduce(t)" in stepped.stdout.splitlines(), stepped.stdout  # the cell's source
    assert stepped.shown.count("sum 3.0") == 2 and "did not complete" not in stepped.shown + stepped.stderr, stepped

    nothing = execute(client, "%ranks debug")  # no cell failed yet
    assert nothing.error is not None and "no rank failed" in nothing.error["evalue"], nothing.error
    failed = execute(client, POOL_FAIL)
    assert failed.error is not None and "ZeroDivisionError" in str(failed.error), failed
    post = _ok(execute(client, "%ranks debug", scripted("p scale", "q")))
    assert post.prompts == ["[rank 1] (Pdb) "] * 2, post.prompts
    assert "[rank 1] 14" in post.stdout.splitlines(), post.stdout
    bad = execute(client, "%ranks debug 5")  # IPython's UsageError: one stderr line, no traceback
    assert "UsageError: rank 5 does not exist: the ranks are 0..1" in bad.stderr, bad

    names = _ok(execute(client, POOL_RUN, lambda prompt, _: prompt.split("]")[0][1:]))
    assert sorted(names.prompts) == ["[rank 0] who? ", "[rank 1] who? "] and "names ['rank 0', 'rank 1']" in names.stdout
    _ok(execute(client, "%ranks stop"))


POOL_KEPT = """%%ranks
import torch.distributed as dist
kept = 40 + dist.get_rank()
if dist.get_rank() == 1:
    breakpoint()
    print("not reached")
"""


def test_interrupting_a_ranks_cell_at_a_pdb_prompt_ends_the_cell_and_keeps_the_ranks(kernel):
    """The stop button while rank 1 waits at pdb's prompt: the cell ends with KeyboardInterrupt at once, the
    prompt is not asked again (pdb answers a KeyboardInterrupt with a new prompt: the kernel asked the user
    again, 2 of 5 times), and the ranks keep their variables (not restarted: docs/ranks.md)."""
    manager, client = kernel
    _ok(execute(client, POOL_START))
    pids = _ok(execute(client, "print(*get_ipython().magics_manager.registry['RankMagics'].pool.pids)")).stdout

    def interrupt(prompt: str, so_far: Execution) -> None:
        manager.interrupt_kernel()

    start = time.monotonic()
    stopped = execute(client, POOL_KEPT, interrupt, timeout=60)
    took = time.monotonic() - start
    assert stopped.error is not None and stopped.error["ename"] == "KeyboardInterrupt", stopped
    assert stopped.prompts == ["[rank 1] (Pdb) "], stopped.prompts
    assert "did not stop after the interrupt" not in stopped.stderr, (stopped.stderr, stopped.stdout, stopped.shown, took)
    assert took < 30, took
    kept = _ok(execute(client, "%%ranks\nkept"))
    assert "rank 0: 40" in kept.shown and "rank 1: 41" in kept.shown, kept
    assert _ok(execute(client, "print(*get_ipython().magics_manager.registry['RankMagics'].pool.pids)")).stdout == pids
    _ok(execute(client, "%ranks stop"))


POST_MORTEM_LAUNCH = """
def fails(limit):
    rank = int(os.environ["RANK"])
    total = sum(range(limit)) + rank
    if rank == 1:
        raise ValueError(f"bad total {{total}}")
    return total
try:
    notebook_launcher(fails, (5,), num_processes=2, dashboard=False, start_method={method!r}, debug=True)
except LaunchError as exc:
    print("failed:", exc.failures[1].exc_type)
"""


def test_launch_with_debug_opens_the_post_mortem_of_the_failing_rank(kernel):
    _, client = kernel
    run = _ok(execute(client, POST_MORTEM_LAUNCH.format(method="fork"), scripted("p total", "p rank", "c")))
    assert run.prompts == ["[rank 1] (Pdb) "] * 3, run.prompts
    lines = run.stdout.splitlines()
    assert "[rank 1] 11" in lines and "[rank 1] 1" in lines and "failed: ValueError" in run.stdout, run.stdout
    assert "[rank 1] [nbaccel] rank 1 failed: ValueError: bad total 11; post-mortem" in run.stdout, run.stdout
    bad = execute(client, "notebook_launcher(print, num_processes=2, debug='yes')")
    assert bad.error is not None and "debug must be True or False" in bad.error["evalue"], bad.error


def test_getpass_eof_at_interact_and_a_failure_while_a_rank_waits_at_pdb(kernel):
    """getpass() on a forked rank is asked in the notebook's password box (it inherited ipykernel's getpass,
    which wrote to the kernel's own sockets from the rank: the cell hung); the end of input ("\x04", how a
    client sends it) ends pdb's `interact` console instead of making the launch's input unavailable; a rank
    waiting at pdb while another fails has its question withdrawn, and the cell ends with the failure."""
    _, client = kernel
    steps = ["interact", "print('inside', 40 + 2)", "\x04", "c"]  # rank 1's pdb; the ranks ask in any order
    run = _ok(execute(client, SECRET_AND_EOF, lambda prompt, so_far: "s3cret" if "API key" in prompt else steps.pop(0)))
    assert "secret ['s3cret', None]" in run.stdout, run.stdout
    assert run.passwords == ["[rank 0] API key? "], run.prompts
    assert "[rank 1] inside 42" in run.stdout.splitlines(), run.stdout
    assert "end of input: rank 1 gets EOFError" in run.stderr, run.stderr

    run = _ok(execute(client, FAILS_AT_PDB, lambda prompt, so_far: None, timeout=60))
    assert "failed: 0 ValueError" in run.stdout, run.stdout
    assert run.prompts == ["[rank 1] (Pdb) "], run.prompts
    assert "the question of rank 1 was withdrawn: rank 0 failed" in run.stderr, run.stderr
    assert execute(client, CHILDREN).stdout.strip() == "children 0"
