"""Accelerate's own CI scripts (accelerate/test_utils/scripts), renamed to nbaccel and launched on 2 CPU processes.

Each script is read from the installed Accelerate 1.15, `accelerate` is replaced by `nbaccel` in its text (what a
user does), and `python -m nbaccel launch --num_processes 2 --cpu` runs it: the script's own assertions are the
test. In the same test, Accelerate runs its original copy on 2 CPU processes the only way it can here:
`accelerate launch --cpu` starts one process (its multi-CPU launch needs mpirun), so torchrun starts them with
`ACCELERATE_USE_CPU=true`; Accelerate's `PartialState()` does not read that variable, so the scripts that build
one themselves get `PartialState(cpu=True)` in both copies (else each Accelerate process ran alone). Each rank of
both must print the same sections in the same order (read from the rank's own log: on the shared pipe two
ranks' unbuffered prints interleave); where Accelerate's run ends differently on CPU, the test checks that it
does, and docs/compat.md gives the reason.

`test_notebook.py` calls `notebook_launcher` itself: it runs as a plain script, with its own
`ACCELERATE_NUM_PROCESSES=2`, minus its fault-tolerance case, which races two processes on one queue (the rank
that finds it empty returns while the other waits for it in `PartialState()`: Accelerate hangs there;
nbaccel reports it within seconds, tests/test_launch_deadlock.py).
`external_deps/test_metrics.py` runs its CPU path (gather_for_metrics over every split/dispatch setting) in
both copies without its imports of datasets, evaluate and transformers, which only its GPU-only MRPC case uses.
Not run: `test_cli.py` (Accelerate's CLI on its hardware matrix) and the other `external_deps/` scripts: they
download a model or GLUE from the Hub (no network here), need DeepSpeed, or (`test_pippy.py`) build full-size
BERT and GPT-2 from transformers and run on several GPUs only; tests/test_inference.py runs prepare_pippy
side by side on a small model instead.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from process_helpers import environment_without, run_in_session

accelerate_scripts = pytest.importorskip("accelerate.test_utils.scripts", reason="runs Accelerate 1.15's CI scripts")

SCRIPTS = Path(accelerate_scripts.__path__[0])
TIMEOUT = 150
# torch runs the bf16 DDP hooks on CUDA with NCCL only, and DDP refuses device_ids for a CPU module (the
# script's reference model passes GPU indices): the CPU run leaves those two out, in both libraries' copies.
CPU_EDITS = {
    "test_ddp_comm_hook.py": [
        ("        device_ids=[accelerator.local_process_index],\n"
         "        output_device=accelerator.local_process_index,\n", ""),
        ('        print(f"Test DDP comm hook:',
         '        if DDPCommunicationHookType.BF16 in (comm_hook, comm_wrapper):\n'
         '            continue\n'
         '        print(f"Test DDP comm hook:'),
    ],
    # Accelerate's PartialState() ignores ACCELERATE_USE_CPU: without cpu=True its 2 processes each ran alone
    # ("Num processes: 1"), and the comparison compared nothing distributed
    "test_notebook.py": [("    test_fault_tolerant()\n", ""), ("PartialState()", "PartialState(cpu=True)")],
    "test_ops.py": [("    state = PartialState()\n", "    state = PartialState(cpu=True)\n")],
    # its CPU path (gather_for_metrics on a regression model, every split/dispatch setting) needs none of the
    # Hub libraries it imports for its GPU-only MRPC case: both copies run without those imports
    "external_deps/test_metrics.py": [
        ("import datasets\nimport evaluate\n", ""),
        ("import transformers\nfrom datasets import load_dataset\n", ""),
        ("from transformers import AutoModelForSequenceClassification, AutoTokenizer\n", ""),
        ("    if accelerator.is_local_main_process:\n"
         "        datasets.utils.logging.set_verbosity_warning()\n"
         "        transformers.utils.logging.set_verbosity_warning()\n"
         "    else:\n"
         "        datasets.utils.logging.set_verbosity_error()\n"
         "        transformers.utils.logging.set_verbosity_error()\n",
         # its checks pass in one process too: make each rank say how many processes it ran with
         '    print(f"Test metrics on {accelerator.num_processes} processes")\n'),
    ],
}
RUN_AS_SCRIPT = {"test_notebook.py"}


def script_source(name: str, package: str) -> str:
    text = (SCRIPTS / name).read_text()
    for old, new in CPU_EDITS.get(name, []):
        assert old in text, f"Accelerate's {name} changed: {old!r} is not in it any more"
        text = text.replace(old, new)
    return re.sub(r"\baccelerate\b", package, text)


def launch(tmp_path: Path, name: str, package: str) -> subprocess.CompletedProcess:
    """Run the script on 2 processes; `.ranks` holds what each rank printed, apart (torchrun's ranks write
    unbuffered to one pipe, where a print's text and its newline go out separately and another rank's text can
    land between them): under torchrun each rank's stdout is also teed to its own file."""
    script = tmp_path / package / name
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(script_source(name, package))
    # TMPDIR: Accelerate's notebook_launcher (test_notebook.py) leaves torch's pytorch-errorfile-* and
    # torchelastic_* in the temp folder; they stay in the test's own
    env = environment_without() | {"TMPDIR": str(tmp_path)}
    logs = tmp_path / f"logs-{package}"
    if name in RUN_AS_SCRIPT:
        env["ACCELERATE_NUM_PROCESSES"] = "2"
        command = [sys.executable, str(script)]
    elif package == "nbaccel":
        command = [sys.executable, "-m", "nbaccel", "launch", "--num_processes", "2", "--cpu", "--tee", "1",
                   "--log_dir", str(logs), str(script)]
    else:
        env["ACCELERATE_USE_CPU"] = "true"
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--tee", "1",
                   "--log-dir", str(logs), str(script)]
    result = run_in_session(command, env, script.parent, TIMEOUT)
    result.ranks = [path.read_text() for path in sorted(logs.glob("*/attempt_0/*/stdout.log"))]
    return result


