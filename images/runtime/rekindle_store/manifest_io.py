"""manifest.json: what a checkpoint holds, how to check it, and whether it was proven.

Every file of a checkpoint is listed with its size and digests (BLAKE3,
sha256, crc32), so a restore can tell a damaged, incomplete or altered
checkpoint from a good one before handing it to CRIU (CRIU itself would
restore corrupted memory without complaint). read() is the only way the
agent takes a manifest in: signature first (signing.py, with a key), then
structure, then every path and mode in it against the places it may name.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import rekindle_contract
from rekindle_contract.manifest import (
    FILES_SUBDIR,
    IMAGES_SUBDIR,
    MANIFEST_FORMAT,
    MANIFEST_NAME,
    RUN_CACHE_SUBDIR,
    SHM_SUBDIR,
    SUBDIRS,
    VERIFIED_NAME,
    FileEntry,
    Manifest,
)

from rekindle_store import digests, signing

READ_CHUNK = 8 << 20
# A manifest lists every file with its digests: tens to hundreds of KiB. Far more is not
# one the agent wrote, and is refused before it is parsed.
MAX_MANIFEST_BYTES = 16 << 20
MAX_NAME = 255
# File modes a restore may create: at most rwxr-xr-x. setuid, setgid and sticky
# bits are refused outright; group/other write is masked off.
MODE_REFUSED = 0o7000
MODE_MASK = 0o755
LINK_REMAP = re.compile(r"link_remap\.[0-9]+")
# What CRIU itself writes into the images directory at every restore (never reads).
CRIU_RESTORE_OUTPUTS = (f"{IMAGES_SUBDIR}/stats-restore",)


class ManifestError(ValueError):
    """The checkpoint cannot be used; .reason is one of rekindle_contract.api.FALLBACK_REASONS."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def digest_file(path: Path | str, chunk: int = READ_CHUNK) -> dict[str, str]:
    """Every digest the manifest records ({algorithm: hex}), in one read."""
    hashers = digests.RecordHashers()
    buf = bytearray(chunk)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            hashers.update(view[:n])
    return hashers.hexdigests()


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
    """Sizes and digests of the files, largest first across a thread pool (GiBs of images)."""
    order = sorted(rel_paths, key=lambda r: -(root / r).stat().st_size)

    def one(rel: str) -> FileEntry:
        p = root / rel
        entry: FileEntry = {"path": rel, "size": p.stat().st_size}
        entry.update(digest_file(p))  # type: ignore[typeddict-item]
        return entry

    with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="digest") as pool:
        entries = list(pool.map(one, order))
    return sorted(entries, key=lambda e: e["path"])


def write(root: Path, manifest: Manifest, key: bytes | None = None) -> Path:
    """Sign (with key) and write atomically (rename): a reader never sees half a manifest.

    The data is fsynced before the rename, so a crash leaves the old manifest
    or the new one, and a full volume fails here, not later.
    """
    signing.sign(cast(dict[str, Any], manifest), key)
    path = root / MANIFEST_NAME
    tmp = root / (MANIFEST_NAME + ".tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(manifest, indent=2, sort_keys=True))
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def read(root: Path, key: bytes | None = None, run_dir: str | None = None) -> Manifest:
    """The checkpoint's manifest, only once it is proven safe to act on.

    In order: the signature (with key; unsigned or altered: signature_invalid),
    the structure, then every path and mode in it (run_dir: the only
    directory, besides /dev/shm, that a restore may write into).
    """
    path = root / MANIFEST_NAME
    if not path.is_file():
        raise ManifestError("no_checkpoint", f"{path} does not exist")
    # Read before the signature is checked, so bounded: no key is needed to write it.
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_MANIFEST_BYTES + 1)
    except OSError as e:
        raise ManifestError("manifest_invalid", f"{path}: {e}") from e
    return parse(raw, str(path), key, run_dir)


def parse(raw: bytes, where: str, key: bytes | None = None, run_dir: str | None = None) -> Manifest:
    """read()'s checks on bytes already read (where names them in errors).

    The node agent reads a manifest once from an opened directory and parses
    those bytes; it never opens the file again by path.
    """
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ManifestError(
            "manifest_invalid", f"{where}: larger than {MAX_MANIFEST_BYTES} bytes, not read"
        )
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as e:  # RecursionError: nested too deeply
        raise ManifestError("manifest_invalid", f"{where}: {type(e).__name__}: {e}") from e
    if not isinstance(data, dict):
        raise ManifestError("manifest_invalid", f"{where}: not a JSON object")
    try:
        signing.check(data, key)
    except signing.SignatureError as e:
        raise ManifestError("signature_invalid", f"{where}: {e}") from e
    problems = validate(data)
    if not problems and run_dir is not None:
        problems = validate_paths(data, run_dir)
    if problems:
        raise ManifestError("manifest_invalid", f"{where}: " + "; ".join(problems[:10]))
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
        isinstance(f, dict)
        and {"path", "size"} <= f.keys()
        and any(isinstance(f.get(a), str) and f.get(a) for a in ("blake3", "sha256"))
        for f in files
    ):
        out.append("'files' must be a list of {path, size, blake3 or sha256}")
    else:
        seen: set[str] = set()
        for f in files:
            problem = relpath_problem(f["path"])
            if problem:
                out.append(f"file path {f['path']!r} {problem}")
            if f["path"] in seen:  # two digests for one file: which one holds?
                out.append(f"file path {f['path']!r} is listed twice")
            seen.add(str(f["path"]))
            if not isinstance(f["size"], int) or isinstance(f["size"], bool) or f["size"] < 0:
                out.append(f"file {f['path']!r}: size {f['size']!r} is not a byte count")
    vllm = data.get("vllm", {})
    if not isinstance(vllm, dict):
        out.append("'vllm' must be an object")
    elif not isinstance(vllm.get("root_pid"), int):
        out.append("vllm.root_pid missing")
    return out


