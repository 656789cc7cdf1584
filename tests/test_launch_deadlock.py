"""Ranks deadlocked in collectives are named within seconds (issue 15 item 3).

Each fault is provoked with 2 gloo ranks under notebook_launcher (or debug_launcher); the process group keeps
its 600 s default timeout, so a launch that returns in well under 30 s was stopped by nbaccel's detection.
On main these launches hang until `timeout=` (or 600 s) with "ranks still running: [0, 1]", or blame rank 0
with gloo's "Connection closed by peer". Speed figures live in benchmarks/, not here.
"""

from __future__ import annotations

import inspect
import os
import re
import time

import pytest
import torch
from process_helpers import started_children

from nbaccel import debug_launcher, notebook_launcher
from nbaccel.launch import LaunchError, LaunchTimeout
from nbaccel.launch.kernel.collective_tracker import CollectiveTracker
from nbaccel.utils import broadcast, gather, reduce

pytestmark = pytest.mark.timeout(180)
HERE = os.path.abspath(__file__)
BOUND = 30.0  # seconds: far below the process group's 600 s, far above the few seconds the detection takes


def _line(function, text: str, occurrence: int = 1) -> str:
    """`file:line` of the `occurrence`-th line of `function` containing `text` (what the report names)."""
    lines, first = inspect.getsourcelines(function)
    hits = [first + i for i, line in enumerate(lines) if text in line]
    return f"{HERE}:{hits[occurrence - 1]}"


def _state():
    from nbaccel import PartialState

    return PartialState()


def different_operations():
    state = _state()
    t = torch.ones(3)
    if state.process_index == 0:
        reduce(t)
    else:
        broadcast(t)


def different_shapes():
    state = _state()
    reduce(torch.ones(3 + state.process_index))


def gathers_different_sizes():
    state = _state()
    return gather(torch.ones(3 + state.process_index))  # (no debug mode: nothing compares the sizes first)


def gathers_dicts_of_different_sizes():
    state = _state()
    sizes = 3 + state.process_index  # a stacked gather: its enter is heard once the all-gather started
    return gather({"a": torch.ones(sizes), "b": torch.zeros(sizes)})


def returns_early():
    state = _state()
    if state.process_index == 0:
        reduce(torch.ones(3))
    return state.process_index


def returns_before_joining():
    if os.environ["RANK"] == "1":
        return "left before PartialState()"
    return _state().process_index


def joins_late():
    if os.environ["RANK"] == "1":
        time.sleep(3)  # longer than the 2 s grace: rank 0 waits alone in PartialState() meanwhile
    return _state().process_index


def raw_call_left_by_a_rank_that_returned():
    import torch.distributed as dist

    state = _state()
    if state.process_index == 0:
        dist.all_reduce(torch.ones(3))  # rank 1 never calls it: its return ends the call with gloo's error
    return state.process_index


def sleeps_on_rank_1():
    state = _state()
    if state.process_index == 0:
        reduce(torch.ones(3))
    else:
        time.sleep(120)


def slow_but_matching():
    state = _state()
    total = torch.zeros(2)
    for _ in range(2):
        if state.process_index == 1:
            time.sleep(3)  # longer than the 2 s grace: rank 0 waits alone in the same all_reduce
        total += reduce(torch.ones(2), reduction="sum")
    return total.tolist()


def uneven_but_legal():
    from nbaccel.utils import broadcast_object_list, gather_object, pad_across_processes

    state = _state()
    padded = pad_across_processes(torch.ones(state.process_index + 1))  # lengths differ by design
    objects = gather_object([{"rank": state.process_index, "text": "x" * (100 * state.process_index)}])
    sent = broadcast_object_list([state.process_index * 7])
    return padded.tolist(), [o["rank"] for o in objects], sent


def _launch(function, **kwargs):
    started = time.monotonic()
    with pytest.raises(LaunchError) as caught:
        notebook_launcher(function, num_processes=2, dashboard=False, **kwargs)
    elapsed = time.monotonic() - started
    assert not started_children(recursive=True)
    return str(caught.value), elapsed, caught.value


