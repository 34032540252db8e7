"""CRIU's kernel-feature cache (criu.kdat), kept per node so restores skip the probe.

Why: every CRIU run first probes the kernel (pagemap, sockets, vDSO, netns...):
0.05-0.3 s before a restore forks its first task. CRIU 4.2.1 keeps the result
in `<RUNDIR>/criu.kdat` (RUNDIR is fixed at build time, /run by default) and
loads that file on any file system, but writes it only when the file lands on
a tmpfs. A pod's /run is the container's overlay, so CRIU never writes it there
and every restore probes again.

What CRIU checks when it loads the file: only that it read the whole struct
and that two magic numbers match (a constant, and the time CRIU was built).
Nothing ties it to the boot or the kernel, yet some fields are per boot (the
zero page's frame number, device numbers of internal mounts). So the agent
never hands CRIU a file it did not key itself:

- produce: `criu check` in a private mount namespace with a small tmpfs over
  RUNDIR (so CRIU writes the file), read back from there; the host's and the
  container's RUNDIR are not touched;
- keep: in `<checkpoint root>/.criu-kdat/<key>.kdat`, next to the checkpoints,
  so the first restore on a node finds the file a checkpointing pod (or an
  earlier restore) made. key = digest of the boot id, the kernel release and
  the CRIU binary's SHA-256; the stored file carries a digest of its content,
  an HMAC with the service's signing key when there is one (the volume is
  writable by every replica: without the key, a forged file is not loaded);
- install: before CRIU runs, a copy that passed those checks is renamed into
  RUNDIR/criu.kdat.

A file that fails a check is ignored (and replaced by a fresh one); one that
CRIU itself rejects (wrong size or magic) makes CRIU probe as before. So a
missing, stale or foreign cache costs the probe, never a restore.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import platform
import re
import struct
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("rekindle.kdat")

KDAT_NAME = "criu.kdat"
DEFAULT_RUNDIR = "/run"
CACHE_SUBDIR = ".criu-kdat"
# CRIU's first magic (criu/include/magic.h, KDAT_MAGIC), little-endian at offset 0.
KDAT_MAGIC = 0x57023458
# The stored file: this line, the payload's digest (hex) and a newline, then the payload.
HEADER = b"rekindle-kdat 1\n"
BOOT_ID = "/proc/sys/kernel/random/boot_id"
PRODUCE_TIMEOUT_S = 30.0
# A shell that mounts a private tmpfs over $1 (the child's own mount namespace)
# and runs `$2 check`, which saves CRIU's cache there; the file goes to stdout.
_PRODUCE_SCRIPT = (
    'mount -t tmpfs -o size=4m,mode=0700 rekindle-kdat "$1" || exit 90; '
    '"$2" check >/dev/null 2>&1; exec cat "$1/criu.kdat"'
)
_RUNDIR_IN_BINARY = re.compile(rb"(/[\x21-\x7e]*)/criu\.kdat\x00")


class KdatError(Exception):
    """A cache file that must not be handed to CRIU, or one that could not be made."""


@dataclass(frozen=True)
class Outcome:
    """What prepare() did: installed (from the cache) / produced (new) / skipped, and why."""

    action: str
    detail: str
    path: str = ""


def rundir_of(binary_bytes: bytes) -> str:
    """The directory this CRIU build reads criu.kdat from (its RUNDIR, default /run).

    Why: RUNDIR is a build option; the binary holds the path as a string, so a
    build with another RUNDIR still gets its cache where it looks for it.
    """
    m = _RUNDIR_IN_BINARY.search(binary_bytes)
    return m.group(1).decode() if m else DEFAULT_RUNDIR


def cache_key(boot_id: str, kernel: str, criu_sha256: str) -> str:
    """The name a cache file is kept under: valid for one boot, kernel and CRIU build only."""
    for name, value in (("boot id", boot_id), ("kernel", kernel), ("CRIU digest", criu_sha256)):
        if not value.strip():
            raise KdatError(f"empty {name}: cannot key CRIU's kdat cache")
    text = f"{boot_id.strip()}\n{kernel.strip()}\n{criu_sha256.strip()}\n"
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def check_payload(payload: bytes) -> None:
    """KdatError unless payload looks like CRIU's kdat struct (CRIU checks size and magics)."""
    if len(payload) < 8:
        raise KdatError(f"kdat cache is {len(payload)} bytes: too short for CRIU's header")
    (magic1,) = struct.unpack_from("<I", payload)
    if magic1 != KDAT_MAGIC:
        raise KdatError(f"kdat cache magic {magic1:#x} is not CRIU's {KDAT_MAGIC:#x}")


