"""One rank of a parity run (forked by _zygote_main.py, or run as a script): call the scenario, pickle its result."""

import importlib
import os
import pickle
import sys
import traceback


def preload(lib_name: str):
    """Import the library and the submodules scenarios reach as lib.<submodule> (a zygote does it once)."""
    lib = importlib.import_module(lib_name)
    for submodule in ("utils", "state", "data_loader", "checkpointing", "big_modeling"):
        importlib.import_module(f"{lib_name}.{submodule}")
    importlib.import_module("torch.distributed")
    importlib.import_module("torch._dynamo")  # what every torch optimizer imports when first built (~2 s of CPU)
    return lib


def main() -> int:
    with open(os.environ["PARITY_SPEC"], "rb") as f:
        spec = pickle.load(f)
    lib = preload(spec["lib"])
    scenario = getattr(importlib.import_module(spec["module"]), spec["name"])
    try:
        result = scenario(lib, *spec["args"])
    except BaseException:
        traceback.print_exc()
        return 1
    with open(os.environ["PARITY_OUT"], "wb") as f:
        pickle.dump(result, f)
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            # every rank past init_process_group before any leaves: a scenario whose calls all fail before
            # sending anything (gloo rejects int16 on Accelerate) does no collective after the init, and rank 0
            # leaving while rank 1 still connected its gloo pairs failed rank 1's init ("Connection closed by
            # peer", once in a loaded suite run)
            dist.barrier()
            dist.destroy_process_group()
    except Exception:
        pass
    return 0


if __name__ == "__main__":
    code = main()
    # End without interpreter finalization: gloo can still abort a finishing process there now and then
    # ("terminate called without an active exception", -6) even after destroy_process_group, on both
    # libraries; this harness compares what the scenarios return, not how the interpreter tears down.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