def rank_sections(result: subprocess.CompletedProcess) -> list[list[str]]:
    """The sections each rank printed (torchrun launches), else those of the whole output."""
    return [sections(text) for text in result.ranks] or [sections(result.stdout)]


def sections(output: str) -> list[str]:
    """The section headers a script prints ("Test ...", "**Test ...**", "testing ..."), each once, in order."""
    # two processes that print at once can share a line: break before each header
    output = re.sub(r"(?<=[^\s*])(?=\*\*Test |Test |testing )", "\n", output)
    found: list[str] = []
    for line in output.splitlines():
        line = line.strip()
        if re.match(r"(\*\*)?(Test|testing) ", line) and line not in found:
            found.append(line)
    return found


def nbaccel_passes(tmp_path: Path, name: str) -> list[list[str]]:
    ours = launch(tmp_path, name, "nbaccel")
    assert ours.returncode == 0, f"{name} renamed to nbaccel failed (exit {ours.returncode}):\n{ours.stdout[-6000:]}"
    if name not in RUN_AS_SCRIPT:  # (test_notebook's monitoring case shows the failure it provokes)
        assert "Traceback" not in ours.stdout, ours.stdout[-6000:]
        assert len(ours.ranks) == 2 and "Num processes: 1" not in ours.stdout, ours.stdout[-6000:]
    return rank_sections(ours)


@pytest.mark.parametrize("name", ["test_ops.py", "test_script.py", "test_sync.py", "test_ddp_comm_hook.py",
                                  "test_notebook.py", "external_deps/test_metrics.py"])
def test_script_passes_on_both(tmp_path: Path, name: str):
    ours = nbaccel_passes(tmp_path, name)
    theirs = launch(tmp_path, name, "accelerate")
    assert accelerate_passed(theirs), theirs.stdout[-6000:]
    assert "Num processes: 1" not in theirs.stdout, theirs.stdout[-6000:]  # each of 2 processes ran alone
    assert ours == rank_sections(theirs) and len(ours[0]) >= 4
    if name == "external_deps/test_metrics.py":
        assert all(sections[0] == "Test metrics on 2 processes" for sections in ours)


def accelerate_passed(result: subprocess.CompletedProcess) -> bool:
    """Exit 0, or every check passed and a process then aborted as it exited: now and then (1 run in 4 of
    test_ddp_comm_hook here) one of Accelerate's processes ends with "terminate called without an active
    exception" (SIGABRT) after the script's last line, with no Python exception in any rank."""
    if result.returncode == 0:
        return True
    return ("terminate called without an active exception" in result.stdout
            and not re.search(r"\[rank\d+\]: Traceback", result.stdout))


def test_merge_weights_passes_on_nbaccel_where_accelerate_trains_without_fsdp(tmp_path: Path):
    """On CPU Accelerate prepares the model with DDP whatever the FSDP plugin says, so the script's FSDP save
    fails (docs/compat.md: FSDP runs on CPU ranks in nbaccel)."""
    nbaccel_passes(tmp_path, "test_merge_weights.py")
    theirs = launch(tmp_path, "test_merge_weights.py", "accelerate")
    assert theirs.returncode != 0 and "in save_fsdp_model" in theirs.stdout and "KeyError: None" in theirs.stdout


def test_distributed_data_loop_passes_on_nbaccel(tmp_path: Path):
    """Accelerate is not run: on CPU processes its `join_uneven_inputs` does not join (docs/compat.md), so the
    script's uneven-input case waits forever in a collective (tried: killed after 300 s)."""
    found = nbaccel_passes(tmp_path, "test_distributed_data_loop.py")[0]
    assert "Test join with non DDP distributed raises warning" in found
    assert "Test DataLoader with sampler as an instance of `BatchSampler`" in found
