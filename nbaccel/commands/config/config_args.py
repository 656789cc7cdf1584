"""Where the config file lives and how it is read (Accelerate's `accelerate.commands.config.config_args`).

nbaccel's file is `$NBACCEL_CONFIG_FILE`, else `<cache>/nbaccel/default_config.yaml`, else Accelerate's own
file (`$HF_HOME/accelerate/default_config.yaml`); the keys are Accelerate's. The config classes are
`nbaccel.utils.config_file.LaunchConfig` under Accelerate's names, and `SageMakerConfig` for files written for
SageMaker (read and written; `nbaccel launch` refuses to run them).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

from ...utils.config_file import (
    ConfigError,
    LaunchConfig,
    accelerate_config_file,
    display_path,
    find_config_file,
    read_config_data,
)
from ...utils.config_file import default_config_file as _default_path
from ...utils.constants import (
    SAGEMAKER_PYTHON_VERSION,
    SAGEMAKER_PYTORCH_VERSION,
    SAGEMAKER_TRANSFORMERS_VERSION,
)
from ...utils.dataclasses import enum_value

__all__ = ["BaseConfig", "ClusterConfig", "SageMakerConfig", "cache_dir", "default_config_file",
           "default_json_config_file", "default_yaml_config_file", "hf_cache_home", "load_config_from_file"]

# Accelerate's names for the config class: one class here (a local machine or cluster config).
BaseConfig = LaunchConfig
ClusterConfig = LaunchConfig


@dataclass(kw_only=True)
class SageMakerConfig(LaunchConfig):
    """A config for Amazon SageMaker training jobs (`compute_environment: AMAZON_SAGEMAKER`): the launch fields
    plus the job's. nbaccel reads and writes such files so that code and configs made for Accelerate keep
    working, but it does not submit SageMaker jobs: `nbaccel launch` refuses this config, saying so."""

    compute_environment: str = "AMAZON_SAGEMAKER"
    ec2_instance_type: str
    iam_role_name: str
    image_uri: str | None = None
    profile: str | None = None
    region: str = "us-east-1"
    base_job_name: str = "accelerate-sagemaker-1"
    pytorch_version: str = SAGEMAKER_PYTORCH_VERSION
    transformers_version: str = SAGEMAKER_TRANSFORMERS_VERSION
    py_version: str = SAGEMAKER_PYTHON_VERSION
    sagemaker_inputs_file: str | None = None
    sagemaker_metrics_file: str | None = None
    additional_args: dict | None = None

    # the keys of a SageMaker config file (Accelerate refuses a file holding any other)
    FILE_KEYS = ("compute_environment", "distributed_type", "mixed_precision", "use_cpu", "debug", "ec2_instance_type",
                 "iam_role_name", "image_uri", "profile", "region", "num_machines", "gpu_ids", "base_job_name",
                 "pytorch_version", "transformers_version", "py_version", "sagemaker_inputs_file",
                 "sagemaker_metrics_file", "additional_args", "dynamo_config", "enable_cpu_affinity")

    def to_dict(self) -> dict:
        """The mapping written to the file: SageMaker's keys only, so that Accelerate reads the file too."""
        written = super().to_dict()
        return {k: v for k, v in written.items() if k in self.FILE_KEYS or k in self.extra}

# Paths, computed at import as Accelerate does (set NBACCEL_CONFIG_FILE / HF_HOME before importing to move them).
hf_cache_home = str(accelerate_config_file().parent.parent)
default_yaml_config_file = str(_default_path())
default_json_config_file = default_yaml_config_file  # as Accelerate: its "json" default is the .yaml path
cache_dir = os.path.dirname(default_yaml_config_file)
default_config_file = default_yaml_config_file


def _yaml_booleans_as_written(data: object) -> object:
    """`distributed_type: NO` unquoted (Accelerate 0.30's SageMaker files) reads as YAML's false: the text NO."""
    if isinstance(data, dict) and data.get("distributed_type") is False:
        data = {**data, "distributed_type": "NO"}
    return data


def load_config_from_file(config_file: str | os.PathLike | None) -> LaunchConfig:
    """The config in `config_file`, else the one in use (a `SageMakerConfig` for a SageMaker file).

    Raises FileNotFoundError naming the path when the given file (or, without one, any config file) does not
    exist; ConfigError for a value that cannot work."""
    if config_file is not None and not os.path.isfile(config_file):
        raise FileNotFoundError(f"The config file {config_file} does not exist: pass an existing file, or write "
                                "one with `nbaccel config`.")
    path = find_config_file(config_file)
    if path is None:
        raise FileNotFoundError(f"No config file at {default_config_file}: write one with `nbaccel config` or "
                                "`nbaccel config default`.")
    data = _yaml_booleans_as_written(read_config_data(path))
    if not (isinstance(data, dict) and enum_value(data.get("compute_environment", "")) == "AMAZON_SAGEMAKER"):
        with warnings.catch_warnings():  # unknown keys: the error below, as in Accelerate, not a warning
            warnings.filterwarnings("ignore", message=".*ignoring unknown key")
            config = LaunchConfig.from_dict(data, source=path)
        if config.extra:
            keys = ", ".join(repr(k) for k in sorted(config.extra, key=str))
            raise ConfigError(f"The config file at {display_path(path)} had unknown keys ({keys}): remove them (or "
                              "fix their names), or upgrade nbaccel if a newer Accelerate wrote them.")
        return config
    try:
        return SageMakerConfig.from_dict(data, source=path)
    except TypeError as error:  # a required SageMaker key is missing
        raise ConfigError(f"{display_path(path)}: a SageMaker config needs ec2_instance_type and "
                          f"iam_role_name ({error})") from error
