"""Status computation and the Events its transitions produce."""

from __future__ import annotations

from typing import Any

from rekindle_contract.api import StatusReply
from rekindle_operator.status import (
    Observed,
    PodBoot,
    compute_status,
    pod_boot,
    set_condition,
    transitions,
)


def obs(
    replicas: int = 1,
    checkpoint_path: str | None = None,
    ready: int = 1,
    dep_replicas: int = 1,
    pods: tuple[PodBoot, ...] = (),
    checkpoint: str | None = None,
    shm_error: str | None = None,
    dep: bool = True,
) -> Observed:
    return Observed(
        spec_replicas=replicas,
        deployment={"status": {"replicas": dep_replicas, "readyReplicas": ready}} if dep else None,
        pods=pods,
        checkpoint=checkpoint,
        shm_bytes=1216 * 2**20,
        shm_need={"totalBytes": 1216 * 2**20},
        shm_error=shm_error,
        selector="rekindle.dev/inferenceservice=tiny",
        endpoint="http://tiny.ns.svc:8000/v1",
        checkpoint_path=checkpoint_path,
    )


def cond(st: dict[str, Any], t: str) -> dict[str, Any]:
    return next(c for c in st["conditions"] if c["type"] == t)


def test_ready_phase_and_replica_counts() -> None:
    st = compute_status({}, obs(replicas=2, ready=1, dep_replicas=2))
    assert st["phase"] == "Degraded"
    assert st["replicas"] == 2 and st["readyReplicas"] == 1
    assert st["selector"] == "rekindle.dev/inferenceservice=tiny"
    st = compute_status({}, obs(replicas=2, ready=2, dep_replicas=2))
    assert st["phase"] == "Ready" and cond(st, "Ready")["status"] == "True"


def test_scale_to_zero_and_pending() -> None:
    st = compute_status({}, obs(replicas=0, ready=0, dep_replicas=0))
    assert st["phase"] == "ScaledToZero"
    assert cond(st, "Ready")["reason"] == "ScaledToZero"
    assert compute_status({}, obs(dep=False))["phase"] == "Pending"


def test_replicas_counts_all_not_only_ready() -> None:
    st = compute_status({}, obs(replicas=3, ready=0, dep_replicas=3))
    assert st["replicas"] == 3 and st["readyReplicas"] == 0
    assert st["phase"] == "Progressing"


def test_shm_error_fails_with_message() -> None:
    st = compute_status({}, obs(shm_error="too small: need 1216Mi"))
    assert st["phase"] == "Failed"
    c = cond(st, "SharedMemorySized")
    assert c["status"] == "False" and "1216Mi" in c["message"]


def test_restored_condition_and_cold_start_by_path() -> None:
    pods = (
        PodBoot("a", True, "restored", "", "/c/x", 4.0),
        PodBoot("b", True, "booted", "checksum_mismatch: pages-1.img", None, 41.0),
    )
    st = compute_status({"lastColdStartSeconds": {"restored": 9.9}}, obs(pods=pods, checkpoint="x"))
    c = cond(st, "Restored")
    assert c["status"] == "False" and "checksum_mismatch" in c["message"]
    assert st["lastColdStartSeconds"] == {"restored": 4.0, "booted": 41.0}
    assert cond(st, "CheckpointReady")["status"] == "True"
    assert [p["origin"] for p in st["pods"]] == ["restored", "booted"]


def test_pod_boot_from_agent_reply() -> None:
    p = {
        "metadata": {"name": "p", "creationTimestamp": "2026-01-01T00:00:00Z"},
        "status": {
            "conditions": [
                {"type": "Ready", "status": "True", "lastTransitionTime": "2026-01-01T00:00:05Z"}
            ]
        },
    }
    restored = pod_boot(
        p,
        StatusReply.from_json(
            {
                "state": "Ready",
                "origin": "restored",
                "checkpoint": "/c/x",
                "started_at": 1000.0,
                "ready_at": 1002.25,
                "restore_memory": {"path": "copy", "why": "the tree maps jemalloc"},
                "timings": {"restore": {"criu_restore": 0.61234, "reload_weights": 0.2}},
            }
        ),
        None,
    )
    assert restored.origin == "restored" and restored.reason == ""
    assert restored.restore_seconds == {"criu_restore": 0.612, "reload_weights": 0.2}
    assert (restored.memory, restored.memory_reason) == ("copy", "the tree maps jemalloc")
    assert restored.cold_start_seconds == 5.0
    assert restored.agent_ready_seconds == 2.25
    booted = pod_boot(
        p,
        StatusReply.from_json(
            {
                "state": "Ready",
                "origin": "booted",
                "last_fallback": {"reason": "file_missing", "message": "pages-1.img"},
            }
        ),
        None,
    )
    assert booted.reason == "file_missing: pages-1.img"
    assert booted.memory == ""  # only a restored pod says how its memory came back
    assert booted.restore_seconds is None
    assert booted.agent_ready_seconds is None  # an agent that does not say when
    unknown = pod_boot(p, None, "connection refused")
    assert unknown.origin == "unknown" and "refused" in unknown.reason
    booting = pod_boot(
        p, StatusReply.from_json({"state": "Restoring", "message": "prefetching"}), None
    )
    assert booting.origin == "unknown" and booting.reason == "agent is Restoring: prefetching"


