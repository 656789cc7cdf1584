"""Code that runs in a launched rank: the worker entry, its telemetry sink, and replica threads (torch_xla)."""
