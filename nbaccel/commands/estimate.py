"""`nbaccel estimate-memory`: how much memory a model needs to load and to train, per dtype, without
allocating it.

The model is built under `init_empty_weights` from local code, never downloaded:
`pkg.module:ClassName`, `path/to/file.py:ClassName` or a factory function (`pkg.models:make_model`), with
constructor arguments from `--model_kwargs '{"hidden": 4096}'`. Sizes follow Accelerate's estimate: float32 is
4 bytes per parameter, float16/bfloat16 2, int8 1, int4 half; Adam training (batch size 1, no activations)
needs the weights, the gradients and two optimizer states: about 4x the float32 size, 2x+ with mixed precision.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
from typing import Any

DTYPES = ("float32", "float16", "bfloat16", "int8", "int4")
_BYTES_PER_PARAM = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "int4": 0.5}


def _load_object(spec: str) -> Any:
    """Resolve "pkg.module:Name" or "path/to/file.py:Name" to the object it names."""
    if ":" not in spec:
        raise ValueError(
            f"model {spec!r}: give a module path and a class or factory, as 'pkg.module:ClassName' or "
            "'path/to/file.py:ClassName' (nbaccel builds the model locally; it does not download from the Hub)."
        )
    location, _, name = spec.rpartition(":")
    if location.endswith(".py") or os.sep in location:
        path = os.path.abspath(location)
        if not os.path.isfile(path):
            raise ValueError(f"model {spec!r}: file {location!r} does not exist.")
        module_name = f"_nbaccel_estimate_{abs(hash(path))}"
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module
        sys.path.insert(0, os.path.dirname(path))  # the file may import its neighbours
        try:
            module_spec.loader.exec_module(module)
        finally:
            sys.path.remove(os.path.dirname(path))
    else:
        try:
            module = importlib.import_module(location)
        except ImportError as error:
            raise ValueError(f"model {spec!r}: cannot import module {location!r}: {error}") from error
    obj = module
    for part in name.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"model {spec!r}: {location!r} has no attribute {name!r}.")
        obj = getattr(obj, part)
    return obj


def create_empty_model(spec: str, model_kwargs: dict | None = None):
    """Build the model named by `spec` with every tensor on the meta device (no memory used)."""
    from torch import nn

    from ..big_modeling import init_empty_weights

    factory = _load_object(spec)
    if not callable(factory):
        raise TypeError(f"model {spec!r} is a {type(factory).__name__}, not a class or a factory function.")
    try:
        with init_empty_weights(include_buffers=True):
            model = factory(**(model_kwargs or {}))
    except (RuntimeError, NotImplementedError):  # code that reads tensor values while building: real buffers
        with init_empty_weights(include_buffers=False):
            model = factory(**(model_kwargs or {}))
    if not isinstance(model, nn.Module):
        raise TypeError(f"model {spec!r} returned a {type(model).__name__}, not a torch.nn.Module.")
    return model


def estimate_training_usage(bytes: int, mixed_precision: str) -> dict[str, int]:
    """Memory of Adam training at batch size 1 for a model of `bytes` float32 bytes: model, gradients,
    optimizer states and the peak at the optimizer step (-1 where it does not apply, e.g. int8)."""
    fp32, fp16 = bytes, bytes // 2
    if mixed_precision == "float32":
        return {"model": fp32, "gradients": fp32, "optimizer": 2 * fp32, "step": 4 * fp32}
    if mixed_precision in ("float16", "bfloat16"):
        return {"model": fp32, "gradients": fp32 + fp16, "optimizer": 2 * fp32, "step": 2 * fp32}
    return {"model": -1, "optimizer": -1, "gradients": -1, "step": -1}


def gather_data(model, dtypes=DTYPES) -> list[list[Any]]:
    """Rows [dtype, largest layer bytes, total bytes, training-usage dict] for `model` (sizes from parameter
    counts: a float32 model is the reference)."""
    from ..utils.modeling import calculate_maximum_sizes

    model = model.float()  # meta tensors: free; every floating tensor now counts 4 bytes
    total, (largest, _) = calculate_maximum_sizes(model)
    rows = []
    for dtype in dtypes:
        scale = _BYTES_PER_PARAM[dtype] / 4
        rows.append([dtype, largest * scale, total * scale, estimate_training_usage(total, dtype)])
    return rows


def _human(size: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(size) < 1024 or unit == "TB":
            return f"{size:.2f} {unit}" if unit != "B" else f"{int(size)} B"
        size /= 1024
    return f"{size:.2f} TB"


def estimate_command(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    try:
        kwargs = json.loads(args.model_kwargs) if args.model_kwargs else {}
        if not isinstance(kwargs, dict):
            raise ValueError("--model_kwargs must be a JSON object, e.g. '{\"hidden\": 1024}'.")
        model = create_empty_model(args.model_name, kwargs)
    except (ValueError, TypeError, json.JSONDecodeError) as error:
        print(f"nbaccel estimate-memory: error: {error}", file=sys.stderr)
        return 2
    rows = gather_data(model, args.dtypes)
    params = sum(p.numel() for p in model.parameters())
    table = Table(title=f"Memory Usage for loading `{args.model_name}` ({params:,} parameters)")
    for header in ("dtype", "Largest Layer", "Total Size", "Training using Adam"):
        table.add_column(header, justify="center")
    for dtype, largest, total, training in rows:
        peak = max(training.values())
        table.add_row(dtype, _human(largest), _human(total), _human(peak) if peak != -1 else "N/A")
    Console(width=max(100, Console().width)).print(table)
    return 0


def estimate_command_parser(subparsers=None) -> argparse.ArgumentParser:
    """The `estimate-memory` parser (a subcommand of `nbaccel` when `subparsers` is given)."""
    description = "Estimate the memory a model needs to load and to train with Adam, per dtype."
    if subparsers is not None:
        parser = subparsers.add_parser("estimate-memory", help=description, description=description)
    else:
        parser = argparse.ArgumentParser(prog="nbaccel estimate-memory", description=description)
    parser.add_argument("model_name", help="'pkg.module:ClassName', 'path/to/file.py:ClassName' or a factory "
                                           "function 'pkg.module:make_model' (built locally, never downloaded)")
    parser.add_argument("--model_kwargs", default=None, help="JSON object of arguments for the class/factory")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "float16", "int8", "int4"], choices=DTYPES,
                        help="dtypes to report (default: float32 float16 int8 int4)")
    parser.set_defaults(func=estimate_command)
    return parser


def register(subparsers) -> None:
    """Join the `nbaccel` command line (discovered by nbaccel.commands.main)."""
    estimate_command_parser(subparsers)


def main(argv: list[str] | None = None) -> int:
    args = estimate_command_parser().parse_args(argv)
    return estimate_command(args)


if __name__ == "__main__":
    raise SystemExit(main())
