"""The `nbaccel` command's entry point under Accelerate's module name (`accelerate.commands.accelerate_cli`)."""

from __future__ import annotations

from .main import main

__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(main())
