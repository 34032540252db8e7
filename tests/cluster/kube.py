"""Helpers to drive the real local cluster (scripts/local-cluster) from tests."""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts"


def _cluster_env() -> dict[str, str]:
    lines = subprocess.run(
        [str(SCRIPTS / "local-cluster"), "env"], check=True, stdout=subprocess.PIPE, text=True
    ).stdout.splitlines()
    env = dict(os.environ)
    for line in lines:
        key, _, value = line.removeprefix("export ").partition("=")
        env[key] = value.replace("$PATH", env.get("PATH", ""))
    return env


ENV = _cluster_env()


def kubectl(
    *args: str, input: str | None = None, check: bool = True, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run the pinned kubectl against the local cluster."""
    return subprocess.run(
        ["kubectl", *args],
        input=input,
        env=ENV,
        check=check,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def kubectl_json(*args: str) -> Any:
    return json.loads(kubectl(*args, "-o", "json").stdout)


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["helm", *args], env=ENV, check=check, capture_output=True, text=True, timeout=300
    )


def wait_until(what: str, cond: Callable[[], bool], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def create_namespace(prefix: str) -> str:
    """A new, uniquely named namespace, ready for pods (its default ServiceAccount exists)."""
    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    kubectl("create", "namespace", name)
    wait_until(
        "the default ServiceAccount",
        lambda: kubectl("get", "sa", "default", "-n", name, check=False).returncode == 0,
        60,
    )
    return name
