"""Attacks and faults, made real against a real vLLM CPU server and real CRIU.

One agent (A) boots with a signing key and an API key: the serve port's
allowlist and key are attacked, checkpoints are sent onto a read-only volume,
a full one, and one that fills up just after CRIU stopped vLLM; between them A
makes one good, signed checkpoint. Copies of that checkpoint are tampered
with (each restored by an agent with --restore-policy require, which turns
Failed at once instead of booting, so each case costs seconds), and one
agent (B) with another service's key refuses it and boots, then meets a CRIU
that hangs. A third (C) restores it and meets the same CRIU past its
watchdog. CRIU is a wrapper script around the real one that records its calls
and misbehaves on request (its MODE file).
"""

from __future__ import annotations

import json
import secrets
import subprocess
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from rekindle_agent import signing
from rekindle_contract import api
from rekindle_contract.api import AgentError, StatusReply

from tests.vllm.conftest import PROMPTS, AgentFactory, AgentProc, shadow_checkpoint

pytestmark = [pytest.mark.vllm, pytest.mark.criu]

FAKE_CRIU = """#!/bin/sh
# The real CRIU, unless MODE says otherwise; every call is recorded.
echo "$*" >> "{calls}"
mode=$(cat "{mode}" 2>/dev/null || true)
if [ "$1" = dump ]; then
  case "$mode" in
    hang) exec sleep 3600 ;;
    fill-after)
      "{real}" "$@"; rc=$?
      # CRIU has stopped vLLM: fill the checkpoint's volume before the agent saves the rest.
      prev=""; for a in "$@"; do [ "$prev" = "-D" ] && images="$a"; prev="$a"; done
      ckpt=$(dirname "$images")
      avail=$(df --output=avail -B1 "$ckpt" | tail -1)
      fallocate -l "$avail" "$ckpt/fill" 2>/dev/null || fallocate -l $((avail - 4096)) "$ckpt/fill"
      exit $rc ;;
  esac
fi
exec "{real}" "$@"
"""


@dataclass
class FakeCriu:
    path: Path
    calls: Path
    mode: Path

    def set(self, mode: str) -> None:
        self.mode.write_text(mode)

    def restores(self) -> int:
        if not self.calls.exists():
            return 0
        return sum(1 for ln in self.calls.read_text().splitlines() if ln.startswith("restore"))


def fake_criu(base: Path, real: Path, name: str) -> FakeCriu:
    d = base / f"criu-{name}"
    d.mkdir()
    f = FakeCriu(d / "criu", d / "calls.log", d / "mode")
    f.path.write_text(FAKE_CRIU.format(calls=f.calls, mode=f.mode, real=real))
    f.path.chmod(0o755)
    f.set("pass")
    return f


def completions(agent: AgentProc) -> list[str]:
    return [agent.complete(p) for p in PROMPTS[:3]]


def _key(base: Path, name: str, data: str) -> Path:
    p = base / name
    p.write_text(data + "\n")
    p.chmod(0o600)
    return p


def _mount(*argv: str) -> None:
    subprocess.run(["mount", *argv], check=True)


class Sec:
    a: AgentProc
    criu_a: FakeCriu
    key1: Path
    key2: Path
    api_key: str
    before: list[str]
    good: Path
    manifest: dict[str, Any]
    vols: dict[str, Path]


@pytest.fixture(scope="module")
def sec(agent_factory: AgentFactory) -> Iterator[Sec]:
    f = agent_factory
    s = Sec()
    s.key1 = _key(f.base, "signing-key-1", secrets.token_hex(32))
    s.key2 = _key(f.base, "signing-key-2", secrets.token_hex(32))
    s.api_key = "sk-" + secrets.token_hex(16)
    api_key_file = _key(f.base, "api-key", s.api_key)
    # The volumes exist before A starts: its mount namespace gets a copy of them.
    s.vols = {name: f.checkpoints / name for name in ("ro", "tiny", "fill")}
    for p in s.vols.values():
        p.mkdir()
    _mount("--bind", str(s.vols["ro"]), str(s.vols["ro"]))
    _mount("-o", "remount,bind,ro", str(s.vols["ro"]))
    _mount("-t", "tmpfs", "-o", "size=1m,mode=0700", "tiny", str(s.vols["tiny"]))
    _mount("-t", "tmpfs", "-o", "size=3g,mode=0700", "fill", str(s.vols["fill"]))
    s.criu_a = fake_criu(f.base, f.criu, "a")
    s.a = f.start(
        name="sec-a",
        criu=str(s.criu_a.path),
        signing_key_file=str(s.key1),
        api_key_file=str(api_key_file),
    )
    try:
        st = s.a.wait_ready(600)
        assert st.security["checkpoint_signing"] == "hmac-sha256", st.raw
        assert st.security["serve_api_key"] is True
        s.before = completions(s.a)
        s.good = f.checkpoints / "sec-good"
        s.manifest = dict(s.a.client.checkpoint(str(s.good), timeout=900))
        assert s.manifest["signature"]["algorithm"] == "hmac-sha256"
        yield s
    finally:
        s.a.stop()
        for p in s.vols.values():
            subprocess.run(["umount", "-l", str(p)], check=False)


