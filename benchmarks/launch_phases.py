"""Where one `notebook_launcher` of 2 ranks spends its time, kernel side and rank side apart (issue 42).

The launch is benchmarks/launch.py's (PartialState, one all_reduce, the result back, dashboard "auto" with its
output captured). Each step of the launching process and of a rank is wrapped in a timer (time.perf_counter,
CLOCK_MONOTONIC: one clock for the kernel and its forked ranks); a rank writes its stamps to a file before it
exits. Reported per step: the median over the launches of its duration and of when it starts, in ms after the
call (kernel) or after the fork (rank), and the same for a raw fork floor (launch.py's) for comparison.
Run: python benchmarks/launch_phases.py [launches]   (a profile of the kernel side: add --cprofile; the launch
without its dashboard, to tell its cost apart: --no-dashboard; the floor's ranks meeting in nbaccel's private
rendezvous store instead of torch's env:// one, to tell the launch's own cost from the rendezvous's: --quick-floor)
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import io
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from nbaccel import notebook_launcher  # noqa: E402

QUICK_FLOOR = "--quick-floor" in sys.argv
STAMPS: list[tuple[str, float, float]] = []  # (step, start, end) in this process
FORKED = [0.0]  # in a forked child: when its at-fork hook ran (the fork's end, child side)
os.register_at_fork(after_in_child=lambda: FORKED.__setitem__(0, time.perf_counter()))
RANK_FILES = tempfile.mkdtemp(prefix="launch-phases-")


def timed(module_name: str, attr: str, label: str | None = None) -> None:
    """Wrap `module.attr` (a function or a method `Class.method`) so each call records its span."""
    module = importlib.import_module(module_name)
    owner, _, name = attr.rpartition(".")
    target = functools.reduce(getattr, owner.split("."), module) if owner else module
    original = getattr(target, name)
    label = label or f"{module_name.rsplit('.', 1)[-1]}.{attr}"

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            STAMPS.append((label, start, time.perf_counter()))

    setattr(target, name, wrapper)


KERNEL_STEPS = [
    ("nbaccel.launch.kernel.launcher", "build_plan", "plan"),
    ("nbaccel.launch.kernel.launcher", "make_payload", "payload"),
    ("nbaccel.launch.kernel.launcher", "select_backend", "select backend"),
    ("nbaccel.launch.kernel.launch_session", "LaunchSession.open", "session.open"),
    ("nbaccel.launch.kernel.launch_session", "preload_worker_modules", "  preload"),
    ("nbaccel.launch.kernel.launch_session", "resource_tracker_scope", "  tracker scope"),
    ("nbaccel.launch.kernel.launch_session", "make_store_dir", "  store dir"),
    ("nbaccel.launch.kernel.launch_session", "make_result_dir", "  result dir"),
    ("nbaccel.launch.kernel.launch_session", "RankGroups", "  rank groups + keeper"),
    ("nbaccel.launch.kernel.launch_session", "LaunchSession.start", "session.start (forks)"),
    ("nbaccel.launch.kernel.local", "start_process", "  one fork"),
    ("nbaccel.launch.kernel.pipes", "Pipes.add", "  pipes of a rank"),
    ("multiprocessing.process", "BaseProcess.start", "  Process.start"),
    ("nbaccel.launch.kernel.rank_groups", "RankGroups._start_keeper", "  keeper start"),
    ("nbaccel.launch.kernel.launcher", "make_dashboard", "dashboard made"),
    ("nbaccel.launch.kernel.observers", "DashboardHandle.start", "dashboard start"),
    ("nbaccel.notebook.dashboard", "Dashboard._create_view", "  its view"),
    ("nbaccel.launch.kernel.supervisor", "Supervisor.__init__", "supervisor init"),
    ("nbaccel.launch.kernel.supervisor", "Supervisor.run", "supervisor.run"),
    ("nbaccel.launch.kernel.supervisor", "Supervisor._drain", "  drain"),
    ("nbaccel.launch.kernel.supervisor", "Supervisor._close", "  supervisor close"),
    ("nbaccel.launch.kernel.observers", "DashboardHandle.close", "dashboard close"),
    ("nbaccel.launch.kernel.launch_session", "LaunchSession.close", "session.close"),
    ("nbaccel.launch.kernel.rank_groups", "RankGroups.close", "  rank groups close"),
    ("nbaccel.launch.kernel.local", "LocalBackend.close", "  backend close"),
    ("nbaccel.launch.kernel.launch_session", "remove_dir", "  remove store dir"),
    ("nbaccel.launch.kernel.launch_session", "remove_result_dir", "  remove result dir"),
]

RANK_STEPS = [
    ("nbaccel.launch.worker.entry", "die_with_parent", "parent-death watch"),
    ("nbaccel.launch.worker.entry", "lead_own_group", "own group + register"),
    ("nbaccel.launch.worker.entry", "redirect_std_fds", "redirect stdout/err"),
    ("nbaccel.launch.worker.entry", "apply_cpu_threads", "cpu threads"),
    ("nbaccel.launch.worker.entry", "WorkerSink", "sink"),
    ("nbaccel.launch.worker.rank_display", "install", "rank_display.install"),
    ("nbaccel.launch.worker.rank_prompts", "install", "rank_prompts.install"),
    ("nbaccel.launch.worker.entry", "execute", "execute"),
    ("nbaccel.launch.worker.entry", "start_memory_reports", "  memory reports"),
    ("nbaccel.launch.worker.entry", "watch_raw_collectives", "  raw collective watch"),
    ("nbaccel.launch.worker.rank_display", "finish", "  rank_display.finish"),
    ("nbaccel.launch.shared_tensors", "dumps_value", "  result pickled"),
    ("nbaccel.launch.worker.entry", "flush_std", "  flush_std"),
    ("nbaccel.launch.worker.entry", "_stop_telemetry_sampler", "  telemetry sampler stop"),
    ("nbaccel.launch.channel", "WorkerSink.__call__", "  sink writes"),
    ("nbaccel.telemetry", "detach", "  telemetry.detach"),
    ("nbaccel.launch.channel", "WorkerSink.close", "sink.close"),
]


def instrument_events() -> None:
    """Stamp (as zero-length steps) when the kernel gets each rank's result and sees each rank's exit."""
    supervisor = importlib.import_module("nbaccel.launch.kernel.supervisor")
    local = importlib.import_module("nbaccel.launch.kernel.local")
    handle, poll_exits = supervisor.Supervisor._handle, local.LocalBackend.poll_exits

    def _handle(self, worker, message):
        if message.get("kind") == "result":
            now = time.perf_counter()
            STAMPS.append((f"result of rank {worker.rank} read", now, now))
        return handle(self, worker, message)

    def poll(self):
        exits = poll_exits(self)
        now = time.perf_counter()
        for local_rank, _ in exits:
            STAMPS.append((f"exit of rank {local_rank} seen", now, now))
        return exits

    supervisor.Supervisor._handle = _handle
    local.LocalBackend.poll_exits = poll


def rank_side(function):
    """The user's function, with stamps of its own parts; the rank's stamps go to a file at its end."""

    @functools.wraps(function)
    def run(*args, **kwargs):
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            STAMPS.append(("user function", start, time.perf_counter()))
    return run


def nbaccel_worker() -> float:
    from nbaccel import PartialState

    start = time.perf_counter()
    PartialState()
    STAMPS.append(("  PartialState()", start, time.perf_counter()))
    start = time.perf_counter()
    value = torch.ones(1)
    dist.all_reduce(value)
    STAMPS.append(("  all_reduce", start, time.perf_counter()))
    return value.item()


def save_at_exit(folder: str, stamps: list) -> None:
    """In a forked rank: write `stamps` to a file when multiprocessing ends the process (os._exit), with the
    moment of that call (the rest of the exit is the OS's: the kernel sees it as the rank's sentinel)."""
    real_exit = os._exit

    def _exit(code: int) -> None:
        now = time.perf_counter()
        stamps.append(("os._exit called", now, now))
        with open(os.path.join(folder, f"{os.getpid()}.json"), "w") as file:
            json.dump(stamps, file)
        real_exit(code)

    os._exit = _exit


def instrument_rank_entry() -> None:
    """Wrap run_worker (as local.py calls it) to stamp the rank's start and save its stamps at its end."""
    local = importlib.import_module("nbaccel.launch.kernel.local")
    original = local.run_worker

    def run_worker(*args, **kwargs):
        forked = time.perf_counter()
        STAMPS.clear()  # the kernel's, inherited
        STAMPS.append(("forked (child's at-fork hook)", FORKED[0], FORKED[0]))
        STAMPS.append(("rank entry", forked, forked))
        save_at_exit(RANK_FILES, STAMPS)
        try:
            return original(*args, **kwargs)
        finally:
            STAMPS.append(("run_worker returned", time.perf_counter(), time.perf_counter()))

    local.run_worker = run_worker


