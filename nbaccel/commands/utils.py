"""Argument parsers that accept each long option with `_` or `-` (`--num_processes` / `--num-processes`), as
Accelerate's `accelerate.commands.utils`."""

from __future__ import annotations

import argparse

__all__ = ["CustomArgumentGroup", "CustomArgumentParser"]


def _both_spellings(args: tuple) -> tuple:
    """The option strings plus, for each `--long_name`, its `--long-name` spelling (and the reverse)."""
    out = list(args)
    for name in args:
        if isinstance(name, str) and name.startswith("--"):
            for other in (name.replace("_", "-"), "--" + name[2:].replace("-", "_")):
                if other not in out:
                    out.append(other)
    return tuple(out)


class CustomArgumentGroup(argparse._ArgumentGroup):
    """An argument group whose long options answer to both spellings."""

    def add_argument(self, *args, **kwargs):
        return super().add_argument(*_both_spellings(args), **kwargs)


class CustomArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser whose long options answer to both spellings, in its groups too."""

    def add_argument(self, *args, **kwargs):
        return super().add_argument(*_both_spellings(args), **kwargs)

    def add_argument_group(self, *args, **kwargs):
        group = CustomArgumentGroup(self, *args, **kwargs)
        self._action_groups.append(group)
        return group
