"""Fixtures for suites that run against the real local cluster (scripts/local-cluster)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import pytest

from tests.cluster.kube import ENV, SCRIPTS, create_namespace, kubectl


@pytest.fixture(scope="session")
def cluster() -> dict[str, str]:
    """The local cluster must be up (`make cluster-up`); the environment to reach it."""
    status = subprocess.run(
        [str(SCRIPTS / "local-cluster"), "status"], capture_output=True, text=True
    )
    if status.returncode != 0:
        pytest.fail(f"the local cluster is not up; run `make cluster-up`\n{status.stdout}")
    return ENV


@pytest.fixture()
def namespace(cluster: dict[str, str]) -> Iterator[str]:
    """A fresh namespace per test, deleted (with everything in it) afterwards."""
    name = create_namespace("t")
    yield name
    kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="session")
def smoke_image(cluster: dict[str, str]) -> str:
    """A locally built busybox image, loaded into the node."""
    archive = subprocess.run(
        [str(SCRIPTS / "build-image"), "smoke"], check=True, stdout=subprocess.PIPE, text=True
    ).stdout.strip()
    subprocess.run([str(SCRIPTS / "local-cluster"), "load-image", archive], check=True)
    return "rekindle.local/smoke:dev"
