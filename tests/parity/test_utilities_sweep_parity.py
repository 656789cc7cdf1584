"""Utilities written for Accelerate, run on Accelerate 1.15 and on nbaccel (1 and 2 gloo ranks) and compared:
the nested-data helpers, environment and seed helpers, `find_executable_batch_size`, `get_logger`, the
`on_*_process` decorators, `split_between_processes(apply_padding=True)`, hooks, and the big-model helpers on
CPU and disk. Found by a parity sweep of the utilities (2026-12-01): the first test holds what differed and was
fixed; the second what nbaccel does on purpose otherwise (docs/compat.md), both sides shown; the rest is what
matched, kept so that it stays so."""

from __future__ import annotations

import json
import logging
import os
import tempfile
import warnings

import pytest
import torch
from parity_harness import assert_ranks_same, assert_same, run_both

pytest.importorskip("accelerate")
pytestmark = pytest.mark.timeout(300)


def _outcome(call):
    """("ok", value) or ("raised", the exception's type name): what code written for Accelerate sees."""
    try:
        return ("ok", call())
    except Exception as exc:
        return ("raised", type(exc).__name__)


def _catches(call, kind):
    """Whether `except kind:` catches what `call` raises (None when it raises nothing)."""
    try:
        call()
    except kind:
        return True
    except Exception as exc:
        return type(exc).__name__
    return None


def fixed_helpers(lib):
    """Each of these differed before the sweep's fixes."""
    import gc

    import numpy as np

    gc.freeze()  # find_executable_batch_size collects garbage at each try: keep that cheap

    u = lib.utils
    found = {}
    os.environ.pop("SWEEP_FLAG", None)
    # a text default is a truth value (nbaccel read bool("no") as True)
    found["flag defaults"] = [u.parse_flag_from_env("SWEEP_FLAG", default=d) for d in ("no", "0", "False", "yes", "1")]
    # Accelerate's code indexes past the end: an IndexError, which nbaccel's errors now also are
    found["concatenate([])"] = _catches(lambda: u.concatenate([]), IndexError)
    found["find_batch_size(0-dim)"] = _catches(lambda: u.find_batch_size(torch.tensor(3.0)), IndexError)
    # set_seed(deterministic=True) leaves a CPU process's environment alone
    os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    u.set_seed(3, deterministic=True)
    found["deterministic"] = (torch.are_deterministic_algorithms_enabled(), torch.rand(2))
    found["CUBLAS_WORKSPACE_CONFIG"] = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    torch.use_deterministic_algorithms(False)
    # a numpy integer as the starting batch size (nbaccel refused it with a ValueError)
    tried = []

    @u.find_executable_batch_size(starting_batch_size=np.int64(12))
    def train(batch_size):
        tried.append(int(batch_size))
        if batch_size > 8:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return int(batch_size)

    found["numpy start"] = (_outcome(train), tried)
    # an accelerator index on a machine without one is torch's RuntimeError (nbaccel's said XPU is not compiled in)
    linear = torch.nn.Linear(2, 2)
    found["index 0"] = _outcome(lambda: u.set_module_tensor_to_device(linear, "weight", 0, value=torch.ones(2, 2)))
    found["checkpoint errors"] = _checkpoint_errors(lib)
    found["dispatch notes"] = _dispatch_notes(lib)
    return found


def _dispatch_notes(lib):
    """The warning dispatch_model logs when weights are offloaded (nbaccel logged none)."""
    bm = lib.big_modeling
    records = _Records()
    logging.getLogger().addHandler(records)
    notes = []
    with tempfile.TemporaryDirectory() as tmp:
        for device_map, force in (({"0": "cpu", "1": "disk"}, False), ({"": "cpu"}, False), ({"": "cpu"}, True),
                                  ({"0": "disk", "1": "disk"}, False)):
            records.seen.clear()
            model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
            bm.dispatch_model(model, device_map, offload_dir=os.path.join(tmp, str(len(notes))), force_hooks=force)
            notes.append([(level, "meta device" in message, "cpu" in message, "disk" in message)
                          for _, level, message, _, _ in records.seen])
    logging.getLogger().removeHandler(records)
    return notes


