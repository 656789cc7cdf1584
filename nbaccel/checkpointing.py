"""Checkpoints: save and restore everything a training run needs to resume, atomically.

`save_accelerator_state` / `load_accelerator_state` are what `Accelerator.save_state` / `load_state` call.
A checkpoint directory holds the same files as Accelerate's:

    model.safetensors, model_1.safetensors ...   (or pytorch_model.bin, pytorch_model_1.bin ...)
    optimizer.bin, optimizer_1.bin ...            scheduler.bin, scheduler_1.bin ...
    scaler.pt                                     random_states_{process_index}.pkl (one per process)
    dl_state_dict.bin, dl_state_dict_1.bin ...    (prepared data loaders: position in epoch, sampler state)
    sampler.bin, sampler_1.bin ...                (plain torch DataLoaders: sampler generator / epoch / seed)
    custom_checkpoint_0.pkl ...                   (objects given to `register_for_checkpointing`)

A save is atomic: every process writes into a temporary directory beside the target, the processes agree
that all writes succeeded, then the main process renames it into place (see `save_accelerator_state` and
docs/checkpoints.md for the protocol). A save killed halfway leaves the previous checkpoint whole.

Everything is read back with `torch.load(weights_only=True)`; only scheduler states and registered custom
objects may fall back to full unpickling when their content needs it (they can hold arbitrary Python
objects), and only if the caller did not ask for `weights_only=True` in `load_kwargs`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import pickle
import random
import re
import shutil
import sys
import zipfile
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import checkpoint_fit
from .checkpoint_manifest import MANIFEST_NAME, check_manifest, write_manifest
from .utils.atomic_files import atomic_path, fsync_dir, fsync_file, write_text
from .utils.constants import (  # file names as Accelerate (and transformers, for weights) spell them
    MODEL_NAME,
    OPTIMIZER_NAME,
    RNG_STATE_NAME,
    SAFE_MODEL_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    SAMPLER_NAME,
    SCALER_NAME,
    SCHEDULER_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
)
from .utils.other import extract_model_from_parallel

logger = logging.getLogger(__name__)

DATALOADER_STATE_NAME = "dl_state_dict"
CUSTOM_CHECKPOINT_NAME = "custom_checkpoint"
CHECKPOINTS_DIRNAME = "checkpoints"

MARKER_NAME = ".nbaccel-checkpoint.json"  # written last into every checkpoint folder a save created whole
_KNOWN_FILE_RE = re.compile(
    r"^(model(_\d+)?\.safetensors|pytorch_model(_\d+)?\.bin|(optimizer|scheduler|sampler)(_\d+)?\.bin"
    r"|dl_state_dict(_\d+)?(\.rank\d+)?\.bin|scaler\.pt|random_states_\d+\.pkl|custom_checkpoint_\d+\.pkl)$"
)
_TMP_SUFFIX = ".nbaccel-tmp"  # `.{name}.nbaccel-tmp`: a save in progress (or killed)
_OLD_SUFFIX = ".nbaccel-old"  # `.{name}.nbaccel-old`: the previous checkpoint, during the final rename
_CHECKPOINT_DIR_RE = re.compile(r"^checkpoint_(\d+)$")
_CUSTOM_RE = re.compile(rf"^{CUSTOM_CHECKPOINT_NAME}_(\d+)\.pkl$")

SaveHook = Callable[[list, list, str], None]
LoadHook = Callable[[list, str], None]


# --------------------------------------------------------------------------------------------- errors
class CheckpointError(Exception):
    """A checkpoint could not be saved or loaded."""


class CheckpointFileMissingError(CheckpointError, FileNotFoundError):
    """A file the checkpoint should contain is not there (the message names it)."""


class CheckpointDirectoryMissingError(CheckpointFileMissingError, ValueError):
    """The checkpoint folder itself is not there; also a `ValueError`, which is what Accelerate raises then."""


class CheckpointFileCorruptError(CheckpointError, RuntimeError):
    """A checkpoint file exists but cannot be read (truncated or not what its name says)."""


class CheckpointMismatchError(CheckpointError, RuntimeError):
    """The checkpoint does not fit the objects (other shapes or keys); nothing was loaded. Also a
    `RuntimeError`, which is what torch's `load_state_dict` (and so Accelerate) raises then."""


class RegisteredObjectsMismatchError(CheckpointMismatchError, CheckpointFileMissingError):
    """More objects are registered for checkpointing than the checkpoint holds `custom_checkpoint_N.pkl` files;
    nothing was loaded. A `RuntimeError`, the type of Accelerate's error for this, and a `FileNotFoundError`."""


# ------------------------------------------------------------------------------------------ file names
def _indexed(stem: str, index: int, suffix: str) -> str:
    """`optimizer.bin`, `optimizer_1.bin`, ...: Accelerate numbers every object after the first."""
    return f"{stem}{'' if index == 0 else f'_{index}'}{suffix}"


def model_file_name(index: int, safe_serialization: bool) -> str:
    """`model.safetensors` / `model_1.safetensors` or `pytorch_model.bin` / `pytorch_model_1.bin`."""
    return _indexed(SAFE_MODEL_NAME if safe_serialization else MODEL_NAME, index,
                    ".safetensors" if safe_serialization else ".bin")


def _dataloader_state_name(index: int, process_index: int) -> str:
    """Rank 0 writes Accelerate's `dl_state_dict{_i}.bin`; other ranks add `.rank{p}` before `.bin`."""
    name = _indexed(DATALOADER_STATE_NAME, index, "")
    return f"{name}.bin" if process_index == 0 else f"{name}.rank{process_index}.bin"


def rng_state_file_name(process_index: int) -> str:
    return f"{RNG_STATE_NAME}_{process_index}.pkl"


# ------------------------------------------------------------------------------- project checkpoints
def checkpoints_root(project_configuration: Any) -> Path:
    """`project_dir/checkpoints`, where automatic checkpoint naming puts `checkpoint_N` folders."""
    project_dir = getattr(project_configuration, "project_dir", None)
    if project_dir is None:
        raise ValueError(
            "automatic_checkpoint_naming needs ProjectConfiguration(project_dir=...): "
            "checkpoints go to project_dir/checkpoints/checkpoint_N."
        )
    return Path(project_dir) / CHECKPOINTS_DIRNAME


