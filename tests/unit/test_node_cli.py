"""The node agent's flags for the fleet: the signing key and the object store."""

from __future__ import annotations

from pathlib import Path

import pytest
from rekindle_node import cli


def _args(*argv: str) -> object:
    return cli.parser().parse_args(list(argv))


def test_no_store_flags_no_store() -> None:
    assert cli.object_store(_args()) is None


def test_a_store_needs_its_bucket_credentials_and_a_shared_key(tmp_path: Path) -> None:
    with pytest.raises(
        SystemExit, match=r"--store-bucket, --store-credentials, --signing-key-file"
    ):
        cli.object_store(_args("--store-endpoint", "http://s3.local:8333"))
    creds = tmp_path / "creds"
    creds.mkdir()
    argv = (
        "--store-endpoint", "http://s3.local:8333", "--store-bucket", "ckpts",
        "--store-credentials", str(creds), "--signing-key-file", str(tmp_path / "key"),
    )  # fmt: skip
    with pytest.raises(SystemExit, match="accessKeyID and secretAccessKey"):
        cli.object_store(_args(*argv))
    (creds / "accessKeyID").write_text("AK")
    (creds / "secretAccessKey").write_text("SK")
    store = cli.object_store(_args(*argv, "--store-threads", "3", "--store-prefix", "fleet"))
    assert store is not None
    assert (store.bucket.endpoint, store.bucket.bucket, store.prefix, store.threads) == (
        "http://s3.local:8333",
        "ckpts",
        "fleet",
        3,
    )


def test_the_fleet_key_must_be_long_enough(tmp_path: Path) -> None:
    short = tmp_path / "key"
    short.write_bytes(b"x" * 31)
    with pytest.raises(SystemExit, match="at least 32 bytes"):
        cli.fleet_key(short)
    short.write_bytes(b"k" * 40 + b"\n")
    assert cli.fleet_key(short) == b"k" * 40


def test_crius_cuda_plugin_is_refused_and_cuda_checkpoint_must_run(tmp_path: Path) -> None:
    """The CUDA plugin would run the pod's cuda-checkpoint as root: the node agent runs
    its own (--cuda-checkpoint) instead."""
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    assert cli.gpu_problem(plugins, None) == ""
    (plugins / "cuda_plugin.so").write_bytes(b"\x7fELF")
    assert "holds CRIU's CUDA plugin" in cli.gpu_problem(plugins, None)
    cc = tmp_path / "cuda-checkpoint"
    cc.write_text("#!/bin/sh\n")
    assert "not an executable file" in cli.gpu_problem(None, cc)
    cc.chmod(0o755)
    assert cli.gpu_problem(None, cc) == ""
