"""Pure logic of the agent's defences: the serve allowlist, manifest signing, path and
mode validation, check_target, the fingerprint's env and image, the watchdog."""

from __future__ import annotations

import copy
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from rekindle_agent.agent import Agent
from rekindle_agent.checkpointing import checkpoint, fingerprint
from rekindle_agent.config import AgentConfig, ConfigError
from rekindle_agent.restoring import prefetch
from rekindle_agent.serving import auth, serve_routes
from rekindle_contract import api
from rekindle_contract.manifest import MANIFEST_FORMAT, MANIFEST_NAME
from rekindle_store import manifest_io, signing

KEY = b"k" * 32
OTHER = b"o" * 32
RUN = "/tmp/rekindle-agent"


# -- the serve port's allowlist -----------------------------------------------------
@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/v1/models"),
        ("GET", "/health"),
        ("GET", "/metrics"),
        ("POST", "/v1/embeddings"),
        ("GET", "/v1/responses/resp_abc-123"),
        ("POST", "/v1/responses/resp_abc.1/cancel"),
        ("POST", "/tokenize"),
    ],
)
def test_allowlist_forwards_the_inference_api(method: str, path: str) -> None:
    assert serve_routes.allowed(method, path)


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/collective_rpc"),
        ("POST", "/sleep"),
        ("POST", "/wake_up"),
        ("POST", "/reset_prefix_cache"),
        ("POST", "/v1/load_lora_adapter"),
        ("POST", "/pause"),
        ("POST", "/update_weights"),
        ("POST", "/start_profile"),
        ("POST", "/metrics"),
        ("GET", "/metrics/"),
        ("GET", "/server_info"),
        ("POST", "/v1/completions/"),  # trailing slash
        ("POST", "//v1/completions"),
        ("POST", "/v1/completions/../../collective_rpc"),
        ("POST", "/v1/./completions"),
        ("POST", "/v1%2Fcompletions"),
        ("POST", "/v1/responses/../cancel"),
        ("POST", "/v1/responses/%2e%2e/cancel"),
        ("GET", "/v1/responses/.hidden"),
        ("GET", "/v1/completions"),  # wrong method
        ("DELETE", "/v1/models"),
        ("POST", "http://127.0.0.1:18000/collective_rpc"),  # absolute-form target
        ("POST", ""),
        ("POST", "/"),
    ],
)
def test_allowlist_refuses_control_endpoints_and_tricks(method: str, path: str) -> None:
    assert not serve_routes.allowed(method, path)


def test_every_route_is_absolute_and_plain() -> None:
    for method, path in api.SERVE_ROUTES:
        assert method in ("GET", "POST") and path.startswith("/") and ".." not in path
        assert serve_routes.known_path(path.replace("{id}", "x1"))


# -- signing --------------------------------------------------------------------
def _manifest(tmp: Path | None = None) -> dict[str, Any]:
    return {
        "format": MANIFEST_FORMAT,
        "fingerprint": {"vllm": "1"},
        "criu": {},
        "vllm": {"root_pid": 12000, "pids": [12000, 12001], "run_dir": RUN},
        "files": [
            {"path": "images/core-1.img", "size": 4, "sha256": "x", "blake3": "y"},
            {"path": "shm/psm_1", "size": 0, "sha256": "x"},
            {"path": "files/000-vllm.log", "size": 3, "sha256": "x"},
        ],
        "shm_files": [{"name": "psm_1", "size": 0, "mode": 0o600, "uid": 0, "gid": 0}],
        "extra_files": [
            {
                "path": f"{RUN}/vllm.log",
                "saved": "files/000-vllm.log",
                "size": 3,
                "mode": 0o600,
                "exact": False,
            }
        ],
        "timings": {"total": 1.25e-05},
    }


