"""Fixtures shared by every suite. Suite-specific ones live in that suite's conftest."""

from __future__ import annotations

import contextlib
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


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Checkpoints made by tests have immutable pages images and weight dumps: clear the
    flag so pytest (and anyone) can delete its temporary directories later."""
    if os.geteuid() != 0:
        return
    from rekindle_agent.immutable import set_immutable

    base = session.config._tmp_path_factory.getbasetemp()  # type: ignore[attr-defined]
    protected = [*Path(base).rglob("pages-*.img"), *Path(base).rglob("weights-rank*")]
    for img in protected:
        if img.is_file() and not img.is_symlink():
            with contextlib.suppress(OSError):
                set_immutable(img, False)


@pytest.fixture()
def require_root() -> None:
    if os.geteuid() != 0:
        pytest.fail("this suite needs root (CRIU, namespaces, mounts); run it as root")
