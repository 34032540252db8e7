"""Fixtures of the store suite: one real S3-compatible server for the session."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from rekindle_store.s3 import Bucket

from .seaweedfs import SeaweedFS

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def seaweedfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedFS]:
    res = subprocess.run(
        [str(REPO / "scripts" / "build-seaweedfs")],
        stdout=subprocess.PIPE,
        text=True,
        timeout=3600,
        check=False,
    )
    assert res.returncode == 0, "scripts/build-seaweedfs failed (its progress is on stderr)"
    server = SeaweedFS(Path(res.stdout.strip().splitlines()[-1]), tmp_path_factory.mktemp("s3"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def bucket(seaweedfs: SeaweedFS) -> Bucket:
    """A new bucket of that server, for one test."""
    b = seaweedfs.bucket(f"t-{uuid.uuid4().hex[:12]}")
    b.create()
    return b
