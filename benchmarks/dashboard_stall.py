"""The live dashboard's longest stall: how long after a rank's step the notebook shows it, in a real kernel.

Each run starts a fresh Jupyter kernel (jupyter_client) with one checkout first on its PYTHONPATH, defines a
training function in one cell and launches it in the next, as a user does:
`notebook_launcher(train, num_processes=2, dashboard="widget")`. Each rank paces itself at `--rate` steps per
second (a little arithmetic per step), and at every step stamps `time.time()`, reports the step
(`telemetry.report_step`, what the prepared optimizer calls), logs two metrics (`telemetry.log_metrics`, what
`Accelerator.log` calls: `loss`, and `mark` = the step number, so the widget's metric table says which step it
shows) and prints a line carrying its stamp. After its last step a rank idles `--tail` seconds, so the live
view (not the end-of-run summary) shows every step.

This process receives the kernel's IOPub messages (raw frames, stamped on arrival, decoded after the run).
Per step and rank, the lag is (the first message that shows the step) - (the rank's stamp), timed by the
kernel's sending of the message (its header's date: a frontend on the machine shows it a few ms later) and,
in the `arrived` columns, by its arrival here (which on a busy machine adds this reader's own waits):

- line: the `stream` message carrying the rank's printed line (forwarded through the cell's output);
- step: the widget's per-rank table (a `comm_msg` updating its HTML widget) showing that step or a later one;
- metric: the widget's metric table of `mark` showing that step's value or a later one;
- first metric: the lag of the first logged metric (when the dashboard adds its first metric panels);
- first chart: from the first step to the first chart (a bqplot Figure widget) reaching the notebook.

Every run is a fresh kernel, so the chart libraries are imported at each run's first metric, as in a
user's first launch. Variants are checkouts (`--checkout before=DIR --checkout after=DIR`); they alternate in
each round, quiet and under a busy machine (`--busy N` processes spinning on the CPU for the busy runs).

    python benchmarks/dashboard_stall.py --checkout before=/tmp/before --checkout after=. [--rounds 2]
        [--steps 2500] [--rate 500] [--busy 2]     (no --checkout: this checkout alone)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

from jupyter_client.manager import KernelManager

ROOT = Path(__file__).resolve().parent.parent

DEFINE = textwrap.dedent('''
    import json, time
    from nbaccel import notebook_launcher

    def train(steps, rate, tail):
        import time
        from nbaccel import telemetry
        stamps, started, period, work = [], time.time(), 1.0 / rate, 0
        for step in range(1, steps + 1):
            work += sum(i * i for i in range(300))  # a little compute per step
            now = time.time()
            stamps.append(now)
            telemetry.report_step(step, steps)
            telemetry.log_metrics({"loss": 1.0 / (1.0 + 1e-3 * step), "mark": step}, step=step)
            print(f"step {step} {now:.6f}", flush=True)
            delay = started + step * period - time.time()
            if delay > 0:
                time.sleep(delay)
        time.sleep(tail)  # the live view catches up before the end-of-run summary replaces it
        return stamps
''')
LAUNCH = ("results = notebook_launcher(train, args=({steps}, {rate}, {tail}), num_processes=2, dashboard={dashboard!r})\n"
          "json.dump(results, open({out!r}, 'w'))\n")

LINE = re.compile(r"\[rank (\d+)\] step (\d+) (\d+\.\d+)")
RANK_ROW = re.compile(r"<tr class='nbaccel-rank' data-rank='(\d+)'[^>]*>(.*?)</tr>", re.S)
CELL = re.compile(r"<td[^>]*>(.*?)</td>", re.S)
HEAD = re.compile(r"<th[^>]*>(.*?)</th>")
# what a message showed: (arrival here, sent by the kernel, the step shown)
Shown = tuple[float, float, int]
MEASURES = ("line", "step", "metric")


@dataclass
class Run:
    """What one launch showed, and when each rank took each step."""

    load_average: float
    stamps: list[list[float]] = field(default_factory=list)  # per rank, step 1 first
    shown: dict[str, dict[int, list[Shown]]] = field(default_factory=lambda: {m: {} for m in MEASURES})
    chart_built: float | None = None  # when the first chart (a bqplot Figure) reached the notebook

    def lags(self, measure: str, when: int) -> list[float]:
        """For every step of every rank shown live: when it was first shown (it or a later step, at `when`:
        0 arrival, 1 sent) minus its stamp. Lines are shown one by one: each counts for its own step."""
        lags = []
        for rank, stamps in enumerate(self.stamps):
            events = sorted(self.shown[measure].get(rank, []), key=lambda event: event[when])
            if measure == "line":
                lags += [event[when] - stamps[event[2] - 1] for event in events]
                continue
            index, best, best_at = 0, 0, 0.0
            for step, stamp in enumerate(stamps, start=1):
                while best < step and index < len(events):
                    event = events[index]
                    index += 1
                    if event[2] > best:
                        best, best_at = event[2], event[when]
                if best < step:
                    break  # never shown live
                lags.append(best_at - stamp)
        return lags

    def first_metric_lag(self, when: int) -> float:
        lags = []
        for rank, stamps in enumerate(self.stamps):
            events = sorted(self.shown["metric"].get(rank, []), key=lambda event: event[when])
            if events and stamps:
                lags.append(events[0][when] - stamps[0])
        return max(lags, default=float("nan"))


def read_html(shown: dict[str, dict[int, list[Shown]]], at: tuple[float, float], html: str, steps: int) -> None:
    """What an HTML widget's new value shows: the rank table's step per rank, or the `mark` metric per rank."""
    if "nbaccel-ranks" in html:
        for rank, row in RANK_ROW.findall(html):
            for cell in CELL.findall(row):
                match = re.fullmatch(rf"(\d+)/{steps}", cell.strip())
                if match:
                    shown["step"].setdefault(int(rank), []).append((*at, int(match.group(1))))
    elif "nbaccel-metric" in html:
        cells = CELL.findall(html)
        if cells and cells[0] == "mark":
            for head, value in zip(HEAD.findall(html)[2:], cells[2:]):
                if head.startswith("rank ") and value.isdigit():
                    shown["metric"].setdefault(int(head[5:]), []).append((*at, int(value)))


def collect(client, msg_id: str, timeout: float) -> list[tuple[float, list[bytes]]]:
    """IOPub's raw frames until the cell `msg_id` is done, each stamped on arrival. Decoding waits until the
    end, so that on a busy machine this reader needs as little CPU as it can to keep up."""
    socket = client.iopub_channel.socket
    received: list[tuple[float, list[bytes]]] = []
    deadline = time.time() + timeout
    while time.time() < deadline:
        if not socket.poll(1000):
            continue
        frames = socket.recv_multipart()
        received.append((time.time(), frames))
        _, (_, header, parent, _, content, *_) = client.session.feed_identities(frames)
        if b'"status"' in header and b'"idle"' in content and json.loads(parent).get("msg_id") == msg_id:
            return received
    raise TimeoutError(f"the launch did not end within {timeout} s")


def decode(client, frames: list[bytes]) -> dict:
    _, parts = client.session.feed_identities(frames)
    return client.session.deserialize(parts, content=True)


def read_messages(client, received: list[tuple[float, list[bytes]]], steps: int, run: Run) -> None:
    for arrival, frames in received:
        msg = decode(client, frames)
        kind, content = msg["msg_type"], msg["content"]
        at = (arrival, msg["header"]["date"].timestamp())  # here, and when the kernel sent it
        if kind == "stream":
            for rank, step, _ in LINE.findall(content.get("text", "")):
                run.shown["line"].setdefault(int(rank), []).append((*at, int(step)))
        elif kind == "comm_msg":
            value = content.get("data", {}).get("state", {}).get("value")
            if isinstance(value, str):
                read_html(run.shown, at, value, steps)
        elif kind == "comm_open" and run.chart_built is None:
            if content.get("data", {}).get("state", {}).get("_model_name") == "FigureModel":
                run.chart_built = at[1]
        elif kind == "error":
            raise RuntimeError("\n".join(content.get("traceback", [])))


def one_run(checkout: Path, args: argparse.Namespace) -> Run:
    """One fresh kernel: define the training function, launch it, read what the notebook was sent."""
    run = Run(load_average=os.getloadavg()[0])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(checkout), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    manager = KernelManager(kernel_name="python3")
    manager.start_kernel(env=env)
    client = manager.client()
    client.start_channels()
    try:
        client.wait_for_ready(timeout=120)
        with tempfile.TemporaryDirectory() as folder:
            out = os.path.join(folder, "stamps.json")
            imported: list[str] = []
            reply = client.execute_interactive(
                DEFINE + "import nbaccel; print(nbaccel.__file__)", timeout=120,
                output_hook=lambda msg: imported.append(msg["content"].get("text", "")))
            assert reply["content"]["status"] == "ok", reply["content"]
            if not "".join(imported).strip().startswith(str(checkout)):
                raise RuntimeError(f"the kernel imported {''.join(imported).strip()}, not the checkout {checkout}")
            msg_id = client.execute(LAUNCH.format(dashboard=args.dashboard, steps=args.steps, rate=args.rate,
                                                  tail=args.tail, out=out))
            read_messages(client, collect(client, msg_id, timeout=300), args.steps, run)
            with open(out) as f:
                run.stamps = json.load(f)
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    return run


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def summary(run: Run) -> dict[str, float]:
    """Max and p95 of each lag, by the kernel's sending time and by the arrival here; the first metric's
    lag; how long after the first metric the first chart came; the slower rank's steps/s."""
    row: dict[str, float] = {}
    for measure in MEASURES:
        for when, suffix in ((1, ""), (0, " arrived")):
            lags = run.lags(measure, when)
            row[f"{measure} max{suffix}"] = max(lags, default=float("nan"))
            row[f"{measure} p95{suffix}"] = quantile(lags, 0.95)
    row["first metric"] = run.first_metric_lag(1)
    first_stamp = min((s[0] for s in run.stamps if s), default=float("nan"))
    row["first chart"] = (run.chart_built - first_stamp) if run.chart_built else float("nan")
    rates = [(len(s) - 1) / (s[-1] - s[0]) for s in run.stamps if len(s) > 1]
    row["steps/s"] = min(rates, default=float("nan"))
    row["load"] = run.load_average
    return row


