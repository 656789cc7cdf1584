"""Code that runs in the host agent: the process the kernel starts on each host of a several-machine launch."""
