"""Which of the kernel's environment variables the ranks of a `hosts=` launch get (local ranks inherit the
whole environment; a remote rank starts from its SSH login's).

The kernel's variables whose names match `FORWARDED_ENV_VARS` (shell patterns, `fnmatch`, as torchrunx's
`copy_env_vars`) are copied: the settings a user makes in a notebook for the communication libraries, torch,
the Hub and the trackers. `env_vars=` adds patterns of names to copy, or, as a mapping, values to set on every
rank (torchrunx's `extra_env_vars`). Never copied: what differs per machine or per launch
(`NOT_FORWARDED`: the devices, torch elastic's own) and paths (PATH, PYTHONPATH, LD_LIBRARY_PATH: each host
runs its own Python), unless named by `env_vars` exactly. nbaccel's own launch variables are set after these.
The values travel inside the launch's plan over the SSH connection, never on a command line.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Iterable, Mapping

FORWARDED_ENV_VARS = (
    "NCCL_*", "GLOO_*", "CUDA_*", "TORCH*", "PYTORCH_*",  # NCCL_DEBUG, NCCL_SOCKET_IFNAME, TORCH_LOGS, ...
    "HF_*", "HUGGINGFACE_*", "TRANSFORMERS_*", "TOKENIZERS_PARALLELISM",  # HF_TOKEN, HF_HOME, ...
    "WANDB_*", "MLFLOW_*", "COMET_*", "NEPTUNE_*",  # the trackers' keys and projects
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "PYTHONHASHSEED", "PYTHONWARNINGS", "NBACCEL_VERBOSITY",
)
NOT_FORWARDED = ("CUDA_VISIBLE_DEVICES", "TORCHELASTIC_*")  # per machine, per launch

EnvVars = Iterable[str] | Mapping[str, str] | None


def check_env_vars(env_vars: EnvVars) -> tuple[tuple[str, ...], dict[str, str]]:
    """`env_vars=` as (patterns to copy, values to set); a clear error for anything else."""
    if env_vars is None:
        return (), {}
    if isinstance(env_vars, Mapping):
        bad = [key for key, value in env_vars.items() if not isinstance(key, str) or not key or "=" in key
               or not isinstance(value, str)]
        if bad:
            raise TypeError(f"env_vars: a mapping sets str names to str values on every rank; bad entries {bad!r}")
        return (), dict(env_vars)
    if isinstance(env_vars, str):
        raise TypeError(f"env_vars takes a list of names or patterns (['MYAPP_*']), not the str {env_vars!r}")
    patterns = tuple(env_vars)
    bad = [p for p in patterns if not isinstance(p, str) or not p or "=" in p]
    if bad:
        raise TypeError(f"env_vars: names or shell patterns of the kernel's variables to copy, like 'MYAPP_*'; got "
                        f"{bad!r} (to set a value on the ranks pass a dict: env_vars={{'NAME': 'value'}})")
    return patterns, {}


def forwarded_environment(env_vars: EnvVars = None, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The kernel's variables a remote rank gets (module docstring), with `env_vars`' additions."""
    patterns, values = check_env_vars(env_vars)
    environ = os.environ if environ is None else environ

    def copied(name: str) -> bool:
        if any(fnmatch.fnmatchcase(name, p) for p in patterns):
            return True
        return (any(fnmatch.fnmatchcase(name, p) for p in FORWARDED_ENV_VARS)
                and not any(fnmatch.fnmatchcase(name, p) for p in NOT_FORWARDED))

    return {**{name: value for name, value in environ.items() if copied(name)}, **values}