# -- the serve port -----------------------------------------------------------------
def test_serve_port_forwards_only_the_api_and_needs_the_key(sec: Sec) -> None:
    a = sec.a
    auth = {"Authorization": f"Bearer {sec.api_key}"}
    attacks: list[tuple[str, str, object | None]] = [
        ("POST", "/collective_rpc", {"method": "rekindle_release_weights"}),
        ("POST", "/sleep?level=1", None),
        ("POST", "/wake_up", None),
        ("POST", "/reset_prefix_cache", None),
        ("POST", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/tmp"}),
        ("GET", "/no/such/path", None),
        ("POST", "/v1/completions/../../collective_rpc", {"method": "x"}),
        ("POST", "/v1%2F..%2Fcollective_rpc", {"method": "x"}),
    ]
    for method, path, body in attacks:
        code, text = a.request(method, path, body)
        assert code == 401, (path, code, text)  # no key: nothing else is even considered
        code, text = a.request(method, path, body, headers=auth)
        assert code == 404, (path, code, text)
    # Without the key even the API is refused; with it, it works.
    code, _ = a.request("POST", "/v1/completions", {"model": "tiny", "prompt": "x"})
    assert code == 401
    code, _ = a.request("GET", "/v1/models", headers={"Authorization": "Bearer wrong"})
    assert code == 401
    code, text = a.request("GET", "/v1/models", headers=auth)
    assert code == 200 and "tiny" in text
    code, _ = a.request("GET", "/health", headers=auth)
    assert code == 200
    code, _ = a.request("GET", "/v1/completions", headers=auth)
    assert code == 405
    # The weights were never released: the same greedy answers as before.
    assert completions(a) == sec.before
    assert a.status().state == "Ready"


# -- checkpoints that fail ----------------------------------------------------------
def _failed_checkpoint(sec: Sec, target: Path, reason: str) -> dict[str, Any]:
    with pytest.raises(AgentError) as e:
        sec.a.client.checkpoint(str(target), timeout=900)
    assert e.value.status == 500, e.value.body
    body = json.loads(e.value.body)
    assert body["reason"] == reason, body
    st = sec.a.wait_ready(600)
    last = st.last_checkpoint
    assert last is not None and last["ok"] is False and last["reason"] == reason, st.raw
    assert completions(sec.a) == sec.before
    return body


def test_checkpoint_onto_a_read_only_volume(sec: Sec) -> None:
    body = _failed_checkpoint(sec, sec.vols["ro"] / "c", "read_only")
    assert "Read-only file system" in body["error"]
    assert sec.a.status().origin == "restored"  # the same tree serves on: no reboot


def test_checkpoint_onto_a_full_volume(sec: Sec) -> None:
    """1 MiB: the weight dump (7 MB) fails inside vLLM's workers; vLLM serves on."""
    body = _failed_checkpoint(sec, sec.vols["tiny"] / "c", "volume_full")
    assert "No space left" in body["error"]
    assert not (sec.vols["tiny"] / "c").exists()  # the partial dump is gone
    assert sec.a.status().origin == "restored"


def test_volume_full_after_criu_stopped_vllm(sec: Sec) -> None:
    """The volume fills just after the dump: vLLM is gone, so the agent boots it again."""
    target = sec.vols["fill"] / "c"
    sec.criu_a.set("fill-after")
    try:
        body = _failed_checkpoint(sec, target, "volume_full")
    finally:
        sec.criu_a.set("pass")
    assert "after CRIU stopped vLLM" in body["error"]
    assert not target.exists()  # images, weights and the fill removed
    assert sec.a.status().origin == "booted"


# -- tampered checkpoints -----------------------------------------------------------
def _a_done(sec: Sec) -> None:
    """The tests below restore in new namespaces: vLLM's port (shared, like pods') must be free."""
    sec.a.stop()


def _edit(ckpt: Path, change: Callable[[dict[str, Any]], None], key: Path | None) -> None:
    """Change the manifest; re-sign it with key (None: leave the signature as it was)."""
    path = ckpt / "manifest.json"
    doc = json.loads(path.read_text())
    change(doc)
    if key is not None:
        signing.sign(doc, signing.read_key(str(key)))
    path.write_text(json.dumps(doc))


def _smallest_pages(ckpt: Path) -> Path:
    pages = [p for p in (ckpt / "images").glob("pages-*.img") if p.stat().st_size > 0]
    return min(pages, key=lambda p: p.stat().st_size)


def _corrupt_pages(ckpt: Path) -> None:
    target = _smallest_pages(ckpt)
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.unlink()
    target.write_bytes(bytes(data))


def _refused(
    f: AgentFactory, criu: FakeCriu, ckpt: Path, name: str, **settings: Any
) -> tuple[StatusReply, str]:
    """Restore with --restore-policy require: Failed at once, with the fallback's reason."""
    agent = f.start(
        name=name, checkpoint=str(ckpt), restore_policy="require", criu=str(criu.path), **settings
    )
    try:
        st = agent.wait_state(("Failed", "Ready"), 300)
        assert st.state == "Failed", (st.raw, agent.tail(50))
        assert st.last_fallback is not None, st.raw
        return st, agent.tail(400)
    finally:
        agent.stop()


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("shm-dotdot", "manifest_invalid"),
        ("shm-absolute", "manifest_invalid"),
        ("extra-absolute", "manifest_invalid"),
        ("extra-saved-dotdot", "manifest_invalid"),
        ("setuid-mode", "manifest_invalid"),
        ("unlisted-image", "manifest_invalid"),
        ("tampered-manifest", "signature_invalid"),
        ("unsigned-manifest", "signature_invalid"),
        ("tampered-pages-no-prefetch", "checksum_mismatch"),
        ("tampered-pages", "checksum_mismatch"),
        ("unsigned-agent-shm-dotdot", "manifest_invalid"),
    ],
)
def test_tampered_checkpoint_is_refused_before_use(
    sec: Sec, agent_factory: AgentFactory, tmp_path: Path, case: str, reason: str
) -> None:
    _a_done(sec)
    f = agent_factory
    ckpt = shadow_checkpoint(sec.good, tmp_path / "ckpt")
    planted = Path("/tmp") / f"rekindle-pwned-{secrets.token_hex(4)}"
    settings: dict[str, Any] = {"signing_key_file": str(sec.key1)}
    k1 = sec.key1
    if case == "shm-dotdot":
        _edit(ckpt, lambda d: d["shm_files"][0].update(name=f"../../..{planted}"), k1)
    elif case == "shm-absolute":
        _edit(ckpt, lambda d: d["shm_files"][0].update(name=str(planted)), k1)
    elif case == "extra-absolute":
        _edit(ckpt, lambda d: d["extra_files"][0].update(path=str(planted)), k1)
    elif case == "extra-saved-dotdot":
        _edit(ckpt, lambda d: d["extra_files"][0].update(saved="../../../../etc/hostname"), k1)
    elif case == "setuid-mode":
        _edit(ckpt, lambda d: d["shm_files"][0].update(mode=0o4777), k1)
    elif case == "unlisted-image":
        (ckpt / "images" / "tmpfs-dev-99.tar.gz.img").write_bytes(b"\x1f\x8b not listed")
    elif case == "tampered-manifest":
        _edit(ckpt, lambda d: d["shm_files"][0].update(mode=0o644), None)
    elif case == "unsigned-manifest":
        _edit(ckpt, lambda d: d.pop("signature"), None)
    elif case.startswith("tampered-pages"):
        _corrupt_pages(ckpt)
        if case.endswith("no-prefetch"):
            settings["prefetch"] = False
    elif case == "unsigned-agent-shm-dotdot":
        # An agent without a key (today's deployments) still validates every path.
        _edit(ckpt, lambda d: d["shm_files"][0].update(name=f"../../..{planted}"), None)
        settings = {}
    criu = fake_criu(tmp_path, f.criu, "t")
    st, log = _refused(f, criu, ckpt, f"tamper-{case}", **settings)
    assert st.last_fallback is not None
    assert st.last_fallback["reason"] == reason, st.raw
    assert not planted.exists()
    if case == "tampered-pages":
        # CRIU restored the tree stopped; the mismatch was found before it ever ran.
        assert criu.restores() == 1
        assert "resumed" not in log
    else:
        assert criu.restores() == 0, criu.calls.read_text()