def test_sign_and_check_round_trip_through_json() -> None:
    doc = _manifest()
    signing.sign(doc, KEY)
    assert doc["signature"]["algorithm"] == "hmac-sha256"
    parsed = json.loads(json.dumps(doc, indent=2, sort_keys=True))
    signing.check(parsed, KEY)
    signing.check(parsed, None)  # no key: nothing to check


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (lambda d: d["files"][0].update(blake3="z"), "altered"),
        (lambda d: d["shm_files"][0].update(mode=0o4755), "altered"),
        (lambda d: d.update(verified={"at": 1}), "altered"),
        (lambda d: d.pop("signature"), "unsigned"),
        (lambda d: d.update(signature=signing.signature(d, OTHER)), "another key"),
        (lambda d: d["signature"].update(algorithm="none"), "not supported"),
    ],
)
def test_check_refuses_tampering(change: Any, needle: str) -> None:
    doc = _manifest()
    signing.sign(doc, KEY)
    bad = copy.deepcopy(doc)
    change(bad)
    with pytest.raises(signing.SignatureError, match=needle):
        signing.check(bad, KEY)


def test_read_checks_the_signature_first(tmp_path: Path) -> None:
    doc = _manifest()
    signing.sign(doc, OTHER)
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(doc))
    with pytest.raises(manifest_io.ManifestError) as e:
        manifest_io.read(tmp_path, KEY, RUN)
    assert e.value.reason == "signature_invalid"
    manifest_io.read(tmp_path, OTHER, RUN)
    manifest_io.read(tmp_path, None, RUN)  # unsigned mode reads signed manifests too


def test_write_signs_and_verified_needs_the_signed_record(tmp_path: Path) -> None:
    doc = _manifest()
    manifest_io.write(tmp_path, doc, KEY)  # type: ignore[arg-type]
    man = manifest_io.read(tmp_path, KEY, RUN)
    (tmp_path / "verified").write_text("{}")  # the marker alone is not signed
    assert not manifest_io.is_verified(tmp_path, man)
    manifest_io.mark_verified(tmp_path, man, {"restore_seconds": 1.0}, KEY)
    man = manifest_io.read(tmp_path, KEY, RUN)
    assert manifest_io.is_verified(tmp_path, man)
    assert not list(tmp_path.glob("*.tmp"))


def test_read_key_needs_32_bytes(tmp_path: Path) -> None:
    f = tmp_path / "key"
    f.write_bytes(b"short\n")
    with pytest.raises(ConfigError, match="32 bytes"):
        auth.read_signing_key(str(f))
    f.write_bytes(KEY + b"\n")
    assert auth.read_signing_key(str(f)) == KEY
    with pytest.raises(ConfigError, match="signing key file"):
        auth.read_signing_key(str(tmp_path / "missing"))
    assert signing.key_id(KEY) != signing.key_id(OTHER) and len(signing.key_id(KEY)) == 16


# -- paths and modes in a manifest -----------------------------------------------
def _problems(change: Any, run_dir: str = RUN) -> list[str]:
    doc = _manifest()
    change(doc)
    return manifest_io.validate(doc) + manifest_io.validate_paths(doc, run_dir)


def test_a_good_manifest_has_no_problems() -> None:
    assert _problems(lambda d: None) == []


