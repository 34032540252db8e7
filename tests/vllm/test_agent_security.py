"""Attacks and faults, made real against a real vLLM CPU server and real CRIU.

One agent (A) restores the session's tiny checkpoint (conftest's tiny_ckpt; a
copy signed here with the service's key) with a signing key and an API key:
the serve port's allowlist and key are attacked; A makes one good, signed
checkpoint of its own; then checkpoints are sent onto a read-only volume, a
full one, and one that fills up just after CRIU stopped vLLM (A boots vLLM
again). Copies of A's checkpoint are tampered with (each restored by an agent
with --restore-policy require, which turns Failed at once instead of booting,
so each case costs seconds), one of them restored by an agent with another
service's key. Agent B restores A's checkpoint and meets a CRIU that hangs
(the dump is killed and vLLM booted again); C restores it and meets the same
CRIU past its watchdog. CRIU is a wrapper script around the real one that
records its calls and misbehaves on request (its MODE file).

The module's agents keep their checkpoints (and CRIU's kdat cache, signed with
the key here) under a checkpoint root of their own, not the session factory's.
A test that needs vLLM's port (shared by the factory's agents, like pods of a
service) stops A first; a test that needs A starts it again from its good
checkpoint if it is not running, so any test runs alone or in any order.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from rekindle_agent.serving import auth
from rekindle_contract import api
from rekindle_contract.api import AgentError, StatusReply
from rekindle_dev.harness import namespace_members
from rekindle_store import signing

from tests.vllm.conftest import (
    PROMPTS,
    AgentFactory,
    AgentProc,
    TinyCheckpoint,
    shadow_checkpoint,
)

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


def _edit(ckpt: Path, change: Callable[[dict[str, Any]], None], key: Path | None) -> None:
    """Change the manifest; re-sign it with key (None: leave the signature as it was)."""
    path = ckpt / "manifest.json"
    doc = json.loads(path.read_text())
    change(doc)
    if key is not None:
        signing.sign(doc, auth.read_signing_key(str(key)))
    path.write_text(json.dumps(doc))


@dataclass
class Sec:
    """The module's keys, volumes and A, the agent attacked and made to fail checkpoints."""

    factory: AgentFactory
    root: Path  # the checkpoint root of this module's agents
    key1: Path  # this service's signing key
    key2: Path  # another service's
    api_key: str
    api_key_file: Path
    criu_a: FakeCriu
    vols: dict[str, Path]
    before: list[str] = field(default_factory=list)
    good: Path = Path()  # A's own checkpoint, signed with key1
    manifest: dict[str, Any] = field(default_factory=dict)
    a_status: dict[str, Any] = field(default_factory=dict)  # A's, once Ready from the seed
    _a: AgentProc | None = None

    def start_a(self, checkpoint: Path) -> AgentProc:
        self._a = self.factory.start(
            name="sec-a",
            restore_from=str(checkpoint),
            criu=str(self.criu_a.path),
            signing_key_file=str(self.key1),
            api_key_file=str(self.api_key_file),
            checkpoint_root=str(self.root),
        )
        st = self._a.wait_ready(300)
        assert st.origin == "restored" and st.last_fallback is None, st.raw
        return self._a

    def a(self) -> AgentProc:
        """A, serving: started again from its good checkpoint if a test stopped it."""
        if self._a is None or self._a.proc.poll() is not None:
            self.start_a(self.good)
        assert self._a is not None
        return self._a

    def stop_a(self) -> None:
        """For the tests that restore A's checkpoint: vLLM's port (shared, like pods') is
        then free."""
        if self._a is not None:
            self._a.stop()
            self._a = None


@pytest.fixture(scope="module")
def sec(agent_factory: AgentFactory, tiny_ckpt: TinyCheckpoint) -> Iterator[Sec]:
    f = agent_factory
    root = f.base / "sec"
    root.mkdir(mode=0o700)
    key1 = _key(root, "signing-key-1", secrets.token_hex(32))
    api_key = "sk-" + secrets.token_hex(16)
    s = Sec(
        factory=f,
        root=root,
        key1=key1,
        key2=_key(root, "signing-key-2", secrets.token_hex(32)),
        api_key=api_key,
        api_key_file=_key(root, "api-key", api_key),
        criu_a=fake_criu(root, f.criu, "a"),
        # The volumes exist before A starts: its mount namespace gets a copy of them.
        vols={name: root / name for name in ("ro", "tiny", "fill")},
    )
    for p in s.vols.values():
        p.mkdir()
    try:
        _mount("--bind", str(s.vols["ro"]), str(s.vols["ro"]))
        _mount("-o", "remount,bind,ro", str(s.vols["ro"]))
        _mount("-t", "tmpfs", "-o", "size=1m,mode=0700", "tiny", str(s.vols["tiny"]))
        _mount("-t", "tmpfs", "-o", "size=3g,mode=0700", "fill", str(s.vols["fill"]))
        # The session's checkpoint, as this service would have signed it.
        seed = shadow_checkpoint(tiny_ckpt.path, root / "seed")
        _edit(seed, lambda d: None, key1)
        a = s.start_a(seed)
        s.a_status = dict(a.status().raw)
        s.before = completions(a)
        s.good = root / "good"
        s.manifest = dict(a.client.checkpoint(str(s.good), timeout=900))
        yield s
    finally:
        s.stop_a()
        for p in s.vols.values():
            subprocess.run(["umount", "-l", str(p)], check=False)


