"""Fixtures for the CRIU tests: the CRIU builds and the memmix test program."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def _need_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("CRIU dump/restore needs root")


@pytest.fixture(scope="session")
def criu_prefix() -> Path:
    """Directory with stock/criu and patched/criu, from scripts/build-criu (cached)."""
    _need_root()
    res = subprocess.run(
        [str(REPO / "scripts" / "build-criu")],
        stdout=subprocess.PIPE,
        text=True,
        timeout=1800,
        check=False,
    )
    assert res.returncode == 0, "scripts/build-criu failed (its progress is on stderr)"
    prefix = Path(res.stdout.strip().splitlines()[-1])
    assert prefix.is_absolute(), prefix
    for flavor in ("stock", "patched"):
        assert os.access(prefix / flavor / "criu", os.X_OK), prefix / flavor / "criu"
    assert (prefix / "patched" / "plugins" / "cuda_plugin.so").is_file()
    return prefix


@pytest.fixture(scope="session")
def memmix(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The memmix test program, compiled with gcc."""
    _need_root()
    gcc = shutil.which("gcc")
    if not gcc:
        pytest.skip("gcc not found")
    out = tmp_path_factory.mktemp("memmix") / "memmix"
    subprocess.run(
        [gcc, "-O2", "-Wall", "-Werror", "-pthread", "-o", str(out), str(HERE / "memmix.c")],
        check=True,
        timeout=120,
    )
    return out