def floor_worker(rank: int, port: int, folder: str) -> None:
    stamps = [("forked (child's at-fork hook)", FORKED[0], FORKED[0]),
              ("rank entry", time.perf_counter(), time.perf_counter())]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    start = time.perf_counter()
    if QUICK_FLOOR:  # the same rendezvous as nbaccel's ranks: the launch's own cost, the rendezvous's gain aside
        from nbaccel.utils.file_rendezvous import QuickFileStore

        store = QuickFileStore(os.path.join(folder, "store"), 2)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    else:
        dist.init_process_group("gloo", rank=rank, world_size=2)
    stamps.append(("init_process_group", start, time.perf_counter()))
    start = time.perf_counter()
    value = torch.ones(1)
    dist.all_reduce(value)
    stamps.append(("all_reduce", start, time.perf_counter()))
    save_at_exit(folder, stamps)


def run_floor() -> tuple[float, list, list]:
    import torch.multiprocessing as torch_mp

    from nbaccel.utils.other import get_free_port

    folder = tempfile.mkdtemp(prefix="launch-phases-floor-")
    port = get_free_port("127.0.0.1")  # below the ephemeral range, as the launch's own port
    start = time.perf_counter()
    context = torch_mp.start_processes(floor_worker, args=(port, folder), nprocs=2, start_method="fork", join=False)
    joined = []
    while not context.join():
        joined.append(time.perf_counter())  # a rank's exit seen (join returns False while others run)
    end = time.perf_counter()
    ranks = []
    for name in os.listdir(folder):
        if name.endswith(".json"):
            with open(os.path.join(folder, name)) as file:
                ranks.append(json.load(file))
        os.remove(os.path.join(folder, name))
    os.rmdir(folder)
    return start, [*(("an exit seen", t, t) for t in joined[:1]), ("whole call", start, end)], ranks


