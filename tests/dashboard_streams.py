"""Channel message streams for dashboard tests (shapes as in docs/internals.md, "The channel")."""

from __future__ import annotations

T0 = 1_700_000_000.0
MiB = 1 << 20


def scripted_stream(fail_rank: int | None = None) -> list[dict]:
    """Two ranks, 10 steps at 10 steps/s, loss logged each step, memory sampled; rank `fail_rank` fails."""
    messages = []
    for rank in range(2):
        messages.append(dict(kind="status", rank=rank, time=T0, state="starting", device=f"cpu:{rank}"))
        messages.append(dict(kind="status", rank=rank, time=T0 + 0.1, state="running", device=f"cpu:{rank}"))
        messages.append(dict(kind="total", rank=rank, time=T0 + 0.1, total=10))
    for step in range(1, 11):
        for rank in range(2):
            t = T0 + 0.1 + step * 0.1
            messages.append(dict(kind="step", rank=rank, time=t, step=step, total=10))
            messages.append(dict(kind="metrics", rank=rank, time=t, values={"loss": 1.0 / step + rank}, step=step))
            messages.append(dict(kind="memory", rank=rank, time=t, rss=(100 + step) * MiB, rss_peak=None,
                                 device_allocated=None, device_reserved=None, device_peak=None))
            messages.append(dict(kind="output", rank=rank, time=t, stream="stdout", text=f"rank {rank} step {step}"))
    end = T0 + 1.5
    for rank in range(2):
        if rank == fail_rank:
            error = "Traceback (most recent call last):\n  File \"x.py\", line 1\nValueError: loss is nan"
            messages.append(dict(kind="status", rank=rank, time=end, state="failed", error=error))
        else:
            messages.append(dict(kind="status", rank=rank, time=end, state="finished"))
    return messages
