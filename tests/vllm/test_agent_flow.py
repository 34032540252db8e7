"""The agent against a real vLLM CPU server and real CRIU, each agent in a fresh PID+mount ns.

One boot makes the checkpoint (under load), shared by the module; restores
then run in new namespaces with an empty /dev/shm, like new pods.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rekindle_agent import criu, immutable, mounts
from rekindle_contract import api
from rekindle_contract.api import AgentError

from tests.vllm.conftest import (
    PROMPTS,
    AgentFactory,
    AgentProc,
    edit_manifest,
    shadow_checkpoint,
)

pytestmark = [pytest.mark.vllm, pytest.mark.criu]


def completions(agent: AgentProc) -> list[str]:
    return [agent.complete(p) for p in PROMPTS]


def vllm_lines_with(agent: AgentProc, text: str, timeout: float = 10) -> list[str]:
    """The agent's output lines tagged as vLLM's that contain text (waits for them)."""
    deadline = time.monotonic() + timeout
    while True:
        lines = [ln for ln in agent.tail(100000).splitlines() if ln.startswith("[vllm] ")]
        found = [ln for ln in lines if text in ln]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


class Shared:
    ckpt: Path
    manifest: dict[str, Any]
    before: list[str]
    after_verify: list[str]
    outcomes: list[tuple[str, Any]]
    refused_headers: list[str]
    status: dict[str, Any]  # the booted agent's status after its checkpoint


def _load(agent: AgentProc, stop: threading.Event, outcomes: list[tuple[str, Any]], i: int) -> None:
    """Keep sending requests until told to stop; record each outcome."""
    n = 0
    while not stop.is_set():
        n += 1
        try:
            text = agent.complete(f"The river {i} {n}", max_tokens=24, stream=(n % 2 == 0))
            outcomes.append(("ok", text))
        except urllib.error.HTTPError as e:
            outcomes.append((f"http {e.code}", e.headers.get("Retry-After")))
            time.sleep(0.2)
        except Exception as e:
            outcomes.append(("error", repr(e)))


@pytest.fixture(scope="module")
def shared(agent_factory: AgentFactory) -> Iterator[Shared]:
    s = Shared()
    agent = agent_factory.start(name="boot")
    try:
        st = agent.wait_ready(600)
        assert st.origin == "booted"
        s.before = completions(agent)
        stop = threading.Event()
        s.outcomes = []
        workers = [
            threading.Thread(target=_load, args=(agent, stop, s.outcomes, i)) for i in range(3)
        ]
        for w in workers:
            w.start()
        time.sleep(1.5)  # requests are in flight when the checkpoint starts
        s.ckpt = agent_factory.checkpoints / "c1"
        s.manifest = dict(agent.client.checkpoint(str(s.ckpt), timeout=900))
        time.sleep(1.0)
        stop.set()
        for w in workers:
            w.join(180)
        st = agent.wait_ready(60)
        assert st.origin == "restored", st.raw
        assert st.timings["checkpoint"]["criu_dump"] > 0
        s.status = st.raw
        s.after_verify = completions(agent)
    except BaseException:
        print(agent.tail(200))
        raise
    finally:
        agent.stop()
    yield s


def test_checkpoint_manifest_and_verification(shared: Shared) -> None:
    man = shared.manifest
    assert man["format"] == 1
    assert (shared.ckpt / "verified").is_file()
    assert shared.ckpt.stat().st_mode & 0o777 == 0o700
    paths = {f["path"] for f in man["files"]}
    assert any(p.startswith("images/pages-") for p in paths)
    assert any(p.startswith("shm/") for p in paths), "vLLM's /dev/shm files were not saved"
    assert man["fingerprint"]["model_digest"] and man["fingerprint"]["vllm"]
    assert man["criu"]["version"]
    assert man["timings"]["criu_dump"] > 0
    on_disk = json.loads((shared.ckpt / "manifest.json").read_text())
    assert on_disk["verified"]["restore_seconds"]["total"] > 0
    # The verification restore serves the same greedy completions as before the dump.
    assert shared.after_verify == shared.before
    # ... and it copied the memory, so this pod can be checkpointed again.
    assert shared.status["restore_memory"]["path"] == "copy"
    assert shared.status["restore_memory"]["why"].startswith("proving a new checkpoint")


def test_checkpoint_records_the_trees_facts_and_protects_its_pages(shared: Shared) -> None:
    """What the restore's mmap decision reads: vLLM on glibc malloc, no userfaultfd."""
    facts = shared.manifest["mmap"]
    assert facts["allocators"] == [] and facts["userfaultfd_pids"] == []
    assert 100 < facts["max_vmas"] < facts["max_map_count"]
    assert facts["overcommit_memory"] in (0, 1)
    pages = sorted((shared.ckpt / "images").glob("pages-*.img"))
    probe = shared.ckpt.parent / "immutable-probe"
    probe.write_bytes(b"x")
    supported = immutable.set_immutable(probe)
    if supported:
        immutable.set_immutable(probe, False)
    protection = shared.status["last_checkpoint"]["images_protection"]
    if supported:
        assert protection == "immutable"
        assert pages and all(immutable.is_immutable(p) for p in pages)
        with pytest.raises(PermissionError):  # root included
            pages[0].open("r+b")
    else:
        assert protection.startswith("read-only: ")


