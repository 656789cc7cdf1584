"""Helpers shared by the config subcommands (Accelerate's `accelerate.commands.config.config_utils`)."""

from __future__ import annotations

import argparse

from ...utils.dataclasses import DynamoBackend

__all__ = ["DYNAMO_BACKENDS", "SubcommandHelpFormatter"]

# The torch.compile backends the questions offer, as Accelerate lists them (upper case, "NO" first).
DYNAMO_BACKENDS = DynamoBackend.list()


class SubcommandHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Help formatter that leaves out the `{default,update}` choices line under the usage."""

    def _format_usage(self, usage, actions, groups, prefix):
        text = super()._format_usage(usage, actions, groups, prefix)
        return text.replace("<command> [<args>] ", "")
