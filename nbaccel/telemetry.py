"""The worker-side reporter: status, logged metrics, steps, memory samples and collectives.

Training code (`Accelerator.log`, the optimizer step, the data loader) reports here unconditionally. Until
a launcher plugs in a sink with `attach`, every call is a cheap no-op, so scripts run without a kernel pay
nothing. The launcher's sink carries messages to the kernel, where the dashboard and persistent ranks read
them. Message shape and kinds are documented in docs/internals.md ("The channel").
"""

from __future__ import annotations

import collections
import numbers
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

try:  # imported here, in the kernel: a rank forked from it would import it cold (3 ms) to send its peak memory
    import resource
except ImportError:  # Windows
    resource = None  # type: ignore[assignment]

from .utils import collective_trace
from .utils.xla import runtime_started as xla_runtime_started

Message = dict[str, Any]
Sink = Callable[[Message], None]
# What a sink with a `defer(item)` method (the launcher's WorkerSink) queues instead of a message: a
# function and its arguments, called when the sink sends its queue, which returns the message.
Deferred = tuple[Any, ...]


class EpochPosition(NamedTuple):
    """Where a prepared data loader's pass is: the epoch (from 0), the batches of it done, and the batches
    in the epoch (None for an unsized loader). A step message carries the position of the loader the
    optimizer stepped in, so the dashboard shows training progress whatever other loaders were prepared."""

    epoch: int
    batch: int
    batches: int | None


class _Reporter:
    """Where one rank's reports go: its sink, its rank, and the sampler batching them."""

    def __init__(self, sink: Sink | None = None, rank: int = 0) -> None:
        self.sink: Sink | None = None
        self.deferring: Any = None  # the sink again when it has `defer(item)`: collectives are queued as tuples
        self.plug(sink, rank)
        self.sampler: _Sampler | None = None
        self.pending_step: tuple[int, int | None, EpochPosition | None] | None = None
        self.queue: collections.deque[Message] = collections.deque()

    def plug(self, sink: Sink | None, rank: int) -> None:
        self.sink, self.rank = sink, rank
        self.deferring = sink if hasattr(sink, "defer") else None


_process = _Reporter()  # the reporter of a process that runs one rank (every launcher but torch_xla's threads)
class _ThreadReporter(threading.local):
    """`reporter`: set in a thread that runs its own rank (torch_xla on TPU v2/v3, CPU); None elsewhere.
    The class default matters: a missing attribute of a thread-local costs a raised and caught
    AttributeError on every look-up (microseconds; the collective trace looks twice per collective)."""

    reporter: _Reporter | None = None


_threads = _ThreadReporter()
_thread_ranks = False  # set for good once a thread attaches its own reporter: until then no look-up is needed


def _current() -> _Reporter:
    return (_threads.reporter or _process) if _thread_ranks else _process


def attach(sink: Sink, rank: int, *, this_thread: bool = False) -> None:
    """Send every report, tagged with `rank`, to `sink`: those of the whole process, or with
    `this_thread` only those made in the calling thread (torch_xla runs several ranks as threads of one
    process; each attaches its own sink)."""
    global _thread_ranks
    if this_thread:
        _threads.reporter = _Reporter(sink, rank)
        _thread_ranks = True
    else:
        _process.plug(sink, rank)
    collective_trace.add_listener(_on_collective, with_record=False)


def detach() -> None:
    """Stop reporting (after the sampler, if running, sent what it holds); later calls are no-ops again.
    In a thread attached with `this_thread`, only that thread's reporter is detached."""
    stop_sampler()
    if _threads.reporter is not None:
        _threads.reporter = None
        return
    _process.plug(None, _process.rank)
    collective_trace.remove_listener(_on_collective)


def is_attached() -> bool:
    return _current().sink is not None


def emit(kind: str, **fields: Any) -> None:
    """Send one message of `kind` with `fields`; dropped silently when no sink is attached."""
    _emit(_current(), kind, fields)


def _emit(reporter: _Reporter, kind: str, fields: dict[str, Any]) -> None:
    sink = reporter.sink
    if sink is None:
        return
    fields.update(kind=kind, rank=reporter.rank, time=time.time())
    sink(fields)


