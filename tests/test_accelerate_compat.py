"""Accelerate scripts run on nbaccel after the rename, exactly as a user does it.

Each script in tests/compat/scripts is written for Accelerate (`from accelerate import ...`, shaped like Accelerate's
official examples). The test rewrites `accelerate` -> `nbaccel` in the source text, runs the result with
`python -m nbaccel launch --num_processes 2 --cpu` (or, for a few, pastes it in a "notebook cell" and calls
`notebook_launcher(training_function, ...)` in this process, which is cheaper), and checks what the script printed. The expected values are what
Accelerate 1.15 itself produces for the same scripts under torchrun with 2 CPU processes (checked by hand when the
scripts were written; noted next to each assertion).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parent / "compat" / "scripts"
TIMEOUT = 120


def renamed_source(name: str) -> str:
    """The script's source with every `accelerate` module name replaced by `nbaccel`, as `sed` would do it."""
    return re.sub(r"\baccelerate\b", "nbaccel", (SCRIPTS / name).read_text())


def launch(tmp_path: Path, name: str, *script_args: str, expect_ok: bool = True,
           launcher_args: tuple[str, ...] = ("--num_processes", "2", "--cpu")) -> subprocess.CompletedProcess:
    script = tmp_path / name
    if not script.exists():
        script.write_text(renamed_source(name))
    command = [sys.executable, "-m", "nbaccel", "launch", *launcher_args, str(script), *script_args]
    # stdout stays block-buffered, as for a user piping to a file: each print reaches the pipe as whole lines
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT, env=env)
    if expect_ok:
        assert result.returncode == 0, f"{name} failed (exit {result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result


def results(run: subprocess.CompletedProcess | str) -> list[dict]:
    """The JSON after each `RESULT ` marker (launcher prefixes before it are ignored)."""
    decoder = json.JSONDecoder()
    text = run if isinstance(run, str) else run.stdout
    return [decoder.raw_decode(line.split("RESULT ", 1)[1])[0] for line in text.splitlines() if "RESULT " in line]


def notebook_launch(name: str, capfd: pytest.CaptureFixture[str], **script_args) -> str:
    """Run a script the notebook way: its source pasted in a cell (exec'd in a fresh module, so the
    `if __name__ == "__main__"` block stays off), then `notebook_launcher(training_function, (args,), num_processes=2)`
    in this process. Returns what the workers printed."""
    import argparse

    from nbaccel import notebook_launcher

    cell = types.ModuleType("__notebook_cell__")
    exec(compile(renamed_source(name), f"<cell: {name}>", "exec"), cell.__dict__)
    capfd.readouterr()
    notebook_launcher(cell.training_function, (argparse.Namespace(cpu=True, **script_args),), num_processes=2)
    return capfd.readouterr().out


def single_result(run: subprocess.CompletedProcess | str) -> dict:
    found = results(run)
    text = run if isinstance(run, str) else run.stdout
    assert len(found) == 1, f"expected one RESULT line (main process only), got {len(found)}:\n{text[-3000:]}"
    return found[0]


def test_rename_leaves_no_accelerate_import() -> None:
    imports = re.compile(r"^\s*(from|import)\s+accelerate\b", re.MULTILINE)
    for script in SCRIPTS.glob("*.py"):
        assert imports.search(script.read_text()), f"{script.name} should be written for Accelerate"
        assert not imports.search(renamed_source(script.name)), script.name


def test_nlp_example(tmp_path: Path) -> None:
    """examples/nlp_example.py: prepare 5 objects, train, evaluate with gather_for_metrics (30 eval samples)."""
    run = launch(tmp_path, "nlp_example.py", "--cpu", "--mixed_precision", "no")
    result = single_result(run)
    assert result["num_processes"] == 2
    assert result["eval_count"] == 30  # Accelerate: 30, the padding of the last batch is dropped
    assert result["accuracy"] >= 0.8  # Accelerate: 1.0 after 3 epochs
    assert run.stdout.count("epoch 2:") == 1  # accelerator.print: main process only
    checksums = [(tmp_path / f"checksum_rank{rank}.txt").read_text() for rank in range(2)]
    assert checksums[0] == checksums[1], f"the ranks' weights differ after training: {checksums}"


def test_checkpointing_resume_is_exact(tmp_path: Path) -> None:
    """complete_cv_example / by_feature/checkpointing.py with a seedable sampler: a run resumed from a step
    checkpoint (mid-epoch, via skip_first_batches) ends with exactly the weights of the
    uninterrupted run. Accelerate 1.15: exact (step_8: 10 batches left; also exact from step_12, not run here to
    keep the file short)."""
    full = single_result(launch(tmp_path, "checkpointing.py", "--cpu", "--checkpointing_steps", "4", "--output_dir", "a"))
    assert full["batches_per_epoch"] == 6 and full["batches_seen"] == 18
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["step_12", "step_16", "step_4", "step_8"]
    mid = single_result(launch(tmp_path, "checkpointing.py", "--cpu", "--output_dir", "b",
                               "--resume_from_checkpoint", str(tmp_path / "a" / "step_8")))
    assert (mid["starting_epoch"], mid["batches_seen"], mid["overall_step"]) == (1, 10, 18)
    assert mid["params"] == full["params"], "resumed mid-epoch: weights differ from the uninterrupted run"
    assert mid["lr"] == pytest.approx(full["lr"])


