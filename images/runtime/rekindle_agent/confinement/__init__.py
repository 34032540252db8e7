"""Keeping io_uring out of vLLM's process tree, and finding any that got in.

CRIU cannot dump io_uring instances: seccomp.py runs vLLM under a filter
that refuses io_uring_setup (an exec wrapper, so it works per process without
a host sysctl), and io_uring.py looks for instances anyway before a dump, so
that a checkpoint fails early with the fix named. Separate because it is a
constraint on the tree that both the launch and the checkpoint rely on.
"""
