"""CRIU's kdat cache as the agent keeps it: keying, the stored form's checks, prepare()."""

import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from rekindle_agent.checkpointing import criu, fingerprint
from rekindle_agent.config import AgentConfig
from rekindle_agent.restoring import early, kdat_cache
from rekindle_agent.restoring.early import EarlyStart
from rekindle_agent.restoring.kdat_cache import KdatError

PAYLOAD = struct.pack("<II", kdat_cache.KDAT_MAGIC, 1795471251) + bytes(range(200))


def test_key_changes_with_boot_kernel_and_criu() -> None:
    base = kdat_cache.cache_key("boot-a", "6.18.44", "c" * 64)
    assert base == kdat_cache.cache_key("boot-a\n", "6.18.44", "c" * 64)  # as read from /proc
    assert base != kdat_cache.cache_key("boot-b", "6.18.44", "c" * 64)
    assert base != kdat_cache.cache_key("boot-a", "6.18.45", "c" * 64)
    assert base != kdat_cache.cache_key("boot-a", "6.18.44", "d" * 64)


def test_key_refuses_empty_parts() -> None:
    with pytest.raises(KdatError, match="boot id"):
        kdat_cache.cache_key(" \n", "6.18.44", "c" * 64)


def test_wrap_unwrap_round_trip() -> None:
    assert kdat_cache.unwrap(kdat_cache.wrap(PAYLOAD)) == PAYLOAD


@pytest.mark.parametrize(
    "mangle, why",
    [
        (lambda d: d[:-1], "digest"),  # truncated
        (lambda d: d[:-1] + bytes([d[-1] ^ 1]), "digest"),  # one bit flipped
        (lambda d: PAYLOAD, "header"),  # CRIU's raw file, not ours
        (lambda d: b"", "header"),
        (lambda d: kdat_cache.HEADER + b"abc\n" + PAYLOAD, "no content digest"),
    ],
)
def test_unwrap_rejects_altered_files(mangle: Callable[[bytes], bytes], why: str) -> None:
    with pytest.raises(KdatError, match=why):
        kdat_cache.unwrap(mangle(kdat_cache.wrap(PAYLOAD)))


def test_keyed_digest_needs_the_same_key() -> None:
    signed = kdat_cache.wrap(PAYLOAD, b"k" * 32)
    assert kdat_cache.unwrap(signed, b"k" * 32) == PAYLOAD
    with pytest.raises(KdatError, match="digest"):
        kdat_cache.unwrap(signed, b"x" * 32)  # another service's key
    with pytest.raises(KdatError, match="digest"):
        kdat_cache.unwrap(kdat_cache.wrap(PAYLOAD), b"k" * 32)  # unsigned, key expected


def test_payload_needs_criu_magic() -> None:
    with pytest.raises(KdatError, match="magic"):
        kdat_cache.wrap(b"\0" * 64)
    with pytest.raises(KdatError, match="too short"):
        kdat_cache.check_payload(b"\x58\x34")


def test_rundir_is_read_from_the_binary() -> None:
    assert kdat_cache.rundir_of(b"\x7fELF..\0/run/criu.kdat\0..") == "/run"
    assert kdat_cache.rundir_of(b"\0/var/run/x/criu.kdat\0") == "/var/run/x"
    assert kdat_cache.rundir_of(b"no such string") == kdat_cache.DEFAULT_RUNDIR


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """A fake CRIU whose RUNDIR is under tmp_path, a boot id file, a counting producer."""
    rundir = tmp_path / "run"
    rundir.mkdir()
    binary = tmp_path / "criu"
    binary.write_bytes(b"\x7fELF\0" + str(rundir).encode() + b"/criu.kdat\0")
    boot = tmp_path / "boot_id"
    boot.write_text("11111111-2222\n")
    monkeypatch.setattr(kdat_cache, "BOOT_ID", str(boot))
    made: list[str] = []

    def fake_produce(b: str, r: str) -> bytes:
        made.append(r)
        return PAYLOAD

    monkeypatch.setattr(kdat_cache, "produce", fake_produce)
    return {"rundir": rundir, "binary": binary, "boot": boot, "root": tmp_path / "ckpts"}


def _prepare(node: dict[str, Path]) -> kdat_cache.Outcome:
    return kdat_cache.prepare(str(node["binary"]), str(node["root"]))


def _kept(node: dict[str, Path]) -> list[Path]:
    return sorted((node["root"] / kdat_cache.CACHE_SUBDIR).glob("*.kdat"))


