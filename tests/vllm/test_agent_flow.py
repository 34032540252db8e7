"""The agent against a real vLLM CPU server and real CRIU, each agent in a fresh PID+mount ns.

The session's tiny checkpoint (conftest's tiny_ckpt: one boot, checkpointed
under load) is restored in new namespaces with an empty /dev/shm, like new
pods. A bad checkpoint is refused with its exact reason by agents with
--restore-policy require (they go Failed at once instead of booting); one
bad checkpoint falls back to a real boot that serves, and that booted server
(started without the io_uring seccomp filter) then refuses a checkpoint.
"""

from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from rekindle_agent.checkpointing import criu
from rekindle_agent.mapped_files import immutable, mounts
from rekindle_contract import api
from rekindle_contract.api import AgentError

from tests.vllm.conftest import (
    PROMPTS,
    AgentFactory,
    AgentProc,
    TinyCheckpoint,
    edit_manifest,
    shadow_checkpoint,
)

pytestmark = [pytest.mark.vllm, pytest.mark.criu]


def completions(agent: AgentProc) -> list[str]:
    return [agent.complete(p) for p in PROMPTS]


def vllm_lines_with(agent: AgentProc, text: str, timeout: float = 30) -> list[str]:
    """The agent's output lines tagged as vLLM's that contain text (waits for them)."""
    deadline = time.monotonic() + timeout
    while True:
        lines = [ln for ln in agent.tail(100000).splitlines() if ln.startswith("[vllm] ")]
        found = [ln for ln in lines if text in ln]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


# -- the checkpoint the session's boot made under load --------------------------------------


def test_checkpoint_manifest_and_verification(tiny_ckpt: TinyCheckpoint) -> None:
    man = tiny_ckpt.manifest
    assert man["format"] == 1
    assert (tiny_ckpt.path / "verified").is_file()
    assert tiny_ckpt.path.stat().st_mode & 0o777 == 0o700
    paths = {f["path"] for f in man["files"]}
    assert any(p.startswith("images/pages-") for p in paths)
    assert any(p.startswith("shm/") for p in paths), "vLLM's /dev/shm files were not saved"
    assert man["fingerprint"]["model_digest"] and man["fingerprint"]["vllm"]
    assert man["criu"]["version"]
    assert man["timings"]["criu_dump"] > 0
    assert tiny_ckpt.status["timings"]["checkpoint"]["criu_dump"] > 0
    on_disk = json.loads((tiny_ckpt.path / "manifest.json").read_text())
    assert on_disk["verified"]["restore_seconds"]["total"] > 0
    # The canary: greedy tokens and logprobs of fixed prompts, recorded at the checkpoint and
    # compared by the proving restore (a phase of its own) before the proof was written.
    can = man["canary"]
    assert len(can["answers"]) == len(can["prompts"]) == 3, can
    for answer in can["answers"]:
        assert len(answer["tokens"]) == len(answer["logprobs"]) == can["max_tokens"], can
        assert all(math.isfinite(x) and x <= 0 for x in answer["logprobs"]), can
    assert on_disk["verified"]["restore_seconds"]["canary"] > 0
    # The verification restore serves the same greedy completions as before the dump.
    assert tiny_ckpt.after_verify == tiny_ckpt.before
    # ... and it copied the memory, so this pod can be checkpointed again.
    assert tiny_ckpt.status["restore_memory"]["path"] == "copy"
    assert tiny_ckpt.status["restore_memory"]["why"].startswith("proving a new checkpoint")


