"""The test suites' preflight (rekindle_dev.testenv): what make runs before each suite.

Run the way the Makefile runs it (the system python3 on the file), on a PATH without
gcc and as another user: it must fail at once, naming every missing thing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from rekindle_dev import testenv

SCRIPT = Path(testenv.__file__)


def preflight(*suites: str, path: str | None = None, user: int | None = None) -> tuple[int, str]:
    argv = [sys.executable, "-P", str(SCRIPT), *suites]
    if user is not None:
        setpriv = shutil.which("setpriv")
        assert setpriv is not None, "setpriv not on PATH: apt-get install util-linux"
        argv = [setpriv, f"--reuid={user}", f"--regid={user}", "--clear-groups", *argv]
    env = {**os.environ, "PATH": path} if path is not None else None
    res = subprocess.run(argv, capture_output=True, text=True, env=env, check=False, timeout=60)
    return res.returncode, res.stdout + res.stderr


def test_every_need_of_every_suite_is_known() -> None:
    assert set(testenv.SUITES) == {"unit", "packaging", "store", "criu", "vllm", "cluster"}
    for suite, needs in testenv.SUITES.items():
        assert set(needs) <= set(testenv.NEEDS), suite


def test_this_machine_passes_every_suite_s_preflight(require_root: None) -> None:
    assert preflight(*testenv.SUITES) == (0, "")


def test_without_gcc_or_root_it_fails_naming_both(require_root: None, tmp_path: Path) -> None:
    """The Makefile's check: gcc off PATH, or not root, fails `make test-criu` in seconds."""
    bin_dir = tmp_path / "bin"  # a PATH without gcc (the preflight runs nothing from PATH)
    bin_dir.mkdir()
    rc, out = preflight("criu", path=str(bin_dir))
    assert rc == 1 and out == (
        "the criu test suite cannot run here; missing:\n  gcc not on PATH: apt-get install gcc\n"
    ), out
    rc, out = preflight("criu", "packaging", path=str(bin_dir), user=65534)
    assert rc == 1, out
    assert out.splitlines() == [
        "the criu, packaging test suites cannot run here; missing:",
        "  " + testenv.NEEDS["root"].fix,
        "  " + testenv.NEEDS["gcc"].fix,
    ]


def test_usage_errors() -> None:
    assert preflight()[0] == 2
    rc, out = preflight("unit", "nope")
    assert rc == 2 and "unknown: nope" in out


def test_require_fails_the_test_naming_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(testenv.shutil, "which", lambda name, path=None: None)
    with pytest.raises(pytest.fail.Exception, match="gcc not on PATH: apt-get install gcc"):
        testenv.require("gcc", "root")
