"""Pipeline-parallel inference: `prepare_pippy` cuts a model into one stage per process.

torch.distributed.pipelining does the work: `pipeline` traces the model and splits it at the split points,
each process builds its own stage, and a GPipe schedule streams micro-batches through the stages (point-to-
point sends over the process group: gloo on CPU, nccl on GPU). The first process feeds the batch, the last
one returns the output, the others return None (every process with `gather_output=True`).

Inputs and cuts that torch would only discover mid-pipeline (a peer crashing in gloo, or waiting for the
process group's timeout) are refused first with a ValueError that says what to change; docs/compat.md lists
where that differs from Accelerate.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import MethodType
from typing import Any

import torch

from .state import PartialState
from .utils import (
    calculate_maximum_sizes,
    convert_bytes,
    copy_tensor_to_devices,
    ignorant_find_batch_size,
    infer_auto_device_map,
    is_pippy_available,
    pad_input_tensors,
    send_to_device,
)

__all__ = ["build_pipeline", "find_pippy_batch_size", "generate_device_map", "pippy_forward", "prepare_pippy"]


def generate_device_map(
    model: torch.nn.Module, num_processes: int = 1, no_split_module_classes: list[str] | None = None,
    max_memory: dict[int | str, int | str] | None = None,
) -> dict[str, int | str]:
    """Where each submodule of `model` goes when it is cut into `num_processes` stages (keys 0..n-1).

    Without `max_memory`, each stage may hold its share of the model plus its largest layer, rounded up in
    the unit `convert_bytes` picks, with 10% room: Accelerate's sizing, so `split_points="auto"` cuts a
    model at the same modules in both libraries.
    """
    if num_processes == 1:
        return infer_auto_device_map(model, no_split_module_classes=no_split_module_classes, clean_result=False)
    if max_memory is None:
        budget = _stage_budget(model, num_processes)
        max_memory = {stage: budget for stage in range(num_processes)}
    return infer_auto_device_map(
        model, max_memory=max_memory, no_split_module_classes=no_split_module_classes, clean_result=False
    )


def _stage_budget(model: torch.nn.Module, stages: int) -> str:
    total, (largest, _) = calculate_maximum_sizes(model)
    value, unit = convert_bytes((total + largest) / stages).split(" ")
    return f"{math.ceil(float(value)) * 1.1} {unit}"


def find_pippy_batch_size(args: tuple[Any, ...] | None, kwargs: dict[str, Any] | None) -> int | None:
    """The batch size of the first positional argument that has one, else of the first keyword argument."""
    for value in [*(args or ()), *(kwargs or {}).values()]:
        found = ignorant_find_batch_size(value)
        if found is not None:
            return found
    return None


def build_pipeline(
    model: torch.nn.Module, split_points: list[str], args: tuple[Any, ...], kwargs: dict[str, Any] | None,
    num_chunks: int,
) -> Any:
    """Trace `model` on the example inputs, cut it before each split point, and return this process's
    GPipe schedule (its stage, `num_chunks` micro-batches per call)."""
    from torch.distributed.pipelining import ScheduleGPipe, SplitPoint, pipeline

    state = PartialState()
    pipe = pipeline(
        model, mb_args=args, mb_kwargs=kwargs, split_spec={name: SplitPoint.BEGINNING for name in split_points}
    )
    return ScheduleGPipe(pipe.build_stage(state.process_index, device=state.device), num_chunks)


def pippy_forward(forward: Callable[..., Any], num_chunks: int, gather_output: bool, *args: Any, **kwargs: Any) -> Any:
    """One pipelined call: the first process pads the batch to a multiple of `num_chunks` and feeds it, the
    last returns the output (every process when `gather_output`), the others None. Every keyword argument
    goes to the model."""
    return _pipelined_call(forward, num_chunks, gather_output, None, args, kwargs)


def _pipelined_call(forward: Callable[..., Any], num_chunks: int, gather_output: bool, micro_batch_size: int | None,
                    args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """`pippy_forward`, checking the batch against `micro_batch_size` (the batch size the model was traced
    with, which every micro-batch must have) when it is known."""
    state = PartialState()
    if state.num_processes == 1:
        return forward(*args, **kwargs)
    output = None
    if state.process_index == 0:
        batch_size = find_pippy_batch_size(args, kwargs)
        if batch_size is None:
            raise ValueError(
                "prepare_pippy: the first process found no batch size in the call's arguments; pass the batch "
                "as tensors (positional or keyword) that have a batch dimension."
            )
        _check_batch(batch_size, num_chunks, micro_batch_size)
        if batch_size != num_chunks:
            args = pad_input_tensors(args, batch_size, num_chunks)
            kwargs = pad_input_tensors(kwargs, batch_size, num_chunks)
        forward(*args, **kwargs)
    elif state.is_last_process:
        output = forward()
    else:
        forward()
    if gather_output:
        output = copy_tensor_to_devices(output)
    return output


def _check_batch(batch_size: int, num_chunks: int, micro_batch_size: int | None) -> None:
    per_chunk = -(-batch_size // num_chunks)
    if micro_batch_size is not None and per_chunk != micro_batch_size:
        raise ValueError(
            f"prepare_pippy: a batch of {batch_size} makes micro-batches of {per_chunk} (num_chunks={num_chunks}), "
            f"but the model was traced with a batch of {micro_batch_size} (example_args/example_kwargs), the size "
            f"of the stages' buffers. Pass {num_chunks * (micro_batch_size - 1) + 1} to {num_chunks * micro_batch_size} "
            "rows (fewer are padded), or trace with an example of the "
            "micro-batch size you will use."
        )


def prepare_pippy(
    model: torch.nn.Module,
    split_points: str | list[str] | None = "auto",
    no_split_module_classes: list[str] | None = None,
    example_args: tuple[Any, ...] | None = (),
    example_kwargs: dict[str, Any] | None = None,
    num_chunks: int | None = None,
    gather_output: bool | None = False,
) -> torch.nn.Module:
    """Make `model` run as a pipeline over every process, one stage each, for inference.

    Call it on every process with the same model and an example input of one micro-batch (`example_args`,
    or `example_kwargs` whose keys every call then passes). `split_points="auto"` cuts the model into
    stages of about equal size (`no_split_module_classes` are kept whole); a list names the module that
    starts each stage after the first. Each call is split into `num_chunks` micro-batches (default: the
    number of processes). Returns `model` with its forward replaced; the original stays in
    `model._original_forward`, the schedule in `model.pippy_stage`, the cuts in `model.hf_split_points`.
    """
    if not is_pippy_available():
        raise ImportError("prepare_pippy needs torch.distributed.pipelining: install torch>=2.4.")
    state = PartialState()
    stages = state.num_processes
    if stages < 2:
        raise ValueError(
            "prepare_pippy: the pipeline has one stage per process and only 1 process runs; launch with "
            "notebook_launcher(..., num_processes=2) or `nbaccel launch --num_processes 2`."
        )
    example_args = send_to_device(example_args, "cpu")
    example_kwargs = send_to_device(example_kwargs, "cpu")
    if num_chunks is None:
        num_chunks = stages
    if num_chunks < 1:
        raise ValueError(f"prepare_pippy: num_chunks must be at least 1, got {num_chunks}.")
    split_points = _split_points(model, split_points, no_split_module_classes, stages)
    model.hf_split_points = split_points
    schedule = build_pipeline(model, split_points, example_args, example_kwargs, num_chunks)
    micro_batch_size = find_pippy_batch_size(example_args, example_kwargs)
    model._original_forward = model.forward
    model._original_call = model.__call__
    model.pippy_stage = schedule

    def forward(*args: Any, **kwargs: Any) -> Any:
        return _pipelined_call(schedule.step, num_chunks, bool(gather_output), micro_batch_size, args, kwargs)

    forward.__wrapped__ = MethodType(forward, model)
    model.forward = forward
    return model


def _split_points(
    model: torch.nn.Module, split_points: str | list[str] | None, no_split_module_classes: list[str] | None,
    stages: int,
) -> list[str]:
    """The module names that start stages 1..n-1: found by the balanced device map ("auto"), or checked."""
    if split_points == "auto":
        device_map = generate_device_map(model, stages, no_split_module_classes=no_split_module_classes)
        first_module = {}
        for name, stage in device_map.items():
            first_module.setdefault(stage, name)
        missing = [stage for stage in range(1, stages) if stage not in first_module]
        if missing:
            raise ValueError(
                f"prepare_pippy: split_points='auto' could not cut the model into {stages} stages (one per "
                f"process): no module was placed on stage(s) {missing} ({dict(device_map)}). Pass split_points "
                "(the modules that start stages 2..n), or fewer no_split_module_classes."
            )
        return [first_module[stage] for stage in range(1, stages)]
    names = [split_points] if isinstance(split_points, str) else list(split_points or [])
    if len(names) != stages - 1:
        raise ValueError(
            f"prepare_pippy: {len(names)} split point(s) make {len(names) + 1} stage(s), but {stages} processes "
            f"run the pipeline, one stage each: pass {stages - 1} split point(s), or split_points='auto'."
        )
    for name in names:
        model.get_submodule(name)  # AttributeError naming the missing module, before torch traces the model
    return names
