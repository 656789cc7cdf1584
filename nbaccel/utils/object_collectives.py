"""Collectives over Python objects (gather_object, broadcast_object_list) and copy_tensor_to_devices.

Objects are pickled (cloudpickle when plain pickle cannot: classes and functions defined in a notebook
cell) into a byte tensor. The first communication carries a fixed-size block of `_BLOCK` bytes holding the
length and the start of the payload, so a small object (a metrics dict, a config) moves in ONE
communication; only a larger one needs a second for the rest. torch's own object collectives always make
two (sizes, then data). A rank that cannot pickle its object sends an error instead, so every rank raises
rather than one rank failing and the others waiting forever.
"""

from __future__ import annotations

import pickle
import struct
from typing import Any

import torch
import torch.distributed as dist

from . import xla
from .collective_trace import in_collective
from .collectives import DistributedOperationException, _rank, _world_size, all_gather_rows

_BLOCK = 4096
_HEADER = struct.Struct("<q")
_ROOM = _BLOCK - _HEADER.size


def _receive_buffer(shape: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Where a broadcast lands. On XLA it is made on the CPU and sent over, so it is device data like the
    sender's tensor: every replica then runs the same graph (an XLA collective hangs otherwise)."""
    if device.type == "xla":
        return torch.zeros(shape, dtype=dtype).to(device)
    return torch.empty(shape, dtype=dtype, device=device)


def _object_device() -> torch.device:
    """Where the process group's backend wants byte tensors: the CPU for gloo/mpi, the accelerator otherwise."""
    backend = str(dist.get_backend()).lower()
    if "gloo" in backend or "mpi" in backend:
        return torch.device("cpu")
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    if "xla" in backend:
        import torch_xla.core.xla_model as xm

        return xm.xla_device()
    if "xccl" in backend:
        return torch.device("xpu", torch.xpu.current_device())
    if "hccl" in backend:
        return torch.device("npu", torch.npu.current_device())
    return torch.device("cpu")


def _dumps(obj: Any) -> tuple[bytes, bool]:
    """(payload, ok): the pickled object, or an error message when it cannot be pickled."""
    try:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), True
    except Exception:
        try:
            import cloudpickle

            return cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), True
        except Exception as exc:
            return f"cannot pickle a {type(obj).__name__}: {type(exc).__name__}: {exc}".encode()[:_ROOM], False


def _first_block(payload: bytes, ok: bool) -> torch.Tensor:
    block = bytearray(_BLOCK)
    _HEADER.pack_into(block, 0, len(payload) if ok else -len(payload))
    head = payload[:_ROOM]
    block[_HEADER.size : _HEADER.size + len(head)] = head
    return torch.frombuffer(block, dtype=torch.uint8)


def _read_block(block: bytes) -> tuple[int, bytes]:
    """(signed length, the payload bytes the block holds)."""
    (length,) = _HEADER.unpack_from(block, 0)
    return length, block[_HEADER.size : _HEADER.size + min(abs(length), _ROOM)]


def gather_object(object: Any) -> list[Any]:
    """Gather a picklable object from every process; every process gets the list, in rank order.

    As in Accelerate, each process's object contributes its items (`gather_object([x])` gives `[x0, x1, ...]`;
    a tensor its rows, a dict its keys, a string its characters); an object that cannot be iterated contributes
    itself (Accelerate raises TypeError). In one process the object is returned as it is.
    """
    world = _world_size()
    if world == 1:
        return object
    device = _object_device()
    payload, ok = _dumps(object)
    block = _first_block(payload, ok).to(device)
    everyone = all_gather_rows("gather_object", block)
    blocks = everyone.cpu().numpy()
    parts = [_read_block(blocks[r].tobytes()) for r in range(world)]
    failed = [(r, data.decode(errors="replace")) for r, (length, data) in enumerate(parts) if length < 0]
    if failed:
        lines = "\n".join(f"  - rank {r}: {message}" for r, message in failed)
        raise DistributedOperationException(f"gather_object: some ranks could not send their object:\n{lines}")
    longest = max(length for length, _ in parts)
    payloads = [data for _, data in parts]
    if longest > _ROOM:  # a second round for what did not fit in the first block
        rest = longest - _ROOM
        tail = bytearray(rest)
        tail[: max(len(payload) - _ROOM, 0)] = payload[_ROOM:]
        mine = torch.frombuffer(tail, dtype=torch.uint8).to(device)
        tails = all_gather_rows("gather_object", mine)
        tails_np = tails.cpu().numpy()
        payloads = [
            data + tails_np[r, : length - _ROOM].tobytes() if length > _ROOM else data
            for r, (length, data) in enumerate(parts)
        ]
    result: list[Any] = []
    for data in payloads:
        value = pickle.loads(data)
        try:
            items = iter(value)
        except TypeError:  # not iterable (an int, a 0-d tensor): itself, where Accelerate's raises TypeError
            result.append(value)
        else:
            result.extend(items)
    return result


