from __future__ import annotations

from pathlib import Path

import pytest
from rekindle_agent.checkpointing import criu, fingerprint


def test_mismatches_only_on_strict_keys() -> None:
    a = {k: "x" for k in fingerprint.STRICT_KEYS} | {"note": 1}
    assert fingerprint.mismatches(a, dict(a, note=2)) == []
    out = fingerprint.mismatches(a, dict(a, vllm="0.33.0"))
    assert out == ["vllm: checkpoint has 'x', this pod has '0.33.0'"]


def test_normalize_argv_drops_interpreter() -> None:
    assert fingerprint.normalize_argv(["/venv/bin/python3", "-m", "vllm"]) == ["-m", "vllm"]
    assert fingerprint.normalize_argv(["vllm", "serve"]) == ["vllm", "serve"]


def test_model_fingerprint_follows_content(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    big = tmp_path / "model.safetensors"
    big.write_bytes(b"\0" * (fingerprint.LARGE_FILE + 10))
    first = fingerprint.model_fingerprint(str(tmp_path))
    assert fingerprint.model_fingerprint(str(tmp_path)) == first
    (tmp_path / "config.json").write_text('{"a": 1}')
    second = fingerprint.model_fingerprint(str(tmp_path))
    assert second != first
    with big.open("r+b") as f:  # the last MiB of a large shard counts
        f.seek(fingerprint.LARGE_FILE + 5)
        f.write(b"\1")
    assert fingerprint.model_fingerprint(str(tmp_path)) != second


def test_criu_version_and_option_probe() -> None:
    assert criu.parse_version("Version: 4.2.1\nGitID: v4.2.1\n") == "4.2.1"
    assert criu.parse_version("garbage") is None
    help_text = "  --lazy-pages  ...\n  --mmap-restore   map pages-*.img\n"
    assert criu.supports_option(help_text, "--mmap-restore")
    assert not criu.supports_option("  --mmap-restore-all\n", "--mmap-restore")
    assert not criu.supports_option(help_text, "--tcp-close")


def test_criu_argv() -> None:
    dump = criu.dump_argv("/c/criu", 42, "/ck/images", "/ck/dump.log")
    assert dump[:4] == ["/c/criu", "dump", "-t", "42"]
    assert "--leave-running" not in dump  # failure resumes the tree, success kills it
    for flag in criu.COMMON_FLAGS:
        assert flag in dump
    rest = criu.restore_argv(
        "/c/criu", "/ck/images", "/run/r/restore.log", "/p", mmap=True, plugins="/plug"
    )
    assert rest[:3] == ["/c/criu", "restore", "-d"]
    # stats-restore goes beside the log, never into the (read-only, shared) images
    assert rest[rest.index("-W") + 1] == "/run/r"
    assert criu.MMAP_RESTORE_FLAG in rest and rest[-2:] == ["-L", "/plug"]
    assert criu.MMAP_RESTORE_FLAG not in criu.restore_argv("/c/criu", "/i", "/l", "/p")


def test_cpu_isa_is_compared_and_read_from_cpuinfo() -> None:
    """A checkpoint from an AVX-512 node restored on an AVX2 node would run code the CPU
    lacks: the fingerprint must differ, and say so."""
    avx512 = "processor\t: 0\nflags\t\t: fpu sse avx avx2 fma avx512f avx512_bf16 amx_tile ht\n"
    avx2 = "processor\t: 0\nflags\t\t: fpu sse avx avx2 fma ht\n"
    assert fingerprint.cpu_isa(avx512) == "amx_tile,avx,avx2,avx512_bf16,avx512f,fma"
    assert fingerprint.cpu_isa(avx2) == "avx,avx2,fma"
    assert fingerprint.cpu_isa("Features\t: fp asimd sve\n") == "asimd,sve"
    assert fingerprint.cpu_isa("nothing here\n") == ""
    problems = fingerprint.mismatches(
        {"cpu_isa": fingerprint.cpu_isa(avx512)}, {"cpu_isa": fingerprint.cpu_isa(avx2)}
    )
    assert len(problems) == 1 and problems[0].startswith("cpu_isa: checkpoint has 'amx_tile,")
    assert fingerprint.cpu_isa() == fingerprint.cpu_isa()  # this machine: stable


def test_the_gpu_identity_is_this_pods_gpus_not_the_nodes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A privileged container sees every GPU of the node; the fingerprint names only the
    ones vLLM is pinned to, so a node with another GPU count still matches."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\n"
        'case "$*" in\n'
        '  *--id=GPU-a*) echo "NVIDIA H100 80GB HBM3, 580.65.06" ;;\n'
        '  *) printf "NVIDIA H100 80GB HBM3, 580.65.06\\nNVIDIA H100 80GB HBM3, 580.65.06\\n" ;;\n'
        "esac\n"
    )
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    one = ("NVIDIA H100 80GB HBM3", "580.65.06")
    assert fingerprint.gpu_identity("GPU-aaaa") == one
    assert fingerprint.gpu_identity(None) == (
        "NVIDIA H100 80GB HBM3;NVIDIA H100 80GB HBM3",
        "580.65.06",
    )
    fp = fingerprint.collect(
        str(tmp_path), ["python", "-m", "vllm"], "cuda", {"CUDA_VISIBLE_DEVICES": "GPU-aaaa"}, "i"
    )
    assert (fp["gpu"], fp["driver"]) == one