def relpath_problem(p: Any) -> str | None:
    """Why p is not a plain path below one of the checkpoint's subdirectories (None: fine)."""
    if not isinstance(p, str) or not p:
        return "is not a path"
    if "\0" in p or p.startswith("/"):
        return "escapes the checkpoint directory"
    parts = p.split("/")
    if any(part in ("", ".", "..") for part in parts) or ".." in Path(p).parts:
        return "escapes the checkpoint directory"
    if len(parts) < 2 or parts[0] not in SUBDIRS:
        return f"is not below one of {', '.join(SUBDIRS)}"
    if any(len(part.encode()) > MAX_NAME for part in parts):
        return "has a name longer than 255 bytes"
    return None


def name_problem(name: Any) -> str | None:
    """Why name is not a single plain file name (None: fine)."""
    if not isinstance(name, str) or not name:
        return "is not a file name"
    if "/" in name or "\0" in name or name in (".", ".."):
        return "is not a single file name (a path would escape its directory)"
    if len(name.encode()) > MAX_NAME:
        return "is longer than 255 bytes"
    return None


def mode_problem(mode: Any) -> str | None:
    if not isinstance(mode, int) or isinstance(mode, bool) or not 0 <= mode <= 0o7777:
        return f"mode {mode!r} is not a file mode"
    if mode & MODE_REFUSED:
        return f"mode {mode:o} has setuid, setgid or sticky bits"
    return None


def safe_mode(mode: Any) -> int:
    """The mode a restore creates a file with: validated, then at most rwxr-xr-x."""
    if mode_problem(mode):
        raise ValueError(f"unsafe file mode {mode!r}")
    return int(mode) & MODE_MASK


def _id_problem(value: Any) -> bool:
    return not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**32 - 1


def below(path: str, directory: str) -> bool:
    """path (normalized, absolute) is strictly below directory."""
    d = directory.rstrip("/")
    return path.startswith(d + "/") and len(path) > len(d) + 1


