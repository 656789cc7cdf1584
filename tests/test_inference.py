"""prepare_pippy (nbaccel.inference) side by side with Accelerate's, on 2 CPU processes over gloo.

tests/compat/scripts/pipeline_inference.py is written for Accelerate. The renamed copy runs under
`nbaccel launch`, the original under torchrun (Accelerate's `accelerate launch --cpu` starts one process), and
each rank saves what every case gave it: split points, outputs, the exception raised. Where Accelerate works,
the two must agree exactly; where it fails on this machine, the test checks that it still does the way
docs/compat.md says, and what nbaccel does instead.
"""

from __future__ import annotations

import re
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from process_helpers import environment_without, run_in_session

pytest.importorskip("accelerate.inference", reason="compares with Accelerate 1.15's prepare_pippy")

SCRIPT = Path(__file__).resolve().parent / "compat" / "scripts" / "pipeline_inference.py"
TIMEOUT = 120
SAME = ["auto", "padded", "named_split_called_twice", "keyword_inputs", "padded_to_traced_size",
        "missing_split_point", "too_small_to_split"]
# Accelerate fails these on CPU processes (docs/compat.md, "prepare_pippy"); nbaccel runs or refuses them
DIFFERENT = ["gather_output", "more_chunks_than_processes", "more_stages_than_processes"]


class Run:
    """One launch of the script: its output, exit status, and each rank's saved results."""

    def __init__(self, process: subprocess.CompletedProcess, out: Path) -> None:
        self.stdout, self.returncode = process.stdout, process.returncode
        self.ranks = [torch.load(path, weights_only=False) for path in sorted(out.glob("rank*.pt"))]


def launch(tmp_path: Path, package: str, *cases: str, stop_on_error: bool = False) -> Run:
    folder = tmp_path / f"{package}-{cases[0]}"
    folder.mkdir()
    script = folder / SCRIPT.name
    script.write_text(re.sub(r"\baccelerate\b", package, SCRIPT.read_text()))
    env = environment_without() | {"TMPDIR": str(folder)}  # torchrun's torchelastic_* log folder: in the test's own
    if package == "nbaccel":
        command = [sys.executable, "-m", "nbaccel", "launch", "--num_processes", "2", "--cpu"]
    else:
        env["ACCELERATE_USE_CPU"] = "true"
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    command += [str(script), str(folder), *(["--stop-on-error"] if stop_on_error else []), *cases]
    return Run(run_in_session(command, env, folder, TIMEOUT), folder)