def log_metrics(values: dict[str, Any], step: int | None = None) -> None:
    """What `Accelerator.log` recorded: numbers only, as floats.

    While the sampler runs, the values (stamped now) are queued and the sampler thread sends the queue
    every FLUSH_INTERVAL seconds as ONE `metrics` message: `values`/`step`/`time` are the latest log, and
    `history` lists the earlier ones ({"values", "step", "time"}, oldest first). The kernel gets every
    logged value; the training loop pays a list append instead of a pipe write per log.
    """
    reporter = _current()
    if reporter.sink is None:
        return
    charted = {}
    for key, value in values.items():
        number = _as_number(value)
        if number is not None:
            charted[key if type(key) is str else str(key)] = number  # the kernel's views sort the names
    if not charted:
        return
    if isinstance(step, numbers.Integral) and not isinstance(step, (bool, int)):
        step = int(step)  # NumPy's int64 (`for step in np.arange(n)`): the kernel charts int steps
    if reporter.sampler is not None:
        reporter.queue.append({"values": charted, "step": step, "time": time.time()})
    else:
        _emit(reporter, "metrics", {"values": charted, "step": step})


def report_step(step: int, total: int | None = None, position: EpochPosition | None = None) -> None:
    """One optimizer step done (`step` counts from 1); `total`: the run's steps, when known; `position`:
    where the data loader the step was taken in stands (the prepared optimizer passes it).

    While the sampler runs, the step is only recorded here and the sampler sends the latest one a few
    times a second, so a fast training loop pays an attribute write per step, not a message.
    """
    reporter = _current()
    if reporter.sink is None:
        return
    if reporter.sampler is not None:
        reporter.pending_step = (step, total, position)
    else:
        _emit(reporter, "step", _step_fields(step, total, position))


def _step_fields(step: int, total: int | None, position: EpochPosition | None) -> dict[str, Any]:
    fields: dict[str, Any] = {"step": step, "total": total}
    if position is not None:
        fields.update(epoch=position.epoch, batch=position.batch, batches=position.batches)
    return fields


def report_total_steps(total: int) -> None:
    """The number of optimizer steps the whole run will take, when the training code knows it: the
    dashboard then shows `step/total` and the run's progress (otherwise the epoch's, from the data loader).
    A whole float (`len(loader) * epochs / accumulation`: 88.0) or NumPy integer counts; ValueError otherwise."""
    whole = isinstance(total, numbers.Integral) or (isinstance(total, float) and total.is_integer())
    if isinstance(total, bool) or not whole or total < 1:
        raise ValueError(f"report_total_steps: total must be a positive whole number of optimizer steps, got {total!r}")
    emit("total", total=int(total))


def _as_number(value: Any) -> float | None:
    """`value` as a float if it is one real number (a Python or NumPy number, a one-element tensor or
    array), else None. Never raises: what a tracker accepts (a string, an image, a meta or complex tensor, an
    int too large for a float) must not fail the training loop only because a dashboard is attached."""
    if type(value) is float:  # the common case first: `loss.item()`
        return value
    if isinstance(value, (bool, numpy_bool_types())):
        return None
    try:
        if isinstance(value, numbers.Real):  # int, NumPy's float32 and int64, Fraction
            return float(value)
        size = getattr(value, "numel", None) or getattr(value, "size", None)
        size = size() if callable(size) else size
        if size == 1 and callable(getattr(value, "item", None)):  # a one-element tensor or array
            item = value.item()  # not float(tensor): that warns for a tensor that requires grad
            return float(item) if isinstance(item, numbers.Real) and not isinstance(item, bool) else None
    except Exception:  # noqa: BLE001 - a value that cannot be read as a number is not charted
        return None
    return None


def numpy_bool_types() -> tuple[type, ...]:
    """NumPy's bool scalar type when NumPy is loaded (a flag is not a metric to chart, as `bool` is not)."""
    numpy = sys.modules.get("numpy")
    return (numpy.bool_,) if numpy is not None else ()