def test_agent_with_a_key_signs_its_checkpoint(sec: Sec, tiny_ckpt: TinyCheckpoint) -> None:
    """A restored a copy signed with its key; its own checkpoint is signed with it too."""
    security = sec.a_status["security"]
    assert security["checkpoint_signing"] == "hmac-sha256", security
    assert security["serve_api_key"] is True, security
    assert sec.manifest["signature"]["algorithm"] == "hmac-sha256", sec.manifest["signature"]
    on_disk = json.loads((sec.good / "manifest.json").read_text())
    signing.check(on_disk, auth.read_signing_key(str(sec.key1)))  # raises if not signed by key1
    with pytest.raises(signing.SignatureError):
        signing.check(on_disk, auth.read_signing_key(str(sec.key2)))
    assert sec.before == tiny_ckpt.before[:3]


# -- the serve port -----------------------------------------------------------------
def test_serve_port_forwards_only_the_api_and_needs_the_key(sec: Sec) -> None:
    a = sec.a()
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
    # vLLM's own metrics, read-only, for routers and autoscalers (with the key, like the API).
    code, _ = a.request("GET", "/metrics")
    assert code == 401
    code, text = a.request("GET", "/metrics", headers=auth)
    assert code == 200 and "vllm:num_requests_waiting" in text, text[:300]
    assert "rekindle_" not in text  # the agent's own families stay on the admin port
    code, _ = a.request("GET", "/v1/completions", headers=auth)
    assert code == 405
    # The weights were never released: the same greedy answers as before.
    assert completions(a) == sec.before
    assert a.status().state == "Ready"


# -- checkpoints that fail ----------------------------------------------------------
def _failed_checkpoint(
    sec: Sec, target: Path, reason: str, status: int = 500
) -> tuple[dict[str, Any], StatusReply, StatusReply]:
    """A's checkpoint into target fails with reason; A serves the same answers after.
    (The error's body, A's status before, A's status after.)"""
    a = sec.a()
    st0 = a.status()
    with pytest.raises(AgentError) as e:
        a.client.checkpoint(str(target), timeout=900)
    assert e.value.status == status, e.value.body
    body = json.loads(e.value.body)
    assert body["reason"] == reason, body
    st = a.wait_ready(600)
    last = st.last_checkpoint
    assert last is not None and last["ok"] is False and last["reason"] == reason, st.raw
    assert completions(a) == sec.before
    return body, st0, st


def test_checkpoint_onto_a_read_only_volume(sec: Sec) -> None:
    body, st0, st = _failed_checkpoint(sec, sec.vols["ro"] / "c", "read_only")
    assert "Read-only file system" in body["error"]
    # The same tree serves on: no reboot.
    assert (st.origin, st.raw["vllm_pid"]) == (st0.origin, st0.raw["vllm_pid"]), st.raw


def test_checkpoint_onto_a_full_volume(sec: Sec) -> None:
    """1 MiB: refused before anything is drained or written (the estimate from vLLM's real
    process tree is far larger); vLLM serves on. The ENOSPC that a volume filling up
    during a dump meets is the next test's."""
    body, st0, st = _failed_checkpoint(
        sec, sec.vols["tiny"] / "c", "insufficient_space", status=507
    )
    assert "GiB needed" in body["error"] and "GiB free" in body["error"], body
    assert not (sec.vols["tiny"] / "c").exists()  # nothing was written
    assert (st.origin, st.raw["vllm_pid"]) == (st0.origin, st0.raw["vllm_pid"]), st.raw


def test_volume_full_after_criu_stopped_vllm(sec: Sec) -> None:
    """The volume fills just after the dump: vLLM is gone, so the agent boots it again."""
    target = sec.vols["fill"] / "c"
    sec.criu_a.set("fill-after")
    try:
        body, st0, st = _failed_checkpoint(sec, target, "volume_full")
    finally:
        sec.criu_a.set("pass")
    assert "after CRIU stopped vLLM" in body["error"]
    assert not target.exists()  # images, weights and the fill removed
    assert st.origin == "booted" and st.raw["vllm_pid"] != st0.raw["vllm_pid"], st.raw


