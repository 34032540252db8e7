"""Making a checkpoint, and the CRIU machinery the restore reuses.

checkpoint.py (the flow: a drained, serving vLLM -> a checkpoint directory),
criu.py (CRIU's command lines and what the installed CRIU can do),
criu_backend.py (who runs CRIU for this pod: the agent itself or the node
agent), fingerprint.py (what must match between the environment that dumped
and the one that restores) and gpu_preflight.py (whether CRIU's CUDA plugin
will really work). Separate from restoring/, which sits above it: a restore
uses this machinery and checks what a checkpoint recorded, never the reverse.
"""