@pytest.fixture(scope="module")
def both(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    """The cases both libraries run, plus nbaccel's side of the ones Accelerate fails, in one launch each."""
    tmp = tmp_path_factory.mktemp("pippy")
    runs = {"nbaccel": launch(tmp, "nbaccel", *SAME, *DIFFERENT), "accelerate": launch(tmp, "accelerate", *SAME)}
    for name, run in runs.items():
        assert run.returncode == 0 and len(run.ranks) == 2, f"{name} failed:\n{run.stdout[-6000:]}"
    return runs


def same(a: Any, b: Any) -> bool:
    """Equal, with tensors compared exactly (values, dtype and shape)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("case", ["auto", "padded", "named_split_called_twice", "keyword_inputs",
                                  "padded_to_traced_size"])
def test_pipeline_gives_accelerates_results(both: dict[str, Run], case: str) -> None:
    for rank in (0, 1):
        ours, theirs = both["nbaccel"].ranks[rank][case], both["accelerate"].ranks[rank][case]
        assert ours[0] == "returned", ours
        assert same(ours, theirs), (rank, ours, theirs)
    first, last = both["nbaccel"].ranks[0][case][1], both["nbaccel"].ranks[1][case][1]
    outputs = [key for key in ("output", "first") if key in last]
    assert outputs and all(first[key] is None for key in outputs)  # only the last stage returns the output
    expected = last["expected"]
    output = last.get("output", last.get("first"))
    # padded batches come back with their padding rows, as in Accelerate
    assert torch.allclose(output[: len(expected)], expected, atol=1e-6) and len(output) % 2 == 0


def test_split_points_match_accelerates(both: dict[str, Run]) -> None:
    ours = {case: both["nbaccel"].ranks[0][case][1]["split_points"] for case in ("auto", "keyword_inputs")}
    assert ours == {"auto": ["blocks.1"], "keyword_inputs": ["blocks.1.lin"]}
    assert both["accelerate"].ranks[0]["auto"][1]["split_points"] == ["blocks.1"]
    assert both["nbaccel"].ranks[1]["auto"][1]["schedule"] == "ScheduleGPipe"


def test_bad_split_points_raise_before_any_communication(both: dict[str, Run]) -> None:
    for rank in (0, 1):
        ours, theirs = both["nbaccel"].ranks[rank], both["accelerate"].ranks[rank]
        assert ours["missing_split_point"][:2] == theirs["missing_split_point"][:2] == ("raised", "AttributeError")
        assert "`9`" in ours["missing_split_point"][2]
        # Accelerate: a bare StopIteration from its search for a module on stage 1 (docs/compat.md)
        assert theirs["too_small_to_split"][:2] == ("raised", "StopIteration")
        kind, message = ours["too_small_to_split"][1:]
        assert kind == "ValueError" and "could not cut the model into 2 stages" in message


def test_gather_output_sends_the_output_to_every_process(both: dict[str, Run], tmp_path: Path) -> None:
    ours = [rank["gather_output"][1] for rank in both["nbaccel"].ranks]
    assert same(ours[0]["output"], ours[1]["output"])
    assert torch.allclose(ours[0]["output"], ours[0]["expected"], atol=1e-6)
    theirs = launch(tmp_path, "accelerate", "gather_output", stop_on_error=True)
    assert theirs.returncode != 0
    kind, message = theirs.ranks[0]["gather_output"][1:]  # its copy_tensor_to_devices passes a tensor as a shape
    assert kind == "TypeError" and "zeros()" in message


def test_num_chunks_sets_micro_batches_not_stages(both: dict[str, Run], tmp_path: Path) -> None:
    last = both["nbaccel"].ranks[1]["more_chunks_than_processes"][1]
    assert torch.allclose(last["output"], last["expected"], atol=1e-6)
    theirs = launch(tmp_path, "accelerate", "more_chunks_than_processes", stop_on_error=True)
    assert theirs.returncode != 0  # Accelerate cuts 4 stages for 2 processes; torch fails building them
    assert theirs.ranks[0]["more_chunks_than_processes"][1] == "AttributeError"


def test_more_split_points_than_processes_is_refused(both: dict[str, Run], tmp_path: Path) -> None:
    for rank in both["nbaccel"].ranks:
        kind, message = rank["more_stages_than_processes"][1:]
        assert kind == "ValueError" and "2 split point(s) make 3 stage(s), but 2 processes" in message
    theirs = launch(tmp_path, "accelerate", "more_stages_than_processes", stop_on_error=True)
    assert theirs.returncode != 0 and "Received data size doesn't match expected size" in theirs.stdout


def test_batch_the_stages_cannot_take_is_refused_by_the_first_process(tmp_path: Path) -> None:
    ours = launch(tmp_path, "nbaccel", "batch_larger_than_traced", stop_on_error=True)
    assert ours.returncode != 0
    kind, message = ours.ranks[0]["batch_larger_than_traced"][1:]
    assert kind == "ValueError" and "a batch of 5 makes micro-batches of 3" in message and "2 rows" in message
    theirs = launch(tmp_path, "accelerate", "batch_larger_than_traced", stop_on_error=True)
    assert theirs.returncode != 0 and "Received data size doesn't match expected size" in theirs.stdout


def test_stages_follow_the_process_index_across_machines(tmp_path: Path) -> None:
    """Two machines of one process each (two `nbaccel launch --num_machines 2` on this host): each builds the
    stage of its global process index. Accelerate numbers stages by local index, so both of its processes
    build stage 0 and the pipeline breaks in gloo (tried by hand, docs/compat.md)."""
    from concurrent.futures import ThreadPoolExecutor

    from ranks_helper import free_port

    script = tmp_path / SCRIPT.name
    script.write_text(re.sub(r"\baccelerate\b", "nbaccel", SCRIPT.read_text()))
    env = environment_without()
    port = str(free_port())

    def machine(rank: int) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "nbaccel", "launch", "--num_machines", "2", "--machine_rank", str(rank),
                   "--num_processes", "2", "--main_process_ip", "127.0.0.1", "--main_process_port", port, "--cpu",
                   str(script), str(tmp_path), "--stop-on-error", "auto", "gather_output"]
        return run_in_session(command, env, tmp_path, TIMEOUT)

    with ThreadPoolExecutor(2) as pool:
        machines = list(pool.map(machine, [0, 1]))
    for result in machines:
        assert result.returncode == 0, result.stdout[-4000:]
    first, last = (torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in (0, 1))
    assert first["auto"][1]["output"] is None and last["auto"][1]["split_points"] == ["blocks.1"]
    assert torch.allclose(last["auto"][1]["output"], last["auto"][1]["expected"], atol=1e-6)
    assert same(first["gather_output"][1]["output"], last["gather_output"][1]["output"])


def test_prepare_pippy_in_notebook_launcher(both: dict[str, Run]) -> None:
    """The same cells the notebook way: forked ranks, `PartialState()` without cpu=True."""
    from nbaccel import notebook_launcher

    cell = types.ModuleType("__pipeline_cell__")
    exec(compile(re.sub(r"\baccelerate\b", "nbaccel", SCRIPT.read_text()), "<cell>", "exec"), cell.__dict__)

    def pipeline_cell() -> tuple[Any, Any]:
        cell.PartialState()
        return cell.auto(), cell.gather_output()

    results = notebook_launcher(pipeline_cell, num_processes=2)
    assert same(results[1][0], both["accelerate"].ranks[1]["auto"][1])
    assert same(results[0][1]["output"], results[1][1]["output"])


def test_the_docs_example_runs(tmp_path: Path) -> None:
    """docs/big_models.md's prepare_pippy example, as printed, under the command in its first line."""
    docs = (Path(__file__).resolve().parent.parent / "docs" / "big_models.md").read_text()
    example = re.search(r"```python\n(# pipeline\.py: .*?)```", docs, re.DOTALL).group(1)
    (tmp_path / "pipeline.py").write_text(example)
    env = environment_without()
    command = [sys.executable, "-m", "nbaccel", "launch", "--num_processes", "2", "--cpu", "pipeline.py"]
    assert example.startswith("# pipeline.py: nbaccel launch --num_processes 2 --cpu pipeline.py\n")
    result = run_in_session(command, env, tmp_path, TIMEOUT)
    assert result.returncode == 0 and "['1'] torch.Size([2, 3])" in result.stdout, result.stdout[-3000:]


def test_one_process_is_refused_as_in_accelerate() -> None:
    import accelerate.inference
    import accelerate.state

    from nbaccel import PartialState
    from nbaccel.inference import prepare_pippy
    from nbaccel.state import isolated_states

    model, example = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)), (torch.randn(1, 4),)
    accelerate.state.PartialState._reset_state()
    try:
        accelerate.state.PartialState(cpu=True)
        with pytest.raises(ValueError, match="process group has not been initialized"):
            accelerate.inference.prepare_pippy(model, example_args=example)
    finally:
        accelerate.state.PartialState._reset_state()
    with isolated_states():
        PartialState(cpu=True)
        with pytest.raises(ValueError, match="one stage per process and only 1 process runs"):
            prepare_pippy(model, example_args=example)


def test_pippy_forward_passes_every_keyword_to_the_model_as_in_accelerate() -> None:
    """In one process pippy_forward is the model's call; a keyword nbaccel uses inside (the traced batch
    size) must not be taken from the caller's."""
    import accelerate.inference
    import accelerate.state

    from nbaccel import PartialState
    from nbaccel.inference import pippy_forward
    from nbaccel.state import isolated_states

    def model(x, micro_batch_size=None, scale=1):
        return (x * scale, micro_batch_size)

    x = torch.ones(2)
    accelerate.state.PartialState._reset_state()
    try:
        accelerate.state.PartialState(cpu=True)
        theirs = accelerate.inference.pippy_forward(model, 1, False, x, micro_batch_size=3, scale=2)
    finally:
        accelerate.state.PartialState._reset_state()
    with isolated_states():
        PartialState(cpu=True)
        ours = pippy_forward(model, 1, False, x, micro_batch_size=3, scale=2)
    assert torch.equal(ours[0], theirs[0]) and ours[1] == theirs[1] == 3
