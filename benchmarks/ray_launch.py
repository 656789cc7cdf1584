"""Launch latency on a Ray cluster, 2 nodes x 2 ranks: nbaccel's `notebook_launcher(hosts="ray")` against Ray
Train's `TorchTrainer(...).fit()`, interleaved, on the same cluster.

The cluster is the tests' (tests/ray_cluster.py): two Ray nodes on this machine in a private network
namespace. This script starts it, runs itself inside the namespace as the Ray driver (`--inside`), and stops
it. Each run: the function joins the process group (gloo) and returns its rank; the time is the call's wall
time in the driver (nbaccel: placement group, actors, host agents, ranks, results; Ray Train: its controller,
worker group, torch process group, the run's storage). Needs `pip install "ray[train]"` (the bench extra).

    python benchmarks/ray_launch.py [rounds]
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def rank_of() -> int:
    import torch.distributed as dist

    if not dist.is_initialized():  # nbaccel: PartialState builds the group from the launcher's environment
        from nbaccel import PartialState

        return PartialState().process_index
    return dist.get_rank()


def run_nbaccel() -> list[int]:
    from nbaccel import notebook_launcher

    return notebook_launcher(rank_of, num_processes=2, hosts="ray", dashboard=False)


def run_ray_train(storage: str) -> bool:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    def train_loop() -> None:
        import ray.train

        ray.train.report({"rank": rank_of()})

    trainer = TorchTrainer(train_loop, scaling_config=ScalingConfig(num_workers=4, placement_strategy="SPREAD"),
                           run_config=RunConfig(storage_path=storage))
    result = trainer.fit()
    return result.error is None


def inside(rounds: int) -> None:
    import ray

    ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
    storage = tempfile.mkdtemp(prefix="nbaccel-raytrain-")
    times: dict[str, list[float]] = {"nbaccel": [], "ray_train": []}
    assert run_nbaccel() == [0, 1, 2, 3] and run_ray_train(storage)  # warm-up: workers, imports
    for _ in range(rounds):
        for name, call in (("nbaccel", run_nbaccel), ("ray_train", lambda: run_ray_train(storage))):
            started = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - started)
    nb, rt = statistics.median(times["nbaccel"]), statistics.median(times["ray_train"])
    print(f"nbaccel notebook_launcher(hosts='ray'): median {nb:.2f} s  {[round(t, 2) for t in times['nbaccel']]}")
    print(f"Ray Train TorchTrainer.fit():          median {rt:.2f} s  {[round(t, 2) for t in times['ray_train']]}")
    print(f"ratio nbaccel / Ray Train: {nb / rt:.2f}")
    shutil.rmtree(storage, ignore_errors=True)  # Ray Train's run records


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    sys.path.insert(0, str(ROOT / "tests"))
    import ray_cluster

    folder = Path(tempfile.mkdtemp(prefix="nbaccel-raybench-"))
    cluster = ray_cluster.start_cluster(folder)
    try:
        subprocess.run(cluster.inside([sys.executable, __file__, "--inside", str(rounds)]), env=cluster.environ(),
                       check=True)
    finally:
        cluster.stop()
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--inside":
        sys.path.insert(0, str(ROOT))
        inside(int(sys.argv[2]))
    else:
        main()
