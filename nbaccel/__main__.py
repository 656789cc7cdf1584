"""`python -m nbaccel ...` runs the `nbaccel` command."""

from nbaccel.commands.main import main

if __name__ == "__main__":
    raise SystemExit(main())
