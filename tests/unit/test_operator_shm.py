"""The /dev/shm formula: each term follows the spec, and the total covers them all."""

from __future__ import annotations

from rekindle_operator import shm_sizing as shm
from rekindle_operator.quantity import GiB, MiB
from rekindle_operator.spec import parse_spec


def spec(**over: object) -> object:
    base: dict[str, object] = {"model": {"source": "/m"}, "runtime": {"device": "cpu"}}
    base.update(over)
    return parse_spec("s", "ns", base)


def test_cpu_tp1_has_message_queues_and_default_mm_cache() -> None:
    need = shm.shm_need(spec())  # type: ignore[arg-type]
    assert need.message_queues == 160 * MiB + 240 * MiB + 24 * MiB
    assert need.multimodal_cache == 4 * GiB + 32
    assert need.kv_offload == 0 and need.nccl == 0
    parts = need.message_queues + need.multimodal_cache + need.headroom
    assert need.total == parts
    assert need.total % (64 * MiB) == 0
    assert need.headroom >= shm.HEADROOM_MIN


def test_gpu_tp1_uses_uniproc_executor_no_queues() -> None:
    s = spec(runtime={"device": "gpu"}, resources={"gpus": 1})
    need = shm.shm_need(s)  # type: ignore[arg-type]
    assert need.message_queues == 0
    assert need.nccl == 0


def test_gpu_tp4_adds_worker_queues_and_nccl_per_rank() -> None:
    s = spec(runtime={"device": "gpu"}, resources={"gpus": 4}, tensorParallelSize=4)
    need = shm.shm_need(s)  # type: ignore[arg-type]
    assert need.message_queues == 160 * MiB + 4 * 240 * MiB + 24 * MiB
    assert need.nccl == 4 * shm.NCCL_PER_RANK


def test_mm_cache_off_and_kv_offload_on() -> None:
    s = spec(
        runtime={"device": "gpu"},
        resources={"gpus": 1},
        multimodal={"shmCache": False},
        kvCache={"cpuOffloadSize": "8Gi"},
    )
    need = shm.shm_need(s)  # type: ignore[arg-type]
    assert need.multimodal_cache == 0
    assert need.kv_offload == 8 * GiB
    # 10% headroom once the subtotal is large
    assert need.headroom >= int((need.message_queues + need.kv_offload) * 0.10)


def test_need_grows_with_every_input() -> None:
    small = shm.shm_need(spec(multimodal={"cacheSize": "512Mi"}))  # type: ignore[arg-type]
    bigger = shm.shm_need(spec(multimodal={"cacheSize": "2Gi"}))  # type: ignore[arg-type]
    assert bigger.total > small.total
    assert bigger.total - small.total >= (2 * GiB - 512 * MiB) - 64 * MiB


def test_as_status_keys() -> None:
    st = shm.shm_need(spec()).as_status()  # type: ignore[arg-type]
    assert st["totalBytes"] == sum(v for k, v in st.items() if k != "totalBytes")


def test_explicit_size_below_the_need_is_refused_with_the_number() -> None:
    s = spec(multimodal={"cacheSize": "512Mi"}, sharedMemory={"size": "600Mi"})
    need = shm.shm_need(s)  # type: ignore[arg-type]
    msg = shm.shm_shortfall(s, need)  # type: ignore[arg-type]
    assert msg is not None
    assert f"{need.total // 2**20}Mi" in msg and "600Mi" in msg
    assert shm.effective_shm_bytes(s, need) == 600 * MiB  # type: ignore[arg-type]


def test_memory_request_counts_dev_shm_but_not_an_undecided_cache() -> None:
    declared = spec(multimodal={"enabled": True})
    need = shm.shm_need(declared)  # type: ignore[arg-type]
    assert shm.memory_request_bytes(declared, need.total) == 8 * GiB + need.total  # type: ignore[arg-type]
    auto = spec()  # enabled unset: the agent decides, the limit makes room, the request not
    need = shm.shm_need(auto)  # type: ignore[arg-type]
    assert shm.memory_request_bytes(auto, need.total) == (  # type: ignore[arg-type]
        8 * GiB + need.total - need.multimodal_cache
    )
    text = spec(multimodal={"enabled": False})
    need = shm.shm_need(text)  # type: ignore[arg-type]
    assert need.multimodal_cache == 0
    assert shm.memory_request_bytes(text, need.total) == 8 * GiB + need.total  # type: ignore[arg-type]


def test_no_explicit_size_means_the_need() -> None:
    s = spec()
    need = shm.shm_need(s)  # type: ignore[arg-type]
    assert shm.shm_shortfall(s, need) is None  # type: ignore[arg-type]
    assert shm.effective_shm_bytes(s, need) == need.total  # type: ignore[arg-type]
    assert shm.memory_limit_bytes(s, need.total) == 8 * GiB + need.total  # type: ignore[arg-type]
