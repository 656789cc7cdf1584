"""The walk-through notebooks run top to bottom in a real Jupyter kernel and say what they should.

Each notebook is executed with nbclient in a fresh `python3` kernel (this interpreter), in a temporary
working directory, and the test reads the key results from the cells' outputs: accuracies, the gathered
tensors, the mismatch report, the equality of the resumed weights, the number of gathered predictions,
the lines every rank printed.
"""

from __future__ import annotations

import importlib.util
import re
import time
from pathlib import Path

import nbformat
import psutil
import pytest
from notebook_outputs import Executed, check_quickstart, read_outputs
from ssh_server import HOSTS

pytestmark = [pytest.mark.kernel, pytest.mark.slow]

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
EXECUTED = ("01_quickstart", "02_debug_collectives", "03_checkpoint_and_resume", "04_distributed_inference",
            "05_config_and_scripts", "07_big_models", "08_live_output", "09_several_machines", "10_ray_cluster")
# 10_ray_cluster runs in tests/test_ray_launch.py, in the kernel of the session's Ray cluster


def _demo_runner():
    """scripts/run_notebook.py, `./run.sh demo`'s script, as a module."""
    spec = importlib.util.spec_from_file_location("run_notebook", NOTEBOOKS.parent / "scripts" / "run_notebook.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _scripted_input_client() -> type:
    """scripts/run_notebook.py's client: a cell's `nbaccel.input` metadata lines answer its input requests."""
    return _demo_runner().ScriptedInputClient


def run_notebook(name: str, workdir: Path, timeout: int = 240) -> Executed:
    """Execute notebooks/`name` in a fresh kernel, in `workdir`; return its code cells with their outputs."""
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    started = time.monotonic()
    _scripted_input_client()(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(workdir)}}).execute()
    seconds = time.monotonic() - started
    print(f"{name}: {seconds:.1f} s")
    return read_outputs(nb, seconds)


@pytest.mark.timeout(120)
def test_the_demo_runner_shuts_its_kernel_down_before_it_returns(tmp_path, monkeypatch, capsys):
    # `./run.sh demo`'s script: the kernel used to outlive it (and print ipykernel's "Parent appears to have
    # exited, shutting down." on the terminal after the command had returned)
    notebook = tmp_path / "pid.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("import os; print(os.getpid())")],
                                            metadata={"kernelspec": {"name": "python3", "display_name": "Python 3"}}),
                   notebook)
    monkeypatch.chdir(tmp_path)
    assert _demo_runner().main([str(notebook)]) == 0
    kernel = int(capsys.readouterr().out.split("--- cell 1\n")[1].splitlines()[0])
    assert not psutil.pid_exists(kernel) or psutil.Process(kernel).status() == psutil.STATUS_ZOMBIE


def test_the_output_reader_joins_one_print_sent_as_two_messages():
    # ipykernel flushes stdout on a timer, so `print("same:", True)` can reach the notebook as two stream
    # outputs; a notebook shows them as one line, and the reader must too (a CI run once read "same:\n True").
    cell = nbformat.v4.new_code_cell("print('same:', True)")
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="same:"),
                    nbformat.v4.new_output("stream", name="stdout", text=" True\n"),
                    nbformat.v4.new_output("stream", name="stderr", text="warning\n"),
                    nbformat.v4.new_output("stream", name="stdout", text="next\n")]
    text = read_outputs(nbformat.v4.new_notebook(cells=[cell])).cells[0].text
    assert text == "same: True\n\nwarning\n\nnext\n"


def test_each_notebook_is_listed_and_executable():
    names = sorted(path.stem for path in NOTEBOOKS.glob("*.ipynb"))
    assert names == sorted([*EXECUTED, "06_colab_tpu"]), "a new notebook needs its test here"
    for name in EXECUTED:
        nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
        assert nb.metadata.get("nbaccel", {}).get("execute", True) is True, name
        assert nb.metadata["kernelspec"]["name"] == "python3", name


@pytest.mark.timeout(300)
def test_quickstart(tmp_path):
    check_quickstart(run_notebook("01_quickstart.ipynb", tmp_path))


