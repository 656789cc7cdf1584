"""`nbaccel estimate-memory`: how much memory a model needs to load and to train, per dtype, without
allocating it.

The model is built under `init_empty_weights`, either from local code (`pkg.module:ClassName`,
`path/to/file.py:ClassName` or a factory function `pkg.models:make_model`, with constructor arguments from
`--model_kwargs '{"hidden": 4096}'`), or, as in Accelerate, from a Hub name (`bert-base-cased`) through
transformers or timm (`--library_name`, `--trust_remote_code`), which needs network access to the Hub. Sizes follow Accelerate's estimate: float32 is
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
        # the console script's sys.path lacks the working folder that `python -m nbaccel` has: a package in the
        # folder the command runs from must import either way, as with uvicorn's or gunicorn's "module:name"
        added = os.getcwd() not in sys.path
        if added:
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(location)
        except ImportError as error:
            raise ValueError(f"model {spec!r}: cannot import module {location!r}: {error}") from error
        finally:
            if added:
                sys.path.remove(os.getcwd())
    obj = module
    for part in name.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"model {spec!r}: {location!r} has no attribute {name!r}.")
        obj = getattr(obj, part)
    return obj


def verify_on_hub(repo: str, token: str | None = None):
    """The Hub's model info for `repo`; "gated" when access is refused, "repo" when there is no such repository.
    Without network access (or with HF_HUB_OFFLINE=1) raises OSError saying so."""
    from huggingface_hub import model_info
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        return model_info(repo, token=token)
    except GatedRepoError:
        return "gated"
    except RepositoryNotFoundError:
        return "repo"
    except Exception as error:  # offline mode, DNS, connection refused: whichever HTTP library raised it
        raise OSError(f"model {repo!r} is a Hub name, and the Hub cannot be reached ({type(error).__name__}: "
                      f"{error}). Connect to huggingface.co (and unset HF_HUB_OFFLINE), or give local code as "
                      "'pkg.module:ClassName' or 'path/to/file.py:ClassName'.") from error


def check_has_model(error: BaseException) -> str:
    """Which library raised `error` for a model it does not know: "timm", "transformers" or "unknown"."""
    message = str(error)
    if importlib.util.find_spec("timm") is not None and (
            (isinstance(error, RuntimeError) and "Unknown model" in message)
            or type(error).__name__ == "EntryNotFoundError"
            or (isinstance(error, KeyError) and "architecture" in message)):
        return "timm"
    if importlib.util.find_spec("transformers") is not None and isinstance(error, (OSError, ValueError)) and (
            "does not appear to have a file named" in message or "Unrecognized model in" in message):
        return "transformers"
    return "unknown"


def add_timm_hub_prefix(model_name: str) -> str:
    """`hf-hub:<repo>` for a Hub repo id (what timm.create_model needs); names with a source prefix or no `/`
    (bare architectures) unchanged."""
    return model_name if ":" in model_name or "/" not in model_name else f"hf-hub:{model_name}"


def _require(library: str, model_name: str) -> None:
    if importlib.util.find_spec(library) is None:
        raise ImportError(f"model {model_name!r} is built with {library}, which is not installed: pip install {library}")


def _hub_model(model_name: str, library_name: str | None, trust_remote_code: bool, access_token: str | None):
    """Build a Hub model on the meta device through transformers (AutoConfig, from_config) or timm."""
    import torch

    from ..big_modeling import init_empty_weights

    info = verify_on_hub(model_name, access_token)
    if info == "gated":
        raise OSError(f"model {model_name!r} is gated on the Hub: log in with `hf auth login` and request access.")
    if info == "repo":
        raise OSError(f"model {model_name!r} does not exist on the Hub (for a private one, log in first).")
    library_name = library_name or getattr(info, "library_name", None)
    if not library_name:
        raise ValueError(f"model {model_name!r} has no library on the Hub: pass --library_name transformers or timm.")
    if library_name == "transformers":
        _require("transformers", model_name)
        import transformers

        config = transformers.AutoConfig.from_pretrained(model_name, trust_remote_code=trust_remote_code,
                                                         token=access_token)
        auto_map = (getattr(info, "config", None) or {}).get("auto_map") or {}
        constructor = next((getattr(transformers, key) for key in auto_map if key.startswith("AutoModelFor")),
                           transformers.AutoModel)
        with init_empty_weights():
            return constructor.from_config(config, torch_dtype=torch.float32, trust_remote_code=trust_remote_code)
    if library_name == "timm":
        _require("timm", model_name)
        import timm

        with init_empty_weights():
            return timm.create_model(add_timm_hub_prefix(model_name), pretrained=False)
    raise ValueError(f"library {library_name!r} is not supported: use transformers or timm.")


def create_empty_model(model_name: str, library_name: str | None = None, trust_remote_code: bool = False,
                       access_token: str | None = None, model_kwargs: dict | None = None):
    """Build the model with every tensor on the meta device (no memory used): local code for
    'pkg.module:Name' / 'path/to/file.py:Name' (called with `model_kwargs`), else a Hub model name."""
    from torch import nn

    from ..big_modeling import init_empty_weights

    if ":" not in model_name:
        return _hub_model(model_name, library_name, trust_remote_code, access_token)
    factory = _load_object(model_name)
    if not callable(factory):
        raise TypeError(f"model {model_name!r} is a {type(factory).__name__}, not a class or a factory function.")
    try:
        with init_empty_weights(include_buffers=True):
            model = factory(**(model_kwargs or {}))
    except (RuntimeError, NotImplementedError):  # code that reads tensor values while building: real buffers
        with init_empty_weights(include_buffers=False):
            model = factory(**(model_kwargs or {}))
    if not isinstance(model, nn.Module):
        raise TypeError(f"model {model_name!r} returned a {type(model).__name__}, not a torch.nn.Module.")
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


def _model_from_args(args: argparse.Namespace):
    """The empty model that parsed `estimate-memory` arguments name (errors propagate)."""
    kwargs = json.loads(args.model_kwargs) if getattr(args, "model_kwargs", None) else {}
    if not isinstance(kwargs, dict):
        raise ValueError("--model_kwargs must be a JSON object, e.g. '{\"hidden\": 1024}'.")
    return create_empty_model(args.model_name, library_name=args.library_name,
                              trust_remote_code=args.trust_remote_code, model_kwargs=kwargs)


def gather_data(model, dtypes=DTYPES) -> list[list[Any]]:
    """Rows [dtype, largest layer bytes, total bytes, training-usage dict] for `model` (sizes from parameter
    counts: a float32 model is the reference). As in Accelerate, `model` may also be the parsed
    `estimate-memory` arguments: the model they name is built empty, and their `dtypes` are used."""
    from ..utils.modeling import calculate_maximum_sizes

    if isinstance(model, argparse.Namespace):
        model, dtypes = _model_from_args(model), model.dtypes
    model = model.float()  # meta tensors: free; every floating tensor now counts 4 bytes
    total, (largest, _) = calculate_maximum_sizes(model)
    rows = []
    for dtype in dtypes:
        scale = _BYTES_PER_PARAM[dtype] / 4
        rows.append([dtype, largest * scale, total * scale, estimate_training_usage(total, dtype)])
    return rows


def create_ascii_table(headers: list, rows: list, title: str) -> str:
    """A box-drawn text table of `rows` (lists of str) under `headers` and a centred `title`."""
    widths = [max(len(str(row[i])) for row in [*rows, headers]) for i in range(len(headers))]
    inner = sum(widths) + len(widths) - 1
    if len(title) > inner:
        widths[-1] += len(title) - inner
        inner = len(title)

    def line(cells: list) -> str:
        return "│" + "│".join(str(cell).center(width) for cell, width in zip(cells, widths)) + "│"

    parts = ["┌" + "─" * inner + "┐", "│" + title.center(inner) + "│", "├" + "┬".join("─" * w for w in widths) + "┤",
             line(headers), "├" + "┼".join("─" * w for w in widths) + "┤", *(line(row) for row in rows),
             "└" + "┴".join("─" * w for w in widths) + "┘"]
    return "\n".join(parts)


def _human(size: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(size) < 1024 or unit == "TB":
            return f"{size:.2f} {unit}" if unit != "B" else f"{int(size)} B"
        size /= 1024
    return f"{size:.2f} TB"


def estimate_command(args: argparse.Namespace) -> int:
    """Print the table for the model `args` name. A model that cannot be built raises (as in Accelerate);
    the `nbaccel estimate-memory` command turns that into a message and exit status 2."""
    from rich.console import Console
    from rich.table import Table

    model = _model_from_args(args)
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
    parser.add_argument("model_name", type=str,
                        help="A Hub model name (needs network access), or local code: 'pkg.module:ClassName', "
                             "'path/to/file.py:ClassName' or a factory function 'pkg.module:make_model'")
    parser.add_argument("--library_name", type=str, choices=["timm", "transformers"], default=None,
                        help="The library that builds a Hub model, when the Hub does not say")
    parser.add_argument("--model_kwargs", default=None, help="JSON object of arguments for the class/factory")
    parser.add_argument("--trust_remote_code", action="store_true", default=False,
                        help="Run the model code a Hub repository ships (only for repositories you trust)")
    parser.add_argument("--dtypes", type=str, nargs="+", default=["float32", "float16", "int8", "int4"], choices=DTYPES,
                        help="dtypes to report (default: float32 float16 int8 int4)")
    parser.set_defaults(func=estimate_command)
    return parser


def _estimate_from_command_line(args: argparse.Namespace) -> int:
    """estimate_command, with a model that cannot be built reported in one line (exit status 2)."""
    try:
        return estimate_command(args)
    except (ValueError, TypeError, OSError, ImportError) as error:  # JSONDecodeError is a ValueError
        print(f"nbaccel estimate-memory: error: {error}", file=sys.stderr)
        return 2


def register(subparsers) -> None:
    """Join the `nbaccel` command line (discovered by nbaccel.commands.main)."""
    estimate_command_parser(subparsers).set_defaults(func=_estimate_from_command_line)


def main(argv: list[str] | None = None) -> int:
    return _estimate_from_command_line(estimate_command_parser().parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