# -- tampered checkpoints -----------------------------------------------------------
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
    sec: Sec, criu: FakeCriu, ckpt: Path, name: str, **settings: Any
) -> tuple[StatusReply, str]:
    """Restore with --restore-policy require: Failed at once, with the fallback's reason."""
    agent = sec.factory.start(
        name=name,
        restore_from=str(ckpt),
        restore_policy="require",
        criu=str(criu.path),
        checkpoint_root=str(sec.root),
        **settings,
    )
    try:
        st = agent.wait_state(("Failed", "Ready"), 300)
        assert st.state == "Failed", (st.raw, agent.tail(50))
        assert st.last_fallback is not None, st.raw
        assert st.origin == "none" and st.raw["vllm_pid"] is None, st.raw  # nothing booted
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
        ("other-service-key", "signature_invalid"),
        ("tampered-pages-no-prefetch", "checksum_mismatch"),
        ("tampered-pages", "checksum_mismatch"),
        ("unsigned-agent-shm-dotdot", "manifest_invalid"),
    ],
)
def test_tampered_checkpoint_is_refused_before_use(
    sec: Sec, tmp_path: Path, case: str, reason: str
) -> None:
    sec.stop_a()
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
    elif case == "other-service-key":
        # Untouched, but this agent has another service's key.
        settings = {"signing_key_file": str(sec.key2)}
    elif case.startswith("tampered-pages"):
        _corrupt_pages(ckpt)
        if case.endswith("no-prefetch"):
            settings["prefetch"] = False
    elif case == "unsigned-agent-shm-dotdot":
        # An agent without a key (today's deployments) still validates every path.
        _edit(ckpt, lambda d: d["shm_files"][0].update(name=f"../../..{planted}"), None)
        settings = {}
    criu = fake_criu(tmp_path, sec.factory.criu, "t")
    st, log = _refused(sec, criu, ckpt, f"tamper-{case}", **settings)
    assert st.last_fallback is not None
    assert st.last_fallback["reason"] == reason, st.raw
    assert not planted.exists()
    if case == "other-service-key":
        assert "another key" in st.last_fallback["message"], st.last_fallback
    if case == "tampered-pages":
        # CRIU restored the tree stopped; the mismatch was found before it ever ran.
        assert criu.restores() == 1
        assert "resumed" not in log
    else:
        assert criu.restores() == 0, criu.calls.read_text()


# -- a hanging CRIU, the watchdog, the good checkpoint -------------------------------
def test_a_hanging_criu_dump_is_killed_and_vllm_booted_again(sec: Sec, tmp_path: Path) -> None:
    """B restores the good checkpoint; then its CRIU hangs: the dump is killed after
    --dump-timeout and vLLM booted again (a tree CRIU let go of mid-dump is not trusted)."""
    sec.stop_a()
    f = sec.factory
    criu = fake_criu(tmp_path, f.criu, "b")
    b = f.start(
        name="sec-b",
        restore_from=str(sec.good),
        criu=str(criu.path),
        signing_key_file=str(sec.key1),
        checkpoint_root=str(sec.root),
        dump_timeout=5,
    )
    try:
        st = b.wait_ready(300)
        assert st.origin == "restored" and st.last_fallback is None, st.raw
        assert criu.restores() == 1
        assert completions(b) == sec.before
        criu.set("hang")
        target = sec.root / "hang"
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


def _hanging_criu_in(agent: AgentProc) -> list[int]:
    """PIDs of the fake CRIU's `sleep 3600` inside the agent's PID namespace."""
    ns = agent.namespace()
    out = []
    for pid in namespace_members(ns) if ns else []:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv[:2] == [b"sleep", b"3600"]:
            out.append(pid)
    return out


def test_watchdog_ends_a_stuck_checkpoint(sec: Sec, tmp_path: Path) -> None:
    sec.stop_a()
    f = sec.factory
    criu = fake_criu(tmp_path, f.criu, "c")
    c = f.start(
        name="sec-c",
        restore_from=str(sec.good),
        restore_policy="require",
        criu=str(criu.path),
        signing_key_file=str(sec.key1),
        checkpoint_root=str(sec.root),
        drain_timeout=2,
        checkpoint_timeout=8,
    )
    try:
        st = c.wait_ready(300)
        assert st.origin == "restored", st.raw
        criu.set("hang")
        target = sec.root / "stuck"
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
        assert c.namespace() is not None
        assert _hanging_criu_in(c) == []  # the hanging CRIU was killed
    finally:
        c.stop()


def test_signed_checkpoint_restores(sec: Sec) -> None:
    """The good one, untouched, restores with the key (the mmap restore, prefetch on)."""
    sec.stop_a()
    agent = sec.factory.start(
        name="sec-good",
        restore_from=str(sec.good),
        signing_key_file=str(sec.key1),
        checkpoint_root=str(sec.root),
    )
    try:
        st = agent.wait_ready(300)
        assert st.origin == "restored" and st.last_fallback is None, st.raw
        assert st.raw["restored_with_mmap"] is True, st.raw
        assert completions(agent) == sec.before
        assert "resumed" in agent.tail(400)
    finally:
        agent.stop()
