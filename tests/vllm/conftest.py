"""Real-vLLM fixtures: the agent as a subprocess, in a fresh PID + mount namespace like a pod.

The launching itself is rekindle_dev.harness (shared with `rekindle-dev bench local`):
every port (the agent's and vLLM's) outside the ephemeral range, reported in --ports-file.
Agents run under `unshare --pid --fork --mount-proc --mount` with their own
tmpfs on /dev/shm, so a restore sees an empty /dev/shm and free PIDs exactly
as in a new pod, and the host's /dev/shm is never touched. Killing the
namespace's PID 1 (the agent) kills everything in it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rekindle_dev.harness import AgentFactory, AgentProc

__all__ = [
    "PROMPTS",
    "AgentFactory",
    "AgentProc",
    "edit_manifest",
    "factory_for",
    "shadow_checkpoint",
]

PROMPTS = [
    "The river",
    "Checkpoint and restore",
    "A winter garden in the city",
    "Tokens flow through the kernel",
    # Longer than a KV block (~260 tokens): after a restore this prompt would hit
    # the prefix cache, whose blocks' content was released with the KV cache.
    "The river flows past the stone bridge into the winter garden of the city, " * 12,
]


def factory_for(
    tmp_path_factory: pytest.TempPathFactory,
    name: str,
    model: Path,
    criu_prefix: Path,
    served_name: str = "tiny",
) -> Iterator[AgentFactory]:
    """The body of every AgentFactory fixture: root check, patched CRIU, stop all at the end."""
    if os.geteuid() != 0:
        pytest.fail("the agent's vLLM tests need root (CRIU, namespaces, mounts)")
    f = AgentFactory(
        tmp_path_factory.mktemp(name), model, criu_prefix / "patched" / "criu", served_name
    )
    yield f
    f.stop_all()


@pytest.fixture(scope="session")
def agent_factory(
    tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, criu_prefix: Path
) -> Iterator[AgentFactory]:
    yield from factory_for(tmp_path_factory, "agent", tiny_model, criu_prefix)


def shadow_checkpoint(src: Path, dst: Path) -> Path:
    """A copy of a checkpoint made of symlinks (cheap), with real copies of the small files.

    Tests then damage the copy, never the shared original.
    """
    for dirpath, _dirs, files in os.walk(src):
        rel = Path(dirpath).relative_to(src)
        (dst / rel).mkdir(mode=0o700, parents=True, exist_ok=True)
        for name in files:
            s, d = Path(dirpath) / name, dst / rel / name
            if name == "stats-restore":
                continue  # CRIU's output at each restore, not part of the checkpoint
            if name in ("manifest.json", "verified"):
                d.write_bytes(s.read_bytes())
            else:
                os.symlink(s, d)
    return dst


def edit_manifest(ckpt: Path, change: Any) -> None:
    path = ckpt / "manifest.json"
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))