def collective_fields(event: str, record: collective_trace.CollectiveRecord) -> dict[str, Any]:
    """The fields of a `collective` message: `enter` carries the whole record; `exit`/`error` only what
    identifies it (op, seq): the receiver already has the rest, and a training step should not pay twice."""
    if event == "enter":
        fields = record.to_dict()  # a new dict: add to it rather than copy it into another
        fields["event"] = event
        return fields
    return {"event": event, "op": record.op, "seq": record.seq}


def collective_item(event: str, trace: collective_trace.in_collective, rank: int) -> Deferred:
    """What a deferring sink queues for one collective event of `rank`: the few values the message needs,
    read now (no tensor is kept), turned into the `collective_fields` message only when the sink sends
    it, off the training thread. The enter message's `time` is the collective's `started`."""
    if event == "enter":
        shapes, dtypes = trace.layout()
        return _enter_message, rank, trace.op, trace.call, shapes, dtypes, trace.site, trace.started, trace.seq
    return _end_message, rank, event, trace.op, trace.seq, time.time()


def _enter_message(rank: int, op: str, call: str, shapes: list[Any], dtypes: list[Any], site: str, started: float,
                   seq: int) -> Message:
    return {"op": op, "call": call, "shapes": list(map(list, shapes)),
            "dtypes": list(map(collective_trace.dtype_name, dtypes)), "site": site, "started": started,
            "seq": seq, "event": "enter", "kind": "collective", "rank": rank, "time": started}


def _end_message(rank: int, event: str, op: str, seq: int, now: float) -> Message:
    return {"event": event, "op": op, "seq": seq, "kind": "collective", "rank": rank, "time": now}


def _on_collective(event: str, trace: collective_trace.in_collective) -> None:
    """The collective trace's listener while a sink is attached (registered with_record=False): the
    launcher's sink defers the message (`collective_item`, written out here: this runs twice per collective,
    between calls that leave the caches cold, where each Python call counts); any other sink gets it at once."""
    reporter = (_threads.reporter or _process) if _thread_ranks else _process
    sink = reporter.deferring  # one read: another thread may detach meanwhile
    if sink is None:
        if reporter.sink is not None:
            _emit(reporter, "collective", collective_fields(event, trace.record()))
    elif event == "enter":
        shapes, dtypes = trace.layout()
        sink.defer((_enter_message, reporter.rank, trace.op, trace.call, shapes, dtypes, trace.site, trace.started,
                    trace.seq))
    else:
        sink.defer((_end_message, reporter.rank, event, trace.op, trace.seq, time.time()))


# --- the background sampler: memory and the latest step, a few times a second ---------------------------

FLUSH_INTERVAL = 0.25  # seconds between sends of the queued log messages (the dashboard redraws at most 5/s by default)
# Logs one send carries at most: past it, consecutive logs are averaged in pairs. `accelerator.log` in a tight loop
# (a few hundred thousand a second) made messages the kernel took longer to read than the rank took to write: the
# launch's end waited seconds for them, and the rank's memory grew with what was still to send.
MAX_LOGS_PER_SEND = 1024


def start_sampler(interval: float = 0.5) -> None:
    """Start a daemon thread sending a `memory` message every `interval` seconds, and every
    FLUSH_INTERVAL the latest `step` and the queued `metrics` (see `report_step`, `log_metrics`).

    Host memory comes from psutil (RSS; the peak from the OS where it keeps one); device memory from
    torch.cuda once CUDA is initialized in this process, or from torch_xla on TPU (which reports the
    memory in use and the device's limit, sent as `device_limit`, rather than a reserved pool). Restarting replaces a
    running sampler. Nothing is sent while no sink is attached. The sampler serves the reporter of the
    calling thread (see `attach`).
    """
    if not (isinstance(interval, (int, float)) and interval > 0):
        raise ValueError(f"start_sampler: interval must be a positive number of seconds, got {interval!r}")
    stop_sampler(flush=False)
    reporter = _current()
    reporter.sampler = _Sampler(float(interval), reporter)
    reporter.sampler.start()


