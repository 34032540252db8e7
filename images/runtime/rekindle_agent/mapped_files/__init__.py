"""Checkpoint files that live processes map: when they may be, and how they stay unchanged.

A restored tree can map its pages images and a reloaded worker its weight
dump, for its whole life, so those files must never change under it:
mmap_policy.py (whether a restore may map the images), weights_map.py (whether
a worker's reload maps the weight dump; the worker extension imports it too),
immutable.py (chattr +i on those files, and removal past it) and mounts.py (a
read-only bind mount of the checkpoint a pod restores from). Separate, and at
the bottom, because the flows, the launch and the worker extension all apply
these rules, which need nothing of them.
"""