def test_checkpoint_records_the_trees_facts_and_protects_its_pages(
    tiny_ckpt: TinyCheckpoint,
) -> None:
    """What the restore's mmap decision reads: vLLM on glibc malloc, no userfaultfd."""
    facts = tiny_ckpt.manifest["mmap"]
    assert facts["allocators"] == [] and facts["userfaultfd_pids"] == []
    assert 100 < facts["max_vmas"] < facts["max_map_count"]
    assert facts["overcommit_memory"] in (0, 1)
    pages = sorted((tiny_ckpt.path / "images").glob("pages-*.img"))
    probe = tiny_ckpt.path.parent / "immutable-probe"
    probe.write_bytes(b"x")
    supported = immutable.set_immutable(probe)
    if supported:
        immutable.set_immutable(probe, False)
    probe.unlink()
    protection = tiny_ckpt.status["last_checkpoint"]["images_protection"]
    if supported:
        assert protection == "immutable"
        assert pages and all(immutable.is_immutable(p) for p in pages)
        with pytest.raises(PermissionError):  # root included
            pages[0].open("r+b")
    else:
        assert protection.startswith("read-only: ")


def test_no_request_lost_during_checkpoint(tiny_ckpt: TinyCheckpoint) -> None:
    outcomes = tiny_ckpt.outcomes
    sent, answered = tiny_ckpt.window
    errors = [o for o in outcomes if o.kind not in ("ok", "http 503")]
    assert not errors, errors[:5]
    refused = [o for o in outcomes if o.kind == "http 503"]
    assert refused, "no request arrived while draining: the test did not exercise refusal"
    assert all(o.value for o in refused), "a 503 without Retry-After"
    # Refused only while the checkpoint ran; every client served before it and after it.
    assert all(o.done >= sent and o.sent <= answered for o in refused), (sent, answered)
    workers = {o.worker for o in outcomes}
    assert {o.worker for o in outcomes if o.kind == "ok" and o.done < sent} == workers
    assert {o.worker for o in outcomes if o.kind == "ok" and o.sent > answered} == workers


# -- restores in new "pods" ------------------------------------------------------------------


@pytest.mark.parametrize("mmap_restore", ["auto", "off"])
def test_restore_in_new_namespace(
    tiny_ckpt: TinyCheckpoint, agent_factory: AgentFactory, mmap_restore: str
) -> None:
    """From one checkpoint: the mmap restore of the patched CRIU, then the copying one."""
    assert criu.probe(str(agent_factory.criu)).mmap_restore, "the patched CRIU maps"
    mapped = mmap_restore == "auto"
    settings: dict[str, Any] = {"mmap_restore": mmap_restore}
    if not mapped:
        settings["prefetch"] = False
    agent = agent_factory.start(
        name=f"restore-{mmap_restore}", restore_from=str(tiny_ckpt.path), **settings
    )
    try:
        st = agent.wait_ready(300)
        assert st.origin == "restored", (st.raw, agent.tail(100))
        assert st.last_fallback is None
        assert st.raw["restored_with_mmap"] is mapped
        # The checkpoint is read-only inside the "pod" (its own mount namespace).
        assert st.security["checkpoint_mount"] == "read-only", st.raw
        info = Path(f"/proc/{agent.proc.pid}/mountinfo")
        assert mounts.is_read_only_mount(tiny_ckpt.path, info)
        assert not mounts.is_read_only_mount(tiny_ckpt.path)  # the host's view is unchanged
        memory = st.raw["restore_memory"]
        if mapped:
            assert memory["path"] == "mmap", memory
            assert "no jemalloc/tcmalloc/mimalloc" in memory["why"], memory
        else:
            assert memory == {"path": "copy", "why": "--mmap-restore off"}, memory
        assert completions(agent) == tiny_ckpt.before
        if mapped:
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
    tiny_ckpt: TinyCheckpoint, agent_factory: AgentFactory, tmp_path: Path
) -> None:
    """A dumped tree that mapped jemalloc (as its facts say) is restored by copying."""
    assert criu.probe(str(agent_factory.criu)).mmap_restore, "the patched CRIU maps"
    ckpt = shadow_checkpoint(tiny_ckpt.path, tmp_path / "ckpt")
    edit_manifest(ckpt, lambda d: d["mmap"].update(allocators=["jemalloc"]))
    agent = agent_factory.start(name="nommap", restore_from=str(ckpt))
    try:
        st = agent.wait_ready(300)
        assert st.origin == "restored", (st.raw, agent.tail(50))
        assert st.raw["restored_with_mmap"] is False
        assert st.raw["restore_memory"]["path"] == "copy"
        assert "jemalloc" in st.raw["restore_memory"]["why"]
        assert completions(agent) == tiny_ckpt.before
    finally:
        agent.stop()


