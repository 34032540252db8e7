"""`rekindle fetch-model --s3-*` against a real S3-compatible server (SeaweedFS): a model
below a prefix downloaded with parallel ranged reads into the node's model cache,
checked, shared, refreshed when an object changes, and refused when the bytes are not
the store's.
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import pytest
from rekindle_agent import model_fetch_s3
from rekindle_agent.cli import main as rekindle_main
from rekindle_agent.model_fetch import FetchError
from rekindle_contract.model_cache import MODEL_CACHE_MOUNT, s3_dir, s3_model_path
from rekindle_store.s3 import Bucket

pytestmark = pytest.mark.store

PREFIX = "models/tiny/"


def _model(bucket: Bucket) -> dict[str, bytes]:
    """A model's files (one larger than a ranged read) uploaded below PREFIX."""
    files = {
        "config.json": b'{"model_type": "llama"}',
        "model.safetensors": os.urandom(2 * model_fetch_s3.PART_BYTES + 4099),
        "tokenizer/tokenizer.json": b'{"v": 1}',
    }
    for rel, data in files.items():
        bucket.put(PREFIX + rel, data)
    bucket.put("models/tinyish/other.bin", b"not this model")  # a prefix that only looks alike
    return files


def _tree(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def test_the_model_lands_whole_and_a_second_fetch_downloads_nothing(
    tmp_path: Path, bucket: Bucket
) -> None:
    files = _model(bucket)
    ref = model_fetch_s3.fetch_s3(bucket, PREFIX, tmp_path)
    assert ref == tmp_path / s3_dir(bucket.endpoint, bucket.bucket, PREFIX) / "refs" / "current"
    assert _tree(ref.resolve()) == files
    # The operator tells vLLM the same path, under the cache's mount point.
    assert s3_model_path(bucket.endpoint, bucket.bucket, PREFIX) == (
        f"{MODEL_CACHE_MOUNT}/{ref.relative_to(tmp_path)}"
    )
    calls: list[str] = []
    real_get = bucket.get

    def counting(key: str, *a: object, **k: object) -> bytes:
        calls.append(key)
        return real_get(key, *a, **k)  # type: ignore[arg-type]

    bucket.get = counting  # type: ignore[method-assign]
    assert model_fetch_s3.fetch_s3(bucket, PREFIX.rstrip("/"), tmp_path) == ref
    assert calls == []  # listed, found in the cache, nothing read


def test_replicas_fetching_at_once_download_once(tmp_path: Path, bucket: Bucket) -> None:
    files = _model(bucket)
    reads: list[str] = []
    real_get = bucket.get

    def counting(key: str, *a: object, **k: object) -> bytes:
        reads.append(key)
        return real_get(key, *a, **k)  # type: ignore[arg-type]

    bucket.get = counting  # type: ignore[method-assign]
    out: list[Path] = []
    threads = [
        threading.Thread(
            target=lambda: out.append(model_fetch_s3.fetch_s3(bucket, PREFIX, tmp_path))
        )
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(out)) == 1 and _tree(out[0].resolve()) == files
    # Each range read once: three parts of the large file, one of each small one.
    assert sorted(reads) == sorted([PREFIX + "config.json", PREFIX + "tokenizer/tokenizer.json"]
                                   + [PREFIX + "model.safetensors"] * 3)  # fmt: skip


def test_a_changed_object_makes_a_new_version(tmp_path: Path, bucket: Bucket) -> None:
    files = _model(bucket)
    first = model_fetch_s3.fetch_s3(bucket, PREFIX, tmp_path).resolve()
    bucket.put(PREFIX + "config.json", b'{"model_type": "llama", "changed": true}')
    second = model_fetch_s3.fetch_s3(bucket, PREFIX, tmp_path).resolve()
    assert second != first and first.is_dir()  # a replica still mapping the old one keeps it
    assert _tree(second)["config.json"] == b'{"model_type": "llama", "changed": true}'
    assert _tree(second)["model.safetensors"] == files["model.safetensors"]


def test_bytes_that_are_not_the_stores_are_refused_and_leave_nothing(
    tmp_path: Path, bucket: Bucket
) -> None:
    _model(bucket)
    real_get = bucket.get

    def flipped(key: str, start: int = 0, end: int | None = None, limit: int = 0) -> bytes:
        data = bytearray(real_get(key, start, end, limit))
        if key.endswith("config.json"):
            data[0] ^= 0xFF  # a proxy or a bad disk on the way
        return bytes(data)

    bucket.get = flipped  # type: ignore[method-assign]
    with pytest.raises(FetchError, match=r"config.json: content does not match the store's ETag"):
        model_fetch_s3.fetch_s3(bucket, PREFIX, tmp_path)
    model = tmp_path / s3_dir(bucket.endpoint, bucket.bucket, PREFIX)
    assert list((model / "snapshots").iterdir()) == [] and not list(model.glob(".tmp-*"))
    assert not (model / "refs" / "current").exists()


def test_an_unreachable_store_uses_the_cached_copy(tmp_path: Path, bucket: Bucket) -> None:
    files = _model(bucket)
    ref = model_fetch_s3.fetch_s3(bucket, PREFIX, tmp_path)
    gone = Bucket("http://127.0.0.1:9", bucket.bucket, bucket.creds, timeout=2)
    gone.endpoint = bucket.endpoint  # same cache key: the same store, now unreachable
    assert model_fetch_s3.fetch_s3(gone, PREFIX, tmp_path) == ref
    assert _tree(ref.resolve()) == files
    with pytest.raises(FetchError, match="cannot list"):
        model_fetch_s3.fetch_s3(gone, PREFIX, tmp_path / "empty-cache")


def test_the_cli_reads_the_keys_from_the_environment(
    tmp_path: Path,
    bucket: Bucket,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    files = _model(bucket)
    argv = [
        "fetch-model", "--s3-endpoint", bucket.endpoint, "--s3-bucket", bucket.bucket,
        "--s3-prefix", PREFIX, "--cache", str(tmp_path),
    ]  # fmt: skip
    monkeypatch.delenv("AWS_ACCESS_KEY_ID", raising=False)
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY", raising=False)
    assert rekindle_main(argv) == 1
    assert "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY are not set" in capsys.readouterr().err
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", bucket.creds.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", bucket.creds.secret_key)
    assert rekindle_main(argv) == 0
    path = Path(capsys.readouterr().out.strip())
    assert _tree(path.resolve()) == files
    digest = hashlib.sha256(files["model.safetensors"]).hexdigest()
    assert hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest() == digest
