"""Code that runs in the kernel (the launching process): the plan, its validation, the backends that start
the workers, the supervisor that watches them, and the observers (dashboard) it reports to."""