def test_a_compiled_kernel_below_the_run_dirs_caches_may_be_restored() -> None:
    kernel = f"{RUN}/cache/vllm/torch_compile_cache/x/inductor_cache/jo/k.main.so"
    assert _problems(lambda d: d["extra_files"][0].update(path=kernel)) == []
    # the cache dir itself, and a look-alike beside it, are not below it
    for path in (f"{RUN}/cache", f"{RUN}/cache-x/k.so"):
        (problem,) = _problems(lambda d, p=path: d["extra_files"][0].update(path=p))
        assert "neither vLLM's log" in problem and f"{RUN}/cache" in problem


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (lambda d: d["shm_files"][0].update(name="../../etc/cron.d/x"), "single file name"),
        (lambda d: d["shm_files"][0].update(name="/etc/passwd"), "single file name"),
        (lambda d: d["shm_files"][0].update(name=".."), "single file name"),
        (lambda d: d["shm_files"][0].update(name="psm_2"), "not in 'files'"),
        (lambda d: d["shm_files"][0].update(mode=0o4755), "setuid"),
        (lambda d: d["shm_files"][0].update(mode=0o2700), "setuid"),
        (lambda d: d["shm_files"][0].update(mode="rwx"), "not a file mode"),
        (lambda d: d["shm_files"][0].update(uid=-1), "uid/gid"),
        (lambda d: d["extra_files"][0].update(path="/etc/cron.d/evil"), "outside the run dir"),
        (lambda d: d["extra_files"][0].update(path=f"{RUN}/../etc/x"), "normalized"),
        (lambda d: d["extra_files"][0].update(path="relative/vllm.log"), "absolute"),
        (lambda d: d["extra_files"][0].update(path=f"{RUN}/bin/sh"), "neither vLLM's log"),
        (lambda d: d["extra_files"][0].update(saved="../../etc/shadow"), "saved copy"),
        (lambda d: d["extra_files"][0].update(saved="images/core-1.img"), "saved copy"),
        (lambda d: d["extra_files"][0].update(mode=0o6755), "setuid"),
        (lambda d: d["files"].append({"path": "/etc/shadow", "size": 1, "sha256": "x"}), "escapes"),
        (
            lambda d: d["files"].append({"path": "images/../../x", "size": 1, "sha256": "x"}),
            "escapes",
        ),
        (lambda d: d["files"].append({"path": "other/x", "size": 1, "sha256": "x"}), "not below"),
        (lambda d: d["files"].append({"path": "images/x", "size": -1, "sha256": "x"}), "size"),
        (lambda d: d["vllm"].update(run_dir="/etc"), "run_dir"),
        (lambda d: d["vllm"].update(pids=[1, "x"]), "PIDs"),
    ],
)
def test_unsafe_paths_and_modes_are_refused(change: Any, needle: str) -> None:
    problems = _problems(change)
    assert any(needle in p for p in problems), problems


def test_link_remaps_below_the_run_dir_are_fine() -> None:
    def change(d: dict[str, Any]) -> None:
        d["files"].append({"path": "files/001-link_remap.3", "size": 0, "sha256": "x"})
        d["extra_files"].append(
            {
                "path": f"{RUN}/tmp/link_remap.3",
                "saved": "files/001-link_remap.3",
                "size": 0,
                "mode": 0o600,
                "exact": True,
            }
        )

    assert _problems(change) == []


def test_modes_are_masked() -> None:
    assert manifest_io.safe_mode(0o666) == 0o644
    assert manifest_io.safe_mode(0o777) == 0o755
    assert manifest_io.safe_mode(0o600) == 0o600
    with pytest.raises(ValueError):
        manifest_io.safe_mode(0o4755)


def test_unlisted_files_are_found(tmp_path: Path) -> None:
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "core-1.img").write_bytes(b"core")
    files = manifest_io.checksum_files(tmp_path, ["images/core-1.img"])
    assert files[0]["blake3"] and "sha256" not in files[0]
    manifest_io.check_files(tmp_path, files)
    (tmp_path / "images" / "tmpfs-dev-9.tar.gz.img").write_bytes(b"evil")
    with pytest.raises(manifest_io.ManifestError, match="does not list"):
        manifest_io.check_files(tmp_path, files)


def test_critical_files_are_checked_first(tmp_path: Path) -> None:
    (tmp_path / "images").mkdir()
    (tmp_path / "weights").mkdir()
    for rel, size in (("images/pages-1.img", 1 << 20), ("images/core-1.img", 10)):
        (tmp_path / rel).write_bytes(b"a" * size)
    (tmp_path / "weights" / "w.bin").write_bytes(b"w" * 100)
    files = manifest_io.checksum_files(
        tmp_path, ["images/pages-1.img", "images/core-1.img", "weights/w.bin"]
    )
    assert prefetch.critical_paths(files) == {"images/core-1.img"}
    pre = prefetch.Prefetcher(tmp_path, files, threads=1, verify="blake3")
    assert pre.order[0] == "images/core-1.img"
    assert pre.result(timeout=30, paths={"images/core-1.img"}).bad == []
    assert pre.result(timeout=30).bad == []
    (tmp_path / "images" / "core-1.img").write_bytes(b"b" * 10)
    res = prefetch.Prefetcher(tmp_path, files, threads=2, verify="blake3").result(timeout=30)
    assert res.bad == ["images/core-1.img: blake3 differs from the manifest"]