def _digest(payload: bytes, key: bytes | None) -> bytes:
    """HMAC-SHA256 with the signing key when there is one, else SHA-256 (hex)."""
    if key:
        return hmac.new(key, payload, hashlib.sha256).hexdigest().encode()
    return hashlib.sha256(payload).hexdigest().encode()


def wrap(payload: bytes, key: bytes | None = None) -> bytes:
    """The stored form: header, the payload's digest (keyed when key is given), the payload."""
    check_payload(payload)
    return HEADER + _digest(payload, key) + b"\n" + payload


def unwrap(data: bytes, key: bytes | None = None) -> bytes:
    """The payload of a stored file; KdatError if it is foreign, truncated, altered or
    (with key) not written by a holder of that key."""
    if not data.startswith(HEADER):
        raise KdatError("not a Rekindle kdat cache file (header)")
    rest = data[len(HEADER) :]
    digest, sep, payload = rest.partition(b"\n")
    if not sep or len(digest) != 64:
        raise KdatError("kdat cache file has no content digest")
    if not hmac.compare_digest(_digest(payload, key), digest):
        raise KdatError("kdat cache file content does not match its digest (or key)")
    check_payload(payload)
    return payload


def write_atomic(path: Path, data: bytes) -> None:
    """Write data to path through a temporary file and a rename: readers never see half."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".rekindle-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def produce(binary: str, rundir: str) -> bytes:
    """A fresh kdat from `criu check` run under a private tmpfs over rundir.

    Needs CAP_SYS_ADMIN (the restore container is privileged; CRIU needs it anyway).
    """
    argv = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c"]
    argv += [_PRODUCE_SCRIPT, "sh", rundir, binary]
    try:
        res = subprocess.run(argv, capture_output=True, timeout=PRODUCE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise KdatError(f"cannot run `criu check` for the kdat cache: {e}") from e
    if res.returncode != 0:
        err = res.stderr.decode(errors="replace").strip()[-300:]
        raise KdatError(f"`criu check` under a private tmpfs failed ({res.returncode}): {err}")
    check_payload(res.stdout)
    return res.stdout


def node_key(binary_bytes: bytes) -> str:
    """cache_key for this boot, this kernel and this CRIU binary."""
    boot_id = Path(BOOT_ID).read_text()
    return cache_key(boot_id, platform.release(), hashlib.sha256(binary_bytes).hexdigest())


def prepare(binary: str, cache_dir: str | None, key: bytes | None = None) -> Outcome:
    """Put a kdat valid for this boot, kernel and CRIU where binary reads it.

    From cache_dir when it holds one for this key, else made now (and kept in
    cache_dir when given). key: the signing key, if any (wrap). Never raises: a
    failure only means CRIU probes as it always did, so the outcome says why.
    """
    try:
        data = Path(binary).read_bytes()
        dest = Path(rundir_of(data)) / KDAT_NAME
        name = node_key(data)
    except (OSError, KdatError) as e:
        return Outcome("skipped", f"cannot key the kdat cache: {e}")
    kept = Path(cache_dir) / CACHE_SUBDIR / f"{name}.kdat" if cache_dir else None
    if kept is not None:
        try:
            write_atomic(dest, unwrap(kept.read_bytes(), key))
            return Outcome("installed", f"from {kept}", str(dest))
        except FileNotFoundError:
            pass
        except (OSError, KdatError) as e:
            log.warning("ignoring kdat cache %s: %s", kept, e)
    try:
        payload = produce(binary, str(dest.parent))
        write_atomic(dest, payload)
    except (OSError, KdatError) as e:
        return Outcome("skipped", str(e))
    if kept is not None:
        try:
            write_atomic(kept, wrap(payload, key))
        except OSError as e:
            log.warning("cannot keep the kdat cache in %s: %s", kept, e)
    return Outcome("produced", f"by `criu check`, kept in {kept}", str(dest))