def test_the_cold_start_path_says_whether_the_node_pulled_the_checkpoint_first() -> None:
    pod = {"metadata": {"name": "p"}, "spec": {"nodeName": "gpu-7"}, "status": {}}

    def path(reply: dict[str, Any]) -> tuple[str, str]:
        boot = pod_boot(pod, StatusReply.from_json({"state": "Ready", **reply}), None)
        return boot.node, boot.path

    pulled = {"restore": {"pull": 3.2, "criu_restore": 1.0}}
    assert path({"origin": "restored", "timings": pulled}) == ("gpu-7", "restoreAfterPull")
    assert path({"origin": "restored", "timings": {"restore": {"criu_restore": 1.0}}}) == (
        "gpu-7",
        "restore",
    )
    assert path({"origin": "booted"}) == ("gpu-7", "boot")
    assert pod_boot(pod, None, "refused").path == ""


def test_per_node_status_says_where_the_checkpoint_is_and_how_replicas_came_up() -> None:
    ck = "/var/lib/rekindle/checkpoints/c1-0123"
    warm = {"residentPercent": 97.5, "residentBytes": 1, "bytes": 1}
    pods = (
        PodBoot("a", True, "restored", "", ck, 4.0, page_cache=warm, node="n1", path="restore"),
        PodBoot("b", True, "restored", "", ck, 9.0, node="n2", path="restoreAfterPull"),
        PodBoot("c", True, "booted", "store_unreachable: x", None, 41.0, node="n3", path="boot"),
        PodBoot("d", False, "unknown", "agent is Restoring", None, None, node="n1"),
        PodBoot("e", True, "restored", "", "/old/c0", 5.0, node="n3", path="restore"),
    )
    st = compute_status({}, obs(pods=pods, checkpoint="c1", checkpoint_path=ck, dep_replicas=5))
    assert st["nodes"] == [
        {
            "name": "n1",
            "replicas": 2,
            "ready": 1,
            "checkpointCached": True,
            "residentPercent": 97.5,
            "coldStartSeconds": {"restore": 4.0},
        },
        {
            "name": "n2",
            "replicas": 1,
            "ready": 1,
            "checkpointCached": True,
            "coldStartSeconds": {"restoreAfterPull": 9.0},
        },
        # Restored from an older checkpoint: the current one is not proven there.
        {
            "name": "n3",
            "replicas": 2,
            "ready": 2,
            "checkpointCached": False,
            "coldStartSeconds": {"boot": 41.0, "restore": 5.0},
        },
    ]
    assert st["lastColdStartSeconds"]["restoredAfterPull"] == 9.0
    assert [p.get("coldStartPath") for p in st["pods"]] == [
        "restore",
        "restoreAfterPull",
        "boot",
        None,
        "restore",
    ]


def test_agent_ready_seconds_recorded_on_the_pod_win() -> None:
    p = {"metadata": {"name": "p", "annotations": {"rekindle.dev/agent-ready-seconds": "4.000"}}}
    later = StatusReply.from_json(
        {"state": "Ready", "origin": "booted", "started_at": 1.0, "ready_at": 500.0}
    )
    assert pod_boot(p, later, None).agent_ready_seconds == 4.0
    after_checkpoint = StatusReply.from_json(
        {
            "state": "Ready",
            "origin": "booted",
            "started_at": 1.0,
            "ready_at": 500.0,
            "last_checkpoint": {"dir": "/c", "ok": True},
        }
    )
    assert pod_boot({"metadata": {"name": "p"}}, after_checkpoint, None).agent_ready_seconds is None


def test_condition_time_moves_only_on_flip() -> None:
    c1 = set_condition([], "Ready", True, "R", "m")
    c1[0]["lastTransitionTime"] = "2000-01-01T00:00:00Z"
    c2 = set_condition(c1, "Ready", True, "R", "m2")
    assert c2[0]["lastTransitionTime"] == "2000-01-01T00:00:00Z"
    c3 = set_condition(c2, "Ready", False, "X", "m3")
    assert c3[0]["lastTransitionTime"] != "2000-01-01T00:00:00Z"


