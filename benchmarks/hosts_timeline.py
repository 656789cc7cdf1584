"""Where the time of a launch on 2 hosts x 2 ranks over SSH goes: wall-clock stamps on both sides of the
SSH sessions, one file, the median of each step over the rounds.

The same launch as benchmarks/hosts.py (`notebook_launcher(f, num_processes=2, hosts=[a, b])`, the private
sshd of tests/ssh_server.py on 127.0.0.1, both hosts this machine, so one clock). The kernel side is stamped by
wrapping the SSH backend's steps in this process; the agent side by starting each agent through a wrapper
(NBACCEL_SSH_PYTHON): a shell script that stamps the moment sshd ran the login's command, then this file in
`--agent` mode, which stamps Python's start, wraps the agent's steps and runs the agent as `-m` would. The
ranks stamp their own steps (fork, the process group, return). Nothing of nbaccel is changed for this.

With --floor, every round also runs the floor (benchmarks/hosts.py run_floor: per host one `ssh HOST python
-c ...` that imports torch and forks 2 ranks that join the group and print their ranks), stamped the same way
(a prologue wraps os.fork, os.write, os.waitpid and os._exit; the program itself is unchanged), and the
milestones of both are printed side by side: what nbaccel spends that the least code does not.

    python benchmarks/hosts_timeline.py [rounds]                  # prints the median timeline
    python benchmarks/hosts_timeline.py [rounds] --ssh --floor    # + a bare `ssh HOST true` login, the floor
"""

from __future__ import annotations

import sys
import time

_T0 = time.time()  # before any import: the agent's Python is running (its startup is before this)

import os  # noqa: E402

STAMPS_ENV = "NBACCEL_BENCH_STAMPS"


def stamp(path: str, side: str, event: str) -> None:
    """One line: wall time, pid, side (kernel / agent / rank N), event."""
    with open(path, "a") as f:
        f.write(f"{time.time():.6f} {os.getpid()} {side} {event}\n")


def wrap(owner: object, name: str, path: str, side: str, label: str) -> None:
    """Stamp `label start` and `label end` around owner.name."""
    inner = getattr(owner, name)

    def wrapped(*args, **kwargs):
        stamp(path, side, f"{label}:start")
        try:
            return inner(*args, **kwargs)
        finally:
            stamp(path, side, f"{label}:end")

    setattr(owner, name, wrapped)


# ---------------------------------------------------------------------------------------------- the agent side
class TorchImportStamp:
    """A finder that stamps the moment `import torch` begins (it finds nothing: the import goes on as usual)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name == "torch":
            stamp(self.path, "agent", "torch-import:start")
            sys.meta_path.remove(self)


def agent_main(path: str) -> int:
    with open(path, "a") as f:
        f.write(f"{_T0:.6f} {os.getpid()} agent python-started\n")
    sys.meta_path.insert(0, TorchImportStamp(path))
    import atexit
    import gc
    import importlib.util

    if importlib.util.find_spec("nbaccel.launch.agent.__main__"):  # as `python -m nbaccel.launch.agent` starts
        gc.disable()  # its imports without collections (host_agent.main turns them on again)

    from nbaccel.launch.agent import host_agent

    stamp(path, "agent", "agent-module-imported")
    atexit.register(stamp, path, "agent", "atexit")
    wrap(host_agent, "hello", path, "agent", "hello")
    wrap(host_agent.Relay, "start", path, "agent", "start-ranks")
    wrap(host_agent.Relay, "serve", path, "agent", "serve")
    os.register_at_fork(after_in_child=lambda: stamp(path, "rank", "forked"))
    if hasattr(host_agent, "preload"):
        wrap(host_agent, "preload", path, "agent", "preload")
    code = host_agent.main()
    stamp(path, "agent", "main-returned")
    if hasattr(host_agent, "leave"):  # the agent's own way out, as `python -m` takes it
        host_agent.leave(code)
    return code


# ---------------------------------------------------------------------------------------------- the ranks
def rank_of(path: str) -> int:
    from nbaccel import PartialState

    stamp(path, f"rank{os.environ.get('RANK')}", "function-start")
    state = PartialState()
    stamp(path, f"rank{state.process_index}", "group-ready")
    return state.process_index


# ---------------------------------------------------------------------------------------------- the kernel side
def kernel_wraps(path: str) -> None:
    from nbaccel.launch.kernel import ssh_backend

    wrap(ssh_backend.Agent, "_open", path, "kernel", "ssh-spawn")
    wrap(ssh_backend.SshBackend, "_wait_hellos", path, "kernel", "wait-hellos")
    wrap(ssh_backend.SshBackend, "start", path, "kernel", "backend-start")
    wrap(ssh_backend.SshBackend, "stop", path, "kernel", "backend-stop")
    wrap(ssh_backend.SshBackend, "close", path, "kernel", "backend-close")
    checked = ssh_backend.check_versions

    def check_versions(host, theirs, ours):
        stamp(path, "kernel", f"hello-from-{host}")
        return checked(host, theirs, ours)

    ssh_backend.check_versions = check_versions
    exited = ssh_backend.SshBackend._rank_exited

    def rank_exited(self, agent, i, code):
        stamp(path, "kernel", f"exit-of-{agent.host}-rank{i}")
        return exited(self, agent, i, code)

    ssh_backend.SshBackend._rank_exited = rank_exited


def one_launch(path: str, names: list[str]) -> float:
    from nbaccel import notebook_launcher

    stamp(path, "kernel", "call:start")
    start = time.perf_counter()
    result = notebook_launcher(rank_of, (path,), num_processes=2, hosts=names, dashboard=False)
    took = time.perf_counter() - start
    stamp(path, "kernel", "call:end")
    assert sorted(result) == [0, 1, 2, 3], result
    return took


def timeline(lines: list[str]) -> dict[str, float]:
    """event -> seconds since the call's start, for one launch. Agent events carry the host (by the order of
    their first stamp: the first agent to run is called a0), rank events their rank."""
    rows = [line.split(" ", 3) for line in lines if line.strip()]
    start = next(float(t) for t, _, side, event in rows if side == "kernel" and event == "call:start")
    agents: dict[str, str] = {}
    forks: dict[str, str] = {}
    out: dict[str, float] = {}
    for t, pid, side, event in rows:
        if side in ("agent", "login"):
            side = agents.setdefault(pid, f"a{len(agents)}")
        elif side == "rank":
            side = forks.setdefault(pid, f"fork{len(forks)}")  # stamped before the rank knows its number
        key = f"{side} {event}"
        out.setdefault(key, float(t) - start)  # first occurrence
    return out


# ---------------------------------------------------------------------------------------------- the floor
FLOOR_PROLOGUE = """
import os as _os, sys as _sys, time as _time
_T0 = _time.time()
_PATH = {path!r}