def stop_sampler(flush: bool = True) -> None:
    """Stop the sampler thread; with `flush`, send the queued metrics, the last step and a final memory
    sample first (the launcher calls this before reporting the result, so nothing logged is lost)."""
    reporter = _current()
    sampler, reporter.sampler = reporter.sampler, None
    if sampler is not None:
        sampler.stop()
        if flush:
            sampler.flush()
            sampler.sample_memory()
    reporter.pending_step = None
    reporter.queue.clear()


def memory_sample(xla_device: Any = None) -> dict[str, int | None]:
    """This process's memory now, in bytes: the fields of a `memory` message (None where unknown).
    On torch_xla, `xla_device` names the device to ask (default: the calling thread's)."""
    sample: dict[str, int | None] = dict(
        rss=None, rss_peak=None, device_allocated=None, device_reserved=None, device_peak=None
    )
    sample.update(_host_memory())
    sample.update(_device_memory(xla_device))
    return sample


def process_memory(pid: int) -> dict[str, int | None] | None:
    """Host memory of another process (a worker that reports nothing itself), read from the kernel with
    psutil: the fields of a `memory` message (device fields None), or None when it cannot be read."""
    try:
        import psutil

        rss = psutil.Process(pid).memory_info().rss
    except Exception:
        return None
    if not rss:  # a process that is exiting has released its memory already: no sample
        return None
    return dict(rss=rss, rss_peak=None, device_allocated=None, device_reserved=None, device_peak=None)


