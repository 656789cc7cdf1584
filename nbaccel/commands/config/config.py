"""`nbaccel config` (the questions), as `accelerate.commands.config.config`: `config_command_parser`,
`config_command`, `get_user_input`, `main`. The subcommands live in `default.py` and `update.py`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from ...utils.config_file import LaunchConfig, default_config_file, display_path
from ...utils.constants import MIXED_PRECISION_CHOICES, RDZV_BACKENDS
from ...utils.dataclasses import DynamoBackend


class _Asker:
    """Asks questions with `input()`, re-asking until an answer is valid; Enter keeps the default."""

    def __init__(self, read: Callable[[str], str] | None = None) -> None:
        self.read = read or (lambda prompt: input(prompt))

    def ask(self, question: str, default, convert: Callable = str, error: str = "invalid answer"):
        while True:
            answer = self.read(f"{question} [{default}]: ").strip()
            if not answer:
                return default
            try:
                return convert(answer)
            except (ValueError, KeyError):
                print(f"  {error}; try again")

    def choose(self, question: str, choices: list[str] | tuple[str, ...], default: str) -> str:
        def convert(answer: str) -> str:
            if answer.isdigit() and int(answer) < len(choices):
                return choices[int(answer)]
            if answer.lower() in [c.lower() for c in choices]:
                return next(c for c in choices if c.lower() == answer.lower())
            raise ValueError(answer)

        listing = ", ".join(f"{i}) {c}" for i, c in enumerate(choices))
        return self.ask(f"{question} ({listing})", default, convert, f"answer one of {', '.join(choices)}")

    def yes_no(self, question: str, default: bool) -> bool:
        table = {"y": True, "yes": True, "n": False, "no": False, "true": True, "false": False}
        shown = "yes" if default else "no"
        answer = self.ask(f"{question} (yes/no)", shown, lambda a: table[a.lower()], "answer yes or no")
        return answer if isinstance(answer, bool) else table[answer]

    def integer(self, question: str, default: int, minimum: int = 0) -> int:
        def convert(answer: str) -> int:
            value = int(answer)
            if value < minimum:
                raise ValueError(answer)
            return value

        return self.ask(question, default, convert, f"answer an integer >= {minimum}")


def interactive_config(read: Callable[[str], str] | None = None) -> LaunchConfig:
    """Ask for the launch settings and return the LaunchConfig (not saved)."""
    import torch

    q = _Asker(read)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    kinds = ["No distributed training", "multi-CPU", "multi-GPU", "FSDP (multi-GPU, sharded)"]
    kind = q.choose("Which type of machine are you using?", kinds, "multi-GPU" if gpus > 1 else kinds[0])
    config = LaunchConfig()
    if kind == "multi-CPU":
        config.distributed_type, config.use_cpu = "MULTI_CPU", True
    elif kind == "multi-GPU":
        config.distributed_type = "MULTI_GPU"
    elif kind.startswith("FSDP"):
        config.distributed_type = "FSDP"
    if kind != kinds[0]:
        config.num_machines = q.integer("How many machines will you use?", 1, minimum=1)
        if config.num_machines > 1:
            config.machine_rank = q.ask("What is the rank of this machine?", 0, int)
            config.main_process_ip = q.ask("What is the IP address of the machine with rank 0?", "127.0.0.1")
            config.main_process_port = q.ask("What port will the machine with rank 0 listen on?", 29500, int)
            config.rdzv_backend = q.choose("Which rendezvous backend?", RDZV_BACKENDS, "static")
            config.same_network = q.yes_no("Are all the machines on the same local network?", True)
        per_machine = q.integer("How many processes on each machine?", max(gpus, 2 if config.use_cpu else 1), minimum=1)
        config.num_processes = per_machine * config.num_machines
        if not config.use_cpu and gpus:
            config.gpu_ids = q.ask("Which GPUs (by id) should this machine use, comma-separated?", "all")
    else:
        config.num_processes = 1
        config.use_cpu = q.yes_no("Run on the CPU only (even if a GPU is present)?", gpus == 0)
    if config.uses_fsdp:
        fsdp = {"fsdp_version": int(q.choose("FSDP version?", ("2", "1"), "2"))}
        if fsdp["fsdp_version"] == 2:
            fsdp["fsdp_reshard_after_forward"] = q.yes_no("Reshard parameters after the forward pass?", True)
        else:
            fsdp["fsdp_sharding_strategy"] = q.choose(
                "Sharding strategy?", ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"), "FULL_SHARD"
            )
        fsdp["fsdp_offload_params"] = q.yes_no("Offload parameters to the CPU?", False)
        fsdp["fsdp_auto_wrap_policy"] = q.choose(
            "Auto wrap policy?", ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"), "TRANSFORMER_BASED_WRAP"
        )
        fsdp["fsdp_state_dict_type"] = q.choose(
            "State dict type for checkpoints?", ("SHARDED_STATE_DICT", "FULL_STATE_DICT"), "SHARDED_STATE_DICT"
        )
        fsdp["fsdp_activation_checkpointing"] = q.yes_no("Use activation checkpointing?", False)
        config.fsdp_config = fsdp
    if q.yes_no("Compile the model with torch.compile (dynamo)?", False):
        backends = [b.lower() for b in DynamoBackend.list() if b != "NO"]
        config.dynamo_config = {
            "dynamo_backend": q.choose("Which dynamo backend?", backends, "inductor").upper(),
            "dynamo_mode": q.choose("Which mode?", ("default", "reduce-overhead", "max-autotune"), "default"),
            "dynamo_use_fullgraph": q.yes_no("Require a full graph?", False),
            "dynamo_use_dynamic": q.yes_no("Use dynamic shapes?", False),
        }
    config.debug = q.yes_no("Check collectives for shape mismatches across processes (debug mode)?", False)
    config.mixed_precision = q.choose("Mixed precision?", MIXED_PRECISION_CHOICES, "no")
    return config


def config_command(args: argparse.Namespace) -> int:
    """`nbaccel config`: ask, then save; needs a terminal."""
    if not sys.stdin.isatty():
        print("nbaccel config: asks questions and needs an interactive terminal; to write a basic config for "
              "this machine without questions, run `nbaccel config default`", file=sys.stderr)
        return 1
    try:
        config = interactive_config()
    except (EOFError, KeyboardInterrupt):
        print("\nnbaccel config: cancelled, nothing written", file=sys.stderr)
        return 1
    path = config.save(args.config_file)
    print(f"nbaccel configuration saved at {display_path(path)}")
    return 0


description = "Write the launch config file by answering questions (`nbaccel config default`: no questions)."


def get_user_input() -> LaunchConfig:
    """Accelerate's name for the questionnaire: ask on the terminal and return the config (not saved)."""
    return interactive_config()


def config_command_parser(subparsers=None) -> argparse.ArgumentParser:
    """The `config` parser: added to `subparsers` when given (as `nbaccel config`), else a parser of its own."""
    if subparsers is not None:
        from ..main import add_command

        parser = add_command(subparsers, "config", config_command, help=description)
    else:
        parser = argparse.ArgumentParser("nbaccel config", description=description, allow_abbrev=False)
        parser.set_defaults(func=config_command)
    parser.add_argument("--config_file", "--config-file", default=None,
                        help=f"Where to save (default: {display_path(default_config_file())}).")
    return parser


def main() -> int:
    """`python -m nbaccel.commands.config.config`: the questions only."""
    args = config_command_parser().parse_args()
    return config_command(args)


if __name__ == "__main__":
    raise SystemExit(main())
