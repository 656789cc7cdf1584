"""The `nbaccel` command line: env, config, launch, test (and subcommands other modules register)."""
