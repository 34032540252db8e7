"""Fixtures shared by every suite. Suite-specific ones live in that suite's conftest."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's own seeded tiny Llama (nothing is downloaded)."""
    from rekindle_dev.models import generate_tiny_model

    return generate_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="session")
def criu_prefix() -> Path:
    """Directory with stock/criu and patched/criu, built (or found cached) by scripts/build-criu."""
    out = subprocess.run(
        [str(REPO / "scripts" / "build-criu")], check=True, stdout=subprocess.PIPE, text=True
    ).stdout
    return Path(out.strip().splitlines()[-1])


@pytest.fixture()
def require_root() -> None:
    if os.geteuid() != 0:
        pytest.fail("this suite needs root (CRIU, namespaces, mounts); run it as root")
