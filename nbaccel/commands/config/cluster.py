"""The questions for a machine or cluster (Accelerate's `accelerate.commands.config.cluster`)."""

from __future__ import annotations

from ...utils.config_file import LaunchConfig
from .config import interactive_config

__all__ = ["get_cluster_input"]


def get_cluster_input() -> LaunchConfig:
    """Ask the launch questions on the terminal and return the config (not saved)."""
    return interactive_config()