def _checkpoint_errors(lib):
    """The error types of load_checkpoint_in_model for a bad checkpoint, and the note on a file without metadata."""
    from safetensors.torch import save_file

    u = lib.utils
    found = {}
    records = _Records()
    logging.getLogger().addHandler(records)
    with tempfile.TemporaryDirectory() as tmp:
        weights = {**_net(tied=False).state_dict(), "extra.weight": torch.ones(2)}
        torch.save(weights, os.path.join(tmp, "model.bin"))
        save_file(weights, os.path.join(tmp, "bare.safetensors"))
        save_file(weights, os.path.join(tmp, "odd.safetensors"), metadata={"format": "odd"})
        save_file(weights, os.path.join(tmp, "tf.safetensors"), metadata={"format": "tf"})
        with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
            json.dump({"weight_map": {"embed.weight": "gone.safetensors"}}, f)
        load = u.load_checkpoint_in_model
        found["strict"] = _catches(lambda: load(_net(tied=False), os.path.join(tmp, "model.bin"), strict=True),
                                   RuntimeError)
        found["odd format"] = _catches(lambda: load(_net(tied=False), os.path.join(tmp, "odd.safetensors")), OSError)
        found["tf format"] = _catches(lambda: load(_net(tied=False), os.path.join(tmp, "tf.safetensors")),
                                      ValueError)
        found["unknown dtype"] = _catches(lambda: load(_net(tied=False), os.path.join(tmp, "model.bin"),
                                                       dtype="float17"), AttributeError)
        found["missing shard"] = _catches(
            lambda: load(_net(tied=False), os.path.join(tmp, "model.safetensors.index.json")), FileNotFoundError)
        records.seen.clear()
        u.modeling.load_state_dict(os.path.join(tmp, "bare.safetensors"))
        found["no metadata"] = [(level, "metadata" in message) for _, level, message, _, _ in records.seen]
    logging.getLogger().removeHandler(records)
    return found


def test_what_differed_is_now_as_in_accelerate():
    results = run_both(fixed_helpers, 1)
    theirs, ours = results["accelerate"][0], results["nbaccel"][0]
    assert theirs["flag defaults"] == [False, False, False, True, True]
    assert theirs["concatenate([])"] is True and theirs["find_batch_size(0-dim)"] is True
    assert theirs["numpy start"] == (("ok", 8), [12, 10, 9, 8])
    if not torch.cuda.is_available():
        assert theirs["index 0"] == ("raised", "RuntimeError")
    assert theirs["checkpoint errors"] == {"strict": True, "odd format": True, "tf format": True,
                                           "missing shard": True, "no metadata": [("WARNING", True)],
                                           "unknown dtype": True}
    assert theirs["dispatch notes"] == [[("WARNING", True, True, True)], [], [("WARNING", True, True, False)],
                                        [("WARNING", True, False, True)]]
    if torch.cuda.is_available():  # docs/compat.md: on CUDA nbaccel sets the variable deterministic cuBLAS needs
        assert (theirs.pop("CUBLAS_WORKSPACE_CONFIG"), ours.pop("CUBLAS_WORKSPACE_CONFIG")) == (None, ":4096:8")
    assert_same(theirs, ours, "fixed_helpers")


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("scale", torch.full((4,), 2.0))
        self.register_buffer("tmp", torch.ones(1), persistent=False)

    def forward(self, x):
        return self.lin(x) * self.scale + self.tmp