def broadcast_object_list(object_list: list[Any], from_process: int = 0) -> list[Any]:
    """Replace the items of `object_list` on every process with those of process `from_process` (in place).

    Returns the same list. Items must be picklable on the sending process.
    """
    world = _world_size()
    if world == 1:
        return object_list
    if not isinstance(object_list, list):
        raise TypeError(
            f"broadcast_object_list: object_list must be a list (it is filled in place), got "
            f"{type(object_list).__name__}."
        )
    if not isinstance(from_process, int) or not 0 <= from_process < world:
        raise ValueError(
            f"broadcast_object_list: from_process must be a process index in [0, {world - 1}], got {from_process!r}."
        )
    device = _object_device()
    if device.type == "xla":
        xla.run_pending_graph()  # the broadcast's graph must be the same on every replica: nothing else in it
    sending = _rank() == from_process
    if sending:
        payload, ok = _dumps(list(object_list))
        block = _first_block(payload, ok).to(device)
    else:
        payload, block = b"", _receive_buffer(_BLOCK, torch.uint8, device)
    with in_collective("broadcast_object_list", "broadcast", [block]):
        dist.broadcast(block, src=from_process)
    length, data = _read_block(block.cpu().numpy().tobytes())
    if length < 0:
        raise DistributedOperationException(
            f"broadcast_object_list: process {from_process} could not send its list: {data.decode(errors='replace')}"
        )
    if length > _ROOM:
        rest = length - _ROOM
        if sending:
            tail = torch.frombuffer(bytearray(payload[_ROOM:]), dtype=torch.uint8).to(device)
        else:
            tail = _receive_buffer(rest, torch.uint8, device)
        with in_collective("broadcast_object_list", "broadcast", [tail]):
            dist.broadcast(tail, src=from_process)
        data = data + tail.cpu().numpy().tobytes()
    if not sending:
        object_list[:] = pickle.loads(data)
    return object_list


_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8, torch.int16,
    torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128,
]
_MAX_DIMS = 32


def copy_tensor_to_devices(tensor: torch.Tensor | None = None) -> torch.Tensor:
    """Send a tensor that exists on exactly one process (the others pass None) to every process.

    Unlike `broadcast`, the receivers need not know its shape or dtype. Exactly one process must pass a
    tensor; otherwise every process raises ValueError.
    """
    world = _world_size()
    if world == 1:
        if tensor is None:
            raise ValueError("copy_tensor_to_devices: no process passed a tensor (got None in a single process).")
        return tensor
    device = _object_device()
    header = torch.zeros(3 + _MAX_DIMS, dtype=torch.int64)
    problem = ""
    if tensor is not None:
        if not isinstance(tensor, torch.Tensor):
            problem = f"expected a tensor or None, got a {type(tensor).__name__}"
        elif tensor.dtype not in _DTYPES or tensor.ndim > _MAX_DIMS:
            problem = f"unsupported tensor ({tensor.dtype}, {tensor.ndim} dims)"
        else:
            header[0] = 1
            header[1] = _DTYPES.index(tensor.dtype)
            header[2] = tensor.ndim
            header[3 : 3 + tensor.ndim] = torch.tensor(tensor.shape, dtype=torch.int64)
    if problem:
        header[0] = -1
    header = header.to(device)
    headers = all_gather_rows("copy_tensor_to_devices", header)
    rows = headers.cpu().tolist()
    bad = [r for r, row in enumerate(rows) if row[0] < 0]
    owners = [r for r, row in enumerate(rows) if row[0] == 1]
    if bad:
        raise ValueError(
            f"copy_tensor_to_devices: process(es) {bad} passed something other than a tensor or None"
            + (f" ({problem})" if problem else "") + "."
        )
    if len(owners) != 1:
        raise ValueError(
            "copy_tensor_to_devices: exactly one process must pass a tensor (the others None); "
            f"got tensors on processes {owners}."
        )
    owner = owners[0]
    row = rows[owner]
    if _rank() == owner:
        buffer = tensor.detach().to(device).contiguous()
    else:
        buffer = _receive_buffer(row[3 : 3 + row[2]], _DTYPES[row[1]], device)
    with in_collective("copy_tensor_to_devices", "broadcast", [buffer]):
        dist.broadcast(buffer, src=owner)
    return tensor if _rank() == owner else buffer
