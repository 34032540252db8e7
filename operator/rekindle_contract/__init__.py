"""The contract between the operator and the in-pod agent (standard library only).

Both sides import this package; it imports neither. Ports and paths of the
agent's HTTP API, the status document, the checkpoint manifest, env and mount
names, the worker-extension RPC names, and the two command lines that must
agree: the agent's (built by the operator) and vLLM's (built by the agent).
"""

# The Python distribution that installs these packages (pyproject.toml's name).
DISTRIBUTION = "rekindle-vllm"


def __getattr__(name: str) -> str:
    """__version__ on first use: importlib.metadata costs ~40 ms of every agent start."""
    if name != "__version__":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import metadata

    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:  # a source tree that was not installed
        return "0+unknown"
