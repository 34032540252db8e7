"""The contract between the operator and the in-pod agent (standard library only).

Both sides import this package; it imports neither. Ports and paths of the
agent's HTTP API, the status document, the checkpoint manifest, env and mount
names, the worker-extension RPC names, and the two command lines that must
agree: the agent's (built by the operator) and vLLM's (built by the agent).
"""

from importlib import metadata

try:
    __version__ = metadata.version("rekindle")
except metadata.PackageNotFoundError:  # a source tree that was not installed
    __version__ = "0+unknown"