def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    """The `checkpoint_N` folders under `root`, oldest (smallest N) first; temporary folders are ignored."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _CHECKPOINT_DIR_RE.match(entry.name)
        if match and entry.is_dir():
            found.append((int(match.group(1)), entry))
    return [path for _, path in sorted(found)]


def next_checkpoint_dir(project_configuration: Any) -> Path:
    """`project_dir/checkpoints/checkpoint_{iteration}` for the next automatic save.

    Raises ValueError if that folder already exists (as Accelerate does): set
    `project_configuration.iteration` to the number to continue from, e.g. after resuming.
    """
    iteration = int(getattr(project_configuration, "iteration", 0))
    path = checkpoints_root(project_configuration) / f"checkpoint_{iteration}"
    if path.exists():
        raise ValueError(
            f"Checkpoint directory {path} ({iteration}) already exists. Set "
            f"`accelerator.project_configuration.iteration` to the iteration to continue from "
            f"(e.g. {iteration + 1})."
        )
    return path


def latest_checkpoint_dir(project_configuration: Any) -> Path:
    """The newest `checkpoint_N` under `project_dir/checkpoints` (what `load_state()` without a dir loads)."""
    root = checkpoints_root(project_configuration)
    found = list_checkpoints(root)
    if not found:
        raise FileNotFoundError(
            f"No checkpoint_N folder under {root}: nothing to resume from. Call save_state() first or "
            "pass load_state(input_dir=...)."
        )
    return found[-1]


def rotate_checkpoints(
    root: str | os.PathLike, total_limit: int | None, *, keep: str | os.PathLike | None = None
) -> list[Path]:
    """Delete the oldest `checkpoint_N` folders under `root` so that at most `total_limit` remain.

    `keep` (the checkpoint just written) is never deleted and counts as one of the `total_limit`, even
    when its number is lower than older ones (a resumed run whose iteration restarted). Returns the
    deleted folders; `None` keeps everything. nbaccel rotates after the new checkpoint is in place
    (Accelerate deletes before saving), so a failed save never costs the last good checkpoint.
    """
    if total_limit is None:
        return []
    if not isinstance(total_limit, int) or total_limit < 1:
        raise ValueError(f"total_limit must be a positive int or None, got {total_limit!r}.")
    found = list_checkpoints(root)
    kept = Path(keep).absolute() if keep is not None else None
    others = [path for path in found if path.absolute() != kept]
    room = total_limit - (1 if kept is not None and len(others) < len(found) else 0)
    doomed = others[: max(0, len(others) - room)]
    if doomed:  # a warning, as Accelerate's (which deletes before saving): checkpoints going away should show
        logger.warning("Deleting %d old checkpoint(s) to keep total_limit=%d: %s", len(doomed), total_limit,
                       ", ".join(path.name for path in doomed))
    for path in doomed:
        shutil.rmtree(path)
    return doomed


# ------------------------------------------------------------------------------- atomic directories
def _tmp_dir_for(target: Path) -> Path:
    return target.parent / f".{target.name}{_TMP_SUFFIX}"


def _old_dir_for(target: Path) -> Path:
    return target.parent / f".{target.name}{_OLD_SUFFIX}"


def _recover_interrupted_rename(target: Path) -> None:
    """Finish or undo a save killed during its final rename (main process, before a new save)."""
    tmp, old = _tmp_dir_for(target), _old_dir_for(target)
    if old.exists():
        if not target.exists():
            # Killed between "target -> old" and "tmp -> target": tmp was complete (it is only moved
            # after every process finished writing), so finish the rename; else put the old one back.
            if tmp.is_dir():
                os.replace(tmp, target)
            else:
                os.replace(old, target)
        if old.exists():
            shutil.rmtree(old)


def _resolve_readable_dir(path: Path) -> Path:
    """Where to read checkpoint `path` from, tolerating a save killed mid-rename (read only, no changes)."""
    if path.is_dir():
        return path
    tmp, old = _tmp_dir_for(path), _old_dir_for(path)
    if old.is_dir():
        chosen = tmp if tmp.is_dir() else old
        logger.warning("Checkpoint %s was being replaced when a save was interrupted; reading %s", path, chosen)
        return chosen
    raise CheckpointDirectoryMissingError(
        f"Checkpoint directory {path} does not exist (or is not a directory). Check the path; "
        "save_state() writes it."
    )


def _clean_stale_tmp_dirs(parent: Path) -> None:
    """Remove temporary folders left by saves that were killed (any `.*.nbaccel-tmp` beside the target)."""
    if not parent.is_dir():
        return
    for entry in list(parent.iterdir()):  # first finish renames that were interrupted (their tmp is complete)
        if entry.name.startswith(".") and entry.name.endswith(_OLD_SUFFIX) and entry.is_dir():
            _recover_interrupted_rename(parent / entry.name[1:-len(_OLD_SUFFIX)])
    for entry in parent.iterdir():
        if entry.name.startswith(".") and entry.name.endswith(_TMP_SUFFIX) and entry.is_dir():
            logger.info("Removing %s left by an interrupted save", entry)
            shutil.rmtree(entry, ignore_errors=True)


def _replaceable(target: Path) -> bool:
    """True when `target` may be replaced as a whole: absent, empty, written by a save (its marker), or
    holding only checkpoint files by Accelerate's names. A folder with anything else in it is merged into
    file by file instead, so a save never deletes files it did not write."""
    if not target.exists():
        return True
    names = [entry.name for entry in target.iterdir()]
    return MARKER_NAME in names or all(_KNOWN_FILE_RE.match(name) for name in names)


def _holds_working_dir(target: Path) -> bool:
    """Whether `target` is this process's working directory or one of its parents (`save_state(".")`): renaming it
    away would leave the process in a deleted folder, where every relative path fails."""
    try:
        cwd = Path(os.path.realpath(os.getcwd()))
    except FileNotFoundError:  # already in a deleted folder: nothing more to lose
        return False
    real = Path(os.path.realpath(target))
    return cwd == real or real in cwd.parents


def _move_files_into(tmp: Path, target: Path) -> None:
    """Non-atomic fallback: move each new file into `target` (each one replaced atomically)."""
    logger.warning(
        "%s holds files that are not part of a checkpoint, so the save replaces its files one by one "
        "instead of atomically as a whole; save into a folder of its own for atomic checkpoints.", target,
    )
    _merge_files_into(tmp, target, durable=True)


def _merge_files_into(tmp: Path, target: Path, durable: bool) -> None:
    """Move each entry of `tmp` into `target` (each one replaced atomically), then remove `tmp`."""
    for entry in sorted(tmp.iterdir()):
        destination = target / entry.name
        if entry.is_dir() and destination.is_dir():
            shutil.rmtree(destination)
        os.replace(entry, destination)
    tmp.rmdir()
    if durable:
        fsync_dir(target)




# ------------------------------------------------------------------------- agreement between ranks
def _distributed_active(num_processes: int) -> bool:
    return num_processes > 1 and torch.distributed.is_available() and torch.distributed.is_initialized()


def _all_succeeded(ok: bool, num_processes: int) -> bool:
    """True on every process iff `ok` is true on every process (one all-reduce; a barrier that tells)."""
    if not _distributed_active(num_processes):
        return ok
    device = torch.device("cpu")
    if torch.distributed.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
    return bool(flag.item())


LOW_SPACE = 64 * 2**20  # bytes free on a file system below which a failed save says the disk may be full


def _step_failures(error: BaseException | None, num_processes: int, folder: Path) -> dict[int, str]:
    """Why a save step failed, by process index, on every process ({}: it succeeded everywhere). One
    all-reduce as the step's barrier; only when some process failed, an all-gather of the reasons, so every
    process can say which one failed and how (the error of the one that failed, the disk's space)."""
    reason = None if error is None else _failure_reason(error, folder)
    if not _distributed_active(num_processes):
        return {} if reason is None else {0: reason}
    if _all_succeeded(reason is None, num_processes):
        return {}
    reasons: list[str | None] = [None] * num_processes
    torch.distributed.all_gather_object(reasons, reason)
    return {index: text for index, text in enumerate(reasons) if text is not None}


def _failure_reason(error: BaseException, folder: Path) -> str:
    """The error's first line, and the disk's free space when it is low: torch's writer reports a full disk as
    "unexpected pos N vs M", without the system's "No space left on device". The hint goes on the error too."""
    message = str(error).strip()
    text = f"{type(error).__name__}: {message.splitlines()[0]}" if message else type(error).__name__
    hint = _disk_hint(error, folder)
    if hint is None:
        return text
    if isinstance(error, Exception):
        error.add_note(hint)
    return f"{text}; {hint}"


def _disk_hint(error: BaseException, folder: Path) -> str | None:
    existing = next((path for path in (folder, *folder.parents) if path.exists()), None)
    try:
        free = shutil.disk_usage(existing).free if existing is not None else None
    except OSError:
        free = None
    full = getattr(error, "errno", None) == errno.ENOSPC
    if not full and (free is None or free >= LOW_SPACE):
        return None
    space = f"only {free / 2**20:.1f} MiB free" if free is not None else "no space left"
    return (f"the file system of {existing or folder} has {space}: the disk is probably full; free some space or "
            "save elsewhere")


def _where(failures: dict[int, str]) -> str:
    """`process 0 (RuntimeError: ...)`, `processes 0 (...), 2 (...)`."""
    listed = ", ".join(f"{index} ({reason})" for index, reason in sorted(failures.items()))
    return f"process{'es' if len(failures) > 1 else ''} {listed}"


# ----------------------------------------------------------------------------------- model weights
def _unwrap_model(model: Any) -> Any:
    """The module inside DDP/DataParallel/FSDP/DeepSpeed and torch.compile wrappers."""
    return extract_model_from_parallel(model, keep_torch_compile=False)


def _default_state_dict(model: Any) -> dict[str, Any]:
    return _unwrap_model(model).state_dict()


def _storage_key(tensor: torch.Tensor) -> tuple:
    try:
        storage = tensor.untyped_storage()
        return (tensor.device, storage.data_ptr(), storage.nbytes())
    except (NotImplementedError, RuntimeError):  # tensors without storage (meta, some subclasses)
        return (tensor.device, id(tensor), 0)


def _prepare_for_safetensors(state_dict: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """CPU, contiguous tensors without aliasing, as safetensors requires.

    Names that are the same tensor (tied weights) keep only the first name in the state dict's order, as
    Accelerate's files do, with its warning; loading re-ties them through the model. Different views of one
    storage are copied so each is saved on its own.
    """
    tensors: dict[str, torch.Tensor] = {}
    for name, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"safetensors can only save tensors; state dict entry {name!r} is {type(value).__name__}. "
                "Use safe_serialization=False for state dicts holding other objects."
            )
        tensors[name] = value
    groups: dict[tuple, list[str]] = defaultdict(list)
    for name, tensor in tensors.items():
        groups[_storage_key(tensor)].append(name)
    result: dict[str, torch.Tensor] = {}
    dropped: list[str] = []
    for names in groups.values():  # each group's names in the state dict's order
        first = tensors[names[0]]
        same = all(
            tensors[n].data_ptr() == first.data_ptr() and tensors[n].shape == first.shape
            and tensors[n].stride() == first.stride() and tensors[n].dtype == first.dtype
            for n in names
        )
        if len(names) == 1 or same:
            result[names[0]] = first.detach().to("cpu").contiguous()
            dropped += names[1:]
        else:
            for name in names:
                result[name] = tensors[name].detach().to("cpu").clone().contiguous()
    if dropped:  # Accelerate warns here too (its clean_state_dict_for_safetensors)
        logger.warning("Removed shared tensor(s) %s while saving with safetensors; they are tied to a saved one and "
                       "load through it (tie them again after loading, e.g. with `model.tie_weights()`).",
                       ", ".join(dropped))
    return result


def _prepare_for_torch_save(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """CPU copies for torch.save; a view of a larger storage is cloned so only its own bytes are written."""
    result: dict[str, Any] = {}
    moved: dict[tuple, torch.Tensor] = {}
    for name, value in state_dict.items():
        if isinstance(value, torch.Tensor):
            key = (_storage_key(value), value.data_ptr(), tuple(value.shape), value.stride(), value.dtype)
            if key not in moved:  # tied tensors stay tied (torch.save keeps shared storage)
                tensor = value.detach().to("cpu")
                if tensor.untyped_storage().nbytes() != tensor.nbytes:
                    tensor = tensor.clone()
                moved[key] = tensor
            result[name] = moved[key]
        else:
            result[name] = value
    return result


def _write_state_dict(state_dict: Mapping[str, Any], path: Path, safe_serialization: bool,
                      metadata: dict[str, str] | None = None) -> None:
    if safe_serialization:
        from safetensors.torch import save_file

        with atomic_path(path, durable=False) as partial:  # save_state fsyncs its folder when durable
            save_file(_prepare_for_safetensors(state_dict), str(partial), metadata={"format": "pt", **(metadata or {})})
    else:
        with atomic_path(path, durable=False) as partial:
            torch.save(_prepare_for_torch_save(state_dict), partial)


def _read_safetensors(path: Path, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        return load_file(str(path), device=str(device))
    except FileNotFoundError as error:
        raise CheckpointFileMissingError(f"Checkpoint file {path} is missing.") from error
    except Exception as error:  # safetensors raises SafetensorError (or OSError) for damaged files
        raise CheckpointFileCorruptError(
            f"Checkpoint file {path} is truncated or corrupt and cannot be read as safetensors "
            f"({type(error).__name__}: {error}). Load an earlier checkpoint or save again."
        ) from error


def _load_into_model(model: Any, state_dict: dict[str, Any], strict: bool, path: Path, **kwargs: Any) -> None:
    """`model.load_state_dict`, accepting tied names saved once and Accelerate's `module.` prefixes.

    `load_accelerator_state` has checked keys and shapes with `checkpoint_fit.fit_model` already; the keys
    are checked again after loading for models whose load_state_dict pre-hooks rename them.
    """
    target = _unwrap_model(model)
    fit = checkpoint_fit.fit_model(target, state_dict, strict=False)
    result = target.load_state_dict(fit.state_dict, strict=False, **kwargs)
    missing = checkpoint_fit.tied_missing(target.state_dict(), fit.state_dict, set(result.missing_keys))
    unexpected = list(result.unexpected_keys)
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"Weights in {path} do not match the model {type(target).__name__}: "
            f"missing keys {sorted(missing)[:10]}{' ...' if len(missing) > 10 else ''}, "
            f"unexpected keys {unexpected[:10]}{' ...' if len(unexpected) > 10 else ''}. "
            "Load into the same architecture, or pass strict=False."
        )


# ------------------------------------------------------------------------------------ torch.load
def _torch_load(path: Path, *, map_location: Any = "cpu", allow_pickle_fallback: bool = False,
                weights_only: bool | None = None) -> Any:
    """torch.load with weights_only=True, turning a missing/damaged file into an error that names it.

    With `allow_pickle_fallback`, content that weights_only refuses (arbitrary Python objects) is loaded
    with full unpickling instead, unless the caller forced `weights_only=True`.
    """
    if not path.is_file():
        raise CheckpointFileMissingError(f"Checkpoint file {path} is missing.")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as error:
        refused = "weights_only" in str(error) or "Weights only load failed" in str(error)
        if refused and allow_pickle_fallback and weights_only is not True:
            logger.debug("%s holds non-tensor Python objects; loading it with full unpickling", path)
            return _torch_load_full(path, map_location)
        if refused:
            detail = next((line for line in str(error).splitlines() if "WeightsUnpickler error" in line
                           or "GLOBAL" in line), str(error).splitlines()[0])
            raise CheckpointFileCorruptError(
                f"Checkpoint file {path} cannot be read with torch.load(weights_only=True): it is damaged, or "
                f"holds Python objects other than tensors and plain containers ({detail.strip()})."
            ) from error
        raise _corrupt(path, error) from error
    except (RuntimeError, EOFError, ValueError, OSError, zipfile.BadZipFile) as error:
        raise _corrupt(path, error) from error


def _torch_load_full(path: Path, map_location: Any) -> Any:
    try:
        return torch.load(path, map_location=map_location, weights_only=False)
    except Exception as error:
        raise _corrupt(path, error) from error


def _corrupt(path: Path, error: BaseException) -> CheckpointFileCorruptError:
    first_line = (str(error).splitlines() or [""])[0]
    return CheckpointFileCorruptError(
        f"Checkpoint file {path} is truncated or corrupt ({type(error).__name__}: {first_line}). "
        "Load an earlier checkpoint or save again."
    )


# ----------------------------------------------------------------------------------------- RNG
def collect_rng_states(step: int = 0) -> dict[str, Any]:
    """This process's random states (python, numpy, torch, each accelerator, XLA), under Accelerate's keys
    and in Accelerate's form, so either library restores the other's file. `torch.load(weights_only=True)`
    reads it with numpy's array reconstruction allowlisted (see `_numpy_safe_globals`)."""
    states: dict[str, Any] = {"step": int(step), "random_state": random.getstate()}
    states["numpy_random_seed"] = np.random.get_state(legacy=True)
    states["torch_manual_seed"] = torch.get_rng_state()
    if torch.cuda.is_available():
        states["torch_cuda_manual_seed"] = torch.cuda.get_rng_state_all()
    for backend in ("xpu", "npu", "mlu", "musa", "sdaa", "hpu"):
        module = getattr(torch, backend, None)
        with contextlib.suppress(Exception):
            if module is not None and module.is_available():
                states[f"torch_{backend}_manual_seed"] = module.get_rng_state_all()
    with contextlib.suppress(Exception):
        if torch.backends.mps.is_available():
            states["torch_mps_manual_seed"] = torch.mps.get_rng_state()
    xm = sys.modules.get("torch_xla.core.xla_model")  # only when the program already uses torch_xla
    if xm is not None:
        states["xm_seed"] = xm.get_rng_state()
    return states


def restore_rng_states(states: Mapping[str, Any]) -> None:
    """Set this process's random generators from `collect_rng_states`'s dict (or Accelerate's file)."""
    if "random_state" in states:
        random.setstate(_as_python_random_state(states["random_state"]))
    numpy_state = states.get("numpy_random_seed")
    if isinstance(numpy_state, Mapping):
        keys = numpy_state["keys"]
        keys = keys.numpy() if isinstance(keys, torch.Tensor) else np.asarray(keys)
        np.random.set_state((numpy_state["bit_generator"], keys.astype(np.uint32), int(numpy_state["pos"]),
                             int(numpy_state["has_gauss"]), float(numpy_state["cached_gaussian"])))
    elif numpy_state is not None:  # Accelerate's file: the tuple of np.random.get_state()
        np.random.set_state(numpy_state)
    if "torch_manual_seed" in states:
        torch.set_rng_state(states["torch_manual_seed"])
    if "torch_cuda_manual_seed" in states and torch.cuda.is_available():
        cuda_states = states["torch_cuda_manual_seed"]
        for index in range(min(len(cuda_states), torch.cuda.device_count())):
            torch.cuda.set_rng_state(cuda_states[index], index)
    for backend in ("xpu", "npu", "mlu", "musa", "sdaa", "hpu"):
        key = f"torch_{backend}_manual_seed"
        module = getattr(torch, backend, None)
        if key in states and module is not None:
            module.set_rng_state_all(states[key])
    if "torch_mps_manual_seed" in states and torch.backends.mps.is_available():
        torch.mps.set_rng_state(states["torch_mps_manual_seed"])
    if "xm_seed" in states:
        xm = sys.modules.get("torch_xla.core.xla_model")
        if xm is None:
            logger.warning("Checkpoint holds an XLA random state but torch_xla is not in use; not restored")
        else:
            xm.set_rng_state(states["xm_seed"])


def _as_python_random_state(value: Any) -> tuple:
    version, internal, gauss = value
    return (int(version), tuple(int(x) for x in internal), gauss)


def _numpy_safe_globals() -> list[Any]:
    """Exactly what `np.random.get_state()`'s uint32 array needs to unpickle; nothing that runs code."""
    try:  # numpy >= 2
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy 1.x
        from numpy.core.multiarray import _reconstruct
    return [np.ndarray, np.dtype, _reconstruct, type(np.dtype(np.uint32))]


def _load_rng_file(path: Path) -> dict[str, Any]:
    """weights_only load with numpy's array reconstruction allowlisted for this one call."""
    with torch.serialization.safe_globals(_numpy_safe_globals()):
        return _torch_load(path, map_location="cpu")


# ---------------------------------------------------------------------------------- data loaders
def _has_state_dict(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _sampler_objects(dataloader: Any) -> list[Any]:
    """The sampler(s) of a plain DataLoader: `.sampler` and `.batch_sampler.sampler`, without repeats."""
    found: list[Any] = []
    for candidate in (getattr(dataloader, "sampler", None),
                      getattr(getattr(dataloader, "batch_sampler", None), "sampler", None)):
        if candidate is not None and all(candidate is not seen for seen in found):
            found.append(candidate)
    return found


_SAMPLER_ATTRIBUTES = ("epoch", "seed", "initial_seed")  # DistributedSampler, seedable samplers


def _sampler_state(dataloader: Any) -> dict[str, Any] | None:
    """What a plain DataLoader exposes about its order: sampler state_dict, generator state, epoch, seed."""
    state: dict[str, Any] = {}
    generator = getattr(dataloader, "generator", None)
    if isinstance(generator, torch.Generator):
        state["dataloader_generator"] = generator.get_state()
    samplers = []
    for sampler in _sampler_objects(dataloader):
        entry: dict[str, Any] = {}
        if _has_state_dict(sampler):
            entry["state_dict"] = sampler.state_dict()
        else:
            gen = getattr(sampler, "generator", None)
            if isinstance(gen, torch.Generator):
                entry["generator"] = gen.get_state()
            for attribute in _SAMPLER_ATTRIBUTES:
                value = getattr(sampler, attribute, None)
                if isinstance(value, int) and not isinstance(value, bool):
                    entry[attribute] = value
        samplers.append(entry)
    if any(samplers):
        state["samplers"] = samplers
    return state or None


def _restore_sampler_state(dataloader: Any, state: Mapping[str, Any]) -> None:
    generator = getattr(dataloader, "generator", None)
    if "dataloader_generator" in state and isinstance(generator, torch.Generator):
        generator.set_state(state["dataloader_generator"])
    for sampler, entry in zip(_sampler_objects(dataloader), state.get("samplers", [])):
        if "state_dict" in entry and _has_state_dict(sampler):
            sampler.load_state_dict(entry["state_dict"])
            continue
        if "generator" in entry and isinstance(getattr(sampler, "generator", None), torch.Generator):
            sampler.generator.set_state(entry["generator"])
        for attribute in _SAMPLER_ATTRIBUTES:
            if attribute in entry:
                if attribute == "epoch" and callable(getattr(sampler, "set_epoch", None)):
                    sampler.set_epoch(entry[attribute])
                else:
                    setattr(sampler, attribute, entry[attribute])


# -------------------------------------------------------------------------------------- checks
def check_checkpointable(obj: Any) -> None:
    """TypeError unless `obj` has `state_dict()` and `load_state_dict()` (register_for_checkpointing's rule)."""
    if not _has_state_dict(obj):
        raise TypeError(
            f"{type(obj).__name__} object cannot be registered for checkpointing: it needs both "
            "`state_dict()` and `load_state_dict(state)` methods."
        )


def _resolve_map_location(map_location: Any, device: Any) -> Any:
    if map_location is None or map_location == "cpu":
        return "cpu"
    if map_location == "on_device":
        if device is None:  # the process's device, as Accelerate does
            from .state import PartialState

            device = PartialState().device
        return device
    if isinstance(map_location, str | torch.device):
        return map_location
    raise TypeError(
        f"Unsupported map_location {map_location!r}: use None, 'cpu', 'on_device' or a torch.device."
    )


# ------------------------------------------------------------------------------------------- save
def save_accelerator_state(
    output_dir: str | os.PathLike,
    *,
    models: Sequence[Any] = (),
    optimizers: Sequence[Any] = (),
    schedulers: Sequence[Any] = (),
    dataloaders: Sequence[Any] = (),
    scaler: Any | None = None,
    custom_objects: Sequence[Any] = (),
    process_index: int = 0,
    num_processes: int = 1,
    is_main_process: bool = True,
    safe_serialization: bool = True,
    save_model_fn: Callable[[Any, Path, int], None] | None = None,
    save_optimizer_fn: Callable[[Any, Path, int], None] | None = None,
    step: int = 0,
    pre_hooks: Iterable[SaveHook] = (),
    get_state_dict: Callable[[Any], Mapping[str, Any]] | None = None,
    total_limit: int | None = None,
    durable: bool = True,
) -> Path:
    """Save models, optimizers, schedulers, data-loader positions, scaler, RNG states and custom objects.

    Call it on every process. The main process writes the shared files (weights, optimizer, scheduler,
    scaler, custom objects, data loaders); every process writes its `random_states_{process_index}.pkl`
    (and its data-loader state when it has one). Atomic protocol:
      1. main: finish/undo a save interrupted during its rename, remove stale `.*.nbaccel-tmp` folders,
         create `.{name}.nbaccel-tmp` beside `output_dir`;  all processes agree it succeeded;
      2. every process writes its files into the temporary folder (and fsyncs them); all agree;
      3. main: `output_dir` (if present) -> `.{name}.nbaccel-old`, temporary folder -> `output_dir`,
         delete the old one, then apply `total_limit` to the `checkpoint_N` siblings; all agree.
    A process that does not see the main process's temporary folder (its own `output_dir`, or no shared
    file system) writes into `.{name}.rank{i}.nbaccel-tmp` and, after step 3, moves its files into its
    `output_dir` one by one (each atomically); all agree once more.
    A failure on any process fails the save on every process (the temporary folder is removed) and the
    previous checkpoint at `output_dir` is untouched. "Agree" is an all-reduce when torch.distributed is
    initialized and `num_processes > 1`, else nothing.

    Args:
        models: the models (or their state dicts, used as given); weights are `get_state_dict(model)`
            (default: the unwrapped module's `state_dict()`), saved as `model{_i}.safetensors` or
            `pytorch_model{_i}.bin`.
        save_model_fn: `save_model_fn(model, directory, index)` writes model `index` itself into the
            (temporary) directory instead, on every process (for sharded models); hooks then see no weights.
        save_optimizer_fn: `save_optimizer_fn(optimizer, directory, index)` writes optimizer `index` itself
            into the (temporary) directory instead of `optimizer{_i}.bin`, on every process (sharded states).
        pre_hooks: `hook(models, weights, directory)` called on every process before anything is written;
            a hook may remove entries from `weights` (it then saves those itself) and write extra files into
            `directory` — the temporary folder that becomes `output_dir`.
        step: stored in the RNG file and returned as `{"step": ...}` by `load_accelerator_state`.
        total_limit: keep only the newest N `checkpoint_N` siblings of `output_dir` (automatic naming).
        durable: fsync every file and folder before the rename, so the checkpoint also survives a power
            loss or kernel crash, not only a killed process. Costs about a third of the save time on a
            disk; False keeps the atomic rename (safe against a killed process) without the fsyncs.
    Returns `output_dir` as a `Path`, as given (a relative folder stays relative, as Accelerate returns it).
    """
    target = Path(output_dir).absolute()
    if target.is_symlink():  # a link to the folder (on another disk, say): the save goes where it points, beside
        target = Path(os.path.realpath(target))  # the real folder, and the link stays a link
    tmp = _tmp_dir_for(target)
    for obj in custom_objects:
        check_checkpointable(obj)

    # 1. the main process prepares the temporary folder
    error: BaseException | None = None
    if target.exists() and not target.is_dir():  # every process that sees it, as Accelerate's makedirs fails on each
        error = FileExistsError(errno.EEXIST, "output_dir is a file, not a folder; pass a folder path", str(target))
    elif is_main_process:
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            _recover_interrupted_rename(target)
            _clean_stale_tmp_dirs(target.parent)
            tmp.mkdir()
        except BaseException as caught:  # noqa: BLE001 - reported to every process below
            error = caught
    failures = _step_failures(error, num_processes, target.parent)
    if failures:  # the process that failed raises its own error (Accelerate's os.makedirs raises it on each)
        if error is not None:
            raise error
        raise CheckpointError(f"Could not prepare the checkpoint folder {tmp}: it failed on {_where(failures)}.")

    # 2. every process writes its part. A process that does not see the main process's folder (each process
    # passed its own folder, as with a per-process tempfile, or nodes without a shared file system) writes
    # into a temporary folder of its own and merges it into its `output_dir` after the main process's rename.
    own_tmp = None
    if not is_main_process and not tmp.is_dir():
        own_tmp = target.parent / f".{target.name}.rank{process_index}{_TMP_SUFFIX}"
    try:
        if own_tmp is not None:
            shutil.rmtree(own_tmp, ignore_errors=True)
            own_tmp.mkdir(parents=True)
        _write_checkpoint_files(own_tmp or tmp, _CheckpointWrite(
            models=models, optimizers=optimizers, schedulers=schedulers, dataloaders=dataloaders,
            scaler=scaler, custom_objects=custom_objects, process_index=process_index,
            is_main_process=is_main_process, safe_serialization=safe_serialization,
            save_model_fn=save_model_fn, save_optimizer_fn=save_optimizer_fn, step=step, pre_hooks=pre_hooks,
            get_state_dict=get_state_dict or _default_state_dict, durable=durable,
        ))
    except BaseException as caught:  # noqa: BLE001
        error = caught
    failures = _step_failures(error, num_processes, target.parent)
    if failures:
        if is_main_process or own_tmp is not None:
            shutil.rmtree(own_tmp or tmp, ignore_errors=True)
        if error is not None:
            raise error
        raise CheckpointError(f"Saving {target} failed on {_where(failures)}; the previous checkpoint is kept.")

    # 3. the main process moves it into place
    if is_main_process:
        try:
            manifest = write_manifest(tmp, skip=(MARKER_NAME,))  # sizes and checksums of every file, then
            if durable:                                          # the marker: both last, before the rename
                fsync_file(manifest)
            if _holds_working_dir(target):  # the folder stays; each file of the save is replaced atomically
                _merge_files_into(tmp, target, durable)
            elif _replaceable(target):
                (tmp / MARKER_NAME).write_text(json.dumps({"format": "nbaccel-checkpoint", "version": 1,
                                                           "num_processes": num_processes, "step": step}))
                if durable:
                    fsync_dir(tmp)
                old = _old_dir_for(target)
                if target.exists():
                    os.replace(target, old)
                os.replace(tmp, target)
                if durable:
                    fsync_dir(target.parent)
                if old.exists():
                    shutil.rmtree(old)
            else:
                _move_files_into(tmp, target)
            if total_limit is not None:
                rotate_checkpoints(target.parent, total_limit, keep=target)
        except BaseException as caught:  # noqa: BLE001
            error = caught
    failures = _step_failures(error, num_processes, target.parent)
    if failures:
        if own_tmp is not None:
            shutil.rmtree(own_tmp, ignore_errors=True)
        _reraise(error, f"Could not move the checkpoint into {target}", failures)
    if own_tmp is not None:  # after the main process's rename, so a shared folder keeps these files too
        try:
            target.mkdir(parents=True, exist_ok=True)
            _merge_files_into(own_tmp, target, durable)
        except BaseException as caught:  # noqa: BLE001
            error = caught
    failures = _step_failures(error, num_processes, target.parent)
    if failures:
        _reraise(error, f"Could not move every process's checkpoint files into {target}", failures)
    logger.info("Saved state to %s", target)
    return Path(output_dir)


def _reraise(error: BaseException | None, message: str, failures: dict[int, str]) -> None:
    """Raise why a save step failed here (KeyboardInterrupt stays one), or say which process failed, and how."""
    if error is None:
        raise CheckpointError(f"{message}: it failed on {_where(failures)}.")
    if not isinstance(error, Exception):
        raise error
    raise CheckpointError(f"{message}: {type(error).__name__}: {error}") from error


@dataclass(frozen=True)
class _CheckpointWrite:
    """What one process writes into a checkpoint folder, and how (save_state's values, passed as one)."""

    models: Any
    optimizers: Any
    schedulers: Any
    dataloaders: Any
    scaler: Any
    custom_objects: Any
    process_index: int
    is_main_process: bool
    safe_serialization: bool
    save_model_fn: Any
    save_optimizer_fn: Any
    step: int
    pre_hooks: Iterable[SaveHook]
    get_state_dict: Callable[[Any], Mapping[str, Any]]
    durable: bool


def _write_checkpoint_files(directory: Path, job: _CheckpointWrite) -> None:
    models, optimizers, schedulers, dataloaders = job.models, job.optimizers, job.schedulers, job.dataloaders
    scaler, custom_objects, process_index, step = job.scaler, job.custom_objects, job.process_index, job.step
    is_main_process, safe_serialization, durable = job.is_main_process, job.safe_serialization, job.durable
    save_model_fn, save_optimizer_fn, pre_hooks = job.save_model_fn, job.save_optimizer_fn, job.pre_hooks
    get_state_dict = job.get_state_dict
    written: list[Path] = []

    def out(name: str) -> Path:
        path = directory / name
        written.append(path)
        return path

    models = list(models)
    if save_model_fn is not None:
        weights: list[Any] = []
        for index, model in enumerate(models):
            save_model_fn(model, directory, index)
    else:
        weights = [model if isinstance(model, Mapping) else get_state_dict(model) for model in models]
    if save_optimizer_fn is not None:  # a collective too (sharded optimizer states): every process writes
        for index, optimizer in enumerate(optimizers):
            save_optimizer_fn(optimizer, directory, index)
    by_functions: list[Path] = []
    if durable and (save_model_fn is not None or save_optimizer_fn is not None):
        # what the functions wrote (they end in a collective, so every rank's files are there): fsynced too,
        # and their sub-folders, so the rename in step 3 never publishes a half-flushed shard
        for root, _, names in os.walk(directory):
            by_functions.extend(Path(root) / name for name in names)
            if Path(root) != directory:
                fsync_dir(Path(root))
    for hook in pre_hooks:
        hook(models, weights, str(directory))

    if is_main_process:
        for index, state in enumerate(weights):
            _write_state_dict(state, out(model_file_name(index, safe_serialization)), safe_serialization)
        for index, optimizer in enumerate(optimizers if save_optimizer_fn is None else ()):
            torch.save(optimizer.state_dict(), out(_indexed(OPTIMIZER_NAME, index, ".bin")))
        for index, scheduler in enumerate(schedulers):
            torch.save(scheduler.state_dict(), out(_indexed(SCHEDULER_NAME, index, ".bin")))
        if scaler is not None:
            torch.save(scaler.state_dict(), out(SCALER_NAME))
        for index, obj in enumerate(custom_objects):
            torch.save(obj.state_dict(), out(f"{CUSTOM_CHECKPOINT_NAME}_{index}.pkl"))
    for index, dataloader in enumerate(dataloaders):
        if _has_state_dict(dataloader):
            torch.save(dataloader.state_dict(), out(_dataloader_state_name(index, process_index)))
        elif is_main_process:
            state = _sampler_state(dataloader)
            if state is not None:
                torch.save(state, out(_indexed(SAMPLER_NAME, index, ".bin")))
    torch.save(collect_rng_states(step), out(rng_state_file_name(process_index)))
    if durable:
        for path in written:
            fsync_file(path)
        for path in by_functions:
            with contextlib.suppress(FileNotFoundError):  # another rank's hook may have renamed its own file
                fsync_file(path)


# ------------------------------------------------------------------------------------------- load
def load_accelerator_state(
    input_dir: str | os.PathLike,
    *,
    models: Sequence[Any] = (),
    optimizers: Sequence[Any] = (),
    schedulers: Sequence[Any] = (),
    dataloaders: Sequence[Any] = (),
    scaler: Any | None = None,
    custom_objects: Sequence[Any] = (),
    process_index: int = 0,
    map_location: Any = None,
    strict: bool = True,
    device: Any = None,
    pre_hooks: Iterable[LoadHook] = (),
    load_model_fn: Callable[[Any, Path, int], None] | None = None,
    load_optimizer_fn: Callable[[Any, Path, int], None] | None = None,
    load_kwargs: Mapping[str, Any] | None = None,
    **load_model_kwargs: Any,
) -> dict[str, Any]:
    """Restore what `save_accelerator_state` wrote; returns the attributes to override (`{"step": n}`).

    Every file needed is checked and read before any object is changed, so a missing or damaged file
    raises `CheckpointFileMissingError` / `CheckpointFileCorruptError` naming it and leaves the run as it
    was. `pre_hooks` get `(models, input_dir)` first and may remove models they load themselves.
    `map_location` (None/"cpu", "on_device": `device` or `PartialState().device`, or a device) is where
    optimizer states go.
    `strict` and `load_model_kwargs` go to the models' `load_state_dict`. Data-loader files that are
    absent (e.g. a checkpoint written by Accelerate without them) only log a warning.
    `load_model_fn(model, directory, index)` / `load_optimizer_fn(optimizer, directory, index)` read a model /
    optimizer themselves (sharded states, on every process), after the other files were checked and read.
    """
    directory = _resolve_readable_dir(Path(input_dir))
    verify_checkpoint(directory)
    location = _resolve_map_location(map_location, device)
    weights_only = (load_kwargs or {}).get("weights_only")
    for obj in custom_objects:
        check_checkpointable(obj)
    models = list(models)
    # hooks get the folder as the caller spelled it (a trailing slash kept, as Accelerate passes it), or the
    # folder actually read when a save interrupted mid-rename left the checkpoint under another name
    given = os.fspath(input_dir)
    for hook in pre_hooks:
        hook(models, given if directory == Path(given) else str(directory))

    # Read everything first.
    model_states: list[Any] = []
    for index in range(len(models)):
        if load_model_fn is not None:
            model_states.append(None)
            continue
        safe, legacy = directory / model_file_name(index, True), directory / model_file_name(index, False)
        if safe.is_file():
            model_states.append((safe, _read_safetensors(safe)))
        elif legacy.is_file():
            model_states.append((legacy, _torch_load(legacy, map_location="cpu")))
        else:
            raise CheckpointFileMissingError(
                f"Checkpoint {directory} has no weights for model {index}: expected {safe.name} or "
                f"{legacy.name}. Was it saved with the same number of models (prepare order)?"
            )
    optimizer_states = [
        None if load_optimizer_fn is not None
        else _torch_load(directory / _indexed(OPTIMIZER_NAME, i, ".bin"), map_location=location)
        for i in range(len(optimizers))
    ]
    scheduler_states = [
        _torch_load(directory / _indexed(SCHEDULER_NAME, i, ".bin"), allow_pickle_fallback=True,
                    weights_only=weights_only)
        for i in range(len(schedulers))
    ]
    scaler_state = _read_scaler_state(directory) if scaler is not None else None
    custom_files = sorted(p.name for p in directory.iterdir() if _CUSTOM_RE.match(p.name))
    absent = [f"{CUSTOM_CHECKPOINT_NAME}_{i}.pkl" for i in range(len(custom_objects))
              if f"{CUSTOM_CHECKPOINT_NAME}_{i}.pkl" not in custom_files]
    if absent:
        raise RegisteredObjectsMismatchError(
            f"Checkpoint file {directory / absent[0]} is missing: {len(custom_objects)} objects are registered "
            f"for checkpointing but the checkpoint holds {custom_files or 'none'}."
        )
    if len(custom_files) != len(custom_objects):
        raise CheckpointMismatchError(
            f"Checkpoint {directory} holds {len(custom_files)} custom objects ({custom_files}) but "
            f"{len(custom_objects)} are registered for checkpointing: register the same objects, in the "
            "same order, as when it was saved."
        )
    custom_states = [
        _torch_load(directory / f"{CUSTOM_CHECKPOINT_NAME}_{i}.pkl", allow_pickle_fallback=True,
                    weights_only=weights_only)
        for i in range(len(custom_objects))
    ]
    dataloader_states = [_read_dataloader_state(directory, i, dl, process_index)
                         for i, dl in enumerate(dataloaders)]
    rng_states = _read_rng_states(directory, process_index)
    _check_fit(directory, strict, models=list(zip(models, model_states)),
               optimizers=list(zip(optimizers, optimizer_states)), schedulers=list(zip(schedulers, scheduler_states)),
               custom=list(zip(custom_objects, custom_states)))

    # Then apply.
    for index, (model, loaded) in enumerate(zip(models, model_states)):
        if load_model_fn is not None:
            load_model_fn(model, directory, index)
        else:
            path, state = loaded
            _load_into_model(model, state, strict, path, **load_model_kwargs)
    for index, (optimizer, state) in enumerate(zip(optimizers, optimizer_states)):
        if load_optimizer_fn is not None:
            load_optimizer_fn(optimizer, directory, index)
        else:
            optimizer.load_state_dict(state)
    for scheduler, state in zip(schedulers, scheduler_states):
        scheduler.load_state_dict(state)
    if scaler is not None and scaler_state is not None:
        scaler.load_state_dict(scaler_state)
    for dataloader, (kind, state) in zip(dataloaders, dataloader_states):
        if kind == "state_dict":
            dataloader.load_state_dict(state)
        elif kind == "sampler":
            _restore_sampler_state(dataloader, state)
    for obj, state in zip(custom_objects, custom_states):
        obj.load_state_dict(state)
    overrides: dict[str, Any] = {}
    if rng_states is not None:
        restore_rng_states(rng_states)
        if "step" in rng_states:
            overrides["step"] = int(rng_states["step"])
    logger.info("Loaded state from %s", directory)
    return overrides


def _check_fit(directory: Path, strict: bool, *, models: list[tuple[Any, Any]], optimizers: list[tuple[Any, Any]],
               schedulers: list[tuple[Any, Any]], custom: list[tuple[Any, Any]]) -> None:
    """CheckpointMismatchError listing every object the checkpoint does not fit (keys, shapes), raised
    before any object is changed. Each list pairs an object with the state read for it."""
    problems: list[str] = []
    for index, (model, loaded) in enumerate(models):
        target = _unwrap_model(model)
        if loaded is not None and isinstance(target, torch.nn.Module):
            found = checkpoint_fit.fit_model(target, loaded[1], strict).problems
            problems += [f"model {index} ({type(target).__name__}, {loaded[0].name}): {p}" for p in found]
    for index, (optimizer, state) in enumerate(optimizers):
        if state is not None:
            found = checkpoint_fit.fit_optimizer(optimizer, state)
            problems += [f"optimizer {index} ({_indexed(OPTIMIZER_NAME, index, '.bin')}): {p}" for p in found]
    for index, (scheduler, state) in enumerate(schedulers):
        found = checkpoint_fit.fit_scheduler(scheduler, state)
        problems += [f"scheduler {index} ({_indexed(SCHEDULER_NAME, index, '.bin')}): {p}" for p in found]
    for index, (obj, state) in enumerate(custom):
        found = checkpoint_fit.fit_object(obj, state)
        problems += [f"registered object {index} ({type(obj).__name__}, {CUSTOM_CHECKPOINT_NAME}_{index}.pkl): {p}"
                     for p in found]
    if problems:
        raise CheckpointMismatchError(
            f"Checkpoint {directory} does not fit the objects it is loaded into; nothing was loaded:\n  - "
            + "\n  - ".join(problems)
            + "\nLoad it into the same architecture (and optimizer/scheduler set-up) it was saved from"
            + (", or pass strict=False to allow missing/unexpected keys (not other shapes)." if strict else ".")
        )


def verify_checkpoint(directory: Path) -> None:
    """Check `directory` against its manifest (checkpoint_manifest.py); raise naming the first bad file.
    A checkpoint without a manifest (Accelerate's, or an older nbaccel's) passes unchecked."""
    try:
        problems = check_manifest(directory)
    except ValueError as error:
        raise CheckpointFileCorruptError(f"{error}. Load an earlier checkpoint or save again.") from error
    if not problems:
        return
    first = problems[0]
    others = f" ({len(problems) - 1} other file(s) too: {', '.join(p.path.name for p in problems[1:])})" \
        if len(problems) > 1 else ""
    if first.kind == "missing":
        raise CheckpointFileMissingError(f"Checkpoint file {first.path} is missing: {first.detail}{others}.")
    raise CheckpointFileCorruptError(
        f"Checkpoint file {first.path} is truncated or corrupt: {first.detail} ({MANIFEST_NAME}){others}. "
        "Load an earlier checkpoint or save again."
    )


def _read_dataloader_state(directory: Path, index: int, dataloader: Any, process_index: int) -> tuple[str, Any]:
    if _has_state_dict(dataloader):
        own = directory / _dataloader_state_name(index, process_index)
        main = directory / _dataloader_state_name(index, 0)
        for path in (own, main):
            if path.is_file():
                return "state_dict", _torch_load(path)
        logger.warning("%s has no %s: data loader %d starts from the beginning", directory, main.name, index)
        return "none", None
    path = directory / _indexed(SAMPLER_NAME, index, ".bin")
    if _sampler_state(dataloader) is None:
        return "none", None
    if not path.is_file():
        logger.warning("%s has no %s: the sampler of data loader %d is not restored", directory, path.name, index)
        return "none", None
    try:
        return "sampler", _torch_load(path)
    except CheckpointFileCorruptError as error:
        if "weights_only" not in str(error):
            raise
        # Accelerate pickles its sampler object here; nbaccel does not unpickle arbitrary objects.
        logger.warning("%s holds a pickled sampler object (Accelerate format); not restored", path)
        return "none", None


def _read_scaler_state(directory: Path) -> dict[str, Any] | None:
    """The GradScaler's state, or None (a warning) for a checkpoint saved without one: Accelerate trains fp16 on
    the CPU without a scaler (nbaccel scales there), and a run may turn fp16 on between a save and its resume.
    The scaler then starts from its initial scale, which it adjusts within a few steps."""
    path = directory / SCALER_NAME
    if path.is_file():
        return _torch_load(path)
    logger.warning("%s has no %s (saved without fp16 gradient scaling): the GradScaler starts from its initial "
                   "scale", directory, SCALER_NAME)
    return None


def _read_rng_states(directory: Path, process_index: int) -> dict[str, Any] | None:
    path = directory / rng_state_file_name(process_index)
    if path.is_file():
        return _load_rng_file(path)
    others = sorted(p.name for p in directory.glob(f"{RNG_STATE_NAME}_*.pkl"))
    if not others:
        raise CheckpointFileMissingError(
            f"Checkpoint file {path} is missing (no random_states_*.pkl at all: the checkpoint is incomplete)."
        )
    logger.warning(
        "Checkpoint %s has no %s (saved with another number of processes: %s); random states not restored",
        directory, path.name, others,
    )
    return None


# -------------------------------------------------------------------------------------- save_model
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*$", re.IGNORECASE)


def _parse_size(size: int | str) -> int:
    """`"10GB"` -> 10**10, `"5MiB"` -> 5 * 2**20, an int is bytes."""
    if isinstance(size, int) and not isinstance(size, bool):
        if size <= 0:
            raise ValueError(f"max_shard_size must be positive, got {size}.")
        return size
    match = _SIZE_RE.match(str(size))
    if not match:
        raise ValueError(f"max_shard_size {size!r} is not a size: use bytes or a string like '10GB' or '500MiB'.")
    number, unit = float(match.group(1)), (match.group(2) or "B").upper()
    powers = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
              "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    value = int(number * powers[unit])
    if value <= 0:
        raise ValueError(f"max_shard_size must be positive, got {size!r}.")
    return value


def _storage_bytes(value: torch.Tensor) -> int:
    """Bytes of the storage under `value`: what the Hub's sharding counts (a view counts its whole storage)."""
    try:
        return value.untyped_storage().nbytes()
    except (NotImplementedError, RuntimeError):  # e.g. tensor subclasses without a plain storage
        return value.numel() * value.element_size()


def _shard(state_dict: Mapping[str, Any], max_bytes: int) -> tuple[list[dict[str, Any]], int]:
    """Shards as huggingface_hub's `split_torch_state_dict_into_shards` (Accelerate's save_model) makes them,
    so both write the same files: in order, a tensor over `max_bytes` gets a shard of its own at once, the
    others fill the current shard until the next one would tip it over; a tensor sharing storage with an
    earlier one joins that one's shard and counts once. Returns the shards and their total size in bytes."""
    shards: list[dict[str, Any]] = []
    current: dict[str, Any] = {}
    current_size = total = 0
    sharing: dict[tuple, list[str]] = {}
    for name, value in state_dict.items():
        is_tensor = isinstance(value, torch.Tensor)
        key = _storage_key(value) if is_tensor and value.device.type != "meta" else None  # meta: no storage
        if key is not None:
            if key in sharing:
                sharing[key].append(name)
                continue
            sharing[key] = [name]
        size = _storage_bytes(value) if is_tensor else 0
        total += size
        if size > max_bytes:
            shards.append({name: value})
            continue
        if current_size + size > max_bytes:
            shards.append(current)
            current, current_size = {}, 0
        current[name] = value
        current_size += size
    if current or not shards:
        shards.append(current)
    for names in sharing.values():
        if len(names) > 1:
            home = next(shard for shard in shards if names[0] in shard)
            for name in names[1:]:
                home[name] = state_dict[name]
    return shards, total


def save_model(
    state_dict: Mapping[str, Any],
    save_directory: str | os.PathLike,
    *,
    max_shard_size: int | str = "10GB",
    safe_serialization: bool = True,
    is_main_process: bool = True,
) -> list[Path]:
    """Write a state dict for `from_pretrained`-style loading: one file, or shards plus an index.

    Names are transformers'/Accelerate's: `model.safetensors`, or `model-00001-of-00003.safetensors` ...
    with `model.safetensors.index.json` (`pytorch_model*.bin` with `safe_serialization=False`). Tied
    tensors are stored once for safetensors. Each file is written to a temporary name and renamed, and
    shard files of an earlier save that are not part of this one are removed. Only the main process
    writes; the others return `[]`. Returns the files written (index last).
    """
    on_meta = [name for name, value in state_dict.items()
               if isinstance(value, torch.Tensor) and value.device.type == "meta"]
    if on_meta:  # on every process, before any folder is made: as Accelerate's save_model refuses it
        raise RuntimeError(
            f"Cannot save the model: {len(on_meta)} of its tensors ({', '.join(on_meta[:3])}"
            f"{', ...' if len(on_meta) > 3 else ''}) are on the meta device and hold no values. Load its weights "
            "first (load_checkpoint_and_dispatch, or load_state_dict(..., assign=True))."
        )
    if not is_main_process:
        return []
    directory = Path(save_directory)
    if directory.is_file():
        raise ValueError(f"save_directory {directory} is a file; pass a directory.")
    directory.mkdir(parents=True, exist_ok=True)
    max_bytes = _parse_size(max_shard_size)
    prepared = _prepare_for_safetensors(state_dict) if safe_serialization else _prepare_for_torch_save(state_dict)
    shards, total_size = _shard(prepared, max_bytes)
    stem, suffix = (SAFE_MODEL_NAME, ".safetensors") if safe_serialization else (MODEL_NAME, ".bin")
    index_name = SAFE_WEIGHTS_INDEX_NAME if safe_serialization else WEIGHTS_INDEX_NAME
    count = len(shards)
    names = [f"{stem}{suffix}"] if count == 1 else [
        f"{stem}-{i + 1:05d}-of-{count:05d}{suffix}" for i in range(count)
    ]
    written: list[Path] = []
    for name, shard in zip(names, shards):
        path = directory / name
        with atomic_path(path) as partial:
            if safe_serialization:
                from safetensors.torch import save_file

                save_file(shard, str(partial), metadata={"format": "pt"})
            else:
                torch.save(shard, partial)
        written.append(path)
    stale_pattern = re.compile(rf"^{re.escape(stem)}(-\d{{5}}-of-\d{{5}})?{re.escape(suffix)}$")
    keep = set(names)
    if count > 1:
        index = {
            "metadata": {"total_size": total_size},
            "weight_map": {key: name for name, shard in zip(names, shards) for key in shard},
        }
        write_text(directory / index_name, json.dumps(index, indent=2, sort_keys=True) + "\n")
        written.append(directory / index_name)
        keep.add(index_name)
    for entry in directory.iterdir():
        stale = stale_pattern.match(entry.name) or entry.name == index_name
        if stale and entry.name not in keep and entry.is_file():
            entry.unlink()
    logger.info("Model weights saved in %s (%d file%s)", directory, count, "" if count == 1 else "s")
    return written


def load_sharded_state_dict(directory: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Read back what `save_model` wrote (single file or shards + index), safetensors or .bin."""
    directory = Path(directory)
    for index_name, single in ((SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME), (WEIGHTS_INDEX_NAME, WEIGHTS_NAME)):
        index_path = directory / index_name
        if index_path.is_file():
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
            except (ValueError, KeyError) as error:
                raise _corrupt(index_path, error) from error
            state: dict[str, torch.Tensor] = {}
            for file_name in sorted(set(weight_map.values())):
                path = directory / file_name
                if not path.is_file():
                    raise CheckpointFileMissingError(f"Shard {path} listed in {index_path} is missing.")
                state.update(_read_safetensors(path) if file_name.endswith(".safetensors") else _torch_load(path))
            return state
        if (directory / single).is_file():
            path = directory / single
            return _read_safetensors(path) if single.endswith(".safetensors") else _torch_load(path)
    raise CheckpointFileMissingError(
        f"No model weights in {directory}: expected {SAFE_WEIGHTS_NAME}, {SAFE_WEIGHTS_INDEX_NAME}, "
        f"{WEIGHTS_NAME} or {WEIGHTS_INDEX_NAME}."
    )


__all__ = [
    "CheckpointError", "CheckpointFileCorruptError", "CheckpointFileMissingError", "check_checkpointable",
    "checkpoints_root", "collect_rng_states", "latest_checkpoint_dir", "list_checkpoints",
    "load_accelerator_state", "load_sharded_state_dict", "model_file_name", "next_checkpoint_dir",
    "restore_rng_states", "rotate_checkpoints", "save_accelerator_state", "save_model",
]


# ----------------------------------------------------------------------------------------- one custom object
def save_custom_state(obj: Any, path: str | os.PathLike, index: int = 0, save_on_each_node: bool = False) -> None:
    """Write `obj.state_dict()` to `{path}/custom_checkpoint_{index}.pkl`, the file `save_state` writes for the
    index-th object given to `register_for_checkpointing`, from the main process (each node's local main process
    with `save_on_each_node`)."""
    from .utils.other import save

    check_checkpointable(obj)
    location = Path(path) / f"{CUSTOM_CHECKPOINT_NAME}_{index}.pkl"
    logger.info("Saving the state of %s to %s", type(obj).__name__, location)
    save(obj.state_dict(), location, save_on_each_node=save_on_each_node)


def load_custom_state(obj: Any, path: str | os.PathLike, index: int = 0) -> None:
    """Restore `obj` from `{path}/custom_checkpoint_{index}.pkl` (written by `save_custom_state` or `save_state`).

    Like Accelerate, arbitrary pickled Python objects are accepted: load only checkpoints you trust. A missing
    or damaged file raises `CheckpointFileMissingError` / `CheckpointFileCorruptError` naming it.
    """
    check_checkpointable(obj)
    location = Path(path) / f"{CUSTOM_CHECKPOINT_NAME}_{index}.pkl"
    logger.info("Loading the state of %s from %s", type(obj).__name__, location)
    obj.load_state_dict(_torch_load(location, allow_pickle_fallback=True))
