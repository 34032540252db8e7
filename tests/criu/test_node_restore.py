"""The node agent's path, on real processes: dump a non-root worker out of one pod,
publish it, verify it into the node cache, tamper with what was published, and
restore it into another pod from the verified copy only.

The pods are PID + mount namespaces with a PID 1 that stays (tests/criu/test_nonroot.py
builds them); CRIU runs as the node agent runs it (rekindle_node.criu_run: its own
loader, libraries and binary through /proc/self/fd, the directories too).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
from rekindle_contract.manifest import MANIFEST_FORMAT, Manifest
from rekindle_dev.testenv import require
from rekindle_node import criu_run
from rekindle_store import manifest_io
from rekindle_store.node_cache import NodeCache
from rekindle_store.verified_copy import CopyError

from .criu_helpers import flavors, wait_gone
from .test_nonroot import PYTHON, UID, Pod, _status

pytestmark = pytest.mark.criu

KEY = b"n" * 32
FLAGS = ["--shell-job", "--file-locks"]


@pytest.fixture
def pods(tmp_path: Path) -> Iterator[list[Pod]]:
    require("root", "unshare")
    assert os.access(PYTHON, os.X_OK), f"no {PYTHON}: apt-get install python3"
    made: list[Pod] = []
    try:
        yield made
    finally:
        for p in made:
            p.kill()


def _errors(work: Path, name: str) -> str:
    try:
        text = (work / name).read_text()
    except OSError as e:
        return str(e)
    return "\n".join(ln for ln in text.splitlines() if "Error (" in ln)


def _publish(staging: Path, published: Path) -> None:
    """Sign what was dumped (as the node agent will) and copy it to shared storage."""
    files = manifest_io.checksum_files(staging, manifest_io.list_files(staging), threads=2)
    doc: dict[str, Any] = {
        "format": MANIFEST_FORMAT,
        "fingerprint": {},
        "criu": {},
        "vllm": {"root_pid": 1},
        "files": files,
    }
    manifest_io.write(staging, cast(Manifest, doc), KEY)
    shutil.copytree(staging, published)


def test_a_worker_restores_into_another_pod_from_the_verified_copy_only(
    criu_prefix: Path, tmp_path: Path, pods: list[Pod]
) -> None:
    files = criu_run.CriuFiles(criu=flavors(criu_prefix)["patched"].criu)
    for d in ("pod-a", "pod-b"):
        (tmp_path / d).mkdir()
    source = Pod(tmp_path / "pod-a")
    pods.append(source)
    worker = source.start_worker()
    worker.ask(worker.host_pid, 1)

    staging, work = tmp_path / "node" / "dump", tmp_path / "node" / "work"
    (staging / "images").mkdir(parents=True)
    work.mkdir()
    res = criu_run.dump(files, source.init, worker.ns_pid, staging / "images", work, FLAGS)
    assert res.returncode == 0, res.output + _errors(work, "dump.log")
    wait_gone(worker.host_pid)
    assert not (staging / "images" / "dump.log").exists()  # logs stay out of the images

    published = tmp_path / "pvc" / "ckpt"
    _publish(staging, published)
    cache = NodeCache(tmp_path / "node" / "cache", budget_bytes=1 << 30)
    verified = cache.get(published, KEY)
    assert verified.copied and verified.bytes > 0

    # After the check, whoever can write the shared storage rewrites every image.
    for img in (published / "images").iterdir():
        img.write_bytes(b"\0" * img.stat().st_size)
    # The tampering is real: a node that had not verified it yet refuses it now.
    with pytest.raises(CopyError, match="digest does not match") as e:
        NodeCache(tmp_path / "node" / "other-cache", budget_bytes=1 << 30).get(published, KEY)
    assert e.value.reason == "checksum_mismatch"
    assert cache.get(published, KEY).path == verified.path  # this node uses its copy

    target = Pod(tmp_path / "pod-b")
    pods.append(target)
    res = criu_run.restore(files, target.init, verified.path / "images", work, FLAGS)
    assert res.returncode == 0, res.output + _errors(work, "restore.log")
    restored = target.child(worker.ns_pid)
    after = _status(restored)
    assert after["Uid"].split() == [str(UID)] * 4, after["Uid"]
    assert int(after["PPid"]) == target.init  # in the other pod, under its PID 1
    worker.ask(restored, 2)  # same token, the counter went on: the verified bytes ran
