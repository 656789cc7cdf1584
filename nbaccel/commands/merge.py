"""`nbaccel merge-weights`: Accelerate's `accelerate merge-weights`, joining the shards of an FSDP
SHARDED_STATE_DICT model checkpoint (a torch.distributed.checkpoint folder such as
`checkpoint/pytorch_model_fsdp_0`) into one `model.safetensors` (or `pytorch_model.bin`), in one process on the CPU.
"""

from __future__ import annotations

import argparse
import sys

description = """Merge the shards of an FSDP checkpoint saved with SHARDED_STATE_DICT into one weights file in
`output_path` (model.safetensors, or pytorch_model.bin with --unsafe_serialization). Runs on the CPU and needs the
memory of the whole model."""


def merge_command(args: argparse.Namespace) -> None:
    """Merge as the arguments say; raises ValueError for a folder that is not a sharded checkpoint."""
    from ..utils.fsdp_utils import merge_fsdp_weights

    merge_fsdp_weights(args.checkpoint_directory, args.output_path, not args.unsafe_serialization,
                       args.remove_checkpoint_dir)


def _cli(args: argparse.Namespace) -> int:
    """The command line's entry: a bad folder is one line on stderr and exit status 2."""
    try:
        merge_command(args)
    except (ValueError, FileNotFoundError) as error:
        print(f"nbaccel merge-weights: error: {error}", file=sys.stderr)
        return 2
    return 0


def merge_command_parser(subparsers=None) -> argparse.ArgumentParser:
    """The `merge-weights` parser with Accelerate's arguments (a subcommand of `nbaccel` with `subparsers`)."""
    from .main import command_parser

    parser = command_parser(subparsers, "merge-weights", _cli, description, help=description.splitlines()[0])
    parser.add_argument("checkpoint_directory", type=str,
                        help="A folder of sharded weights saved by FSDP (e.g. checkpoint/pytorch_model_fsdp_0)")
    parser.add_argument("output_path", type=str, help="The folder to write the merged weights to")
    parser.add_argument("--unsafe_serialization", action="store_true", default=False,
                        help="Write pytorch_model.bin (pickle) instead of model.safetensors (not recommended)")
    parser.add_argument("--remove_checkpoint_dir", action="store_true", default=False,
                        help="Delete the checkpoint folder after merging")
    return parser


def register(subparsers) -> None:
    """Join the `nbaccel` command line (discovered by nbaccel.commands.main)."""
    merge_command_parser(subparsers)


def main(argv: list[str] | None = None) -> int:
    args = merge_command_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