def _deadlock_summary(function, **kwargs):
    """Launch `function`, which must be stopped within BOUND with the deadlock report: (the report's summary
    line, the whole message, the error)."""
    message, elapsed, error = _launch(function, **kwargs)
    assert elapsed < BOUND, message
    lines = message.splitlines()
    assert lines[0] == "not every rank entered the same collective:" and len(lines) > 1, message
    return lines[1], message, error


def test_different_operations_are_named_with_their_lines():
    message, elapsed, error = _launch(different_operations)
    assert elapsed < BOUND, message
    assert message.startswith("not every rank entered the same collective"), message
    assert (f"rank 0 waits in reduce(all_reduce, shape [3], float32) at {_line(different_operations, 'reduce(t)')}"
            in message), message
    assert (f"rank 1 waits in broadcast(broadcast, shape [3], float32) at "
            f"{_line(different_operations, 'broadcast(t)')}" in message), message
    assert "The operations differ: reduce (all_reduce) on rank 0, broadcast (broadcast) on rank 1." in message
    assert sorted(error.failures) == [0, 1]


def test_debug_launcher_names_them_too():
    started = time.monotonic()
    with pytest.raises(LaunchError, match=r"rank 0 waits in reduce\(.*rank 1 waits in broadcast\("):
        debug_launcher(different_operations, num_processes=2)
    assert time.monotonic() - started < BOUND


def test_different_shapes_are_named_even_where_gloo_lets_one_rank_through():
    message, elapsed, _ = _launch(different_shapes)
    assert elapsed < BOUND, message
    line = _line(different_shapes, "reduce(")
    # gloo lets rank 0 through (garbage); rank 1 waits for the rest of its [4]
    assert re.search(rf"rank 0 (went through|waits in) reduce\(all_reduce, shape \[3\], float32\) at {re.escape(line)}",
                     message), message
    assert re.search(rf"rank 1 (went through|waits in) reduce\(all_reduce, shape \[4\], float32\) at {re.escape(line)}",
                     message), message
    assert "The shapes differ: [3] on rank 0, [4] on rank 1." in message


def test_a_rank_that_returned_is_named_instead_of_gloos_connection_error():
    summary, message, _ = _deadlock_summary(returns_early)
    assert re.fullmatch(
        rf"rank 0 waits in reduce\(all_reduce, shape \[3\], float32\) at {re.escape(_line(returns_early, 'reduce('))} "
        r"for [\d.]+ s; rank 1 finished the function", summary), message


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_a_raw_call_that_a_returned_rank_left_is_named_instead_of_gloos_connection_error(start_method):
    """A rank that returns ends its peer's raw `dist.all_reduce` at once ("Connection closed by peer"), before
    the watch's stack sample could show the peer waiting there: the rank names the raw call its error came
    out of (worker/raw_calls.py `report_failure`)."""
    summary, message, error = _deadlock_summary(raw_call_left_by_a_rank_that_returned, start_method=start_method)
    site = _line(raw_call_left_by_a_rank_that_returned, "dist.all_reduce(")
    assert re.fullmatch(rf"rank 0 waits in torch\.distributed\.all_reduce at {re.escape(site)} for [\d.]+ s; "
                        r"rank 1 finished the function", summary), message
    assert "dist.all_reduce(torch.ones(3))" in message  # its stack, down to the user's line
    assert "What the ranks reported:\nrank 0 failed; first: rank 0: RuntimeError: " in message  # gloo's, below
    assert sorted(error.failures) == [0]


