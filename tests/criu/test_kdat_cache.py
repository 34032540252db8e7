"""CRIU's kdat cache for real: a restore loads the file the agent prepared; a bad one is harmless.

The agent (rekindle_agent.restoring.kdat_cache) produces criu.kdat with `criu check` under
a private tmpfs and installs it where CRIU reads it (/run/criu.kdat here); the
restore log must then say CRIU loaded it instead of probing the kernel. A file
CRIU must not trust (garbage, another CRIU build's) must leave the restore
working: CRIU rejects it and probes.

These tests write /run/criu.kdat of this machine, shared with other CRIU runs:
the file they leave is one for this boot and this CRIU (CRIU drops it otherwise).
"""

import struct
from pathlib import Path

import pytest
from rekindle_agent.restoring import kdat_cache

from .criu_helpers import Flavor, Probe, flavors

pytestmark = pytest.mark.criu

LOADED = "Loaded kdat cache from"
MISSING = "criu.kdat does not exist"


def _cycle(flavor: Flavor, probe: Probe, images: Path) -> str:
    """Dump and restore memprobe; the restore log."""
    if not probe.pids:
        probe.start()
    probe.verify_all()
    probe.dump(flavor, images)
    probe.restore(flavor, images)
    probe.verify_all()
    return (images / "restore.log").read_text()


def _kdat_lines(log: str) -> str:
    return "\n".join(line for line in log.splitlines() if "kdat" in line)


def test_restore_loads_the_prepared_cache(patched: Flavor, probe: Probe, tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    first = kdat_cache.prepare(str(patched.criu), str(root))
    assert first.action in ("produced", "installed"), first
    again = kdat_cache.prepare(str(patched.criu), str(root))
    assert again.action == "installed", again  # the node cache serves the next run
    log = _cycle(patched, probe, tmp_path / "images")
    kdat = _kdat_lines(log)
    assert f"{LOADED} {again.path}" in kdat, kdat
    assert MISSING not in kdat and "Stale" not in kdat, kdat


@pytest.mark.parametrize("bad", ["garbage", "other-build"])
def test_a_bad_cache_file_does_not_break_the_restore(
    bad: str, criu_prefix: Path, probe: Probe, tmp_path: Path
) -> None:
    patched = flavors(criu_prefix)["patched"]
    dest = Path(kdat_cache.rundir_of(patched.criu.read_bytes())) / kdat_cache.KDAT_NAME
    if bad == "garbage":
        content = b"not a kdat file at all"
    else:  # right size and first magic, another build's second magic: CRIU must refuse it
        good = kdat_cache.produce(str(patched.criu), str(dest.parent))
        (magic2,) = struct.unpack_from("<I", good, 4)
        content = good[:4] + struct.pack("<I", magic2 ^ 0x5A5A) + good[8:]
    images = tmp_path / "images"
    probe.start()
    probe.dump(patched, images)
    kdat_cache.write_atomic(dest, content)
    probe.restore(patched, images)
    probe.verify_all()
    kdat = _kdat_lines((images / "restore.log").read_text())
    assert "Stale" in kdat and LOADED not in kdat, kdat