def test_blake3_falls_back_to_sha256_for_older_manifests() -> None:
    entry: Any = {"path": "images/x", "size": 1, "sha256": "s"}
    assert prefetch.expected(entry, "blake3") == ("sha256", "s")
    assert prefetch.expected(entry, "crc32") == ("sha256", "s")
    entry["blake3"] = "b"
    assert prefetch.expected(entry, "blake3") == ("blake3", "b")
    assert prefetch.expected(entry, "sha256") == ("sha256", "s")
    assert prefetch.expected({"path": "p", "size": 1, "blake3": "b"}, "sha256") == ("blake3", "b")
    with pytest.raises(ValueError, match="no digest"):
        prefetch.expected({"path": "p", "size": 1}, "blake3")


# -- check_target -------------------------------------------------------------------
def test_check_target_resolves_symlinks(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / "escape").symlink_to(outside)
    with pytest.raises(ValueError, match="below the checkpoint root"):
        checkpoint.check_target(str(root / "escape" / "c1"), str(root))
    with pytest.raises(ValueError, match="below the checkpoint root"):
        checkpoint.check_target(str(root / "escape"), str(root))
    with pytest.raises(ValueError, match="below the checkpoint root"):
        checkpoint.check_target(str(root / ".." / "outside" / "c"), str(root))
    inner = root / "real"
    inner.mkdir()
    (root / "link").symlink_to(inner)
    assert checkpoint.check_target(str(root / "link" / "c1"), str(root)) == inner / "c1"
    assert checkpoint.check_target(str(root / "c2"), str(root)) == root / "c2"


def test_os_reasons() -> None:
    import errno

    assert checkpoint.os_reason(OSError(errno.ENOSPC, "x")) == "volume_full"
    assert checkpoint.os_reason(OSError(errno.EROFS, "x")) == "read_only"
    assert checkpoint.os_reason(OSError("[Errno 28] No space left on device")) == "volume_full"
    assert checkpoint.os_reason(OSError(errno.EIO, "x")) == "io_error"
    assert set(api.CHECKPOINT_FAILURE_REASONS) >= {"volume_full", "read_only", "io_error"}


# -- fingerprint: env and image -----------------------------------------------------
def test_env_digest_covers_values_without_storing_them(tmp_path: Path) -> None:
    env = {"VLLM_X": "1", "HF_TOKEN": "secret-value", "HOME": "/root", "CUDA_VISIBLE_DEVICES": "0"}
    (tmp_path / "config.json").write_text("{}")
    fp = fingerprint.collect(str(tmp_path), ["python", "-m", "vllm"], "cpu", env, image="img:1")
    assert "secret-value" not in json.dumps(fp)
    assert fp["env_names"] == ["HF_TOKEN", "VLLM_X"] and fp["image"] == "img:1"
    assert fp["python_env"]
    same = fingerprint.env_digest({**env, "HOME": "/other", "CUDA_VISIBLE_DEVICES": "3"})
    assert same == fp["env_digest"]
    other = dict(fp, env_digest=fingerprint.env_digest({**env, "HF_TOKEN": "other"}))
    assert fingerprint.mismatches(fp, other) == ["env: vLLM's environment differs (values differ)"]
    added = dict(fp, env_names=[*fp["env_names"], "VLLM_Y"], env_digest="x")
    assert fingerprint.mismatches(fp, added) == ["env: vLLM's environment differs (+VLLM_Y)"]
    assert fingerprint.mismatches(fp, dict(fp, image="img:2")) == [
        "image: checkpoint has 'img:1', this pod has 'img:2'"
    ]