@pytest.mark.parametrize("function", [gathers_different_sizes, gathers_dicts_of_different_sizes])
def test_a_rank_killed_by_gloos_abort_is_named_with_its_stack_not_a_stale_collective(capfd, function):
    # gloo aborts the rank whose buffer is too small for what arrives (SIGABRT, as under Accelerate): its last
    # telemetry died with it, so the kernel still showed it in PartialState's rendezvous, and blamed a deadlock.
    # Two right stories, by which reached the kernel first: both ranks' `enter` of the gather (the differing
    # shapes are reported at once, and every rank is stopped, perhaps before gloo's abort), or the abort (its
    # death, with its stack); never a collective it had left. The unit test above holds each order.
    message, elapsed, _ = _launch(function)
    assert elapsed < BOUND, message
    assert "PartialState" not in message, message
    if message.startswith("not every rank entered the same collective:"):
        assert "The shapes differ: [3] on rank 0, [4] on rank 1." in message or (
            "The shapes differ: [3], [3] on rank 0, [4], [4] on rank 1." in message), message
        assert _line(function, "gather(") in message, message
        return
    assert re.match(r"ranks? 0(, 1)? failed; first: rank 0: killed by SIGABRT", message), message  # (1: gloo's reset)
    output = capfd.readouterr()
    assert "Received data size doesn't match expected size" in output.err + output.out
    # the rank's Python stack at the abort (faulthandler), with the user's line
    assert f'File "{HERE}", line {_line(function, "gather(").rsplit(":", 1)[1]} in {function.__name__}' \
           in output.err + output.out, output


def test_a_rank_that_returned_before_partial_state_is_named_instead_of_a_ten_minute_wait():
    # Accelerate's own test_notebook.py races two ranks on one queue into this (its test_fault_tolerant):
    # without the rendezvous traced, rank 0 waited out the process-group timeout in init_process_group
    summary, message, error = _deadlock_summary(returns_before_joining)
    site = _line(_state, "PartialState()")
    assert re.fullmatch(rf"rank 0 waits in PartialState\(init_process_group\) at {re.escape(site)} for [\d.]+ s; "
                        r"rank 1 finished the function", summary), message
    assert str(error.failures[0]).startswith(f"stopped while waiting in PartialState(init_process_group) at {site}")


def test_a_rank_that_only_joins_late_is_waited_for():
    assert notebook_launcher(joins_late, num_processes=2, dashboard=False) == [0, 1]


def test_timeout_says_where_each_rank_was():
    started = time.monotonic()
    with pytest.raises(LaunchTimeout) as caught:
        notebook_launcher(sleeps_on_rank_1, num_processes=2, dashboard=False, timeout=8)
    assert time.monotonic() - started < BOUND
    message = str(caught.value)
    assert "did not finish within timeout=8 s" in message
    assert (f"rank 0 waits in reduce(all_reduce, shape [3], float32) at {_line(sleeps_on_rank_1, 'reduce(')} for"
            in message), message
    assert "rank 1 is still running" in message
    assert not started_children(recursive=True)


def test_matching_collectives_that_are_only_slow_complete():
    assert notebook_launcher(slow_but_matching, num_processes=2, dashboard=False) == [[4.0, 4.0], [4.0, 4.0]]


def test_collectives_whose_inputs_differ_by_design_are_not_flagged():
    # pad_across_processes traces each rank's own (different) tensors; object collectives pickle
    # objects of different sizes: the communications agree, nothing must be reported
    results = notebook_launcher(uneven_but_legal, num_processes=2, dashboard=False)
    assert results == [([1.0, 0.0], [0, 1], [0]), ([1.0, 1.0], [0, 1], [0])]


# ----------------------------------------------------------------------------------- the tracker alone
def _enter(op: str, shapes: list[list[int]], started: float, site: str = "x.py:1") -> dict:
    return {"kind": "collective", "event": "enter", "op": op, "call": op, "shapes": shapes, "dtypes": ["float32"],
            "site": site, "started": started}


def test_the_tracker_flags_a_pair_exactly_when_the_hang_report_finds_a_difference():
    """The tracker skips building the report's pair for records that agree (its per-collective fast path):
    whatever two ranks' n-th collectives differ in, it flags them exactly when `difference` names it."""
    from itertools import product

    from nbaccel.launch.hang_report import RankProgress, difference
    from nbaccel.launch.messages import RankState

    base = _enter("reduce", [[3]], 90.0)
    changes = [{}, {"op": "gather", "call": "gather"}, {"call": "all_reduce"}, {"shapes": [[4]]},
               {"shapes": [[3], [3]]}, {"shapes": []}, {"dtypes": ["int64"]}, {"site": "y.py:2"},
               {"started": 95.0}, {"op": "pad_across_processes", "call": "pad_across_processes"},
               {"op": "pad_across_processes", "call": "pad_across_processes", "shapes": [[5]]}]
    for first, second in product(changes, repeat=2):
        tracker = CollectiveTracker(grace=2)
        tracker.on_message(0, {**base, **first})
        tracker.on_message(1, {**base, **second})
        pair = [RankProgress(rank, RankState.RUNNING, snapshot={"collective": tracker.ranks[rank].inside[-1]})
                for rank in (0, 1)]
        assert (tracker.divergence is not None) == bool(difference(pair)), (first, second)