class Net(torch.nn.Module):
    def __init__(self, tied=True):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.blocks = torch.nn.ModuleList([Block() for _ in range(3)])
        self.head = torch.nn.Linear(4, 10, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _net(tied=True):
    torch.manual_seed(0)
    return Net(tied)


def _devices(model):
    return sorted((name, t.device.type, str(t.dtype)) for name, t in model.state_dict(keep_vars=True).items())


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.seen = []

    def emit(self, record):
        self.seen.append((record.name, record.levelname, record.getMessage(), record.funcName,
                          getattr(record, "sweep", None)))


def deliberate(lib):
    """What nbaccel does on purpose otherwise (docs/compat.md); the test states both sides."""
    from safetensors.torch import save_file

    u, bm = lib.utils, lib.big_modeling
    found = {}
    # init_empty_weights keeps a weight tied by assignment (Accelerate makes the second module a new meta weight)
    with bm.init_empty_weights():
        empty = Net()
    found["tied under init_empty_weights"] = empty.head.weight is empty.embed.weight
    with tempfile.TemporaryDirectory() as tmp:
        untied = _net(tied=False)
        save_file(untied.state_dict(), os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        with bm.init_empty_weights():
            model = Net(tied=False)
        u.load_checkpoint_in_model(model, os.path.join(tmp, "model.safetensors"), dtype=torch.float16)
        found["dtype without a device map"] = model.blocks[0].lin.weight.dtype
        with bm.init_empty_weights():
            model = Net(tied=False)
        device_map = {"embed": "cpu", "blocks.0": "cpu", "blocks.1": "disk", "blocks.2": "cpu", "head": "cpu"}
        u.load_checkpoint_in_model(model, os.path.join(tmp, "model.safetensors"), device_map=device_map,
                                   offload_folder=os.path.join(tmp, "offload"))
        found["offload folder"] = sorted(os.listdir(os.path.join(tmp, "offload")))
        with open(os.path.join(tmp, "offload", "index.json")) as f:
            found["index points at"] = sorted({os.path.basename(v.get("safetensors_file", ".dat"))
                                               for v in json.load(f).values()})
        model = bm.dispatch_model(model, device_map, offload_dir=os.path.join(tmp, "offload"))
        found["offloaded forward"] = model(torch.tensor([[1, 2]])) - untied(torch.tensor([[1, 2]]))
        found["offloaded .to(dtype)"] = _outcome(lambda: model.to(torch.float64)(torch.tensor([[1, 2]])) - (
            _net(tied=False).double()(torch.tensor([[1, 2]]))))
        found["offloaded .to(device)"] = _outcome(lambda: model.to("cpu"))
        found["all on disk"] = _outcome(lambda: bm.dispatch_model(_net(tied=False), {"": "disk"}, offload_dir=os.path.join(
            tmp, "all"))(torch.tensor([[1, 2]])).equal(untied(torch.tensor([[1, 2]]))))
        weights = lib.utils.offload.OffloadedWeightsLoader(state_dict={"a.x": torch.ones(1), "b": torch.ones(1)})
        prefixed = lib.utils.offload.PrefixedDataset(weights, "a.")
        found["prefixed"] = (len(prefixed), list(prefixed))
    with tempfile.TemporaryDirectory() as tmp:
        save_file({k: v for k, v in _net(tied=False).state_dict().items() if k != "head.weight"},
                  os.path.join(tmp, "partial.safetensors"), metadata={"format": "pt"})
        with bm.init_empty_weights():
            model = Net(tied=False)
        found["a meta weight the checkpoint lacks"] = _outcome(
            lambda: u.load_checkpoint_in_model(model, os.path.join(tmp, "partial.safetensors")))
        found["left on meta"] = [n for n, t in model.state_dict().items() if t.device.type == "meta"]
    found["pad_input_tensors sizes"] = [len(u.pad_input_tensors(torch.arange(rows), batch_size=rows, num_processes=2))
                                        for rows in (1, 2, 3, 6, 9)]
    found["pad_input_tensors(dim=1)"] = _outcome(
        lambda: u.pad_input_tensors(torch.ones(2, 3), batch_size=3, num_processes=2, dim=1).shape)
    found["MemoryError retried"] = _outcome(lambda: u.find_executable_batch_size(
        lambda b: b if b < 6 else (_ for _ in ()).throw(MemoryError()), starting_batch_size=7)())
    lib.PartialState(cpu=True)
    records = _Records()
    logging.getLogger().addHandler(records)
    lib.logging.get_logger("sweep.extra").warning("with extra", extra={"sweep": 5})
    logging.getLogger().removeHandler(records)
    found["extra"] = [r[-1] for r in records.seen]
    found["empty flag"] = _outcome(lambda: (os.environ.__setitem__("SWEEP_FLAG", ""),
                                            u.parse_flag_from_env("SWEEP_FLAG", default=True))[1])
    found["str_to_bool"] = [_outcome(lambda v=v: u.str_to_bool(v)) for v in (True, 1, " yes ", None)]
    import collections

    found["defaultdict"] = _outcome(lambda: type(u.recursively_apply(
        lambda x: x, collections.defaultdict(list, a=torch.ones(1)))).__name__)
    found["0-dim batch size"] = _outcome(lambda: u.ignorant_find_batch_size(torch.tensor(1.0)))
    found["device_specific without an Accelerator"] = _outcome(lambda: u.set_seed(1, device_specific=True))
    found["synchronize without a generator"] = _outcome(lambda: u.synchronize_rng_states(["generator"]))
    def made_in_context():
        with bm.init_on_device("meta", include_buffers=True):
            return torch.ones(1).device.type

    found["init_on_device by name"] = _outcome(made_in_context)
    import pickle

    hooked = lib.hooks.add_hook_to_module(torch.nn.Linear(2, 2), lib.hooks.ModelHook())
    found["hooked module pickles"] = _outcome(lambda: type(pickle.loads(pickle.dumps(hooked))).__name__)
    found["value as a list"] = _outcome(lambda: u.set_module_tensor_to_device(torch.nn.Linear(2, 1), "bias", "cpu",
                                                                              value=[0.5]))
    found["sizes"] = [_outcome(lambda size=size: u.convert_file_size_to_int(size)) for size in ("100", "2TB", 10.5)]
    found["on_process(-1)"] = _outcome(lambda: lib.PartialState().on_process(process_index=-1)(lambda: "ran")())
    found["on_process('0')"] = _outcome(lambda: lib.PartialState().on_process(process_index="0")(lambda: "ran")())
    found["on_main_process()"] = _outcome(lambda: lib.PartialState().on_main_process()(lambda: "ran")())
    return found


def test_what_nbaccel_does_on_purpose_otherwise():
    results = run_both(deliberate, 1)
    theirs, ours = results["accelerate"][0], results["nbaccel"][0]
    assert (theirs["tied under init_empty_weights"], ours["tied under init_empty_weights"]) == (False, True)
    # Accelerate 1.15 hands a map-less load to torch's set_model_state_dict, which keeps the model's dtype
    assert (theirs["dtype without a device map"], ours["dtype without a device map"]) == (torch.float32,
                                                                                          torch.float16)
    # a safetensors checkpoint's disk-offloaded weights: Accelerate copies them into .dat files, nbaccel's index
    # points into the checkpoint (Accelerate's loader reads such entries too)
    assert theirs["offload folder"] == ["blocks.1.lin.bias.dat", "blocks.1.lin.weight.dat", "index.json"]
    assert (ours["offload folder"], ours["index points at"]) == (["index.json"], ["model.safetensors"])
    assert (theirs["all on disk"], ours["all on disk"]) == (("raised", "FileNotFoundError"), ("ok", True))
    assert (theirs["prefixed"], ours["prefixed"]) == ((2, ["a.x"]), (1, ["a.x"]))
    assert_same(theirs["offloaded forward"], ours["offloaded forward"])
    assert theirs["offloaded .to(dtype)"] == ("raised", "RuntimeError")
    assert ours["offloaded .to(dtype)"][0] == "ok" and not ours["offloaded .to(dtype)"][1].any()
    assert theirs["offloaded .to(device)"] == ours["offloaded .to(device)"] == ("raised", "RuntimeError")
    assert not ours["offloaded forward"].any()
    assert (theirs["pad_input_tensors sizes"], ours["pad_input_tensors sizes"]) == ([2, 3, 4, 7, 12], [2, 2, 4, 6, 10])
    assert theirs["a meta weight the checkpoint lacks"] == ("ok", None)
    assert ours["a meta weight the checkpoint lacks"] == ("raised", "ValueError")
    assert theirs["left on meta"] == ours["left on meta"] == ["head.weight"]
    assert theirs["pad_input_tensors(dim=1)"] == ("raised", "RuntimeError")
    assert ours["pad_input_tensors(dim=1)"] == ("ok", torch.Size([2, 4]))
    assert (theirs["MemoryError retried"], ours["MemoryError retried"]) == (("raised", "MemoryError"), ("ok", 5))
    assert (theirs["extra"], ours["extra"]) == ([None], [5])  # Accelerate's LoggerAdapter replaces it
    assert (theirs["empty flag"], ours["empty flag"]) == (("raised", "ValueError"), ("ok", True))
    assert theirs["str_to_bool"] == [("raised", "AttributeError")] * 2 + [("raised", "ValueError"),
                                                                          ("raised", "AttributeError")]
    assert ours["str_to_bool"] == [("ok", 1)] * 3 + [("raised", "ValueError")]
    assert (theirs["defaultdict"], ours["defaultdict"]) == (("raised", "TypeError"), ("ok", "defaultdict"))
    assert (theirs["0-dim batch size"], ours["0-dim batch size"]) == (("raised", "IndexError"), ("ok", None))
    assert theirs["device_specific without an Accelerator"] == ("raised", "ValueError")
    assert ours["device_specific without an Accelerator"] == ("ok", None)
    assert theirs["synchronize without a generator"] == ("raised", "AssertionError")
    assert ours["synchronize without a generator"] == ("raised", "ValueError")
    assert (theirs["init_on_device by name"], ours["init_on_device by name"]) == (("raised", "TypeError"),
                                                                                  ("ok", "meta"))
    assert (theirs["on_process(-1)"], ours["on_process(-1)"]) == (("ok", "ran"), ("raised", "ValueError"))
    assert (theirs["hooked module pickles"], ours["hooked module pickles"]) == (("raised", "AttributeError"),
                                                                                ("ok", "Linear"))
    assert (theirs["value as a list"], ours["value as a list"]) == (("raised", "AttributeError"), ("ok", None))
    assert theirs["sizes"] == [("raised", "ValueError")] * 2 + [("raised", "AttributeError")]
    assert ours["sizes"] == [("ok", 100), ("ok", 2 * 10**12), ("ok", 10)]
    assert (theirs["on_process('0')"], ours["on_process('0')"]) == (("ok", "ran"), ("raised", "ValueError"))
    assert (theirs["on_main_process()"], ours["on_main_process()"]) == (("raised", "TypeError"), ("ok", "ran"))


def helpers(lib):
    """Nested-data, environment and seed helpers: values, container types, exception types."""
    import collections

    u = lib.utils
    t = torch.arange(6, dtype=torch.float32).reshape(3, 2)
    point = collections.namedtuple("Point", "x y")
    found = {
        "send skip_keys": u.send_to_device({"a": t, "b": [t, (t,)], "c": "x"}, "cpu", non_blocking=True,
                                           skip_keys="a"),
        "send skip list": u.send_to_device({"a": t, "b": t}, "cpu", skip_keys=["a", "b"]),
        "send mixed": u.send_to_device((t, 1, "a", None), "cpu"),
        "send namedtuple": type(u.send_to_device(point(t, 1), "cpu")).__name__,
        "fp32": u.convert_outputs_to_fp32(lambda: {"x": t.half(), "y": [t.bfloat16(), t.int()]})(),
        "find_batch_size": u.find_batch_size({"a": [(t,)]}),
        "find_batch_size errors": [_outcome(lambda d=d: u.find_batch_size(d)) for d in ([], {}, None, 3, ["a"])],
        "listify": u.listify({"a": t, "b": (torch.tensor(1.5), [torch.tensor([1, 2])]), "c": t.bfloat16()}),
        "pad_input_tensors": [u.pad_input_tensors(torch.arange(5), batch_size=5, num_processes=2),
                              u.pad_input_tensors({"a": torch.ones(3, 2)}, batch_size=3, num_processes=4)],
        "concatenate": [u.concatenate([{"a": t, "b": [t]}] * 2), u.concatenate([(t, t)] * 2, dim=1),
                        _outcome(lambda: u.concatenate([1, 2]))],
        "slice": u.slice_tensors({"a": t, "b": (t, "s")}, slice(0, 2)),
        "recursively_apply": [u.recursively_apply(lambda x: x + 1, [1, 2.0, t, "a"],
                                                  test_type=lambda x: isinstance(x, int)),
                              _outcome(lambda: u.recursively_apply(lambda x: x, [t, "a"], error_on_other_type=True)),
                              u.recursively_apply(lambda x, y, z=0: x + y + z, [t], 1, z=2)],
        "merge_dicts": u.merge_dicts({"a": {"c": {"e": 3}}, "y": 2}, {"a": {"b": 1, "c": {"d": 2}}, "x": 1}),
        "convert_file_size_to_int": [u.convert_file_size_to_int(size) for size in ("1KB", "1KiB", "1.5GB", "1Kb",
                                                                               "5 GB", "5gb", 7)],
        "convert_bytes": [u.convert_bytes(n) for n in (0, 1023, 1024, 1536, 10**6, 1024**3 * 5.5, 1024**6 * 3)],
        "str_to_bool": [(u.str_to_bool(s), u.str_to_bool(s, to_bool=True)) for s in ("yes", "T", "on", "0", "off")],
        "str_to_bool bad": _outcome(lambda: u.str_to_bool("maybe")),
    }
    os.environ["SWEEP_EXISTING"] = "before"
    with u.patch_environment(sweep_existing=1, SWEEP_NEW=True):
        inside = (os.environ["SWEEP_EXISTING"], os.environ["SWEEP_NEW"])
        os.environ["SWEEP_NEW"] = "changed"
    found["patch_environment"] = (inside, os.environ.get("SWEEP_EXISTING"), os.environ.get("SWEEP_NEW"))
    import socket

    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        found["is_port_in_use"] = u.is_port_in_use(port)
    for value in (None, "1", "yes", "0", "off"):
        os.environ.pop("SWEEP_FLAG", None)
        if value is not None:
            os.environ["SWEEP_FLAG"] = value
        found[f"flag {value}"] = (u.parse_flag_from_env("SWEEP_FLAG"), u.parse_flag_from_env("SWEEP_FLAG", True),
                                  u.parse_choice_from_env("SWEEP_FLAG", "d"))
    class ToWithoutOptions:
        def to(self, device):
            return "moved"

    found["send .to without non_blocking"] = u.send_to_device({"x": ToWithoutOptions()}, "cpu", non_blocking=True)
    os.environ["SWEEP_KEPT"] = "1"
    with u.clear_environment():
        cleared = dict(os.environ)
        os.environ["SWEEP_INSIDE"] = "x"
    found["clear_environment"] = (cleared, os.environ.get("SWEEP_KEPT"), os.environ.get("SWEEP_INSIDE"))
    linear = torch.nn.Linear(2, 2)
    found["extract compiled"] = (u.extract_model_from_parallel(torch.compile(linear)) is linear,
                                 u.is_compiled_module(torch.compile(linear)))
    found["save a list safely"] = _outcome(lambda: u.save([torch.ones(1)], "unused.safetensors", safe_serialization=True))
    u.set_seed(11)
    import random

    import numpy as np

    found["set_seed draws"] = (torch.rand(2), np.random.rand(2).tolist(), random.random())
    return found


def memory(lib):
    """The sizes `find_executable_batch_size` tries, for the errors Accelerate counts as out of memory. (Each
    call and retry collects garbage, ~0.1 s with torch's objects to walk: they are frozen out of the collector's
    way first, and the searches are kept short.)"""
    import gc

    gc.freeze()
    u = lib.utils
    found = {}
    for name, error in (("cuda", "CUDA out of memory. Tried to allocate"), ("cpu", "DefaultCPUAllocator: can't "
                        "allocate memory: you tried"), ("cudnn", "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This"),
                        ("mps", "MPS backend out of memory (MPS allocated"), ("other", "boom")):
        tried = []

        @u.find_executable_batch_size(starting_batch_size=4)
        def train(batch_size, extra=0, error=error, tried=tried):
            tried.append(batch_size)
            if batch_size > 3:
                raise RuntimeError(error)
            return batch_size + extra

        found[name] = (_outcome(lambda: train(extra=1)), tried)
    found["second call starts where the first ended"] = (_outcome(train), tried)
    tried = []

    @u.find_executable_batch_size(starting_batch_size=3)
    def never(batch_size):
        tried.append(batch_size)
        raise torch.OutOfMemoryError("CUDA out of memory.")

    found["to zero"] = (_outcome(never), tried)
    found["reduce fn"] = _outcome(u.find_executable_batch_size(
        lambda b: b if b == 2 else (_ for _ in ()).throw(RuntimeError("CUDA out of memory.")),
        starting_batch_size=9, reduce_batch_size_fn=lambda: 2))
    found["zero start"] = _outcome(u.find_executable_batch_size(lambda b: b, starting_batch_size=0))
    found["batch size passed"] = _outcome(lambda: u.find_executable_batch_size(lambda b, a: a)(8, 1))
    a, b = torch.ones(3), [1]
    found["release_memory"] = u.release_memory(a, b)
    return found


def ranks(lib):
    """What each rank gets from get_logger, the decorators, main_process_first and split_between_processes."""
    found = {"before any state": _outcome(lambda: lib.logging.get_logger("sweep.early").info("x"))}
    state = lib.PartialState(cpu=True)
    records = _Records()
    root = logging.getLogger()
    root.addHandler(records)
    root.setLevel(logging.WARNING)
    logger = lib.logging.get_logger("sweep.main")
    logger.info("dropped")
    logger.warning("main only")
    logger.warning("everyone", main_process_only=False)
    logger.warning("in order %d", state.process_index, in_order=True)
    logger.warning_once("once")
    logger.warning_once("once")
    lib.logging.get_logger("sweep.debug", log_level="debug").debug("debug shown")
    os.environ["ACCELERATE_LOG_LEVEL"] = "ERROR"
    from_env = lib.logging.get_logger("sweep.env")
    from_env.warning("dropped")
    from_env.error("error shown")
    del os.environ["ACCELERATE_LOG_LEVEL"]
    found["log levels"] = (logging.getLogger("sweep.env").level, root.level)
    root.removeHandler(records)
    found["records"] = records.seen
    found["bad level"] = _outcome(lambda: lib.logging.get_logger("sweep.bad", log_level="LOUD"))
    found["decorated"] = [
        state.on_main_process(lambda x: ("main", x))(1), state.on_local_main_process(lambda: "local main")(),
        state.on_last_process(lambda: "last")(), state.on_process(process_index=1)(lambda: "one")(),
        state.on_process(lambda: "one again", process_index=1)(), state.on_process(process_index=5)(lambda: 5)(),
        state.on_local_process(local_process_index=0)(lambda: "local zero")()]
    accelerator = lib.Accelerator(cpu=True)

    class Tracker:
        calls = 0

        @accelerator.on_main_process
        def step(self):
            Tracker.calls += 1
            return Tracker.calls

    found["accelerator decorated"] = [accelerator.on_main_process(lambda: "main")(),
                                      accelerator.on_last_process(lambda: "last")(),
                                      accelerator.on_process(process_index=1)(lambda: "one")(), Tracker().step()]
    order = []
    with state.main_process_first():
        order.append(state.process_index)
    with accelerator.local_main_process_first():
        order.append(state.process_index)
    found["main_process_first"] = order
    generator = torch.Generator().manual_seed(100 + state.process_index)
    torch.manual_seed(7 + state.process_index)
    lib.utils.synchronize_rng_states(["torch", "generator"], generator=generator)
    found["synchronized draws"] = (torch.rand(2), torch.rand(2, generator=generator))
    lib.utils.set_seed(1, device_specific=True)
    found["device-specific draws"] = torch.rand(2)
    for pad in (False, True):
        for name, data in (("list", list(range(5))), ("one item", ["a"]),
                           ("dict", {"a": list(range(5)), "b": torch.arange(5)}),
                           ("tensor", torch.arange(10).reshape(5, 2)), ("tensors", [torch.ones(1), torch.zeros(2)]),
                           ("uneven dict", {"a": [1, 2, 3], "b": [4, 5]})):
            def split(data=data, pad=pad):
                with state.split_between_processes(data, apply_padding=pad) as part:
                    return part
            found[f"split {name} {pad}"] = _outcome(split)
    return found


def hooks(lib):
    """ModelHook subclasses added, appended, replaced and removed; AlignDevicesHook with CPU offload."""
    h = lib.hooks
    calls = []

    class Recorder(h.ModelHook):
        def __init__(self, tag):
            self.tag = tag

        def init_hook(self, module):
            calls.append((self.tag, "init"))
            return module

        def pre_forward(self, module, *args, **kwargs):
            calls.append((self.tag, "pre", len(args), sorted(kwargs)))
            return (args[0] + 1,) + args[1:], kwargs

        def post_forward(self, module, output):
            calls.append((self.tag, "post"))
            return output * 2

        def detach_hook(self, module):
            calls.append((self.tag, "detach"))
            return module

    torch.manual_seed(0)
    lin, x = torch.nn.Linear(2, 2), torch.ones(1, 2)
    found = {"plain": lin(x), "add returns": h.add_hook_to_module(lin, Recorder("a")) is lin, "hooked": lin(x)}
    h.add_hook_to_module(lin, Recorder("b"), append=True)
    found["appended"] = (type(lin._hf_hook).__name__, len(lin._hf_hook.hooks), lin(x))
    h.add_hook_to_module(lin, Recorder("c"))
    found["replaced"] = (type(lin._hf_hook).__name__, lin(x))
    found["removed"] = (h.remove_hook_from_module(lin) is lin, lin(x), hasattr(lin, "_hf_hook"),
                        hasattr(lin, "_old_forward"), _outcome(lambda: h.remove_hook_from_module(lin) is lin))
    seq = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    for module in (*seq, seq):
        h.add_hook_to_module(module, Recorder("s"))
    h.remove_hook_from_module(seq)
    found["not recursive"] = [hasattr(m, "_hf_hook") for m in (seq, *seq)]
    h.remove_hook_from_module(seq, recurse=True)
    found["recursive"] = [hasattr(m, "_hf_hook") for m in (seq, *seq)]
    torch.manual_seed(0)
    block = Block()
    reference = block(torch.ones(1, 4))
    hook = h.AlignDevicesHook(execution_device="cpu", offload=True, io_same_device=True)
    h.add_hook_to_module(block, hook)
    found["align offload"] = (_devices(block), block(torch.ones(1, 4)) - reference, sorted(hook.weights_map.keys()))
    h.remove_hook_from_module(block)
    found["align removed"] = _devices(block)
    model = _net()
    h.attach_align_device_hook_on_blocks(model, execution_device="cpu",
                                         offload={"embed": False, "blocks": True, "head": False})
    found["on blocks"] = sorted((n, type(m._hf_hook).__name__) for n, m in model.named_modules()
                                if hasattr(m, "_hf_hook"))
    h.remove_hook_from_submodules(model)
    torch.manual_seed(0)
    block = Block()
    hook = h.AlignDevicesHook(execution_device="cpu", offload=True, offload_buffers=True,
                              weights_map={k: v.clone() for k, v in block.state_dict().items()})
    h.add_hook_to_module(block, hook)
    found["weights map"] = (block(torch.ones(1, 4)) - reference, _devices(block),
                            (hook.execution_device, hook.offload, hook.io_same_device, hook.place_submodules))

    class Keyed(torch.nn.Module):
        def forward(self, x, cache=None):
            return {"out": x * 2, "cache": cache}

    keyed = h.add_hook_to_module(Keyed(), h.AlignDevicesHook(execution_device="cpu", skip_keys="cache",
                                                             io_same_device=True))
    found["skip_keys"] = keyed(torch.ones(1), cache=[1])

    class Swap(h.ModelHook):
        def init_hook(self, module):
            return torch.nn.Identity()

    found["init_hook's module"] = type(h.add_hook_to_module(torch.nn.Linear(2, 2), Swap())).__name__
    patched = torch.nn.Linear(2, 2)
    patched.forward = lambda x: x * 0
    h.add_hook_to_module(patched, h.ModelHook())
    h.remove_hook_from_module(patched)
    found["instance forward kept"] = (patched(torch.ones(1, 2)), "forward" in patched.__dict__)
    found["calls"] = calls
    return found


def big_models(lib):
    """init_empty_weights, sizes, device maps, set_module_tensor_to_device, cpu/disk offload, dispatch, loading."""
    from safetensors.torch import save_file

    bm, u = lib.big_modeling, lib.utils
    found = {}
    with bm.init_empty_weights(include_buffers=True):
        empty = Net(tied=False)
    with bm.init_on_device("meta", include_buffers=False):
        block = Block()
    found["empty"] = (_devices(empty), empty.blocks[0].tmp.device.type, _devices(block))
    net = _net()
    sizes = u.compute_module_sizes(net)
    found["sizes"] = (dict(sizes), dict(u.compute_module_sizes(net, dtype=torch.float16)))
    found["tied"] = (u.find_tied_parameters(net), u.find_tied_parameters(torch.nn.Linear(2, 2)))
    found["named tensors"] = [[n for n, _ in u.named_module_tensors(net.blocks[0], **kw)] for kw in (
        {}, {"include_buffers": False}, {"remove_non_persistent": True})]
    found["max layer"] = u.get_max_layer_size(list(net.named_children()), sizes, ["Block"])
    for memory in ({"cpu": 2000}, {"cpu": 10**9}, {"cpu": 500}):
        found[f"map {memory}"] = (u.infer_auto_device_map(_net(), max_memory=memory, no_split_module_classes=["Block"]),
                                  u.infer_auto_device_map(_net(), max_memory=memory))
    found["balanced"] = u.get_balanced_memory(_net(), max_memory={"cpu": 3000})
    found["set tensor"] = (u.set_module_tensor_to_device(net, "blocks.0.lin.bias", "cpu", value=torch.ones(4).double(),
                                                         dtype=torch.float16), net.blocks[0].lin.bias.dtype,
                           type(net.blocks[0].lin.bias).__name__)
    found["set tensor errors"] = [_outcome(lambda: u.set_module_tensor_to_device(net, "blocks.0.nope", "cpu")),
                                  _outcome(lambda: u.set_module_tensor_to_device(net, "blocks.2.lin.weight", "cpu",
                                                                                value=torch.zeros(3, 3)))]
    class Frozen(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(2), requires_grad=False)
            self.w.note = "kept"
            self.register_parameter("absent", None)

    with bm.init_empty_weights():
        frozen = Frozen()
    found["frozen empty"] = [(n, type(p).__name__, p.device.type, p.requires_grad, getattr(p, "note", None))
                             for n, p in frozen.named_parameters()] + [frozen.absent]
    ids = torch.tensor([[1, 2, 3]])
    reference = _net()(ids)
    with tempfile.TemporaryDirectory() as tmp:
        model = bm.cpu_offload(_net(), execution_device="cpu")
        found["cpu_offload"] = (model(ids) - reference, _devices(model))
        model = bm.disk_offload(_net(), os.path.join(tmp, "disk"), execution_device="cpu")
        with open(os.path.join(tmp, "disk", "index.json")) as f:
            found["disk_offload"] = (sorted(os.listdir(os.path.join(tmp, "disk"))), json.load(f), model(ids) - reference)
        device_map = {"embed": "cpu", "blocks.0": "cpu", "blocks.1": "disk", "blocks.2": "cpu", "head": "cpu"}
        model = bm.dispatch_model(_net(), device_map=dict(device_map), offload_dir=os.path.join(tmp, "dispatch"))
        found["dispatch"] = (sorted(os.listdir(os.path.join(tmp, "dispatch"))), model(ids) - reference,
                             model.hf_device_map, _devices(model))
        found["dispatch errors"] = [_outcome(lambda: bm.dispatch_model(_net(), device_map=dict(device_map))),
                                    _outcome(lambda: bm.dispatch_model(_net(), device_map={"embed": "cpu"}))]
        untied = _net(tied=False)
        reference = untied(ids)
        state = {k: v.clone() for k, v in untied.state_dict().items()}
        keys = sorted(state)
        folder = os.path.join(tmp, "shards")
        os.makedirs(folder)
        index = {"metadata": {}, "weight_map": {}}
        for number, part in enumerate((keys[:5], keys[5:]), 1):
            name = f"model-0000{number}-of-00002.safetensors"
            save_file({k: state[k] for k in part}, os.path.join(folder, name), metadata={"format": "pt"})
            index["weight_map"].update(dict.fromkeys(part, name))
        with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f)
        torch.save(state, os.path.join(tmp, "model.bin"))

        def load(path, **kwargs):
            with bm.init_empty_weights():
                model = Net(tied=False)
            returned = u.load_checkpoint_in_model(model, path, **kwargs)
            return returned, _devices(model)

        found["load"] = [load(folder), load(os.path.join(folder, "model.safetensors.index.json")),
                         load(os.path.join(tmp, "model.bin"), device_map=dict(device_map),
                              offload_folder=os.path.join(tmp, "bin-offload")),
                         load(folder, device_map={"": "cpu"}, dtype=torch.float16, keep_in_fp32_modules=["head"]),
                         _outcome(lambda: load(os.path.join(tmp, "nope"))),
                         _outcome(lambda: load(folder, device_map=dict(device_map)))]
        found["bin offload folder"] = sorted(os.listdir(os.path.join(tmp, "bin-offload")))
        offload, index = lib.utils.offload, {}
        os.makedirs(os.path.join(tmp, "weights"))  # Accelerate's offload_weight does not create it
        for name, tensor in (("half", torch.arange(6, dtype=torch.float16).reshape(2, 3)),
                             ("bf16", torch.ones(2, dtype=torch.bfloat16)), ("scalar", torch.tensor(3.0)),
                             ("flags", torch.tensor([True, False]))):
            offload.offload_weight(tensor, name, os.path.join(tmp, "weights"), index=index)
        offload.save_offload_index(index, os.path.join(tmp, "weights"))
        with open(os.path.join(tmp, "weights", "index.json")) as f:
            found["offload index"] = (json.load(f), sorted(os.listdir(os.path.join(tmp, "weights"))))
        loader = offload.OffloadedWeightsLoader(state_dict={"m": torch.ones(1)}, save_folder=os.path.join(tmp, "weights"))
        found["offloaded weights"] = ({k: loader[k] for k in sorted(loader.keys())}, len(loader),
                                      _outcome(lambda: loader["nope"]))

        def dispatched(**kwargs):
            with bm.init_empty_weights():
                model = Net(tied=False)
            model = bm.load_checkpoint_and_dispatch(model, folder, **kwargs)
            return model(ids) - reference, getattr(model, "hf_device_map", None), _devices(model)

        found["load and dispatch"] = [dispatched(device_map="auto"), dispatched(),
                                      dispatched(device_map=dict(device_map), offload_folder=os.path.join(tmp, "o")),
                                      dispatched(device_map="sequential", max_memory={"cpu": 600},
                                                 offload_folder=os.path.join(tmp, "o2"),
                                                 no_split_module_classes=["Block"]),
                                      _outcome(lambda: dispatched(device_map="weird"))]
    return found


SAME_ON_ONE = [helpers, memory, hooks, big_models]


@pytest.mark.parametrize("scenario", SAME_ON_ONE, ids=lambda fn: fn.__name__)
def test_the_same_on_both(scenario):
    with warnings.catch_warnings():
        results = run_both(scenario, 1)
    assert_same(results["accelerate"], results["nbaccel"], scenario.__name__)


@pytest.mark.parametrize("num_processes", [1, 2])
def test_each_rank_logs_decorates_and_splits_as_in_accelerate(num_processes):
    assert_ranks_same(run_both(ranks, num_processes), "ranks")
