"""Fixtures of the store suite: one real S3-compatible server for the session."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from rekindle_dev.seaweedfs import SeaweedFS
from rekindle_dev.seaweedfs import build as seaweedfs_build
from rekindle_store.s3 import Bucket


@pytest.fixture(scope="session")
def seaweedfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedFS]:
    server = SeaweedFS(seaweedfs_build(), tmp_path_factory.mktemp("s3"))
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