TABLE = ["line max", "line p95", "step max", "step p95", "metric max", "metric p95", "first metric", "first chart",
         "line max arrived", "step max arrived", "metric max arrived", "steps/s", "load"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkout", action="append", metavar="NAME=DIR",
                        help="a variant: its name and the checkout its kernel imports nbaccel from (default: this "
                             "checkout alone)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2500)
    parser.add_argument("--rate", type=float, default=500.0, help="steps per second each rank aims at")
    parser.add_argument("--tail", type=float, default=1.0)
    parser.add_argument("--busy", type=int, default=2, help="processes spinning on the CPU in the busy runs (0: none)")
    parser.add_argument("--dashboard", default="widget", type=lambda v: {"False": False}.get(v, v),
                        help="the launch's dashboard= (False: none, the floor of the printed lines' lag)")
    parser.add_argument("--json", help="write every run's row here")
    args = parser.parse_args()
    checkouts = args.checkout or [f"this={ROOT}"]
    variants = [(name, Path(path).resolve()) for name, path in (item.split("=", 1) for item in checkouts)]
    loads = ["quiet"] + (["busy"] if args.busy else [])
    rows: list[dict] = []
    for index in range(args.rounds):
        for load in loads:
            for name, checkout in variants if index % 2 == 0 else variants[::-1]:
                spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                            for _ in range(args.busy if load == "busy" else 0)]
                try:
                    row = summary(one_run(checkout, args))
                finally:
                    for spinner in spinners:
                        spinner.kill()
                        spinner.wait()
                rows.append({"variant": name, "load_kind": load, "round": index, **row})
                print(f"round {index} {load:5} {name:8} " + " ".join(f"{key}={row[key]:.3f}" for key in TABLE),
                      flush=True)
    print("\nworst of the rounds (steps/s: the lowest; load: the mean load average), seconds:\n")
    print("| variant | machine | " + " | ".join(TABLE) + " |")
    print("|" + " --- |" * (len(TABLE) + 2))
    for load in loads:
        for name, _ in variants:
            mine = [row for row in rows if row["variant"] == name and row["load_kind"] == load]
            worst = {key: max(row[key] for row in mine) for key in TABLE}
            worst["steps/s"] = min(row["steps/s"] for row in mine)
            worst["load"] = statistics.mean(row["load"] for row in mine)
            print(f"| {name} | {load} | " + " | ".join(
                f"{worst[key]:.0f}" if key == "steps/s" else f"{worst[key]:.2f}" if key == "load" else f"{worst[key]:.3f}"
                for key in TABLE) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