def test_gradient_accumulation(tmp_path: Path) -> None:
    """by_feature/gradient_accumulation.py, 4 steps, 10 batches per process. Accelerate 1.15: gradients sync at
    batches 4, 8 and 10 (the end of the data), the weights change only then, and the scheduler steps once per
    process at each sync: lr = 0.1 * 0.9 ** (3 * 2)."""
    result = single_result(launch(tmp_path, "gradient_accumulation.py", "--cpu", "--gradient_accumulation_steps", "4"))
    assert result["num_processes"] == 2 and result["batches"] == 10
    assert result["sync_steps"] == 3
    assert result["weight_changes"] == 3
    assert result["lr"] == pytest.approx(0.1 * 0.9**6)
    assert result["same_on_all_ranks"]


def test_tracking_tensorboard_and_custom_tracker(tmp_path: Path) -> None:
    """by_feature/tracking.py with log_with=["tensorboard", a user's GeneralTracker subclass], the tracker made
    before the Accelerator, as in Accelerate's guide. (Accelerate 1.15 itself, under torchrun on a CPU machine, runs
    independent single processes here, because the tracker creates `PartialState()` without cpu=True; nbaccel needs
    no flag on CPU -- docs/state.md -- so the run has 2 processes and the main one writes the logs.)"""
    result = single_result(launch(tmp_path, "tracking.py", "--cpu", "--project_dir", "logs"))
    assert result["num_processes"] == 2 and result["steps"] == 4  # 16 samples / batch 4 / 2 processes x 2 epochs
    assert result["trackers"] == ["jsonlines", "tensorboard"]
    assert result["tensorboard_tracker_type"] == "TensorBoardTracker"
    events = list((tmp_path / "logs" / "tracking_example").rglob("events.out.tfevents.*"))
    assert events, "no TensorBoard event file under project_dir/tracking_example"
    lines = [json.loads(line) for line in (tmp_path / "logs" / "custom" / "run.jsonl").read_text().splitlines()]
    assert lines[0] == {"config": {"lr": 0.1, "num_epochs": 2, "batch_size": 4}}
    # 4 steps + 2 epoch summaries, written by the main process only
    assert [line["step"] for line in lines[1:]] == [0, 1, 2, 2, 3, 4], lines


def test_find_executable_batch_size_and_automatic_accumulation(tmp_path: Path) -> None:
    """by_feature/memory.py + automatic_gradient_accumulation.py. Accelerate 1.15 multiplies the batch size by 0.9
    after each out-of-memory error: 32, 28, 25, 22, 19, 17, 15; then 32 // 15 = 2 accumulation steps and 5 updates
    over 9 batches per process (at batches 2, 4, 6, 8 and the last)."""
    result = single_result(launch(tmp_path, "memory.py", "--cpu"))
    assert result["attempts"] == [32, 28, 25, 22, 19, 17, 15]
    assert result["batch_size"] == 15
    assert result["gradient_accumulation_steps"] == 2
    assert result["updates"] == 5


def test_multi_process_metrics_from_a_notebook(capfd: pytest.CaptureFixture[str]) -> None:
    """by_feature/multi_process_metrics.py pasted in a notebook cell: 37 samples over 2 processes, each exactly once
    after gathering."""
    result = single_result(notebook_launch("multi_process_metrics.py", capfd))
    assert result == {"samples_seen": 37, "indices_sorted": True, "names": 37, "unique_names": 37,
                      "mean_len": 37.0, "padded_len": 2, "num_processes": 2}


def test_early_stopping_with_accelerate_config_file(tmp_path: Path) -> None:
    """by_feature/early_stopping.py: the last rank sets the trigger at step 3; every rank stops there. Launched
    with `--config_file` pointing at a multi-CPU config written by Accelerate 1.15's config code (ClusterConfig)."""
    config = SCRIPTS.parent / "fixtures" / "accelerate_multi_cpu_config.yaml"
    launch(tmp_path, "early_stopping.py", "--cpu", launcher_args=("--config_file", str(config)))
    stops = [(tmp_path / f"stopped_rank{rank}.txt").read_text() for rank in range(2)]
    assert stops == ["3", "3"]


def test_local_sgd_from_a_notebook(capfd: pytest.CaptureFixture[str]) -> None:
    """by_feature/local_sgd.py pasted in a notebook cell: parameters averaged every 4 steps; equal on every rank."""
    result = single_result(notebook_launch("local_sgd.py", capfd))
    assert result == {"steps": 8, "same_on_all_ranks": True}


