"""What each test suite needs from this machine, checked before it runs.

An environment that cannot run a suite must fail, naming what is missing and how
to get it, never skip: a skipped test looks like a passed one in a summary. The
Makefile runs this file (`python3 -P scripts/rekindle_dev/testenv.py SUITE...`)
first for each suite, and `make test` for all of them at once, so a missing tool
fails in seconds, every missing thing named, instead of half an hour into `make
test`; the tests call require() with the same checks, so a suite run by hand with
pytest fails with the same message. This module checks, it never installs: `make
env` and the build scripts install.

Standard library only (it runs before the Python env exists), and cheap: no torch
import (find_spec), no subprocess but `scripts/local-cluster env` for helm.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

REPO = Path(__file__).resolve().parents[2]


def helm_binary() -> str | None:
    """The pinned helm (`scripts/local-cluster env` puts its directory first on PATH),
    else one on PATH."""
    r = subprocess.run(
        [str(REPO / "scripts" / "local-cluster"), "env"],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    for line in r.stdout.splitlines():
        key, _, value = line.removeprefix("export ").partition("=")
        if key == "PATH":
            found = shutil.which("helm", path=value.replace("$PATH", ""))
            if found:
                return found
    return shutil.which("helm")


def _seaweedfs_built() -> bool:
    cache = Path(os.environ.get("REKINDLE_CACHE", Path.home() / ".cache" / "rekindle"))
    return any(cache.glob("seaweedfs-*/weed"))


def _io_uring_allowed() -> bool:
    """kernel.io_uring_disabled lets this process create a ring: 0, or 1 as root."""
    try:
        mode = int(Path("/proc/sys/kernel/io_uring_disabled").read_text())
    except (OSError, ValueError):
        return True  # a kernel before the knob: io_uring is on
    return mode == 0 or (mode == 1 and os.geteuid() == 0)


@dataclass(frozen=True)
class Need:
    """One thing a suite needs: how to tell it is there; what is wrong and what to do if not."""

    name: str
    present: Callable[[], bool]
    fix: str


NEEDS: dict[str, Need] = {
    n.name: n
    for n in (
        Need(
            "root",
            lambda: os.geteuid() == 0,
            "not running as root; CRIU, mounts, namespaces, drop_caches and chattr +i need it: "
            "run as root",
        ),
        Need(
            "gcc", lambda: shutil.which("gcc") is not None, "gcc not on PATH: apt-get install gcc"
        ),
        Need(
            "go",
            lambda: shutil.which("go") is not None or _seaweedfs_built(),
            "Go is not on PATH and SeaweedFS is not built: install Go >= 1.26 "
            "(scripts/build-seaweedfs builds the store suite's S3 server from its Go module)",
        ),
        Need(
            "openssl",
            lambda: shutil.which("openssl") is not None,
            "openssl not on PATH: apt-get install openssl",
        ),
        Need(
            "vmtouch",
            lambda: shutil.which("vmtouch") is not None,
            "vmtouch not on PATH: apt-get install vmtouch (make env installs it)",
        ),
        Need(
            "unshare",
            lambda: shutil.which("unshare") is not None,
            "unshare not on PATH: apt-get install util-linux",
        ),
        Need(
            "helm",
            lambda: helm_binary() is not None,
            "the pinned helm is not built: scripts/build-kubernetes builds it (make test-unit "
            "runs it; it needs Go >= 1.25)",
        ),
        Need(
            "torch",
            lambda: importlib.util.find_spec("torch") is not None,
            f"torch is not importable by {sys.executable}: make env installs it "
            "(scripts/python-env)",
        ),
        Need(
            "vllm",
            lambda: importlib.util.find_spec("vllm") is not None,
            f"vllm is not importable by {sys.executable}: make env installs it "
            "(scripts/python-env)",
        ),
        Need(
            "ensurepip",
            lambda: importlib.util.find_spec("ensurepip") is not None,
            f"{sys.executable} cannot make a venv with pip: apt-get install python3-venv",
        ),
        Need(
            "python3",
            lambda: os.access("/usr/bin/python3", os.X_OK),
            "no /usr/bin/python3, which runs zdtm.py (CRIU's test suite): apt-get install python3",
        ),
        Need(
            "io_uring",
            _io_uring_allowed,
            "kernel.io_uring_disabled forbids io_uring here, and the io_uring detection is "
            "tested on a real ring: sysctl kernel.io_uring_disabled=0",
        ),
    )
}

# What each suite needs that make does not install, checked before make builds or
# installs anything (the Makefile runs this file with the system python3): make env
# installs torch, vLLM and vmtouch, scripts/build-kubernetes builds helm, and
# scripts/build-criu installs CRIU's build dependencies. The tests require() those
# too, for a run without make.
SUITES: dict[str, tuple[str, ...]] = {
    "unit": ("root", "gcc", "openssl", "unshare", "io_uring"),
    "packaging": (),
    "store": ("go",),
    "criu": ("root", "gcc", "python3"),
    "vllm": ("root", "unshare"),
    "cluster": ("root", "openssl"),
}


def missing(names: tuple[str, ...] | list[str]) -> list[str]:
    """What is wrong and what to do, for each of names that is not there, in order."""
    return [NEEDS[n].fix for n in names if not NEEDS[n].present()]


def require(*names: str) -> None:
    """Fail the calling test (or module, at import) when one of names is missing."""
    lacking = missing(list(names))
    if lacking:
        import pytest

        fail: Callable[..., NoReturn] = pytest.fail
        fail("this test needs what is missing here:\n  " + "\n  ".join(lacking), pytrace=False)


def main(argv: list[str]) -> int:
    """`testenv.py SUITE...`: exit 1 naming everything missing."""
    unknown = [s for s in argv if s not in SUITES]
    if not argv or unknown:
        print(
            f"usage: testenv.py SUITE... (suites: {', '.join(SUITES)})"
            + (f"; unknown: {', '.join(unknown)}" if unknown else ""),
            file=sys.stderr,
        )
        return 2
    lacking = missing(list(dict.fromkeys(n for s in argv for n in SUITES[s])))
    if lacking:
        print(
            f"the {', '.join(argv)} test suite{'s' * (len(argv) > 1)} cannot run here; missing:\n  "
            + "\n  ".join(lacking),
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
