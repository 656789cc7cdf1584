"""Run Accelerate's own example scripts beside Accelerate: each as it is under `accelerate launch`, and with
`accelerate` renamed to `nbaccel` under `nbaccel launch`, on 2 CPU processes, and compare what they print (the
`epoch N: {...}` metric lines) and the model's final weights.

The examples come from a checkout (or extracted snapshot) of Accelerate's repository, given as its path: they
are in neither Accelerate's wheel nor its source distribution, and they are never copied into this repository
(each run copies the file it needs into a temporary folder). The Hub is not reachable here, so only the loading
is replaced (scripts/examples_parity/): `AutoTokenizer` / `AutoModelForSequenceClassification.from_pretrained`
give a word-level tokenizer and a tiny random BERT, `datasets.load_dataset("glue", "mrpc")` a synthetic
MRPC-like dataset, `evaluate.load("glue", "mrpc")` accuracy and F1. The training code runs untouched.

transformers is not in the main environment on purpose (see run.sh): it is taken from `.venv/side/lomo`, where
run.sh installs it, put on the ranks' PYTHONPATH with the stand-ins.

Usage:
    python scripts/run_accelerate_examples.py PATH_TO_ACCELERATE_CHECKOUT [--cases NAME ...] [--markdown FILE]
Exit status 1 when a case differs or fails. It takes minutes (two launches per case).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from nbaccel.utils.other import get_free_port

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent / "examples_parity"
SIDE = ROOT / ".venv" / "side" / "lomo"
LIBRARIES = ("accelerate", "nbaccel")


@dataclass
class Case:
    """One run of one example; `after` names the case whose folder (its checkpoints) this one continues in."""

    name: str
    example: str
    args: list[str] = field(default_factory=list)
    after: str | None = None


CASES = [
    Case("nlp_example", "nlp_example.py"),
    Case("complete_nlp_example", "complete_nlp_example.py", ["--checkpointing_steps", "epoch"]),
    Case("complete_nlp_example resumed from epoch_0", "complete_nlp_example.py",
         ["--resume_from_checkpoint", "epoch_0"], after="complete_nlp_example"),
    Case("checkpointing --checkpointing_steps 5", "by_feature/checkpointing.py", ["--checkpointing_steps", "5"]),
    Case("checkpointing resumed from step_10", "by_feature/checkpointing.py",
         ["--resume_from_checkpoint", "step_10"], after="checkpointing --checkpointing_steps 5"),
    Case("checkpointing --use_stateful_dataloader --checkpointing_steps 5", "by_feature/checkpointing.py",
         ["--use_stateful_dataloader", "--checkpointing_steps", "5"]),
    Case("checkpointing --use_stateful_dataloader resumed from step_10", "by_feature/checkpointing.py",
         ["--use_stateful_dataloader", "--resume_from_checkpoint", "step_10"],
         after="checkpointing --use_stateful_dataloader --checkpointing_steps 5"),
    Case("gradient_accumulation --gradient_accumulation_steps 2", "by_feature/gradient_accumulation.py",
         ["--gradient_accumulation_steps", "2"]),
    Case("local_sgd --local_sgd_steps 2", "by_feature/local_sgd.py", ["--local_sgd_steps", "2"]),
    Case("multi_process_metrics", "by_feature/multi_process_metrics.py"),
    Case("early_stopping", "by_feature/early_stopping.py"),
    Case("memory", "by_feature/memory.py"),
    Case("automatic_gradient_accumulation", "by_feature/automatic_gradient_accumulation.py"),
    Case("cross_validation --num_folds 2", "by_feature/cross_validation.py", ["--num_folds", "2"]),
    Case("ddp_comm_hook --ddp_comm_hook fp16", "by_feature/ddp_comm_hook.py", ["--ddp_comm_hook", "fp16"]),
]
RESULT_LINE = re.compile(r"^(epoch \d+:.*|fold \d+.*|Average.*|EXAMPLES_PARITY_WEIGHTS .*)$", re.MULTILINE)


@dataclass
class Outcome:
    lines: list[str]
    status: int
    tail: str




def _stop(pid: int) -> None:
    """SIGKILL a launcher and every process under it (torchrun may put its ranks in groups of their own)."""
    import psutil

    try:
        tree = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    for child in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()


def _launcher(library: str) -> list[str]:
    """Two CPU processes. On a machine without GPUs `accelerate launch --cpu --num_processes 2` starts a single
    process (its multi-process launcher is torchrun for GPUs, mpirun for CPUs), so Accelerate's ranks are
    started by torchrun itself, which is what `accelerate launch --multi_gpu` runs."""
    if library == "accelerate":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                "--master_addr", "127.0.0.1", "--master_port", str(get_free_port("127.0.0.1"))]
    return [sys.executable, "-m", "nbaccel", "launch", "--cpu", "--num_processes", "2"]


def run_case(case: Case, library: str, checkout: Path, folders: dict[tuple[str, str], Path], work: Path,
             timeout: float) -> Outcome:
    """Launch `case` for `library` in its folder (the folder of `case.after` when it continues one)."""
    folder = folders[(case.after, library)] if case.after else Path(tempfile.mkdtemp(prefix=f"{library}-", dir=work))
    folders[(case.name, library)] = folder
    text = (checkout / "examples" / case.example).read_text()
    if library != "accelerate":
        text = re.sub(r"\baccelerate\b", library, text)
    script = folder / Path(case.example).name
    script.write_text(text)
    env = {k: v for k, v in os.environ.items() if k != "TESTING_MOCKED_DATALOADERS"}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(HERE / "stubs"), str(SIDE), str(ROOT)])
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    command = [*_launcher(library), str(HERE / "rank_entry.py"), str(script), "--cpu", *case.args]
    # its own session, so that a launch past the timeout is stopped with every rank it started
    process = subprocess.Popen(command, cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop(process.pid)
        stdout, stderr = process.communicate()
        return Outcome(RESULT_LINE.findall(stdout), 124, stderr[-2500:] + f"\ntimed out after {timeout:g} s")
    return Outcome(RESULT_LINE.findall(stdout), process.returncode, stderr[-3000:])


def _complete(outcome: Outcome) -> bool:
    """The run printed its final weights: training finished (whatever happened while its processes exited)."""
    return any(line.startswith("EXAMPLES_PARITY_WEIGHTS") for line in outcome.lines)


def _summary(outcome: Outcome) -> str:
    if outcome.status and not _complete(outcome):
        last = [line for line in outcome.tail.splitlines() if line.strip()][-1:] or ["?"]
        return f"fails (exit {outcome.status}): `{last[0][:120]}`"
    exit_note = "" if not outcome.status else (
        " (then a rank did not exit: stopped at the timeout)" if outcome.status == 124 else
        f" (then exit {outcome.status})")
    weights = [line.split()[1:] for line in outcome.lines if line.startswith("EXAMPLES_PARITY_WEIGHTS")]
    metrics = [line for line in outcome.lines if not line.startswith("EXAMPLES_PARITY_WEIGHTS")]
    final = metrics[-1] if metrics else "no metric line"
    return (f"{final}; weights {weights[-1][0]}, change {weights[-1][1]}" if weights else final) + exit_note


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkout", type=Path, help="a checkout of Accelerate's repository (has examples/)")
    parser.add_argument("--cases", nargs="*", default=None, help="case names (default: all); see CASES")
    parser.add_argument("--markdown", type=Path, default=None, help="write the table to this file too")
    parser.add_argument("--timeout", type=float, default=480.0, help="seconds per launch")
    args = parser.parse_args()
    if not (args.checkout / "examples" / "nlp_example.py").is_file():
        parser.error(f"{args.checkout} has no examples/nlp_example.py: give a checkout of Accelerate's repository")
    if not (SIDE / "transformers").is_dir():
        parser.error(f"transformers is not in {SIDE}: run `./run.sh test` once (it installs it there)")
    wanted = [c for c in CASES if args.cases is None or c.name in args.cases]
    work = Path(tempfile.mkdtemp(prefix="accelerate-examples-"))
    folders: dict[tuple[str, str], Path] = {}
    rows, failed = [], 0
    for case in wanted:
        outcomes = {lib: run_case(case, lib, args.checkout, folders, work, args.timeout) for lib in LIBRARIES}
        same = all(map(_complete, outcomes.values())) and outcomes["accelerate"].lines == outcomes["nbaccel"].lines
        failed += not same
        rows.append(f"| `{case.example} {' '.join(case.args)}` | {_summary(outcomes['accelerate'])} | "
                    f"{_summary(outcomes['nbaccel'])} | {'same' if same else '**differs**'} |")
        print(rows[-1], flush=True)
        if not same or any(o.status for o in outcomes.values()):
            for lib, outcome in outcomes.items():
                print(f"--- {lib} (exit {outcome.status}):\n" + "\n".join(outcome.lines) + "\n" + outcome.tail[-1500:])
    import accelerate

    table = "\n".join([
        f"Run {datetime.date.today().isoformat()}, Accelerate {accelerate.__version__}, 2 CPU processes, "
        f"{len(wanted) - failed} of {len(wanted)} the same.", "",
        "| example and arguments | Accelerate (last metric line; final weights) | nbaccel | |",
        "| --- | --- | --- | --- |", *rows])
    print(table)
    if args.markdown:
        args.markdown.write_text(table + "\n")
    shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