def test_checkpoint_of_a_restored_server(
    tiny_ckpt: TinyCheckpoint, agent_factory: AgentFactory
) -> None:
    """A restored (mmap-restored, with the patched CRIU) vLLM checkpoints again, self-contained."""
    first = tiny_ckpt.path
    agent = agent_factory.start(name="redump", restore_from=str(first))
    second = agent_factory.checkpoints / "redump"
    try:
        assert agent.wait_ready(300).raw["restored_with_mmap"] is True
        man = agent.client.checkpoint(str(second), timeout=900)
        assert man["fingerprint"] == tiny_ckpt.manifest["fingerprint"]
        assert completions(agent) == tiny_ckpt.before
    finally:
        agent.stop()
    try:
        # The new checkpoint must not lean on the first one's pages images: hide them.
        away = first.with_name(first.name + ".away")
        first.rename(away)
        try:
            agent = agent_factory.start(name="from-redump", restore_from=str(second))
            try:
                st = agent.wait_ready(300)
                assert st.origin == "restored" and st.checkpoint == str(second), st.raw
                assert completions(agent) == tiny_ckpt.before
            finally:
                agent.stop()
        finally:
            away.rename(first)
    finally:
        immutable.remove_tree(second)


def test_api_needs_token(tiny_ckpt: TinyCheckpoint, agent_factory: AgentFactory) -> None:
    agent = agent_factory.start(name="auth", restore_from=str(tiny_ckpt.path))
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


# -- bad checkpoints ---------------------------------------------------------------------------


def _smallest_pages(ckpt: Path) -> Path:
    pages = [p for p in (ckpt / "images").glob("pages-*.img") if p.stat().st_size > 0]
    return min(pages, key=lambda p: p.stat().st_size)


def _flip_a_byte(target: Path) -> None:
    """Replace a shadow copy's symlink by a private copy with one byte changed."""
    data = bytearray(target.read_bytes())  # resolves the symlink
    data[len(data) // 2] ^= 0xFF
    target.unlink()
    target.write_bytes(bytes(data))


def _corrupt_pages(ckpt: Path) -> None:
    _flip_a_byte(_smallest_pages(ckpt))


def _corrupt_weights(ckpt: Path) -> None:
    """Checked after the tree resumed (only the reload reads it): the running tree is killed."""
    _flip_a_byte(max((ckpt / "weights").glob("*.bin"), key=lambda p: p.stat().st_size))


def _remove_core(ckpt: Path) -> None:
    next(iter(sorted((ckpt / "images").glob("core-*.img")))).unlink()


def _other_vllm(ckpt: Path) -> None:
    def change(doc: dict[str, Any]) -> None:
        doc["fingerprint"]["vllm"] = "0.0.1"

    edit_manifest(ckpt, change)


def _other_canary(ckpt: Path) -> None:
    """What a restore that computes something else looks like to the agent: one logprob of
    the recorded canary differs by more than the tolerance (0.5 nats)."""

    def change(doc: dict[str, Any]) -> None:
        doc["canary"]["answers"][1]["logprobs"][0] -= 0.5

    edit_manifest(ckpt, change)


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (_corrupt_pages, "checksum_mismatch"),
        (_remove_core, "file_missing"),
        (_other_vllm, "fingerprint_mismatch"),
        (_other_canary, "canary_mismatch"),
    ],
)
def test_bad_checkpoint_is_refused_with_its_reason(
    tiny_ckpt: TinyCheckpoint,
    agent_factory: AgentFactory,
    tmp_path: Path,
    damage: Callable[[Path], None],
    reason: str,
) -> None:
    """--restore-policy require: the agent goes Failed with the reason instead of booting
    (what it would fall back to is test_bad_checkpoint_falls_back_to_a_boot_that_serves)."""
    ckpt = shadow_checkpoint(tiny_ckpt.path, tmp_path / "ckpt")
    damage(ckpt)
    agent = agent_factory.start(
        name=f"refused-{reason}", restore_from=str(ckpt), restore_policy="require"
    )
    try:
        st = agent.wait_state(("Failed", "Ready"), 300)
    finally:
        agent.stop()
    assert st.state == "Failed", (st.raw, agent.tail(50))
    assert st.last_fallback is not None and st.last_fallback["reason"] == reason, st.raw
    assert st.message.startswith(f"restore from {ckpt} failed"), st.message
    assert st.origin == "none" and st.raw["vllm_pid"] is None, st.raw  # nothing was booted