def validate_paths(data: dict[str, Any], run_dir: str) -> list[str]:
    """Every path and mode a restore would act on, against where it may point.

    files[].path         below images/, shm/, files/ or weights/ (validate())
    shm_files[].name     one file name in /dev/shm; its copy shm/NAME is listed
    extra_files[].path   the vLLM log, a CRIU link_remap.N file, or a file below
                         run_dir/cache (compiled kernels), all below run_dir
    extra_files[].saved  files/NAME, listed
    vllm.run_dir         this agent's run_dir (the restored tree has files there)
    modes                no setuid/setgid/sticky (group/other write is masked later)
    """
    out: list[str] = []
    listed = {str(f.get("path")) for f in data.get("files", []) if isinstance(f, dict)}
    vllm = data.get("vllm", {})
    run = os.path.normpath(run_dir)
    if vllm.get("run_dir") != run and vllm.get("run_dir") != run_dir:
        out.append(
            f"vllm.run_dir {vllm.get('run_dir')!r} is not this agent's --run-dir {run_dir!r}"
        )
    pids = vllm.get("pids", [vllm.get("root_pid")])
    if not isinstance(pids, list) or not all(
        isinstance(p, int) and not isinstance(p, bool) and 1 < p < 2**22 for p in pids
    ):
        out.append("vllm.pids must be a list of PIDs")
    shm = data.get("shm_files", [])
    if not isinstance(shm, list):
        out.append("'shm_files' must be a list")
        shm = []
    for rec in shm:
        if not isinstance(rec, dict):
            out.append("a shm_files entry is not an object")
            continue
        name = rec.get("name")
        problem = name_problem(name)
        if problem:
            out.append(f"shm file {name!r} {problem}")
            continue
        if f"{SHM_SUBDIR}/{name}" not in listed:
            out.append(f"shm file {name!r}: its copy {SHM_SUBDIR}/{name} is not in 'files'")
        problem = mode_problem(rec.get("mode"))
        if problem:
            out.append(f"shm file {name!r}: {problem}")
        if _id_problem(rec.get("uid", 0)) or _id_problem(rec.get("gid", 0)):
            out.append(f"shm file {name!r}: uid/gid must be numbers")
    extra = data.get("extra_files", [])
    if not isinstance(extra, list):
        out.append("'extra_files' must be a list")
        extra = []
    log = os.path.join(run, "vllm.log")
    for rec in extra:
        if not isinstance(rec, dict):
            out.append("an extra_files entry is not an object")
            continue
        p = rec.get("path")
        if not isinstance(p, str) or not os.path.isabs(p) or os.path.normpath(p) != p:
            out.append(f"extra file {p!r} is not an absolute, normalized path")
        elif not below(p, run):
            out.append(f"extra file {p!r} is outside the run dir {run}")
        elif (
            p != log
            and not LINK_REMAP.fullmatch(os.path.basename(p))
            and not below(p, os.path.join(run, RUN_CACHE_SUBDIR))
        ):
            out.append(
                f"extra file {p!r} is neither vLLM's log, a CRIU link_remap file nor below "
                f"the compile caches {os.path.join(run, RUN_CACHE_SUBDIR)}"
            )
        saved = rec.get("saved")
        if relpath_problem(saved) or not str(saved).startswith(FILES_SUBDIR + "/"):
            out.append(f"extra file {p!r}: saved copy {saved!r} is not below {FILES_SUBDIR}/")
        elif saved not in listed:
            out.append(f"extra file {p!r}: saved copy {saved!r} is not in 'files'")
        problem = mode_problem(rec.get("mode", 0o600))
        if problem:
            out.append(f"extra file {p!r}: {problem}")
        size = rec.get("size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            out.append(f"extra file {p!r}: size {size!r} is not a byte count")
    return out


def unlisted_files(root: Path, files: list[FileEntry]) -> list[str]:
    """Files below the checkpoint's subdirectories that the manifest does not list.

    CRIU reads optional images by name (a tmpfs archive, an extra pages file):
    a file slipped into images/ would be used without ever being checked.
    """
    listed = {f["path"] for f in files} | set(CRIU_RESTORE_OUTPUTS)
    out = []
    for sub in SUBDIRS:
        base = root / sub
        if not base.is_dir():
            continue
        for dirpath, dirs, names in os.walk(base):
            for name in names + [d for d in dirs if os.path.islink(os.path.join(dirpath, d))]:
                rel = os.path.relpath(os.path.join(dirpath, name), root)
                if rel not in listed:
                    out.append(rel)
    return sorted(out)


def check_files(root: Path, files: list[FileEntry]) -> None:
    """Every listed file is a regular file of its recorded size, and nothing unlisted is there."""
    check_sizes(root, files)
    for rel in CRIU_RESTORE_OUTPUTS:
        # CRIU (root) opens it O_TRUNC and follows symlinks: it must be a plain file.
        with contextlib.suppress(FileNotFoundError):
            st = os.lstat(root / rel)
            if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                raise ManifestError(
                    "manifest_invalid",
                    f"{root / rel} is not a plain file (CRIU would write through it)",
                )
    extra = unlisted_files(root, files)
    if extra:
        raise ManifestError(
            "manifest_invalid",
            f"{root} holds files its manifest does not list: {', '.join(extra[:5])}",
        )


def check_sizes(root: Path, files: list[FileEntry]) -> None:
    """Cheap completeness check: every listed file exists with its recorded size."""
    for f in files:
        p = root / f["path"]
        try:
            st = p.stat()
        except FileNotFoundError as e:
            raise ManifestError("file_missing", f"{p} is listed in the manifest but missing") from e
        size = st.st_size
        if not stat.S_ISREG(st.st_mode):
            raise ManifestError("manifest_invalid", f"{p} is not a regular file")
        if size != f["size"]:
            raise ManifestError(
                "file_missing", f"{p} has {size} bytes, the manifest says {f['size']}"
            )


def is_verified(root: Path, manifest: Manifest | None = None) -> bool:
    """Proven by a restore. For a signed manifest its own (signed) `verified` record
    must say so too: the marker file alone is not signed."""
    if manifest is not None and manifest.get("signature") and not manifest.get("verified"):
        return False
    return (root / VERIFIED_NAME).is_file()


def make_read_only(root: Path, files: list[FileEntry]) -> list[str]:
    """Once proven, the checkpoint's files are read-only (0400): pods map them for as long
    as they run. Root ignores modes, so this stops non-root writers (and mistakes) only.
    Returns what could not be changed."""
    failed = []
    for rel in [f["path"] for f in files] + [MANIFEST_NAME, VERIFIED_NAME]:
        try:
            os.chmod(root / rel, 0o400)
        except OSError as e:
            failed.append(f"{rel}: {e.strerror or e}")
    return failed


def mark_verified(
    root: Path, manifest: Manifest, details: dict[str, Any], key: bytes | None = None
) -> None:
    """A checkpoint counts as good only after one restore from it served a completion."""
    manifest["verified"] = {
        "at": time.time(),
        "agent_version": rekindle_contract.__version__,
        **details,
    }
    write(root, manifest, key)
    marker = root / VERIFIED_NAME
    marker.write_text(json.dumps(manifest["verified"], sort_keys=True) + "\n")
    os.chmod(marker, 0o600)