def test_prepare_produces_once_then_installs(node: dict[str, Path]) -> None:
    first = _prepare(node)
    assert first.action == "produced", first
    assert (node["rundir"] / "criu.kdat").read_bytes() == PAYLOAD
    (node["rundir"] / "criu.kdat").unlink()  # CRIU drops it when it cannot save to a tmpfs
    second = _prepare(node)
    assert second.action == "installed", second
    assert second.path == str(node["rundir"] / "criu.kdat")
    assert (node["rundir"] / "criu.kdat").read_bytes() == PAYLOAD
    assert len(_kept(node)) == 1


def test_new_boot_or_new_criu_gets_a_new_file(node: dict[str, Path]) -> None:
    _prepare(node)
    node["boot"].write_text("33333333-4444\n")
    assert _prepare(node).action == "produced"
    node["binary"].write_bytes(node["binary"].read_bytes() + b"rebuilt")
    assert _prepare(node).action == "produced"
    assert len(_kept(node)) == 3


def test_corrupt_kept_file_is_replaced_not_installed(node: dict[str, Path]) -> None:
    _prepare(node)
    (kept,) = _kept(node)
    kept.write_bytes(kept.read_bytes()[:-3] + b"bad")
    (node["rundir"] / "criu.kdat").unlink()
    out = _prepare(node)
    assert out.action == "produced", out
    assert kdat_cache.unwrap(kept.read_bytes()) == PAYLOAD


def test_prepare_without_cache_dir_still_installs(node: dict[str, Path]) -> None:
    out = kdat_cache.prepare(str(node["binary"]), None)
    assert out.action == "produced"
    assert (node["rundir"] / "criu.kdat").read_bytes() == PAYLOAD


def test_prepare_never_raises(node: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(b: str, r: str) -> bytes:
        raise KdatError("criu check failed")

    monkeypatch.setattr(kdat_cache, "produce", failing)
    out = _prepare(node)
    assert out.action == "skipped" and "criu check failed" in out.detail
    assert not (node["rundir"] / "criu.kdat").exists()
    missing = kdat_cache.prepare(str(node["binary"].with_name("nope")), None)
    assert missing.action == "skipped" and "cannot key" in missing.detail


def test_produce_reports_a_failing_check(tmp_path: Path) -> None:
    with pytest.raises(KdatError):
        kdat_cache.produce(str(tmp_path / "no-criu"), str(tmp_path))


def _cfg(tmp_path: Path, **kw: Any) -> AgentConfig:
    return AgentConfig(model=str(tmp_path), run_dir=str(tmp_path), worker_extension="none", **kw)


@pytest.fixture
def early_fakes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str | None]]:
    """EarlyStart with its probes faked: what kdat_cache.prepare was asked for."""
    calls: list[tuple[str, str | None]] = []

    def fake_prepare(binary: str, cache_dir: str | None, key: bytes | None) -> kdat_cache.Outcome:
        calls.append((binary, cache_dir))
        return kdat_cache.Outcome("installed", "fake", "/run/criu.kdat")

    monkeypatch.setattr(kdat_cache, "prepare", fake_prepare)
    monkeypatch.setattr(criu, "probe", lambda b: criu.CriuInfo(b, "4.2.1", True))
    monkeypatch.setattr(fingerprint, "collect", lambda *a: {})
    monkeypatch.delenv(early.KDAT_CACHE_ENV, raising=False)
    return calls


def test_early_start_prepares_the_cache_in_the_checkpoint_root(
    tmp_path: Path, early_fakes: list[tuple[str, str | None]]
) -> None:
    es = EarlyStart()
    es.begin(_cfg(tmp_path, criu="/opt/criu", checkpoint_root="/ckpts"))
    assert es.criu_info("/opt/criu").version == "4.2.1"  # waits for the cache step too
    out = es.kdat_outcome("/opt/criu")
    assert out is not None and out.action == "installed"
    assert early_fakes == [("/opt/criu", "/ckpts")]
    es.begin(_cfg(tmp_path, criu="/opt/criu", checkpoint_root="/ckpts"))
    assert len(early_fakes) == 1  # once per binary


def test_early_start_cache_dir_defaults_to_the_checkpoints_parent(
    tmp_path: Path, early_fakes: list[tuple[str, str | None]]
) -> None:
    EarlyStart().begin(_cfg(tmp_path, criu="/c", restore_from="/data/ck/one", prefetch=False))
    EarlyStart().begin(_cfg(tmp_path, criu="/c"))
    assert [d for _, d in early_fakes] == ["/data/ck", None]


def test_early_start_cache_can_be_turned_off(
    tmp_path: Path, early_fakes: list[tuple[str, str | None]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(early.KDAT_CACHE_ENV, "off")
    es = early.EarlyStart()
    es.begin(_cfg(tmp_path, criu="/opt/criu"))
    es.criu_info("/opt/criu")
    assert early_fakes == [] and es.kdat_outcome("/opt/criu") is None