def test_tracker_rules():
    now = 100.0
    # the same collective, both stuck long: slow, not a deadlock
    tracker = CollectiveTracker(grace=2)
    tracker.on_message(0, _enter("reduce", [[3]], 90.0))
    tracker.on_message(1, _enter("reduce", [[3]], 90.0))
    assert tracker.divergence is None and tracker.check([0, 1], now) is None
    # one rank a collective ahead (it skipped one): different sequence numbers
    tracker = CollectiveTracker(grace=2)
    tracker.on_message(0, _enter("reduce", [[3]], 80.0))
    tracker.on_message(0, {"event": "exit", "op": "reduce"})
    tracker.on_message(0, _enter("reduce", [[3]], 90.0))
    tracker.on_message(1, _enter("reduce", [[3]], 97.0))  # rank 1's first meets rank 0's first: they agree
    assert tracker.divergence is None
    diagnosis = tracker.check([0, 1], now)
    assert diagnosis.kind == "mismatch" and "collective #2 on rank 0, collective #1 on rank 1" in diagnosis.reason
    # pad_across_processes traces tensors whose lengths differ by design: not a divergence
    tracker = CollectiveTracker(grace=2)
    tracker.on_message(0, _enter("pad_across_processes", [[3, 2]], 90.0))
    tracker.on_message(1, _enter("pad_across_processes", [[5, 2]], 90.0))
    assert tracker.divergence is None and tracker.check([0, 1], now) is None
    # another rank just arrived (less than the grace): wait; a rank still computing: wait
    tracker = CollectiveTracker(grace=2)
    tracker.on_message(0, _enter("reduce", [[3]], 90.0))
    tracker.on_message(1, _enter("broadcast", [[3]], 99.5))
    assert tracker.divergence is not None  # (the first collectives already differ: reported at once)
    tracker = CollectiveTracker(grace=2)
    tracker.on_message(0, _enter("reduce", [[3]], 90.0))
    assert tracker.check([0, 1], now) is None  # rank 1 runs code outside any collective: it may still come
    tracker.finished(1)
    assert "rank 1 finished the function" in tracker.check([0, 1], now).summary
    # the root cause of a failure is the rank whose error did not come out of a collective
    tracker = CollectiveTracker(grace=2)
    tracker.on_message(0, _enter("reduce", [[3]], 90.0))
    tracker.on_message(0, {"event": "error", "op": "reduce"})
    tracker.failed(0, "RuntimeError: Connection closed by peer")
    tracker.failed(1, "ValueError: bad")
    assert tracker.root_cause([0, 1], 0) == 1
    assert tracker.at_failure([0, 1], now) is None  # rank 1 failed on its own: its error is the story
    # a rank killed by a signal (gloo's abort on a size mismatch) still shows a collective its finished peer
    # went through: its exit died in its telemetry queue; the death is the story, not a deadlock
    tracker = CollectiveTracker(grace=2)
    for rank in (0, 1):
        tracker.on_message(rank, _enter("PartialState", [], 90.0))
    tracker.on_message(1, {"event": "exit", "op": "PartialState"})
    tracker.on_message(1, _enter("gather", [[4]], 91.0))
    tracker.on_message(1, {"event": "exit", "op": "gather"})
    tracker.finished(1)
    tracker.failed(0, "killed by SIGABRT (exit code -6)")
    assert tracker.at_failure([0, 1], now) is None and tracker.root_cause([0], 0) == 0
    # one killed inside a collective its finished peer never entered: that is the deadlock behind it
    tracker.on_message(0, {"event": "exit", "op": "PartialState"})
    tracker.on_message(0, _enter("gather", [[3]], 91.0))
    tracker.on_message(0, _enter("reduce", [[3]], 92.0))
    assert "rank 1 finished the function" in tracker.at_failure([0, 1], now).summary
    # killed by gloo's abort in its gather while its peer's telemetry of leaving the rendezvous was still
    # batched: that peer is no longer in PartialState (the killed rank left it, so every rank had entered it);
    # the death is the story, not a mismatch between the gather and PartialState
    tracker = CollectiveTracker(grace=2)
    for rank in (0, 1):
        tracker.on_message(rank, _enter("PartialState", [], 90.0))
    tracker.on_message(0, {"event": "exit", "op": "PartialState"})
    tracker.on_message(0, _enter("gather", [[3]], 91.0))
    tracker.failed(0, "killed by SIGABRT (exit code -6)")
    assert tracker.at_failure([0, 1], now) is None and tracker.root_cause([0], 0) == 0
    # what a rank has returned from: collectives nest (inside #1 and #3, it has left #2, not #1), and one an
    # exception came out of may never have been entered by its peers
    from nbaccel.launch.kernel.collective_tracker import _last_left

    tracker = CollectiveTracker(grace=2)
    for event in (_enter("gather_object", [], 90.0), _enter("all_gather", [[3]], 90.1),
                  {"event": "exit", "op": "all_gather"}, _enter("all_gather", [[3]], 90.2)):
        tracker.on_message(0, event)
    assert _last_left(tracker.ranks[0]) == 2
    tracker.on_message(0, {"event": "error", "op": "all_gather"})
    assert _last_left(tracker.ranks[0]) == 2
    tracker.on_message(0, _enter("reduce", [[3]], 90.3))
    tracker.on_message(0, {"event": "error", "op": "reduce"})
    assert _last_left(tracker.ranks[0]) == 3  # (only the latest error is kept: #3 counts as left)
    tracker.finished(0)
    assert _last_left(tracker.ranks[0]) == 4
    tracker = CollectiveTracker(grace=2)  # the killed rank's abort broke its peer's gather: its death still leads
    for rank in (0, 1):
        tracker.on_message(rank, _enter("PartialState", [], 90.0))
    tracker.on_message(1, {"event": "exit", "op": "PartialState"})
    tracker.on_message(1, _enter("gather", [[4]], 91.0))
    tracker.on_message(1, {"event": "error", "op": "gather"})
    tracker.failed(0, "killed by SIGABRT (exit code -6)")
    tracker.failed(1, "RuntimeError: Connection reset by peer")
    assert tracker.at_failure([0, 1], now) is None and tracker.root_cause([0, 1], 1) == 0
    # a rank that finished had entered the collective another still shows: they met, and the other's `exit`
    # (batched telemetry) has not arrived yet; not a deadlock. One that never entered it: a deadlock.
    tracker = CollectiveTracker(grace=2)
    tracker.on_message(0, _enter("reduce", [[3]], 90.0))
    tracker.on_message(1, _enter("reduce", [[3]], 90.0))
    tracker.on_message(1, {"event": "exit", "op": "reduce"})
    tracker.finished(1)
    assert tracker.check([0, 1], now) is None
    tracker.on_message(0, {"event": "exit", "op": "reduce"})
    tracker.on_message(0, _enter("reduce", [[3]], 95.0))
    assert "rank 1 finished the function" in tracker.check([0, 1], now).summary


