"""The node agent's `evict`: a namespace drops its own checkpoint from one node's cache,
never one a replica there maps, never another namespace's."""

from __future__ import annotations

import os
from pathlib import Path

from rekindle_contract.manifest import MANIFEST_FORMAT
from rekindle_node.identity import PodContainer
from rekindle_node.operations import NodeSettings, Operations
from rekindle_node.requests import Caller, Request
from rekindle_store import manifest_io
from rekindle_store.node_cache import NodeCache

KEY = b"k" * 32
NAME = "/var/lib/rekindle/checkpoints/first-1a2b"


def _ops(tmp_path: Path) -> Operations:
    return Operations(
        NodeSettings(criu=None, work=tmp_path / "work", node="n"),  # type: ignore[arg-type]
        NodeCache(tmp_path / "cache", budget_bytes=1 << 20),
        KEY,
    )


def _cached(ops: Operations, namespace: str) -> str:
    """A checkpoint of namespace in the node cache under NAME, as commit leaves one."""
    stage = ops.cache.new_staging()
    (stage / "images").mkdir()
    (stage / "images" / "core-1.img").write_bytes(b"core")
    man = {
        "format": MANIFEST_FORMAT,
        "fingerprint": {},
        "vllm": {"root_pid": 7},
        "criu": {},
        "identity": {"namespace": namespace, "pod": "pod", "name": NAME},
        "files": manifest_io.checksum_files(stage, ["images/core-1.img"], threads=1),
    }
    manifest_io.write(stage, man, KEY)  # type: ignore[arg-type]
    entry = ops.cache.add_own(stage, "test", KEY).entry
    ops.cache.name(namespace, NAME, entry)
    return entry


def _evict(ops: Operations, namespace: str) -> dict[str, object]:
    caller = Caller(
        pid=os.getpid(), uid=0, gid=0, container=PodContainer("cid", "c", namespace, "p", "uid")
    )
    return ops.evict(caller, Request("evict", "uid", {"name": NAME}))


def test_a_mapped_entry_stays_an_unmapped_one_goes(tmp_path: Path) -> None:
    ops = _ops(tmp_path)
    entry = _cached(ops, "team-a")
    ops.cache.pin(entry, "pod-a")
    assert _evict(ops, "team-a") == {
        "evicted": False,
        "held": True,
        "why": "mapped by 1 replica(s) on this node",
    }
    assert ops.cache.names() == [entry]
    ops.cache.unpin_holder("pod-a")
    assert _evict(ops, "team-a") == {"evicted": True, "held": False, "checkpoint": entry}
    assert ops.cache.names() == []
    assert _evict(ops, "team-a") == {
        "evicted": False,
        "held": False,
        "why": "not in this node's cache",
    }


def test_another_namespace_cannot_evict_it(tmp_path: Path) -> None:
    ops = _ops(tmp_path)
    entry = _cached(ops, "team-a")
    assert _evict(ops, "team-b")["held"] is False  # team-b has no checkpoint by that name
    assert ops.cache.names() == [entry]