def test_transitions_emit_events_once() -> None:
    old = compute_status({}, obs(replicas=1, ready=0))
    new = compute_status(old, obs(replicas=1, ready=1))
    ev = transitions(old, new)
    reasons = [r for _, r, _ in ev]
    assert "PhaseReady" in reasons and "ReadyReplicasReady" in reasons
    assert transitions(new, compute_status(new, obs(replicas=1, ready=1))) == []


def test_event_kinds_first_sight_is_normal_but_shm_shortfall_warns() -> None:
    first = compute_status({}, obs(replicas=1, ready=0))
    kinds = {r: k for k, r, _ in transitions({}, first)}
    assert kinds["ReadyNoReadyReplica"] == "Normal"
    lost = compute_status(compute_status({}, obs(ready=1)), obs(ready=0))
    assert ("Warning", "ReadyNoReadyReplica") in [
        (k, r) for k, r, _ in transitions(compute_status({}, obs(ready=1)), lost)
    ]
    bad = compute_status({}, obs(shm_error="too small"))
    assert ("Warning", "SharedMemorySizedBelowNeed") in [(k, r) for k, r, _ in transitions({}, bad)]


def test_what_an_agent_says_is_bounded_in_status() -> None:
    """A pod's answer goes into status clipped: it is not trusted to be small."""
    from rekindle_operator.status import MAX_AGENT_TEXT

    p = {"metadata": {"name": "p"}, "status": {"conditions": []}}
    huge = "x" * 100_000
    boot = pod_boot(
        p,
        StatusReply.from_json(
            {
                "state": "Ready",
                "origin": "booted",
                "checkpoint": huge,
                "last_fallback": {"reason": "file_missing", "message": huge},
            }
        ),
        None,
    )
    assert len(boot.reason) == MAX_AGENT_TEXT and boot.reason.endswith("…")
    assert boot.reason.startswith("file_missing: xxx")
    assert boot.checkpoint is not None and len(boot.checkpoint) == MAX_AGENT_TEXT
    waiting = pod_boot(p, StatusReply.from_json({"state": "Restoring", "message": huge}), None)
    assert len(waiting.reason) == MAX_AGENT_TEXT


def test_a_manifests_phase_timings_are_bounded() -> None:
    from rekindle_operator.checkpointing import MAX_PHASES, manifest_summary

    timings = {f"phase-{i}-" + "y" * 500: float(i) for i in range(1000)}
    got = manifest_summary({"files": [], "timings": timings})["phaseSeconds"]
    assert len(got) == MAX_PHASES and all(len(k) <= 64 for k in got)


def test_a_pod_restored_by_copying_after_a_mapped_restore_died_is_an_event_once() -> None:
    why = (
        "the node agent copies this checkpoint's memory: a replica (ns/tiny-a) died after "
        "a mapped restore: vLLM exited (killed by SIGBUS)"
    )
    pod = {"name": "tiny-b", "ready": True, "origin": "restored", "memory": "copy",
           "memoryReason": why}  # fmt: skip
    events = transitions({"pods": []}, {"pods": [pod]})
    assert events == [("Warning", "MappedRestoreOff", f"pod tiny-b: {why}")]
    assert transitions({"pods": [pod]}, {"pods": [pod]}) == []
    mapped = {**pod, "memory": "mmap", "memoryReason": "no jemalloc"}
    assert transitions({"pods": []}, {"pods": [mapped]}) == []


def test_checkpoint_status_records_the_weights_and_the_gpu_memory_left() -> None:
    from rekindle_operator.checkpointing import manifest_summary

    files = [
        {"path": "images/pages-1.img", "size": 100},
        {"path": "weights/tensors.bin", "size": 4000},
        {"path": "weights/index.json", "size": 96},
    ]
    weights = {"released": True, "dir": "weights", "gpu_memory_after_release_bytes": 7 << 20}
    got = manifest_summary({"files": files, "timings": {}, "weights": weights})
    assert got["weightsBytes"] == 4096 and got["gpuMemoryAfterSleepBytes"] == 7 << 20
    # not released (weights in the image): no weight dump to reload; CPU: no GPU figure
    cpu = manifest_summary({"files": files, "weights": {"released": False, "dir": "weights"}})
    assert "weightsBytes" not in cpu and "gpuMemoryAfterSleepBytes" not in cpu