def raw_different_operations():
    import torch.distributed as dist

    state = _state()
    t = torch.ones(3)
    if state.process_index == 0:
        dist.all_reduce(t)
    else:
        dist.broadcast(t, src=1)


def raw_slow_but_matching():
    import torch.distributed as dist

    state = _state()
    total = torch.ones(2)
    if state.process_index == 1:
        time.sleep(4)  # rank 0 waits alone in the same raw all_reduce, sampled there, longer than the grace
    dist.all_reduce(total)
    return total.tolist()


def test_raw_torch_distributed_calls_are_named_with_their_lines():
    """Raw `torch.distributed` calls are not traced: the ranks' own watch samples where they block
    (launch/worker/raw_calls.py)."""
    message, elapsed, error = _launch(raw_different_operations)
    assert elapsed < BOUND, message
    assert message.startswith("not every rank entered the same collective"), message
    assert (f"rank 0 waits in torch.distributed.all_reduce at {_line(raw_different_operations, 'dist.all_reduce(t)')}"
            in message), message
    assert (f"rank 1 waits in torch.distributed.broadcast at {_line(raw_different_operations, 'dist.broadcast(t')}"
            in message), message
    assert "rank 0, main thread" in message and "dist.all_reduce(t)" in message  # its stack
    assert sorted(error.failures) == [0, 1]


