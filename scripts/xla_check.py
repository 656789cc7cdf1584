"""The TPU path of notebook_launcher on real torch_xla, run by scripts/test-xla on its CPU device.

PJRT_DEVICE=CPU with CPU_NUM_DEVICES=N runs N replicas as threads of ONE process, as a TPU v2/v3 does with
its cores, so this exercises the threaded layout: each rank's own channel, output pipes and telemetry.
Asserts: results in rank order, xm collectives, Accelerator.gather, broadcast_object_list and a prepared
(shuffled: its seed is agreed by a broadcast) data loader across replicas, mixed_precision
reaching every replica, each rank's prints on its own `[rank N]` stream, logged metrics tagged with the
right rank, a failing ordinal reported by name within seconds, and a wrong num_processes refused before
anything starts.
"""

import os
import time

import psutil

from nbaccel.launch import LaunchError, notebook_launcher

WORLD = int(os.environ["CPU_NUM_DEVICES"])


def settle_first_compile():
    """torch_xla's multi-threaded CPU client can deadlock when several threads compile the same collective
    at once (each compiles its own copy, with a different collective id; plain xmp.spawn fails the same
    way). Staggering the first call of each new graph lets the later threads hit the compile cache."""
    import torch_xla.runtime as xr

    time.sleep(1.5 * xr.global_ordinal())


def replicas(scale):
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr
    from torch.utils.data import DataLoader, TensorDataset

    from nbaccel import Accelerator, telemetry
    from nbaccel.utils import broadcast_object_list

    accelerator = Accelerator()
    rank = accelerator.process_index
    assert rank == xr.global_ordinal() and accelerator.num_processes == xr.world_size(), (rank, accelerator.state)
    device = torch_xla.device()
    value = torch.tensor([rank + 1.0]).to(device)  # data, not a constant: the same graph on every replica
    settle_first_compile()
    total = xm.all_reduce(xm.REDUCE_SUM, value).cpu().item()
    settle_first_compile()
    gathered = accelerator.gather(torch.tensor([float(rank)]).to(accelerator.device)).cpu().tolist()
    settle_first_compile()
    shared = broadcast_object_list([{"from": rank}] if rank == 0 else [None])[0]  # sender and receivers alike
    assert shared == {"from": 0}, shared
    loader = accelerator.prepare(DataLoader(TensorDataset(torch.arange(8.0)), batch_size=2, shuffle=True))
    first_batch = next(iter(loader))[0]
    assert first_batch.device.type == "xla" and len(loader) == 4 // accelerator.num_processes, (first_batch, loader)
    print(f"replica {rank} of {accelerator.num_processes} on {device}: sum {total}")
    telemetry.log_metrics({"loss": 10.0 + rank}, step=1)
    return rank * scale, total, gathered, accelerator.mixed_precision, os.environ["NBACCEL_MIXED_PRECISION"]


messages = []
results = notebook_launcher(replicas, (10,), num_processes=None, mixed_precision="bf16", dashboard=False,
                            timeout=300, observers=[messages.append])
print("results", results)
assert len(results) == WORLD, f"expected one result per XLA device ({WORLD}), got {results!r}"
for rank, (scaled, total, gathered, precision, env_precision) in enumerate(results):
    assert scaled == 10 * rank, results
    assert total == WORLD * (WORLD + 1) / 2, results
    assert gathered == [float(r) for r in range(WORLD)], results
    assert precision == "bf16" and env_precision == "bf16", results
lines = {(m["rank"], m["text"]) for m in messages if m["kind"] == "output"}
for rank in range(WORLD):
    assert (rank, f"replica {rank} of {WORLD} on xla:{rank}: sum {WORLD * (WORLD + 1) / 2}") in lines, lines
logged = {(m["rank"], m["values"]["loss"]) for m in messages if m["kind"] == "metrics"}
assert logged == {(rank, 10.0 + rank) for rank in range(WORLD)}, logged
print("results, collectives, output and metrics per rank: OK")


def broken():
    import torch_xla.runtime as xr

    if xr.global_ordinal() == 1:
        raise ValueError("ordinal one fails")
    time.sleep(60)


began = time.monotonic()
try:
    notebook_launcher(broken, num_processes=None, dashboard=False, timeout=120)
except LaunchError as exc:
    assert "ValueError: ordinal one fails" in str(exc) and 1 in exc.failures, exc
    print(f"failure reported in {time.monotonic() - began:.1f} s:", str(exc).splitlines()[0])
else:
    raise SystemExit("the failing rank was not reported")
assert time.monotonic() - began < 30, "the failure took too long to come back"


def no_children_left():
    deadline = time.monotonic() + 10
    while psutil.Process().children(recursive=True) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = psutil.Process().children(recursive=True)
    assert not left, f"processes left behind: {left}"


no_children_left()
began = time.monotonic()
try:
    notebook_launcher(time.sleep, (60,), num_processes=None, dashboard=False, timeout=5)
except LaunchError as exc:
    assert "timed out" in str(exc) or "timeout" in str(exc), exc
    print(f"timeout reported after {time.monotonic() - began:.1f} s:", str(exc).splitlines()[0])
else:
    raise SystemExit("the timeout did not stop the launch")
no_children_left()

try:
    notebook_launcher(broken, num_processes=WORLD + 1, dashboard=False)
except ValueError as exc:
    assert f"has {WORLD} (CPU_NUM_DEVICES={WORLD})" in str(exc), exc
    print("wrong num_processes refused:", str(exc)[:80], "...")
else:
    raise SystemExit("num_processes different from the device count was accepted")

assert notebook_launcher(lambda: "alone", num_processes=1, dashboard=False) == ["alone"]
print("test-xla: OK")