def test_notebook_cells_with_notebook_launcher(capfd: pytest.CaptureFixture[str]) -> None:
    """A notebook's cells (functions and globals in __main__) launched in-process with notebook_launcher."""
    module = types.ModuleType("__main__")
    module.__dict__["__name__"] = "__main__"
    exec(compile(renamed_source("notebook_cells.py"), "<notebook cell>", "exec"), module.__dict__)
    results = module.__dict__["results"]
    # Accelerate's notebook_launcher returns None; nbaccel returns the per-rank values (an addition).
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["world"] == 2 for r in results)
    assert results[0]["checksum"] == pytest.approx(results[1]["checksum"])
    out = capfd.readouterr().out
    assert out.count("epoch 1 loss") == 1, out[-2000:]


def test_save_model_then_big_model_inference_from_a_notebook(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """save_model, init_empty_weights + load_checkpoint_and_dispatch, split_between_processes + gather_object, from
    a notebook cell. Accelerate 1.15 prints exactly this result (5 prompts: 3 on rank 0, 2 on rank 1)."""
    result = single_result(notebook_launch("inference.py", capfd, output_dir=str(tmp_path / "saved")))
    assert result == {
        "on_meta": True, "loaded_matches": True, "num_processes": 2,
        "answers": ["prompt 0 -> rank 0", "prompt 1 -> rank 0", "prompt 2 -> rank 0", "prompt 3 -> rank 1",
                    "prompt 4 -> rank 1"],
    }
    assert sorted(p.name for p in (tmp_path / "saved").iterdir()) == ["model.safetensors"]


def test_local_sgd_on_one_process_and_bad_steps() -> None:
    """LocalSGD (added by the compat area): a no-op without distribution; a clear error for a bad step count."""
    from nbaccel.local_sgd import LocalSGD
    from nbaccel.state import isolated_states

    with isolated_states():
        from nbaccel import Accelerator

        accelerator = Accelerator(cpu=True)
        model = accelerator.prepare(torch.nn.Linear(2, 1))
        before = [p.detach().clone() for p in model.parameters()]
        with LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=1) as local_sgd:
            assert not local_sgd.enabled
            local_sgd.step()
        assert local_sgd.num_steps == 1
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        with pytest.raises(ValueError, match="local_sgd_steps"):
            LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=0)


def test_automatic_checkpoint_naming(tmp_path: Path) -> None:
    """ProjectConfiguration(automatic_checkpoint_naming=True, total_limit=2), save_state() / load_state() without a
    path, a registered user object. Accelerate 1.15: checkpoint_1 and checkpoint_2 remain, the latest is loaded."""
    result = single_result(launch(tmp_path, "automatic_checkpoint_naming.py", "--cpu", "--project_dir", "project"))
    assert result["checkpoints"] == ["checkpoint_1", "checkpoint_2"]
    assert result["restored_weights"] and result["epochs"] == 3 and result["iteration"] == 3
    accelerate_files = {"custom_checkpoint_0.pkl", "model.safetensors", "optimizer.bin", "random_states_0.pkl",
                        "random_states_1.pkl"}
    assert accelerate_files <= set(result["files"]), result["files"]  # nbaccel may add files of its own


def _debug_launched() -> None:
    from nbaccel import Accelerator

    accelerator = Accelerator(cpu=True)
    value = accelerator.reduce(torch.tensor([float(accelerator.process_index + 1)]), reduction="sum")
    assert accelerator.num_processes == 2 and value.item() == 3.0


def test_debug_launcher() -> None:
    """Accelerate's `debug_launcher(function, num_processes=2)`: the function runs on 2 CPU processes."""
    from nbaccel import debug_launcher

    debug_launcher(_debug_launched, num_processes=2)


# Values of api_tour.py where nbaccel deliberately differs from Accelerate 1.15 (see docs/compat.md).
TOUR_DIFFERENCES = {
    "state.device": "Accelerate reports cpu:0 on every CPU rank; nbaccel reports torch.device('cpu')",
}


def _flatten(value, prefix: str = "") -> dict:
    if isinstance(value, dict):
        flat = {}
        for key, item in value.items():
            flat.update(_flatten(item, f"{prefix}{key}."))
        return flat
    return {prefix.rstrip("."): value}


def test_api_tour_matches_accelerate(tmp_path: Path) -> None:
    """api_tour.py: accumulation with uneven data, clipping, scheduler, the operations, split_between_processes,
    on_process decorators, get_state_dict, save, skip_first_batches. Every value equals what Accelerate 1.15 wrote
    for the same script (tests/compat/expected/api_tour_rank*.json), except TOUR_DIFFERENCES."""
    launch(tmp_path, "api_tour.py", "--cpu", "--out", "tour")
    mismatches = []
    for rank in range(2):
        expected = _flatten(json.loads((SCRIPTS.parent / "expected" / f"api_tour_rank{rank}.json").read_text()))
        got = _flatten(json.loads((tmp_path / "tour" / f"rank{rank}.json").read_text()))
        for key in sorted(set(expected) | set(got)):
            if key not in TOUR_DIFFERENCES and expected.get(key, "<missing>") != got.get(key, "<missing>"):
                mismatches.append(f"rank {rank} {key}: Accelerate {expected.get(key, '<missing>')!r}, "
                                  f"nbaccel {got.get(key, '<missing>')!r}")
    assert not mismatches, "\n".join(mismatches)