def test_raw_matching_calls_that_are_only_slow_complete():
    assert notebook_launcher(raw_slow_but_matching, num_processes=2, dashboard=False) == [[2.0, 2.0]] * 2


def test_tracker_raw_rules():
    """Sampled raw calls (`event` raw): compared by operation only, believed only while fresh and, against a
    rank that finished, only when seen well after its end (a rank may take a moment to leave a call that met)."""
    now = time.time()

    def raw(op, started=now - 3, seen=now, site="train.py:12"):
        return {"event": "raw", "op": op, "site": site, "started": started, "seen": seen, "stack": ""}

    tracker = CollectiveTracker()
    tracker.on_message(0, raw("torch.distributed.all_reduce"))
    tracker.on_message(1, raw("torch.distributed.broadcast", site="train.py:14"))
    found = tracker.check([0, 1], now)
    assert found is not None and "rank 0 waits in torch.distributed.all_reduce at train.py:12" in found.summary
    assert "rank 1 waits in torch.distributed.broadcast at train.py:14" in found.summary

    same = CollectiveTracker()  # one operation, slow: never a deadlock, whatever the lines
    same.on_message(0, raw("torch.distributed.all_reduce"))
    same.on_message(1, raw("torch.distributed.all_reduce", site="train.py:20"))
    assert same.check([0, 1], now) is None

    ended = CollectiveTracker()  # rank 1 finished; rank 0's sample is from just after its end: not yet believed
    ended.finished(1)
    end = ended.ranks[1].finished_at
    ended.on_message(0, raw("torch.distributed.all_reduce", seen=end + 0.1))
    assert ended.check([0, 1], end + 0.2) is None
    ended.on_message(0, raw("torch.distributed.all_reduce", seen=end + 0.6))
    assert ended.check([0, 1], end + 0.7) is not None

    stale = CollectiveTracker()  # samples stop (the rank left the call and the news is late): not believed
    stale.on_message(0, raw("torch.distributed.all_reduce", seen=now - 5))
    stale.on_message(1, raw("torch.distributed.broadcast", seen=now - 5))
    assert stale.check([0, 1], now) is None

    left = CollectiveTracker()
    left.on_message(0, raw("torch.distributed.all_reduce"))
    left.on_message(0, {"event": "raw", "op": None, "seen": now})
    assert not left.active()

    # an error out of a raw call (sent just before the failure): named against a rank that finished, not on
    # its own (so not the root cause); against a rank killed on its own, that death is the story
    returned = CollectiveTracker()
    returned.finished(1)
    returned.on_message(0, {**raw("torch.distributed.all_reduce", started=now), "failed": True})
    returned.failed(0, "RuntimeError: Connection closed by peer")
    found = returned.at_failure([0, 1], now)
    assert found is not None and found.kind == "mismatch", found
    assert "rank 0 waits in torch.distributed.all_reduce at train.py:12" in found.summary
    assert "rank 1 finished the function" in found.summary
    killed = CollectiveTracker()
    killed.on_message(0, {**raw("torch.distributed.all_reduce", started=now), "failed": True})
    killed.failed(0, "RuntimeError: Connection reset by peer")
    killed.failed(1, "killed by SIGKILL (exit code -9)")
    assert killed.at_failure([0, 1], now) is None and killed.root_cause([0, 1], 0) == 1
