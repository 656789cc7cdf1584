"""The collective trace's enter announced after an asynchronous collective started (`announce=False`)."""

from __future__ import annotations

import pytest
import torch

from nbaccel.utils import collective_trace
from nbaccel.utils.collective_trace import in_collective


@pytest.fixture
def heard():
    """What a trace listener (as the launcher's telemetry registers it) and a record listener hear."""
    events: list[tuple] = []

    def trace_listener(event, trace):
        events.append(("trace", event, trace.seq, trace.site))

    def record_listener(event, record):
        events.append(("record", event, record.seq, record.site))

    collective_trace.add_listener(trace_listener, with_record=False)
    collective_trace.add_listener(record_listener)
    yield events
    collective_trace.remove_listener(trace_listener)
    collective_trace.remove_listener(record_listener)


def test_an_enter_announced_later_is_heard_once_at_the_announce_with_the_callers_line(heard):
    trace = in_collective("gather", "all_gather_single", [torch.ones(2)], announce=False)
    with trace:
        assert heard == []  # nothing heard before the communication started
        assert collective_trace.current().op == "gather"  # but a hang report already sees it
        trace.announce()
        trace.announce()
        assert [(kind, event) for kind, event, _, _ in heard] == [("trace", "enter"), ("record", "enter")]
    assert [(kind, event) for kind, event, _, _ in heard][2:] == [("trace", "exit"), ("record", "exit")]
    assert {seq for _, _, seq, _ in heard} == {trace.seq}
    assert all(site.startswith(__file__ + ":") for _, _, _, site in heard)


def test_a_collective_left_before_its_announce_is_heard_entering_then_failing(heard):
    with pytest.raises(RuntimeError, match="the start failed"):
        with in_collective("gather", "all_gather_single", [torch.ones(2)], announce=False):
            raise RuntimeError("the start failed")
    assert [(kind, event) for kind, event, _, _ in heard] == [
        ("trace", "enter"), ("record", "enter"), ("trace", "error"), ("record", "error")]
    assert collective_trace.current() is None


def test_a_listener_added_after_the_collective_was_made_hears_its_enter_once():
    trace = in_collective("gather", "all_gather_single", [torch.ones(2)], announce=False)
    seen = []

    def listener(event, record):
        seen.append(event)

    collective_trace.add_listener(listener)  # as a launcher attaching its sink meanwhile
    try:
        with trace:  # heard here, as a collective made before its listener is: the announce adds nothing
            trace.announce()
    finally:
        collective_trace.remove_listener(listener)
    assert seen == ["enter", "exit"]
