from __future__ import annotations

import hashlib
import json
import zlib
from pathlib import Path
from typing import Any

import pytest
from blake3 import blake3
from rekindle_agent.restoring import prefetch
from rekindle_contract.manifest import MANIFEST_FORMAT, MANIFEST_NAME, FileEntry, Manifest
from rekindle_store import manifest_io


def _ckpt(tmp_path: Path) -> tuple[Path, list[FileEntry]]:
    root = tmp_path / "ckpt"
    (root / "images").mkdir(parents=True)
    (root / "images" / "pages-1.img").write_bytes(bytes(range(256)) * 40000)
    (root / "images" / "core-1.img").write_bytes(b"core")
    (root / "shm").mkdir()
    (root / "shm" / "psm_1").write_bytes(b"")
    rel = manifest_io.list_files(root)
    return root, manifest_io.checksum_files(root, rel, threads=3)


def _doc(files: list[FileEntry]) -> dict[str, Any]:
    return {
        "format": MANIFEST_FORMAT,
        "fingerprint": {},
        "criu": {},
        "vllm": {"root_pid": 123},
        "files": files,
    }


def test_checksums_match_blake3(tmp_path: Path) -> None:
    root, entries = _ckpt(tmp_path)
    assert [e["path"] for e in entries] == ["images/core-1.img", "images/pages-1.img", "shm/psm_1"]
    for e in entries:
        data = (root / e["path"]).read_bytes()
        assert e["size"] == len(data)
        assert e.get("blake3") == blake3(data).hexdigest()


def test_prefetch_reads_the_weight_dump_last_and_apart(tmp_path: Path) -> None:
    """The weight dump is the biggest file but gates only the reload: read after what the
    tree needs, so resuming the tree never waits for it."""
    root, _ = _ckpt(tmp_path)
    (root / "weights").mkdir()
    (root / "weights" / "weights-rank0.bin").write_bytes(b"w" * 3_000_000)
    (root / "weights" / "weights-rank0.json").write_bytes(b"{}")
    entries = manifest_io.checksum_files(root, manifest_io.list_files(root), threads=2)
    pre = prefetch.Prefetcher(root, entries, threads=1)
    assert pre.order == [
        "images/core-1.img",
        "images/pages-1.img",
        "shm/psm_1",
        "weights/weights-rank0.bin",
        "weights/weights-rank0.json",
    ]
    assert prefetch.weight_paths(entries) == {
        "weights/weights-rank0.bin",
        "weights/weights-rank0.json",
    }
    assert prefetch.tree_paths(entries) | prefetch.weight_paths(entries) == {
        e["path"] for e in entries
    }
    assert not prefetch.tree_paths(entries) & prefetch.weight_paths(entries)
    assert pre.result(paths=prefetch.tree_paths(entries)).bad == []
    assert pre.result().bad == []


def _older(entries: list[FileEntry], root: Path) -> list[FileEntry]:
    """The same files as an older agent recorded them: sha256 and crc32, no blake3."""
    out: list[FileEntry] = []
    for e in entries:
        data = (root / e["path"]).read_bytes()
        out.append(
            {
                "path": e["path"],
                "size": e["size"],
                "sha256": hashlib.sha256(data).hexdigest(),
                "crc32": f"{zlib.crc32(data):08x}",
            }
        )
    return out


def test_write_read_and_verified_marker(tmp_path: Path) -> None:
    root, entries = _ckpt(tmp_path)
    man: Manifest = _doc(entries)  # type: ignore[assignment]
    manifest_io.write(root, man)
    assert manifest_io.read(root)["files"] == entries
    assert manifest_io.list_files(root) == [e["path"] for e in entries]  # manifest excluded
    assert not manifest_io.is_verified(root)
    manifest_io.mark_verified(root, man, {"restore_seconds": 1.0})
    assert manifest_io.is_verified(root)
    assert manifest_io.read(root)["verified"]["restore_seconds"] == 1.0


@pytest.mark.parametrize(
    ("doc", "needle"),
    [
        ({"format": 99}, "format"),
        ({"files": [{"path": "../../etc/passwd", "size": 1, "sha256": "x"}]}, "escapes"),
        ({"files": "nope"}, "list"),
        (
            {"files": [{"path": "shm/a", "size": 1, "sha256": "x"}] * 2},
            "'shm/a' is listed twice",
        ),
        ({"vllm": {}}, "root_pid"),
    ],
)
def test_validate_names_the_problem(doc: dict[str, Any], needle: str) -> None:
    base = _doc([])
    base.update(doc)
    problems = manifest_io.validate(base)
    assert any(needle in p for p in problems), problems


def test_read_reasons(tmp_path: Path) -> None:
    with pytest.raises(manifest_io.ManifestError) as e:
        manifest_io.read(tmp_path)
    assert e.value.reason == "no_checkpoint"
    (tmp_path / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(manifest_io.ManifestError) as e:
        manifest_io.read(tmp_path)
    assert e.value.reason == "manifest_invalid"


@pytest.mark.parametrize("algo", ["blake3", "crc32", "sha256"])
def test_size_check_and_prefetch_hash_catch_damage(tmp_path: Path, algo: str) -> None:
    root, entries = _ckpt(tmp_path)
    if algo != "blake3":
        entries = _older(entries, root)
    manifest_io.check_sizes(root, entries)
    assert prefetch.Prefetcher(root, entries, threads=2, verify=algo).result().bad == []
    pages = root / "images" / "pages-1.img"
    data = bytearray(pages.read_bytes())
    data[5000] ^= 0xFF  # same size, different content
    pages.write_bytes(bytes(data))
    manifest_io.check_sizes(root, entries)  # sizes cannot see it ...
    res = prefetch.Prefetcher(root, entries, threads=2, verify=algo).result()
    assert res.bad == [f"images/pages-1.img: {algo} differs from the manifest"]  # ... hashes do
    assert prefetch.Prefetcher(root, entries, threads=2, verify="size").result().bad == []
    assert res.bytes_read == sum(e["size"] for e in entries)
    (root / "images" / "core-1.img").unlink()
    with pytest.raises(manifest_io.ManifestError) as e:
        manifest_io.check_sizes(root, entries)
    assert e.value.reason == "file_missing"
    assert "missing" in json.dumps(str(e.value))


def test_a_deeply_nested_manifest_is_refused_not_a_crash(tmp_path: Path) -> None:
    """No key is needed to write it: it must be a manifest_invalid (the agent then boots),
    never a RecursionError that takes the agent down on every start."""
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / MANIFEST_NAME).write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(manifest_io.ManifestError) as e:
        manifest_io.read(root)
    assert e.value.reason == "manifest_invalid"
    assert "RecursionError" in str(e.value)


def test_an_oversized_manifest_is_not_read(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    with (root / MANIFEST_NAME).open("wb") as f:
        f.truncate(manifest_io.MAX_MANIFEST_BYTES + 1)  # sparse: no disk used
    with pytest.raises(manifest_io.ManifestError) as e:
        manifest_io.read(root)
    assert e.value.reason == "manifest_invalid"
    assert f"larger than {manifest_io.MAX_MANIFEST_BYTES} bytes" in str(e.value)