def test_secret_flags_are_hashed_in_the_argv() -> None:
    argv = ["python", "-m", "vllm", "--api-key", "sk-secret", "--hf-token=hf_secret", "--x", "1"]
    out = fingerprint.normalize_argv(argv)
    assert "sk-secret" not in json.dumps(out) and "hf_secret" not in json.dumps(out)
    assert out[:3] == ["-m", "vllm", "--api-key"] and out[-2:] == ["--x", "1"]
    assert out != fingerprint.normalize_argv([*argv[:4], "sk-other", *argv[5:]])


def test_python_env_digest_sees_a_reinstall(tmp_path: Path) -> None:
    site = tmp_path / "site"
    (site / "pkg-1.0.dist-info").mkdir(parents=True)
    record = site / "pkg-1.0.dist-info" / "RECORD"
    record.write_text("pkg/__init__.py,sha256=abc,10\n")
    os.utime(record, ns=(1, 1))
    first = fingerprint.python_env_digest([str(site)])
    assert fingerprint.python_env_digest([str(site), str(tmp_path / "missing")]) == first
    os.utime(record, ns=(2, 2))  # reinstalled (same size)
    assert fingerprint.python_env_digest([str(site)]) != first
    os.utime(record, ns=(1, 1))
    (site / "pkg-1.0.dist-info").rename(site / "pkg-1.1.dist-info")
    assert fingerprint.python_env_digest([str(site)]) != first


# -- config -------------------------------------------------------------------------
def test_a_signing_key_needs_a_cryptographic_check() -> None:
    cfg = AgentConfig(model="/m", signing_key_file="/k", verify_checksums="crc32")
    with pytest.raises(ConfigError, match="cryptographic"):
        cfg.validate()
    AgentConfig(model="/m", signing_key_file="/k").validate()  # blake3 by default
    with pytest.raises(ConfigError, match="checkpoint-timeout"):
        AgentConfig(model="/m", checkpoint_timeout=10, drain_timeout=30).validate()
    with pytest.raises(ConfigError, match="proxy-max-concurrency"):
        AgentConfig(model="/m", proxy_max_concurrency=0).validate()


# -- the watchdog -------------------------------------------------------------------
def test_watchdog_ends_a_stuck_checkpoint(tmp_path: Path) -> None:
    cfg = AgentConfig(model=str(tmp_path), run_dir=str(tmp_path / "run"), worker_extension="none")
    agent = Agent(cfg, b"t" * 24, signing_key=KEY)
    try:
        assert agent.status_doc()["security"]["checkpoint_signing"] == "hmac-sha256"
        agent.set_state("Ready")
        ckpt = tmp_path / "ckpt"
        (ckpt / "images").mkdir(parents=True)
        (ckpt / "images" / "pages-1.img").write_bytes(b"x")
        agent.guard("the checkpoint", ckpt)
        agent.set_state("Draining")
        agent.set_state("Checkpointing")
        assert not agent.check_watchdog()  # not yet
        assert agent.check_watchdog(now=time.monotonic() + cfg.checkpoint_timeout + 1)
        doc = agent.status_doc()
        assert doc["state"] == "Failed" and "--checkpoint-timeout" in doc["message"]
        assert doc["last_checkpoint"] is not None
        assert doc["last_checkpoint"]["reason"] == "watchdog"
        assert not ckpt.exists() and agent.flow_aborted.is_set()
        agent.set_state("Ready", "the stuck thread woke up")  # ignored: terminal
        assert agent.status.state == "Failed"
        with pytest.raises(RuntimeError, match="watchdog"):
            agent.boot()
    finally:
        agent.reaper.stop()


def test_unsigned_agent_says_so(tmp_path: Path) -> None:
    cfg = AgentConfig(model=str(tmp_path), run_dir=str(tmp_path), worker_extension="none")
    agent = Agent(cfg, b"t" * 24)
    try:
        sec = agent.status_doc()["security"]
        assert sec == {
            "checkpoint_signing": "unsigned",
            "signing_key_id": None,
            "verify": "blake3",
            "serve_api_key": False,
            "checkpoint_mount": "none",
            "admin_tls": False,
        }
    finally:
        agent.reaper.stop()