def _stamp(side, event, when=None):
    with open(_PATH, "a") as f:
        f.write(f"{{when or _time.time():.6f}} {{_os.getpid()}} {{side}} {{event}}\\n")

_stamp("agent", "python-started", _T0)
_fork, _write, _waitpid, _exit = _os.fork, _os.write, _os.waitpid, _os._exit

def _forked():
    if "torch" in _sys.modules:
        _stamp("agent", "torch-imported")  # the first fork comes right after the program's imports
    pid = _fork()
    if pid == 0:
        _stamp("rank", "forked")
    return pid

def _written(fd, data):
    _stamp("rank" + bytes(data).decode().strip(), "group-ready")  # after the barrier: every group built
    return _write(fd, data)

def _reaped(pid, options):
    result = _waitpid(pid, options)
    _stamp("agent", "rank-reaped")
    return result

def _left(code):
    _stamp("agent", "exit")
    _exit(code)

_os.fork, _os.write, _os.waitpid, _os._exit = _forked, _written, _reaped, _left
"""


def floor_launch(path: str, config: object, python: str) -> float:
    import hosts as bench_hosts

    program = FLOOR_PROLOGUE.format(path=path) + bench_hosts.FLOOR_PROGRAM
    stamp(path, "kernel", "call:start")
    start = time.perf_counter()
    result = bench_hosts.run_floor(config, python=python, program=program)
    took = time.perf_counter() - start
    stamp(path, "kernel", "call:end")
    assert sorted(result) == [0, 1, 2, 3], result
    return took


def _at(times: dict[str, float], pick: object, *patterns: str) -> float | None:
    """pick (min or max) of the events whose key matches one of the patterns (fnmatch), or None."""
    import fnmatch

    found = [value for key, value in times.items() if any(fnmatch.fnmatch(key, p) for p in patterns)]
    return pick(found) if found else None


# (what, how nbaccel's launch marks it, how the floor's does): each (min or max, patterns) over one launch's events
MILESTONES = [
    ("every ssh started (kernel)", (max, "kernel ssh-spawn:end"), None),
    ("last login's command runs", (max, "a* command-started"), (max, "a* command-started")),
    ("last Python started", (max, "a* python-started"), (max, "a* python-started")),
    ("last `import torch` begins", (max, "a* torch-import:start"), (max, "a* python-started")),
    ("last torch imported (nbaccel: + agent module)", (max, "a* agent-module-imported"),
     (max, "a* torch-imported")),
    ("kernel holds every hello (checked)", (max, "kernel wait-hellos:end"), None),
    ("last preload done", (max, "a* preload:end"), None),
    ("last rank runs its function (floor: forked)", (max, "rank* function-start"), (max, "fork* forked")),
    ("every group built", (max, "rank* group-ready"), (max, "rank* group-ready")),
    ("last rank's exit seen (nbaccel: kernel; floor: its host)", (max, "kernel exit-of-*"),
     (max, "a* rank-reaped")),
    ("the call returns", (max, "kernel call:end"), (max, "kernel call:end")),
]


def milestones(launches: list[dict[str, float]], column: int) -> list[float | None]:
    import statistics

    out = []
    for row in MILESTONES:
        spec = row[column]
        values = [_at(times, spec[0], *spec[1:]) for times in launches] if spec else []
        values = [value for value in values if value is not None]
        out.append(statistics.median(values) if values else None)
    return out


def main() -> None:
    import statistics
    import tempfile
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root / "tests"))
    sys.path.insert(0, str(root))
    import cloudpickle
    import hosts as bench_hosts
    import ssh_server

    rounds = int(next((a for a in sys.argv[1:] if a.isdigit()), "5"))
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    folder = Path(tempfile.mkdtemp(prefix="nbaccel-bench-timeline-"))
    server = ssh_server.start_server(folder)
    try:
        config = bench_hosts.bench_config(server)
        os.environ["NBACCEL_SSH_CONFIG"] = str(config)
        stamps = folder / "stamps"
        wrapper = folder / "agent-python"
        wrapper.write_text("#!/bin/sh\n"
                           f"echo \"$(date +%s.%N) $$ login command-started\" >> {stamps}\n"
                           f"exec {sys.executable} {Path(__file__).resolve()} --agent {stamps} \"$@\"\n")
        wrapper.chmod(0o755)
        os.environ["NBACCEL_SSH_PYTHON"] = str(wrapper)
        floor_python = folder / "floor-python"  # the same login stamp, then the plain Python
        floor_python.write_text("#!/bin/sh\n"
                                f"echo \"$(date +%s.%N) $$ login command-started\" >> {stamps}\n"
                                f"exec {sys.executable} \"$@\"\n")
        floor_python.chmod(0o755)
        with_floor = "--floor" in sys.argv
        kernel_wraps(str(stamps))
        names = list(bench_hosts.NAMES)
        one_launch(str(stamps), names)  # warm-up
        if with_floor:
            floor_launch(str(stamps), config, str(floor_python))
        per_event: dict[str, list[float]] = {}
        launches: list[dict[str, float]] = []
        floors: list[dict[str, float]] = []
        walls = []
        floor_walls = []
        logins = []
        for _ in range(rounds):
            stamps.write_text("")
            walls.append(one_launch(str(stamps), names))
            launches.append(timeline(stamps.read_text().splitlines()))
            for key, value in launches[-1].items():
                per_event.setdefault(key, []).append(value)
            if with_floor:
                stamps.write_text("")
                floor_walls.append(floor_launch(str(stamps), config, str(floor_python)))
                floors.append(timeline(stamps.read_text().splitlines()))
            if "--ssh" in sys.argv:
                import subprocess

                t = time.perf_counter()
                subprocess.run(["ssh", "-F", str(config), "-T", "-o", "BatchMode=yes", names[1], "true"],
                               check=True)
                logins.append(time.perf_counter() - t)
        print(f"2 hosts x 2 ranks over SSH, stamps on both sides, {rounds} rounds, load average "
              f"{os.getloadavg()[0]:.1f}; launch wall time median {statistics.median(walls):.3f} s")
        if logins:
            print(f"  a bare `ssh HOST true` login: median {statistics.median(logins):.3f} s")
        if with_floor:
            print(f"  the floor's wall time median {statistics.median(floor_walls):.3f} s; milestones, medians of "
                  "seconds since the call (nbaccel | floor):")
            for (what, *_), ours, least in zip(MILESTONES, milestones(launches, 1), milestones(floors, 2)):
                cells = [f"{v:7.3f}" if v is not None else "      -" for v in (ours, least)]
                print(f"  {cells[0]} | {cells[1]}  {what}")
            print("  nbaccel's events:")
        for key, values in sorted(per_event.items(), key=lambda kv: statistics.median(kv[1])):
            if len(values) == rounds:
                print(f"  {statistics.median(values):7.3f} s  {key}")
    finally:
        server.stop()
        import shutil  # here: this module is also the agents' wrapper, whose imports are timed

        shutil.rmtree(folder, ignore_errors=True)  # its keys, configs and stamps


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--agent":
        sys.exit(agent_main(sys.argv[2]))
    main()