# -- another service, a hanging CRIU, the watchdog --------------------------------
def test_other_services_checkpoint_then_a_hanging_criu(
    sec: Sec, agent_factory: AgentFactory
) -> None:
    """B has another service's key: it refuses the checkpoint and boots. Then its
    CRIU hangs: the dump is killed after --dump-timeout and vLLM booted again."""
    _a_done(sec)
    f = agent_factory
    criu = fake_criu(f.base, f.criu, "b")
    b = f.start(
        name="sec-b",
        checkpoint=str(sec.good),
        criu=str(criu.path),
        signing_key_file=str(sec.key2),
        dump_timeout=5,
    )
    try:
        st = b.wait_ready(600)
        assert st.origin == "booted", st.raw
        assert st.last_fallback is not None and st.last_fallback["reason"] == "signature_invalid"
        assert "another key" in st.last_fallback["message"]
        assert criu.restores() == 0
        assert completions(b) == sec.before
        criu.set("hang")
        target = f.checkpoints / "sec-hang"
        with pytest.raises(AgentError) as e:
            b.client.checkpoint(str(target), timeout=900)
        body = json.loads(e.value.body)
        assert e.value.status == 500 and body["reason"] == "criu_timeout", body
        assert "--dump-timeout" in body["error"]
        st = b.wait_ready(600)
        assert st.origin == "booted" and st.last_checkpoint is not None
        assert st.last_checkpoint["reason"] == "criu_timeout"
        assert not target.exists()
        assert completions(b) == sec.before
    finally:
        b.stop()