def test_no_request_lost_during_checkpoint(shared: Shared) -> None:
    kinds = {k for k, _ in shared.outcomes}
    errors = [o for o in shared.outcomes if o[0] not in ("ok", "http 503")]
    assert not errors, errors[:5]
    assert "ok" in kinds
    refused = [v for k, v in shared.outcomes if k == "http 503"]
    assert refused, "no request arrived while draining: the test did not exercise refusal"
    assert all(r for r in refused), "a 503 without Retry-After"


def test_restore_in_new_namespace_twice(shared: Shared, agent_factory: AgentFactory) -> None:
    """Twice from one checkpoint: the mmap restore (if this CRIU has it), then the copying one."""
    has_mmap = criu.probe(str(agent_factory.criu)).mmap_restore
    variants: list[dict[str, Any]] = [
        {"mmap_restore": "auto"},
        {"mmap_restore": "off", "prefetch": False},
    ]
    for attempt, settings in enumerate(variants):
        agent = agent_factory.start(
            name=f"restore{attempt}", checkpoint=str(shared.ckpt), **settings
        )
        try:
            st = agent.wait_ready(300)
            assert st.origin == "restored", (st.raw, agent.tail(100))
            assert st.last_fallback is None
            assert st.raw["restored_with_mmap"] == (has_mmap and attempt == 0)
            # The checkpoint is read-only inside the "pod" (its own mount namespace).
            assert st.security["checkpoint_mount"] == "read-only", st.raw
            assert mounts.is_read_only_mount(shared.ckpt, Path(f"/proc/{agent.proc.pid}/mountinfo"))
            assert not mounts.is_read_only_mount(shared.ckpt)  # the host's view is unchanged
            memory = st.raw["restore_memory"]
            assert memory["path"] == ("mmap" if st.raw["restored_with_mmap"] else "copy")
            if attempt == 1:
                assert memory["why"] == "--mmap-restore off"
            elif has_mmap:
                assert "no jemalloc/tcmalloc/mimalloc" in memory["why"], memory
            assert completions(agent) == shared.before
            if attempt == 0:
                # The restored tree still writes to vLLM's log (CRIU reopened it) and the
                # agent passes it on: vLLM's own request lines, tagged, on its stdout.
                assert vllm_lines_with(agent, "/v1/completions"), agent.tail(40)
            restore = st.timings["restore"]
            assert restore["criu_restore"] > 0 and restore["total"] > 0
            # The pod-level cold start the operator's bench reports, from the agent's clock.
            start_to_ready = st.start_to_ready_seconds()
            assert start_to_ready is not None and start_to_ready >= restore["total"]
        finally:
            agent.stop()


def test_mmap_refused_for_a_tree_that_needs_anonymous_memory(
    shared: Shared, agent_factory: AgentFactory, tmp_path: Path
) -> None:
    """A dumped tree that mapped jemalloc (as its facts say) is restored by copying."""
    if not criu.probe(str(agent_factory.criu)).mmap_restore:
        pytest.skip("this CRIU has no --mmap-restore")
    ckpt = shadow_checkpoint(shared.ckpt, tmp_path / "ckpt")
    edit_manifest(ckpt, lambda d: d["mmap"].update(allocators=["jemalloc"]))
    agent = agent_factory.start(name="nommap", checkpoint=str(ckpt))
    try:
        st = agent.wait_ready(300)
        assert st.origin == "restored", (st.raw, agent.tail(50))
        assert not st.raw["restored_with_mmap"]
        assert st.raw["restore_memory"]["path"] == "copy"
        assert "jemalloc" in st.raw["restore_memory"]["why"]
        assert completions(agent) == shared.before
    finally:
        agent.stop()


def test_checkpoint_of_a_restored_server(shared: Shared, agent_factory: AgentFactory) -> None:
    """A restored (mmap-restored, with the patched CRIU) vLLM checkpoints again, self-contained."""
    agent = agent_factory.start(name="redump", checkpoint=str(shared.ckpt))
    second = agent_factory.checkpoints / "c2"
    try:
        agent.wait_ready(300)
        man = agent.client.checkpoint(str(second), timeout=900)
        assert man["fingerprint"] == shared.manifest["fingerprint"]
        assert completions(agent) == shared.before
    finally:
        agent.stop()
    # The new checkpoint must not lean on the first one's pages images: hide them.
    away = shared.ckpt.with_name(shared.ckpt.name + ".away")
    shared.ckpt.rename(away)
    try:
        agent = agent_factory.start(name="from-redump", checkpoint=str(second))
        try:
            st = agent.wait_ready(300)
            assert st.origin == "restored" and st.checkpoint == str(second), st.raw
            assert completions(agent) == shared.before
        finally:
            agent.stop()
    finally:
        away.rename(shared.ckpt)


