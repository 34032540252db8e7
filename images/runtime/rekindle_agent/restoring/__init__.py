"""Restoring: a checkpoint directory -> a serving vLLM, as fast as the storage allows.

restore.py (the flow), early.py (its long poles, started before the HTTP side
exists), prefetch.py (the checkpoint's files into the page cache, hashed as
they are read), residency.py (how much of a checkpoint is cached, and keeping
it there) and kdat_cache.py (CRIU's kernel-feature cache, so restores skip the
probe). Separate from checkpointing/ because the two flows change for
different reasons; it sits above it, because a restore checks what the
checkpoint recorded (fingerprint, GPU preflight) and runs the same CRIU backend.
"""