def test_watchdog_ends_a_stuck_checkpoint(sec: Sec, agent_factory: AgentFactory) -> None:
    _a_done(sec)
    f = agent_factory
    criu = fake_criu(f.base, f.criu, "c")
    c = f.start(
        name="sec-c",
        checkpoint=str(sec.good),
        restore_policy="require",
        criu=str(criu.path),
        signing_key_file=str(sec.key1),
        drain_timeout=2,
        checkpoint_timeout=8,
    )
    try:
        st = c.wait_ready(300)
        assert st.origin == "restored", st.raw
        criu.set("hang")
        target = f.checkpoints / "sec-stuck"
        with pytest.raises(AgentError) as e:
            c.client.checkpoint(str(target), timeout=300)
        body = json.loads(e.value.body)
        assert e.value.status == 500 and body["reason"] == "watchdog", body
        st = c.status()
        assert st.state == "Failed" and "--checkpoint-timeout" in st.message, st.raw
        assert st.last_checkpoint is not None and st.last_checkpoint["reason"] == "watchdog"
        assert not target.exists()
        with pytest.raises(urllib.error.HTTPError) as h:
            urllib.request.urlopen(c.admin_url + api.PATH_HEALTHZ, timeout=10)
        assert h.value.code == 503  # the liveness probe restarts the container
        ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
        assert "sleep 3600" not in ps  # the hanging CRIU was killed
    finally:
        c.stop()


def test_signed_checkpoint_restores(sec: Sec, agent_factory: AgentFactory) -> None:
    """The good one, untouched, restores with the key (the mmap restore, prefetch on)."""
    _a_done(sec)
    agent = agent_factory.start(
        name="sec-good", checkpoint=str(sec.good), signing_key_file=str(sec.key1)
    )
    try:
        st = agent.wait_ready(300)
        assert st.origin == "restored" and st.last_fallback is None, st.raw
        assert completions(agent) == sec.before
        assert "resumed" in agent.tail(400)
    finally:
        agent.stop()
