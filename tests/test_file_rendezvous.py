"""The private rendezvous's store (nbaccel/utils/file_rendezvous.py): torch's FileStore, waited on by checks."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from nbaccel import debug_launcher
from nbaccel.utils.file_rendezvous import QuickFileStore, store_for


def test_a_wait_ends_when_another_process_s_store_writes_the_key(tmp_path):
    path = str(tmp_path / "store")
    store = QuickFileStore(path, 2, timedelta(seconds=30))
    other = dist.FileStore(path, 2)  # the peer: torch's own FileStore on the same file
    threading.Timer(0.2, lambda: other.set("peer", b"address")).start()
    started = time.monotonic()
    assert store.get("peer") == b"address"
    assert 0.15 < time.monotonic() - started < 10
    store.set("mine", "x")
    assert other.get("mine") == b"x"
    assert store.add("count", 2) == 2 and other.add("count", 1) == 3
    assert store.compare_set("mine", "x", "y") == b"y"
    assert store.check(["mine", "peer"]) and not store.check(["nobody"])
    assert store.multi_get(["mine", "peer"]) == [b"y", b"address"]
    assert store.clone().get("peer") == b"address"
    assert store.num_keys() == other.num_keys()
    assert sorted(store.list_keys()) == sorted(other.list_keys())
    store.barrier("all", 1, timedelta(seconds=5))


def test_every_store_method_a_file_store_has_is_the_file_store_s(tmp_path):
    """A method of torch's Store that QuickFileStore does not define runs the C++ base's, which says "not
    implemented" where the FileStore has one (list_keys did): each public method is defined here, or is one
    the FileStore lacks too (the queues), or the base's own, built on the methods above (barrier, timeout)."""
    own = set(vars(QuickFileStore))
    built_on_the_others = {"barrier", "timeout"}
    file_store = dist.FileStore(str(tmp_path / "plain"), 1)
    for name in (name for name in dir(dist.Store) if not name.startswith("_")):
        if name in own or name in built_on_the_others:
            continue
        with pytest.raises(NotImplementedError):
            getattr(file_store, name)("queue", "x") if name == "queue_push" else getattr(file_store, name)("queue")


def test_a_missing_key_times_out_with_the_key_and_the_file_named(tmp_path):
    store = QuickFileStore(str(tmp_path / "store"), 2, timedelta(seconds=30))
    started = time.monotonic()
    with pytest.raises(dist.DistStoreError, match=r"0\.3 s .*'never'.*store"):
        store.wait(["never"], timedelta(seconds=0.3))
    assert time.monotonic() - started < 10
    store.set_timeout(timedelta(seconds=0.2))
    with pytest.raises(dist.DistStoreError, match="never"):
        store.get("never")


def test_only_a_plain_file_url_gets_the_quick_store(tmp_path):
    assert isinstance(store_for(f"file://{tmp_path}/store", 2, timedelta(seconds=5)), QuickFileStore)
    assert store_for(f"file://{tmp_path}/store?rank=0&world_size=1", 1, timedelta(seconds=5)) is None
    assert store_for("tcp://127.0.0.1:29500", 2, timedelta(seconds=5)) is None


def _groups_meet() -> list[float]:
    from nbaccel import PartialState

    state = PartialState()
    group = dist.new_group([0, 1])  # a second group: its rendezvous goes through the default group's store too
    value = dist.distributed_c10d._get_default_store()  # the launch's private store under torch's prefix
    value.set(f"seen-{state.process_index}", "1")
    value.wait([f"seen-{1 - state.process_index}"])
    tensor = dist.all_reduce(__import__("torch").ones(1), group=group) or None
    return [float(state.num_processes), tensor is None]


def test_launched_ranks_meet_in_the_private_store_and_build_more_groups():
    assert debug_launcher(_groups_meet, num_processes=2) == [[2.0, True], [2.0, True]]
