"""rekindle-node: the node agent, Rekindle's only privileged process.

One per node (a DaemonSet). It runs CRIU and cuda-checkpoint on behalf of the
serving pods of its node, which run unprivileged; it verifies checkpoints into a
node-private cache that no tenant pod mounts, and restores only from there. A
caller is identified by the kernel (the peer credentials of its socket
connection, mapped to a pod through the caller's cgroup), never by what it says.
"""
