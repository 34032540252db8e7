"""Rekindle's checkpoint store: the on-disk format, signatures, digests, and the
verified copy a restore reads.

Both agents use it: the in-pod agent writes and reads checkpoints through it
today; the node agent (rekindle_node) verifies a published checkpoint into its
node-private cache with it. It imports only the contract and the standard
library (blake3 where installed), never an agent.
"""
