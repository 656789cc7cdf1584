"""Run Accelerate's own unit tests against Accelerate and, renamed, against nbaccel; list what differs.

Accelerate's tests are not in its wheel: this downloads the source distribution of the installed Accelerate
version from the package index (`pip download --no-binary`), copies the chosen test files twice (as they are,
and with `accelerate` renamed to `nbaccel` as a user would), runs pytest on each copy, one file at a time, and
prints every test that passes on Accelerate but not on nbaccel. Exit status 1 when there is one that
KNOWN_DIFFERENCES does not name. Not part of `./run.sh test`: it needs the package index and takes minutes.

Usage: python scripts/accelerate_unit_tests.py [TEST_FILE ...] [--work DIR]
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

# The files that run on a CPU machine without transformers, datasets or DeepSpeed (test_big_modeling.py also
# runs once transformers is installed: name it on the command line).
DEFAULT_FILES = (
    "test_accelerator.py", "test_data_loader.py", "test_state_checkpointing.py", "test_utils.py",
    "test_kwargs_handlers.py", "test_optimizer.py", "test_scheduler.py", "test_memory_utils.py",
    "test_grad_sync.py", "test_logging.py", "test_cpu.py", "test_dataclasses.py", "test_tracking.py",
    "test_hooks.py", "test_offload.py", "test_compile.py", "test_launch.py", "test_modeling_utils.py",
    "test_cli.py", "test_sagemaker.py", "test_quantization.py",
)
# Tests that fail on nbaccel on purpose, with the reason (docs/compat.md).
KNOWN_DIFFERENCES = {
    "test_utils.py::UtilsTester::test_honor_type": "compares recursively_apply's whole TypeError text: nbaccel's "
                                                  "message keeps Accelerate's first phrase, in its own words after",
    "test_modeling_utils.py::ModelingUtilsTester::test_set_module_tensor_checks_shape": "compares a whole error "
                                                                                        "message word for word",
    "test_cli.py::AccelerateLauncherTester::test_mpi_multicpu_config_cmd": "nbaccel launch starts its processes "
        "itself and refuses an mpirun_config section with the reason: there is no mpirun command to compare",
    "test_accelerator.py::AcceleratorTester::test_free_memory_dereferences_prepared_components": "bounds the "
        "machine's free memory, which other processes move by more than its tolerance (either library); "
        "tests/parity/test_free_memory_parity.py checks that every prepared object is released",
}
OUTCOME = re.compile(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (\S+)", re.MULTILINE)


@dataclass
class FileRun:
    """One test file's outcomes on one library: test id -> PASSED/FAILED/ERROR/SKIPPED."""

    library: str
    outcomes: dict[str, str]


def download_tests(work: Path) -> Path:
    """The `tests/` folder of the installed Accelerate's source distribution."""
    import accelerate

    version = accelerate.__version__
    subprocess.run([sys.executable, "-m", "pip", "download", f"accelerate=={version}", "--no-binary", ":all:",
                    "--no-deps", "-q", "-d", str(work)], check=True)
    archive = next(work.glob(f"accelerate-{version}.tar.gz"))
    with tarfile.open(archive) as tar:
        tar.extractall(work, filter="data")
    return work / f"accelerate-{version}" / "tests"


def prepare(tests: Path, work: Path, library: str) -> Path:
    """A copy of the tests for `library` ("accelerate" as they are, "nbaccel" renamed), as `<folder>/tests`:
    the tests run from `<folder>`, as from Accelerate's source root (they read `tests/test_configs`)."""
    target = work / library
    shutil.copytree(tests, target / "tests", dirs_exist_ok=True)
    if library != "accelerate":
        for path in (target / "tests").rglob("*.py"):
            path.write_text(re.sub(r"\baccelerate\b", library, path.read_text()))
    return target


def run_file(folder: Path, name: str, library: str) -> FileRun:
    result = subprocess.run([sys.executable, "-m", "pytest", f"tests/{name}", "-q", "-rA", "-p", "no:cacheprovider",
                             "--timeout", "120"], cwd=folder, capture_output=True, text=True, timeout=1200)
    outcomes = {test_id.removeprefix("tests/"): outcome for outcome, test_id in OUTCOME.findall(result.stdout)}
    return FileRun(library, outcomes)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", default=list(DEFAULT_FILES))
    parser.add_argument("--work", type=Path, default=None, help="folder to work in (default: a temporary one)")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="accelerate-tests-"))
    tests = download_tests(work)
    folders = {library: prepare(tests, work, library) for library in ("accelerate", "nbaccel")}
    unexpected = 0
    for name in args.files:
        theirs = run_file(folders["accelerate"], name, "accelerate")
        ours = run_file(folders["nbaccel"], name, "nbaccel")
        passed = {library.library: sum(o == "PASSED" for o in library.outcomes.values()) for library in (theirs, ours)}
        print(f"{name}: Accelerate {passed['accelerate']} passed, nbaccel {passed['nbaccel']} passed")
        for test_id, outcome in sorted(theirs.outcomes.items()):
            if outcome == "PASSED" and ours.outcomes.get(test_id) != "PASSED":
                known = KNOWN_DIFFERENCES.get(test_id)
                unexpected += known is None
                print(f"  {ours.outcomes.get(test_id, 'MISSING')} {test_id}" + (f"  (known: {known})" if known else ""))
    print(f"{unexpected} unexpected difference(s); work folder: {work}")
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
