"""Fixtures shared by every suite. Suite-specific ones live in that suite's conftest."""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

import pytest
from rekindle_dev.testenv import require

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
    """The CRIU builds every suite uses: DIR/stock/criu, DIR/patched/criu and
    DIR/patched/plugins/cuda_plugin.so, from scripts/build-criu (cached; a miss builds).

    REKINDLE_CRIU_PREFIX=DIR uses DIR instead, with the same layout: for work on the
    patches, with a patched CRIU built by hand. CRIU dumps and restores as root only.
    """
    require("root")
    override = os.environ.get("REKINDLE_CRIU_PREFIX")
    if override:
        prefix = Path(override).resolve()
        origin = f"REKINDLE_CRIU_PREFIX={override}"
    else:
        res = subprocess.run(
            [str(REPO / "scripts" / "build-criu")],
            stdout=subprocess.PIPE,
            text=True,
            timeout=1800,
            check=False,
        )
        assert res.returncode == 0, "scripts/build-criu failed (its progress is on stderr)"
        prefix = Path(res.stdout.strip().splitlines()[-1])
        origin = "scripts/build-criu"
        assert prefix.is_absolute(), f"{origin} printed {prefix}, not an absolute directory"
    lacking = [
        str(prefix / p)
        for p in ("stock/criu", "patched/criu")
        if not os.access(prefix / p, os.X_OK)
    ]
    if not (prefix / "patched" / "plugins" / "cuda_plugin.so").is_file():
        lacking.append(str(prefix / "patched" / "plugins" / "cuda_plugin.so"))
    assert not lacking, f"{origin}: missing {', '.join(lacking)}"
    return prefix


@pytest.fixture()
def require_root() -> None:
    """For a test that needs root (mounts, chattr +i, namespaces): fails, naming it, if not."""
    require("root")


@pytest.fixture()
def require_openssl() -> None:
    """For the TLS tests, whose certificates the openssl CLI makes."""
    require("openssl")


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Checkpoints made by tests have immutable pages images and weight dumps: clear the
    flag so pytest (and anyone) can delete its temporary directories later."""
    if os.geteuid() != 0:
        return
    from rekindle_agent.mapped_files.immutable import set_immutable

    base = session.config._tmp_path_factory.getbasetemp()  # type: ignore[attr-defined]
    protected = [*Path(base).rglob("pages-*.img"), *Path(base).rglob("weights-rank*")]
    for img in protected:
        if img.is_file() and not img.is_symlink():
            with contextlib.suppress(OSError):
                set_immutable(img, False)