class _Sampler:
    def __init__(self, interval: float, reporter: _Reporter) -> None:
        self.interval = interval
        self.reporter = reporter
        self._stopped = threading.Event()
        self._last_step: tuple[int, int | None, EpochPosition | None] | None = None
        self._rss_peak = 0
        self._xla_device = _xla_device()  # the starting thread's device: the sampler's own thread has none
        self._thread = threading.Thread(target=self._run, name="nbaccel-telemetry-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        next_memory = 0.0
        while not self._stopped.is_set():
            try:  # a failed sample must never take down training; try again next tick
                self.flush()
                if time.monotonic() >= next_memory:
                    next_memory = time.monotonic() + self.interval
                    self.sample_memory()
            except Exception:
                pass
            self._stopped.wait(min(self.interval, FLUSH_INTERVAL))

    def flush(self) -> None:
        """Send the queued metrics messages and the latest step, if it moved."""
        reporter = self.reporter
        sink = reporter.sink
        if sink is None:
            return
        entries = []
        while reporter.queue:
            entries.append(reporter.queue.popleft())
        while len(entries) > MAX_LOGS_PER_SEND:
            entries = merge_logs(entries)
        if entries:
            latest = entries.pop()
            message = {"kind": "metrics", "rank": reporter.rank, **latest}
            if entries:
                message["history"] = entries
            sink(message)
        pending = reporter.pending_step
        if pending is not None and pending != self._last_step:
            self._last_step = pending
            _emit(reporter, "step", _step_fields(*pending))

    def sample_memory(self) -> None:
        if self.reporter.sink is None:
            return
        sample = memory_sample(self._xla_device)
        if sample["rss"] is not None:  # platforms without an OS peak: the highest value sampled
            self._rss_peak = max(self._rss_peak, sample["rss"], sample["rss_peak"] or 0)
            sample["rss_peak"] = self._rss_peak
        _emit(self.reporter, "memory", sample)


def merge_logs(entries: list[Message]) -> list[Message]:
    """Queued logs ({"values", "step", "time"}) averaged in consecutive pairs, name by name: each pair becomes
    one log at the later one's step and time, which says in `logs` how many it stands for (the dashboard counts
    logs for a metric logged without a step)."""
    merged = []
    for first, second in zip(entries[0::2], entries[1::2]):
        values = dict(first["values"])
        for name, value in second["values"].items():
            values[name] = (values[name] + value) / 2 if name in values else value
        merged.append({"values": values, "step": second["step"], "time": second["time"],
                       "logs": first.get("logs", 1) + second.get("logs", 1)})
    if len(entries) % 2:
        merged.append(entries[-1])
    return merged


def coalesce_metrics(batch: list[Message]) -> list[Message]:
    """A batch of messages (the launcher's sink sends one every few hundredths of a second) with each run of
    consecutive `metrics` messages made one, its earlier logs in `history`, averaged past MAX_LOGS_PER_SEND
    (`merge_logs`). The kernel then hands the dashboard one message per run, not one per `accelerator.log`:
    a tight loop's hundreds of thousands a second kept the kernel busy seconds after the ranks were done."""
    out: list[Message] = []
    run: list[Message] = []
    for message in [*batch, None]:
        is_log = message is not None and message.get("kind") == "metrics"
        if is_log and (not run or _same_rank(run[-1], message)):
            run.append(message)
            continue
        out.extend(run if len(run) < 2 else [_one_metrics_message(run)])
        run = [message] if is_log else []
        if message is not None and not is_log:
            out.append(message)
    return out


def _same_rank(first: Message, second: Message) -> bool:
    """Whether two messages come from one rank (a sink may carry several: torch_xla's ranks are threads)."""
    return first.get("rank") == second.get("rank") and first.get("local_rank") == second.get("local_rank")


def _one_metrics_message(run: list[Message]) -> Message:
    entries: list[Message] = []
    for message in run:
        for entry in message.get("history") or ():
            entries.append(entry)
        latest = {"values": message.get("values") or {}, "step": message.get("step"), "time": message.get("time")}
        if "logs" in message:
            latest["logs"] = message["logs"]
        entries.append(latest)
    while len(entries) > MAX_LOGS_PER_SEND:
        entries = merge_logs(entries)
    merged = {key: value for key, value in run[-1].items() if key not in ("history", "logs")}
    merged.update(entries[-1])
    if len(entries) > 1:
        merged["history"] = entries[:-1]
    return merged


def _host_memory() -> dict[str, int | None]:
    try:
        import psutil
    except ImportError:
        return {}
    rss = psutil.Process().memory_info().rss
    peak = _os_peak_rss()
    return {"rss": rss, "rss_peak": max(peak, rss) if peak else None}


def _os_peak_rss() -> int | None:
    """This process's peak resident memory in bytes as the OS keeps it (None where it keeps none)."""
    if resource is None:
        return None
    try:
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    except OSError:
        return None
    return maxrss if sys.platform == "darwin" else maxrss * 1024  # Linux reports KiB, macOS bytes


def peak_memory_sample() -> dict[str, int | None]:
    """The fields of a `memory` message with only the peak host memory, from one system call: what a rank
    that ended before its first sample sends with its result (a full sample, psutil's, costs ~0.6 ms cold in
    a new fork, on the way to the result)."""
    return dict(rss=None, rss_peak=_os_peak_rss(), device_allocated=None, device_reserved=None, device_peak=None)


def _xla_device() -> Any:
    """The calling thread's XLA device, if this process already runs torch_xla (never starts its runtime)."""
    xla_model = sys.modules.get("torch_xla.core.xla_model")
    if xla_model is None or not xla_runtime_started():
        return None
    try:
        return xla_model.xla_device()
    except Exception:
        return None


def _device_memory(xla_device: Any = None) -> dict[str, int | None]:
    # Only look at runtimes the training code already loaded: the sampler never initializes one.
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        device = torch.cuda.current_device()
        return {
            "device_allocated": torch.cuda.memory_allocated(device),
            "device_reserved": torch.cuda.memory_reserved(device),
            "device_peak": torch.cuda.max_memory_allocated(device),
        }
    xla_model = sys.modules.get("torch_xla.core.xla_model")
    device = xla_device if xla_device is not None else _xla_device()
    if xla_model is not None and device is not None:
        info = xla_model.get_memory_info(device)
        if "bytes_used" in info:  # torch_xla >= 2.5
            return {"device_allocated": info["bytes_used"], "device_limit": info.get("bytes_limit"),
                    "device_peak": info.get("peak_bytes_used")}
        if "kb_total" in info:  # older torch_xla
            used = (info["kb_total"] - info["kb_free"]) * 1024
            return {"device_allocated": used, "device_limit": info["kb_total"] * 1024}
    return {}