def run_nbaccel(profile: bool) -> tuple[float, list, list]:
    STAMPS.clear()
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        if profile:
            import cProfile

            profiler = cProfile.Profile()
            profiler.enable()
        results = notebook_launcher(rank_side(nbaccel_worker), num_processes=2,
                                    **({"dashboard": False} if "--no-dashboard" in sys.argv else {}))
        if profile:
            profiler.disable()
    end = time.perf_counter()
    assert results == [2.0, 2.0], results
    kernel = list(STAMPS) + [("whole call", start, end)]
    ranks = []
    for name in os.listdir(RANK_FILES):
        with open(os.path.join(RANK_FILES, name)) as file:
            ranks.append(json.load(file))
        os.remove(os.path.join(RANK_FILES, name))
    if profile:
        import pstats

        pstats.Stats(profiler, stream=sys.stdout).sort_stats(os.environ.get("PHASES_SORT", "cumulative")).print_stats(45)
    return start, kernel, ranks


def report(title: str, runs: list[tuple[float, list, list]]) -> None:
    """Median duration and median start (ms after the call / after the rank's fork) of each step."""
    print(f"\n{title}: median over {len(runs)} launches (ms)")
    for side in ("kernel", "rank"):
        spans: dict[str, list[float]] = defaultdict(list)
        starts: dict[str, list[float]] = defaultdict(list)
        order: list[str] = []
        for call_start, kernel, ranks in runs:
            ranks = sorted(ranks, key=lambda stamps: stamps[0][1])  # by fork time: "rank entry" comes first
            groups = [(call_start, kernel)] if side == "kernel" else \
                [(call_start, [(f"{label} [{i}]", a, b) for label, a, b in stamps]) for i, stamps in enumerate(ranks)]
            for origin, stamps in groups:
                seen: dict[str, float] = defaultdict(float)
                first: dict[str, float] = {}
                for label, start, end in stamps:
                    seen[label] += end - start
                    first.setdefault(label, start - origin)
                    if label not in order:
                        order.append(label)
                for label in seen:
                    spans[label].append(seen[label] * 1000)
                    starts[label].append(first[label] * 1000)
        print(f"  {side} side{'' if side == 'kernel' else ' ([0]: the first forked, [1]: the second)'}: step, time in it (sum of calls), "
              "starts at (after the call)")
        if side == "rank":
            order.sort(key=lambda label: label[-3:])  # the first rank's steps, then the second's
        for label in order:
            print(f"    {label:<28} {statistics.median(spans[label]):8.2f}   at {statistics.median(starts[label]):8.2f}")


def main() -> None:
    launches = int(next((a for a in sys.argv[1:] if a.isdigit()), "15"))
    profile = "--cprofile" in sys.argv
    for module_name, attr, label in KERNEL_STEPS + RANK_STEPS:
        timed(module_name, attr, label)
    instrument_rank_entry()
    instrument_events()
    run_nbaccel(False)
    run_floor()  # warm-up
    floor_runs, nbaccel_runs = [], []
    for i in range(launches):
        floor_runs.append(run_floor())
        nbaccel_runs.append(run_nbaccel(profile and i == launches - 1))
    report("floor (raw fork + init_process_group" + (" over QuickFileStore" if QUICK_FLOOR else "") + " + all_reduce)",
           floor_runs)
    report("nbaccel notebook_launcher", nbaccel_runs)
    os.rmdir(RANK_FILES)


if __name__ == "__main__":
    main()
