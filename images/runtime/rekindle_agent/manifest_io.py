"""manifest.json: what a checkpoint holds, how to check it, and whether it was proven.

Every file of a checkpoint is listed with its size and sha256, so a restore
can tell a damaged or incomplete checkpoint from a good one before handing it
to CRIU (CRIU itself would restore corrupted memory without complaint).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

from rekindle_contract.manifest import (
    MANIFEST_FORMAT,
    MANIFEST_NAME,
    VERIFIED_NAME,
    FileEntry,
    Manifest,
)

from rekindle_agent import __version__

READ_CHUNK = 8 << 20


class ManifestError(ValueError):
    """The checkpoint cannot be used; .reason is one of rekindle_contract.api.FALLBACK_REASONS."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def digest_file(path: Path | str, chunk: int = READ_CHUNK) -> tuple[str, str]:
    """(sha256, crc32) in one read: the manifest's record and the restore's fast check."""
    h = hashlib.sha256()
    crc = 0
    buf = bytearray(chunk)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
            crc = zlib.crc32(view[:n], crc)
    return h.hexdigest(), f"{crc:08x}"


def list_files(root: Path, exclude: tuple[str, ...] = (MANIFEST_NAME, VERIFIED_NAME)) -> list[str]:
    """Every regular file below root, relative, sorted; the manifest itself excluded."""
    out = []
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            rel = os.path.relpath(os.path.join(dirpath, name), root)
            if rel not in exclude:
                out.append(rel)
    return sorted(out)


def checksum_files(root: Path, rel_paths: list[str], threads: int = 4) -> list[FileEntry]:
    """Sizes and sha256 of the files, largest first across a thread pool (GiBs of images)."""
    order = sorted(rel_paths, key=lambda r: -(root / r).stat().st_size)

    def one(rel: str) -> FileEntry:
        p = root / rel
        sha, crc = digest_file(p)
        return {"path": rel, "size": p.stat().st_size, "sha256": sha, "crc32": crc}

    with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="sha256") as pool:
        entries = list(pool.map(one, order))
    return sorted(entries, key=lambda e: e["path"])


def write(root: Path, manifest: Manifest) -> Path:
    """Atomically (rename) so a reader never sees half a manifest."""
    path = root / MANIFEST_NAME
    tmp = root / (MANIFEST_NAME + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True))
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)
    return path


def read(root: Path) -> Manifest:
    path = root / MANIFEST_NAME
    if not path.is_file():
        raise ManifestError("no_checkpoint", f"{path} does not exist")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ManifestError("manifest_invalid", f"{path}: {e}") from e
    problems = validate(data)
    if problems:
        raise ManifestError("manifest_invalid", f"{path}: " + "; ".join(problems))
    return cast(Manifest, data)


def validate(data: Any) -> list[str]:
    """Structural problems of a manifest (empty list: usable)."""
    if not isinstance(data, dict):
        return ["not a JSON object"]
    out = []
    if data.get("format") != MANIFEST_FORMAT:
        out.append(f"format {data.get('format')!r}, this agent reads {MANIFEST_FORMAT}")
    for key in ("fingerprint", "vllm", "files", "criu"):
        if key not in data:
            out.append(f"missing {key!r}")
    files = data.get("files", [])
    if not isinstance(files, list) or not all(
        isinstance(f, dict) and {"path", "size", "sha256"} <= f.keys() for f in files
    ):
        out.append("'files' must be a list of {path, size, sha256}")
    else:
        for f in files:
            p = str(f["path"])
            if p.startswith("/") or ".." in Path(p).parts:
                out.append(f"file path {p!r} escapes the checkpoint directory")
    vllm = data.get("vllm", {})
    if isinstance(vllm, dict) and not isinstance(vllm.get("root_pid"), int):
        out.append("vllm.root_pid missing")
    return out


def check_sizes(root: Path, files: list[FileEntry]) -> None:
    """Cheap completeness check: every listed file exists with its recorded size."""
    for f in files:
        p = root / f["path"]
        try:
            size = p.stat().st_size
        except FileNotFoundError as e:
            raise ManifestError("file_missing", f"{p} is listed in the manifest but missing") from e
        if size != f["size"]:
            raise ManifestError(
                "file_missing", f"{p} has {size} bytes, the manifest says {f['size']}"
            )


def is_verified(root: Path) -> bool:
    return (root / VERIFIED_NAME).is_file()


def mark_verified(root: Path, manifest: Manifest, details: dict[str, Any]) -> None:
    """A checkpoint counts as good only after one restore from it served a completion."""
    manifest["verified"] = {"at": time.time(), "agent_version": __version__, **details}
    write(root, manifest)
    marker = root / VERIFIED_NAME
    marker.write_text(json.dumps(manifest["verified"], sort_keys=True) + "\n")
    os.chmod(marker, 0o600)