@pytest.mark.timeout(300)
def test_debug_collectives(tmp_path):
    run = run_notebook("02_debug_collectives.ipynb", tmp_path)
    assert "Started 2 ranks" in run.cell("%ranks start").text
    defined = run.cell("import gather, reduce, broadcast").text  # the ranks side by side
    assert "rank 0: tensor([0, 1, 2])" in defined and "rank 1: tensor([10, 11, 12])" in defined, defined
    assert "all ranks: tensor([ 0,  1,  2, 10, 11, 12])" in run.cell("%%ranks\ngather(x)").text
    assert "all ranks: tensor([5., 6., 7.])" in run.cell("reduce(").text
    assert "all ranks: tensor([10, 11, 12])" in run.cell("broadcast(").text
    assert "all ranks: tensor([ 1., -1.,  1.,  1.])" in run.cell("pad_across_processes(ragged").text
    mismatch = run.cell("if state.process_index == 0:")
    assert mismatch.error is not None and mismatch.error.startswith("CollectiveMismatchError"), mismatch.error
    assert re.search(r"rank 0 waits in gather\(.*shape \[3\], int64", mismatch.text), mismatch.text
    assert "rank 1 finished" in mismatch.text
    assert "restarted" in mismatch.text
    # the user's frame, in the cell as JupyterLab numbers it (the 7th code cell: [7]) and at the editor's line
    assert 'File "Cell In[7]", line 3, in <module>\n    gather(x)' in mismatch.text, mismatch.text
    assert "_call_checked" not in mismatch.text and "c10d_logger" not in mismatch.text
    back = run.cell("is back")
    assert back.error is None
    assert "rank 0 is back" in back.text and "rank 1 is back" in back.text
    assert "all ranks: [0, 1, 2, 10, 11, 12]" in back.text  # the restarted pool runs collectives again
    assert "Stopped 2 ranks" in run.cell("%ranks stop").text
    stepped = run.cell("breakpoint()  # rank 1 stops here")  # pdb on rank 1, answered from the cell's metadata
    assert stepped.error is None and "[rank 1] tensor([20, 22, 24])" in stepped.text, stepped.text
    assert "all ranks: tensor(72)" in stepped.text, stepped.text  # 2 * (0+1+2 + 10+11+12)
    post = run.cell("%ranks debug")
    assert post.error is None and "[rank 1] 14" in post.text.splitlines(), post.text


@pytest.mark.timeout(300)
def test_checkpoint_and_resume(tmp_path):
    run = run_notebook("03_checkpoint_and_resume.ipynb", tmp_path)
    plan = run.cell("crash_step =").text
    assert "2 ranks, 44 steps per epoch each; the second run crashes at step 66" in plan, plan
    assert re.search(r"the run failed as planned: .*RuntimeError: simulated crash at step 66", plan), plan
    assert "checkpoints left: ['checkpoint_4', 'checkpoint_5']" in plan  # total_limit=2, saves at 10..60
    assert "[rank 0] finished: 88 steps, 44 per epoch on each of 2 ranks" in plan  # the uninterrupted run
    resumed = run.cell("kwargs={\"resume\": True}").text
    assert "[rank 0] resumed at epoch 1, step 60" in resumed, resumed
    assert "[rank 0] finished: 88 steps" in resumed
    assert "the resumed run ends with the same weights as the uninterrupted one: True" in resumed
    assert "every rank holds the same weights: True" in resumed


@pytest.mark.timeout(300)
def test_distributed_inference(tmp_path):
    run = run_notebook("04_distributed_inference.ipynb", tmp_path)
    scored = run.cell("split_between_processes").text
    per_rank = dict(re.findall(r"\[rank (\d+)\] scored (\d+) images", scored))
    assert per_rank == {"0": "199", "1": "198"}, scored  # 397 inputs split over 2 ranks
    found = re.search(r"(\d+) predictions gathered, accuracy ([0-9.]+)", scored)
    assert found, scored
    assert int(found.group(1)) == 397
    assert float(found.group(2)) > 0.9


@pytest.mark.timeout(300)
def test_config_and_scripts(tmp_path):
    run = run_notebook("05_config_and_scripts.ipynb", tmp_path)
    form = run.cell("config_widget()")
    assert "application/vnd.jupyter.widget-view+json" in form.mimetypes
    # the saved notebook shows what the later cell saved (the form's outputs are updated by their display ids)
    assert "num_processes: 2" in form.text and "use_cpu: True" in form.text, form.text
    assert "one per device" not in form.text
    saved = run.cell("widget.save()").text
    assert re.search(r"saved to \S+default_config\.yaml", saved), saved
    assert "num_processes: 2" in saved and "use_cpu: true" in saved
    launched = run.cell('"nbaccel", "launch"').text
    assert "rank 0 of 2 done on cpu" in launched and "rank 1 of 2 done on cpu" in launched, launched
    epochs = re.findall(r"epoch (\d): loss [0-9.]+", launched)
    assert epochs == ["0", "1", "2"], launched  # accelerator.print: rank 0 only


