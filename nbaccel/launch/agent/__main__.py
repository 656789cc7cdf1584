"""`python -m nbaccel.launch.agent`: the host agent (host_agent.py), as the kernel starts it on each host.

Garbage collection is off until the agent has imported what it and its ranks need (host_agent.main turns it
back on, with that heap frozen): importing torch runs full collections over torch's own objects, ~60 ms of the
launch's path, and the ~0.1 s of the ranks' modules imported after torch was half collections (2-core VM)."""

import gc

gc.disable()

from .host_agent import leave, main  # noqa: E402  (after gc.disable: this import is torch's)

leave(main())
