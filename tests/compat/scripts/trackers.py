# Experiment tracking with the real libraries, offline: TensorBoard event files, an MLflow file store, a W&B
# offline run. Logs a configuration and a mix of values, then prints what the library itself recorded:
#   python trackers.py TRACKER OUT_DIR [none-in-config]
import glob
import json
import os
import sys

import torch
from accelerate import Accelerator

tracker_name, out = sys.argv[1], sys.argv[2]
os.environ.update(MLFLOW_TRACKING_URI=f"file:{out}/mlruns", MLFLOW_ALLOW_FILE_STORE="true",
                  WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DIR=out)

accelerator = Accelerator(cpu=True, log_with=tracker_name, project_dir=out)
config = {"lr": 0.1, "epochs": 3, "name": "x", "flag": True}
if tracker_name != "tensorboard" or sys.argv[3:] == ["none-in-config"]:  # torch's add_hparams refuses these
    config.update(none=None, sizes=[1, 2])
accelerator.init_trackers("parity", config=config)
for step in range(3):
    accelerator.log({"loss": 1.0 / (step + 1), "n": step, "t": torch.tensor(step * 0.25), "s": f"text{step}",
                     "d": {"a": step, "b": 2.0}, "b": step % 2 == 0, "nan": float("nan")}, step=step)
accelerator.log({"final": 7})

recorded = {}
if tracker_name == "wandb":
    run = accelerator.get_tracker("wandb", unwrap=True)

    def plain(value):
        return {k: plain(v) for k, v in dict(value).items()} if hasattr(value, "keys") else value

    recorded["config"] = {k: v for k, v in dict(run.config).items() if not k.startswith("_")}
    recorded["summary"] = {k: plain(v) for k, v in dict(run.summary).items() if not k.startswith("_")}
    recorded["run"] = [run.project, run.step]
accelerator.end_training()

if tracker_name == "tensorboard":
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for path in sorted(glob.glob(f"{out}/**/events.out.tfevents*", recursive=True)):
        events = EventAccumulator(path, size_guidance={"tensors": 0, "scalars": 0})
        events.Reload()
        folder = os.path.relpath(os.path.dirname(path), out)
        recorded[folder] = {
            "scalars": {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]},
            "text": {tag: [(e.step, [v.decode() for v in e.tensor_proto.string_val]) for e in events.Tensors(tag)]
                     for tag in events.Tags()["tensors"]},
        }
elif tracker_name == "mlflow":
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    for experiment in client.search_experiments():
        for run in client.search_runs([experiment.experiment_id]):
            recorded[experiment.name] = {
                "status": run.info.status, "params": run.data.params,
                "metrics": {key: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
                            for key in sorted(run.data.metrics)},
            }
print("RESULT " + json.dumps(recorded, sort_keys=True))
