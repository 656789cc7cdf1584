"""The `nbaccel` command line: env, config, launch, test (and subcommands other modules register), with
Accelerate's module tree (`commands.config` package, `commands.launch.launch_command_parser`, ...).
Submodules are reachable as attributes; importing the package imports none of them."""

from .._lazy import lazy_namespace

__getattr__, __dir__ = lazy_namespace(__name__, {})
