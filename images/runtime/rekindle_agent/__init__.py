"""Rekindle in-pod agent: boots vLLM, checkpoints it with CRIU, restores it."""

__version__ = "0.1.0"