@dataclass
class Fallback:
    """A bad checkpoint's agent: what it said after falling back, then after a checkpoint."""

    status: dict[str, Any]
    served: list[str]
    refusal: AgentError
    status_after: dict[str, Any]
    served_after: list[str]
    target: Path


def _io_uring_enabled() -> None:
    mode = Path("/proc/sys/kernel/io_uring_disabled")
    if mode.exists() and mode.read_text().strip() != "0":
        pytest.fail(
            f"kernel.io_uring_disabled={mode.read_text().strip()}: uvloop cannot open io_uring, "
            "so the agent's refusal of a tree that holds one cannot be shown; "
            "run with `sysctl kernel.io_uring_disabled=0`"
        )


@pytest.fixture(scope="module")
def fallback(
    tiny_ckpt: TinyCheckpoint, agent_factory: AgentFactory, tmp_path_factory: pytest.TempPathFactory
) -> Fallback:
    """The weight dump is checked after the tree resumed: the restored tree is killed and
    vLLM boots (the one real fallback boot). The agent runs without the io_uring seccomp
    filter, so the booted vLLM's uvloop opens io_uring, and a checkpoint is then refused."""
    _io_uring_enabled()
    ckpt = shadow_checkpoint(tiny_ckpt.path, tmp_path_factory.mktemp("fallback") / "ckpt")
    _corrupt_weights(ckpt)
    target = agent_factory.checkpoints / "refused"
    agent = agent_factory.start(name="fallback", restore_from=str(ckpt), seccomp_io_uring=False)
    try:
        st = agent.wait_ready(600)
        served = completions(agent)
        with pytest.raises(AgentError) as e:
            agent.client.checkpoint(str(target), timeout=600)
        after = agent.wait_ready(60)
        return Fallback(st.raw, served, e.value, after.raw, completions(agent), target)
    except BaseException:
        print(agent.tail(200))
        raise
    finally:
        agent.stop()


def test_bad_checkpoint_falls_back_to_a_boot_that_serves(
    fallback: Fallback, tiny_ckpt: TinyCheckpoint
) -> None:
    st = fallback.status
    assert st["origin"] == "booted", st
    assert st["last_fallback"] is not None, st
    assert st["last_fallback"]["reason"] == "checksum_mismatch", st
    assert fallback.served == tiny_ckpt.before


def test_failed_checkpoint_keeps_serving(fallback: Fallback, tiny_ckpt: TinyCheckpoint) -> None:
    """Without the seccomp filter uvloop opens io_uring: the checkpoint must refuse with the
    fix named, put the released weights back, and keep serving the same completions."""
    e = fallback.refusal
    assert e.status == 500
    assert "io_uring" in e.body and "seccomp" in e.body
    assert json.loads(e.body)["reason"] == "io_uring", e.body
    st = fallback.status_after
    assert st["origin"] == "booted" and st["last_checkpoint"]["ok"] is False, st
    assert st["last_checkpoint"]["reason"] == "io_uring", st
    assert st["vllm_pid"] == fallback.status["vllm_pid"], st  # the same tree, no reboot
    assert fallback.served_after == tiny_ckpt.before
    assert not (fallback.target / "manifest.json").exists()