@pytest.mark.timeout(300)
def test_big_models(tmp_path):
    run = run_notebook("07_big_models.ipynb", tmp_path)
    assert "parameters on meta" in run.cell("with init_empty_weights():").text
    compared = run.cell("max |difference| of logits").text
    assert "max |difference| of logits: 0.0" in compared, compared
    dispatched = re.search(r"dispatched: (\[.*\])", compared)
    reference = re.search(r"reference: +(\[.*\])", compared)
    assert dispatched and reference and dispatched.group(1) == reference.group(1), compared
    trained = run.cell("FullyShardedDataParallelPlugin(").text
    losses = re.search(r"loss \(mean over the 2 ranks\): ([0-9.]+) at step 1 -> ([0-9.]+) at step 24", trained)
    assert losses and float(losses.group(2)) < float(losses.group(1)), trained
    assert re.search(r"the exported model continues 0\.\.9 with \d+", run.cell("load_file(os.path.join(export_dir").text)


@pytest.mark.timeout(300)
def test_live_output(tmp_path):
    run = run_notebook("08_live_output.ipynb", tmp_path)
    launch = run.cell("notebook_launcher(train")
    assert launch.error is None, launch.error
    for rank in (0, 1):  # each bar's final state, once, without its carriage-return history
        assert len(re.findall(rf"\[rank {rank}\] rank {rank} training: 100%.*\| 88/88", launch.text)) == 1, launch.text
        assert re.search(rf"\[rank {rank}\] rank {rank}: test accuracy 0\.9\d\d on 397 images", launch.text), launch.text
        assert re.search(rf"\[rank {rank}\]\s+rank\s+batches per epoch", launch.text), launch.text  # its table
    assert "\r" not in launch.text
    assert "image/png" in launch.mimetypes and "text/html" in launch.mimetypes  # the confusion matrix, tables
    assert "[rank 0] <Figure" in launch.text and "[rank 1] <Figure" not in launch.text
    # the dashboard, turned into its summary at the end (no widget left for a reopened notebook to miss)
    assert "application/vnd.jupyter.widget-view+json" not in launch.mimetypes
    assert "class='nbaccel-summary' data-state='finished'" in launch.html
    assert re.search(r"<div class='nbaccel-display' data-rank='0'>.*>rank 0</div><img src='data:image/png;base64,",
                     launch.html)  # rank 0's figure, captioned with its rank
    # its summary: each rank's steps and the training loader's epochs (once "88/4": the test loader's batches)
    assert launch.html.count(">88 (epoch 3, batch 22/22)<") == 2 and "88/4" not in launch.html, launch.html
    ranks = run.cell("display(Markdown(")
    assert ranks.error is None and "text/markdown" in ranks.mimetypes, ranks.text
    assert re.search(r"\[rank 1\] rank 1: 100%.*10/10", ranks.text) and "\r" not in ranks.text, ranks.text


@pytest.mark.timeout(300)
def test_several_machines(tmp_path, ssh_server, monkeypatch):
    # the kernel inherits these: two aliases of this machine behind the session's sshd (tests/ssh_server.py)
    monkeypatch.setenv("NBACCEL_SSH_CONFIG", str(ssh_server.config))
    monkeypatch.setenv("NBACCEL_HOSTS", ",".join(HOSTS))
    run = run_notebook("09_several_machines.ipynb", tmp_path)
    launch = run.cell("hosts=hosts")
    assert "world size: 2" in launch.text, launch.text
    ranks = re.findall(r"rank (\d+) on cpu: final accuracy ([0-9.]+)", launch.text)
    assert [rank for rank, _ in ranks] == ["0", "1"], launch.text
    epochs = re.findall(rf"\[{HOSTS[0]} rank 0\] epoch (\d+): accuracy [0-9.]+ on 397 test images", launch.text)
    assert [int(epoch) for epoch in epochs] == list(range(8)), launch.text
    # the live dashboard became its summary (no widget left in the file), every rank finished
    assert "application/vnd.jupyter.widget-view+json" not in launch.mimetypes, "a dead widget box when reopened"
    assert "class='nbaccel-summary' data-state='finished'" in launch.html, launch.html
    assert re.findall(r"data-rank='\d+' data-state='(\w+)'", launch.html) == ["finished", "finished"], launch.html
    assert re.findall(r'class="nbaccel-host"[^>]*>([^<]*)<', launch.html) == list(HOSTS), launch.html  # its column
    final = run.cell('print("final accuracy:"')
    assert final.error is None and float(re.search(r"final accuracy: ([0-9.]+)", final.text).group(1)) > 0.85


def test_tpu_recipe_is_marked_not_executed():
    nb = nbformat.read(NOTEBOOKS / "06_colab_tpu.ipynb", as_version=4)
    assert nb.metadata["nbaccel"]["execute"] is False
    assert "not executed" in nb.cells[0].source
    assert any("notebook_launcher(train)" in cell.source for cell in nb.cells)  # one rank per TPU device
    assert any("set_seed(42)" in cell.source for cell in nb.cells)  # equal initial weights on every replica


def test_notebooks_are_saved_without_outputs():
    for path in NOTEBOOKS.glob("*.ipynb"):
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert not cell.get("outputs") and cell.get("execution_count") is None, path.name