def test_api_needs_token(shared: Shared, agent_factory: AgentFactory) -> None:
    agent = agent_factory.start(name="auth", checkpoint=str(shared.ckpt))
    try:
        agent.wait_ready(300)
        for path, method, body in (
            (api.PATH_STATUS, "GET", None),
            (api.PATH_CHECKPOINT, "POST", b'{"dir": "/x"}'),
            (api.PATH_METRICS, "GET", None),
        ):
            req = urllib.request.Request(agent.admin_url + path, data=body, method=method)
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(req, timeout=10)
            assert e.value.code == 401
            req.add_header("Authorization", "Bearer wrong-token-wrong-token")
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(req, timeout=10)
            assert e.value.code == 401
        with urllib.request.urlopen(agent.admin_url + api.PATH_READYZ, timeout=10) as r:
            assert r.status == 200
        req = urllib.request.Request(
            agent.admin_url + api.PATH_METRICS, headers={"Authorization": f"Bearer {agent.token}"}
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            text = r.read().decode()
        assert 'rekindle_restore_phase_seconds_count{phase="criu_restore"} 1.0' in text
        assert 'rekindle_state{state="Ready"} 1.0' in text
        # vLLM's own families come through (it listens on loopback only), its
        # process_/python_ ones do not (they would clash with the agent's).
        assert "\n# TYPE vllm:num_requests_running gauge\n" in text
        assert "process_cpu_seconds_total" not in text
    finally:
        agent.stop()


def _smallest_pages(ckpt: Path) -> Path:
    pages = [p for p in (ckpt / "images").glob("pages-*.img") if p.stat().st_size > 0]
    return min(pages, key=lambda p: p.stat().st_size)


def _corrupt_pages(ckpt: Path) -> None:
    target = _smallest_pages(ckpt)
    data = bytearray(target.read_bytes())  # resolves the symlink: a private copy
    data[len(data) // 2] ^= 0xFF
    target.unlink()
    target.write_bytes(bytes(data))


def _corrupt_weights(ckpt: Path) -> None:
    """Checked after the tree resumed (only the reload reads it): the running tree is killed."""
    target = max((ckpt / "weights").glob("*.bin"), key=lambda p: p.stat().st_size)
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.unlink()
    target.write_bytes(bytes(data))


def _remove_core(ckpt: Path) -> None:
    next(iter(sorted((ckpt / "images").glob("core-*.img")))).unlink()


def _other_vllm(ckpt: Path) -> None:
    def change(doc: dict[str, Any]) -> None:
        doc["fingerprint"]["vllm"] = "0.0.1"

    edit_manifest(ckpt, change)


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (_corrupt_pages, "checksum_mismatch"),
        (_corrupt_weights, "checksum_mismatch"),
        (_remove_core, "file_missing"),
        (_other_vllm, "fingerprint_mismatch"),
    ],
)
def test_bad_checkpoint_falls_back_to_boot(
    shared: Shared, agent_factory: AgentFactory, tmp_path: Path, damage: Any, reason: str
) -> None:
    ckpt = shadow_checkpoint(shared.ckpt, tmp_path / "ckpt")
    damage(ckpt)
    agent = agent_factory.start(name=f"fallback-{reason}", checkpoint=str(ckpt))
    try:
        st = agent.wait_ready(600)
        assert st.origin == "booted", st.raw
        assert st.last_fallback is not None and st.last_fallback["reason"] == reason, st.raw
        assert completions(agent) == shared.before
    finally:
        agent.stop()


def test_failed_checkpoint_keeps_serving(shared: Shared, agent_factory: AgentFactory) -> None:
    """Without the seccomp filter uvloop opens io_uring: the checkpoint must refuse with the
    fix named, put the released weights back, and keep serving the same completions."""
    agent = agent_factory.start(name="no-seccomp", seccomp_io_uring=False)
    target = agent_factory.checkpoints / "refused"
    try:
        agent.wait_ready(600)
        with pytest.raises(AgentError) as e:
            agent.client.checkpoint(str(target), timeout=600)
        assert e.value.status == 500
        assert "io_uring" in e.value.body and "seccomp" in e.value.body
        st = agent.wait_ready(60)
        assert st.origin == "booted" and st.raw["last_checkpoint"]["ok"] is False
        assert completions(agent) == shared.before
        assert not (target / "manifest.json").exists()
    finally:
        agent.stop()
