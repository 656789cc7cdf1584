"""A rank's helper threads hold nothing of the rank when it ends: its process group is destroyed with no other
reference to it, in the rank's main thread, while the interpreter is whole."""

from __future__ import annotations

import threading
import time
import weakref

from nbaccel.launch.worker import raw_calls

# a function named like a torch.distributed collective, in a file the watch takes for torch.distributed's
_COLLECTIVE = compile("def barrier(group, wait):\n    wait()\n", "/site-packages/torch/distributed/fake_c10d.py",
                      "exec")


class _Group:
    """Stands for a process group (a weak reference tells when it is freed)."""


def test_stop_returns_once_the_watch_holds_no_frame_of_the_rank(monkeypatch):
    """The raw-collective watch looks at the rank's stack; a collective's frame refers to the process group in a
    local. A look under way when the rank ended (its thread descheduled on a busy machine) kept the group alive
    past destroy_process_group, and the thread freed it later: as the interpreter finalized, gloo's destructor in
    that thread aborted the rank after its result ("terminate called without an active exception", 1 fresh-clone
    run in ~50 of test_torch_distributed_breakpoint_prompts_the_chosen_rank). Here the look is held up on
    purpose until after stop(): stop() must return only once the look let go of the rank's frames."""
    looking = threading.Event()  # the watch has seen the rank in the collective
    real = raw_calls._outermost_collective

    def slow_look(frames):  # the look that finds the collective takes long, as on a busy machine
        found = real(frames)
        if found is not None and found[0] == "torch.distributed.barrier" and not looking.is_set():
            looking.set()
            watch._stop.wait(10)  # still holding `frames` when the rank ends...
            time.sleep(0.5)  # ...and a while after
        return found

    monkeypatch.setattr(raw_calls, "_outermost_collective", slow_look)
    namespace: dict = {}
    exec(_COLLECTIVE, namespace)
    watch = raw_calls.RawCollectiveWatch(lambda **fields: None, threading.get_ident(), interval=0.01)
    group = _Group()
    freed = weakref.ref(group)
    namespace["barrier"](group, lambda: looking.wait(10))  # the rank in a collective while the watch looks
    assert looking.is_set(), "the watch never saw the rank in the collective"
    del group  # the rank's own reference is gone: the collective returned, destroy_process_group dropped it
    watch.stop()
    assert freed() is None, "stop() returned while the watch still held the rank's frames (and its group)"


def test_the_end_of_the_process_group_waits_for_its_hooks_first(monkeypatch):
    """end_process_groups (PartialState's exit hook, and a spawned rank's end) runs what `before_groups_end`
    registered before it destroys the group: an `nbaccel launch` script's watch stops looking first."""
    from nbaccel.utils import process_group_exit

    seen = []
    monkeypatch.setattr(process_group_exit, "_before_end", [])
    monkeypatch.setattr(process_group_exit, "destroy_default_group", lambda: seen.append("destroy") or [])
    process_group_exit.before_groups_end(lambda: seen.append("hook"))
    process_group_exit.before_groups_end(lambda: 1 / 0)  # a failing hook: the exit goes on
    process_group_exit.end_process_groups()
    assert seen == ["hook", "destroy"]


def test_a_launched_scripts_watch_stops_before_its_group_ends_and_at_exit(tmp_path):
    """Under `nbaccel launch` the script's raw-collective watch runs to the end of the process, through
    PartialState's exit hook that destroys the group: it is stopped before that hook destroys anything."""
    import os
    import subprocess
    import sys

    (tmp_path / "s.py").write_text(
        "from nbaccel import PartialState\n"
        "from nbaccel.utils import process_group_exit\n"
        "PartialState(cpu=True)\n"
        "print('HOOKS', [getattr(h, '__qualname__', '') for h in process_group_exit._before_end], flush=True)\n")
    done = subprocess.run([sys.executable, "-m", "nbaccel", "launch", "--cpu", "--num_processes", "2", "s.py"],
                          capture_output=True, text=True, timeout=180, cwd=tmp_path, stdin=subprocess.DEVNULL,
                          env={k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "NBACCEL_"))})
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(line for line in done.stdout.splitlines() if "HOOKS" in line) == [
        "HOOKS ['RawCollectiveWatch.stop']"] * 2, done.stdout
