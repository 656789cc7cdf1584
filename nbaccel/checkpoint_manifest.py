"""A checkpoint's manifest: every file it holds, with its size and SHA-256, checked before a load.

safetensors and torch's zip files carry no checksum of their data, so a flipped bit in a weight loads
silently. `save_accelerator_state` writes `.nbaccel-manifest.json` into the temporary folder once every
process has written its files (just before the marker and the atomic rename), and `load_accelerator_state`
checks it before reading anything: a file listed there that is missing, of another size or with another
checksum is named in the error. A checkpoint without a manifest (written by Accelerate, or by an nbaccel
from before manifests) loads as before; files added to a checkpoint folder later are not checked.
Accelerate ignores the extra file, so it still loads nbaccel's checkpoints.

Cost: hashing reads every file once more after the save (from the page cache, usually) and once on every
load, at roughly the speed of SHA-256 on one core (benchmarks/checkpoint.py measures it).
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from .utils.atomic_files import write_text

MANIFEST_NAME = ".nbaccel-manifest.json"
_FORMAT = "nbaccel-checkpoint-manifest"
_ALGORITHM = "sha256"
_CHUNK = 4 << 20


@dataclass(frozen=True)
class ManifestProblem:
    """One file of a checkpoint that does not match its manifest: `missing`, `size` or `checksum`."""

    path: Path
    kind: str
    detail: str


def file_sha256(path: Path) -> str:
    """Hex SHA-256 of a file, read in large chunks (hashlib releases the GIL: files hash in parallel)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _files_under(directory: Path, skip: set[str]) -> list[str]:
    names = []
    for root, _, files in os.walk(directory):
        for name in files:
            relative = (Path(root) / name).relative_to(directory).as_posix()
            if relative not in skip:
                names.append(relative)
    return sorted(names)


def _hash_all(directory: Path, names: list[str]) -> list[str]:
    workers = min(8, max(1, len(names)), os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda name: file_sha256(directory / name), names))


def write_manifest(directory: Path, skip: tuple[str, ...] = ()) -> Path:
    """List every file under `directory` (but the manifest and `skip`) with size and SHA-256; returns the
    manifest's path. Written through a temporary name, so a reader never sees half a manifest."""
    directory = Path(directory)
    names = _files_under(directory, {MANIFEST_NAME, *skip})
    checksums = _hash_all(directory, names)
    files = {name: {"size": (directory / name).stat().st_size, _ALGORITHM: checksum}
             for name, checksum in zip(names, checksums)}
    # not fsynced here: save_state fsyncs the manifest with the rest when it is durable
    return write_text(directory / MANIFEST_NAME, json.dumps(
        {"format": _FORMAT, "version": 1, "algorithm": _ALGORITHM, "files": files}, indent=1, sort_keys=True),
        durable=False)


def read_manifest(directory: Path) -> dict[str, dict] | None:
    """The `files` table of `directory`'s manifest, or None when the checkpoint has none."""
    manifest = Path(directory) / MANIFEST_NAME
    if not manifest.is_file():
        return None
    try:
        data = json.loads(manifest.read_text())
        files = data["files"]
        if data.get("format") != _FORMAT or not isinstance(files, dict):
            raise ValueError("not an nbaccel checkpoint manifest")
    except (ValueError, KeyError, TypeError, OSError) as error:
        raise ValueError(f"the checkpoint manifest {manifest} cannot be read ({error})") from error
    return files


def check_manifest(directory: Path) -> list[ManifestProblem]:
    """Every file of `directory` that does not match its manifest (empty: all match, or no manifest)."""
    directory = Path(directory)
    files = read_manifest(directory)
    if not files:
        return []
    problems: list[ManifestProblem] = []
    present = []
    for name, entry in sorted(files.items()):
        path = directory / name
        if not path.is_file():
            problems.append(ManifestProblem(path, "missing", "listed in the manifest but not there"))
            continue
        size = path.stat().st_size
        if size != entry.get("size"):
            problems.append(ManifestProblem(path, "size", f"{size} bytes, {entry.get('size')} when saved"))
            continue
        present.append(name)
    for name, checksum in zip(present, _hash_all(directory, present)):
        if checksum != files[name].get(_ALGORITHM):
            problems.append(ManifestProblem(directory / name, "checksum",
                                            f"its {_ALGORITHM} differs from the one recorded when it was saved"))
    return problems
