"""Where the config file lives and how it is read (Accelerate's `accelerate.commands.config.config_args`).

nbaccel's file is `$NBACCEL_CONFIG_FILE`, else `<cache>/nbaccel/default_config.yaml`, else Accelerate's own
file (`$HF_HOME/accelerate/default_config.yaml`); the keys are Accelerate's. The config classes are
`nbaccel.utils.config_file.LaunchConfig` under Accelerate's names.
"""

from __future__ import annotations

import os

from ...utils.config_file import LaunchConfig, accelerate_config_file, find_config_file, load_config
from ...utils.config_file import default_config_file as _default_path

__all__ = ["BaseConfig", "ClusterConfig", "cache_dir", "default_config_file", "default_json_config_file",
           "default_yaml_config_file", "hf_cache_home", "load_config_from_file"]

# Accelerate's names for the config class: one class here (a local machine or cluster config).
BaseConfig = LaunchConfig
ClusterConfig = LaunchConfig

# Paths, computed at import as Accelerate does (set NBACCEL_CONFIG_FILE / HF_HOME before importing to move them).
hf_cache_home = str(accelerate_config_file().parent.parent)
default_yaml_config_file = str(_default_path())
default_json_config_file = default_yaml_config_file  # nbaccel writes YAML only; JSON files are still read
cache_dir = os.path.dirname(default_yaml_config_file)
default_config_file = default_yaml_config_file


def load_config_from_file(config_file: str | os.PathLike | None) -> LaunchConfig:
    """The config in `config_file`, else the one in use. Raises FileNotFoundError naming the path when the
    given file (or, without one, any config file) does not exist; ConfigError for a value that cannot work."""
    if config_file is not None and not os.path.isfile(config_file):
        raise FileNotFoundError(f"The config file {config_file} does not exist: pass an existing file, or write "
                                "one with `nbaccel config`.")
    path = find_config_file(config_file)
    if path is None:
        raise FileNotFoundError(f"No config file at {default_config_file}: write one with `nbaccel config` or "
                                "`nbaccel config default`.")
    return load_config(path)
