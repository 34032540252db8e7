"""Fixtures for suites that run against the real local cluster (scripts/local-cluster)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import pytest

from tests.cluster.cluster_tools import ENV, SCRIPTS, create_namespace, kubectl, node_room


@pytest.fixture(scope="session")
def cluster() -> dict[str, str]:
    """The local cluster must be up (`make cluster-up`); the environment to reach it."""
    status = subprocess.run(
        [str(SCRIPTS / "local-cluster"), "status"], capture_output=True, text=True
    )
    if status.returncode != 0:
        pytest.fail(f"the local cluster is not up; run `make cluster-up`\n{status.stdout}")
    check_room()
    return ENV


# The largest pod the suite runs: the sample InferenceService (1 CPU, 6 GiB plus
# its /dev/shm, which the memory request now includes), one at a time.
NEED_CPU = 1.0
NEED_MEMORY = 8 * 2**30


def check_room() -> None:
    """Fail up front, naming what occupies the node, when the suite's pods cannot fit."""
    cpu, mem, holders = node_room()
    if cpu < NEED_CPU or mem < NEED_MEMORY:
        pytest.fail(
            f"the node has {cpu:g} CPU and {mem / 2**30:.1f} GiB unrequested; the cluster "
            f"suite needs {NEED_CPU:g} CPU and {NEED_MEMORY / 2**30:.0f} GiB. Requests on the "
            f"node: {', '.join(holders)}. Delete what you left running (for example "
            "`kubectl delete namespace rekindle-demo`, or run `make demo` without DEMO_KEEP=1)"
        )


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
