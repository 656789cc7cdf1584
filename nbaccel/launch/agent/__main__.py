"""`python -m nbaccel.launch.agent`: the host agent (host_agent.py), as the kernel starts it on each host.

The SSH session is opened first (session.py, nothing of torch): from then on a stop ends the agent at once,
also while it imports. Garbage collection is off until the agent has imported what it and its ranks need
(host_agent.main turns it back on, with that heap frozen): importing torch runs full collections over torch's
own objects, ~60 ms of the launch's path, and the ~0.1 s of the ranks' modules imported after torch was half
collections (2-core VM)."""

import gc

gc.disable()

from .session import leave, open_session  # noqa: E402

kernel, reader = open_session()

from .host_agent import main  # noqa: E402  (this import is torch's)

leave(main(kernel, reader))
