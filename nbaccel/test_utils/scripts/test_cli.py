"""The smallest script to launch: it says how many accelerators this process sees, and exits 0.

Used to check that `nbaccel launch` starts a script at all (with or without a config file):
`nbaccel launch test_cli.py`.
"""

from __future__ import annotations


def main() -> None:
    import torch

    if torch.cuda.is_available():
        kind, count = "GPU", torch.cuda.device_count()
    elif hasattr(torch, "xpu") and torch.xpu.is_available():
        kind, count = "XPU", torch.xpu.device_count()
    else:
        kind, count = "GPU", 0
    print(f"Successfully ran on {count} {kind}s")


if __name__ == "__main__":
    main()
