"""How big /dev/shm must be for what vLLM will put there (one pure function).

Kubernetes gives a container 64 MiB of /dev/shm; vLLM needs far more and finds
out late (tmpfs allocates lazily: an undersized multimodal cache is a SIGBUS
under load, not an error at start). The operator sizes a memory-backed emptyDir
with this formula and adds the same amount to the pod's memory limit, because
tmpfs pages count against the container's memory cgroup.

need = message_queues + multimodal_cache + kv_offload + nccl + headroom

- message_queues: vLLM's multiprocess executor keeps shared-memory ring buffers:
  the RPC broadcast queue (VLLM_MQ_MAX_CHUNK_BYTES_MB=16 MiB x 10 chunks =
  160 MiB), one response queue per worker (24 MiB x 10 = 240 MiB each) and one
  broadcaster per TP group (4 MiB x 6 = 24 MiB). The CPU backend always uses
  the multiprocess executor; on GPU, TP=1 runs the uniprocess executor and has
  none of these.
- multimodal_cache: with --mm-processor-cache-type shm, one ring buffer of
  --mm-processor-cache-gb (+32 bytes) shared by the API process and workers.
- kv_offload: vLLM's native CPU KV offload maps /dev/shm/vllm_offload_*.mmap of
  the configured size.
- nccl: NCCL's SHM transport (GPU) or the CPU backend's shared-memory
  all-reduce keeps per-rank segments when TP > 1; 192 MiB per rank (about what
  a 16-rank node was reported to use: ~3 GB). vLLM's CPU wheel has that
  all-reduce only in its AVX-512 kernels: on a node without AVX-512 the ranks
  all-reduce over gloo (TCP) and the term goes unused, but the operator cannot
  tell which node a pod lands on, so it is always counted.
- headroom: 10% of the rest, at least 256 MiB (PyTorch's own shm tensors,
  semaphores, the agent's restored copies during a checkpoint's verification).
The total is rounded up to a multiple of 64 MiB.

An explicit spec.sharedMemory.size is used as given if it covers the need, and
refused (with the computed need and each term) if it does not.
"""

from __future__ import annotations

from dataclasses import dataclass

from rekindle_operator.quantity import MiB, mib_str, to_bytes
from rekindle_operator.spec import IsvcSpec

RPC_BROADCAST_MQ = 16 * MiB * 10
WORKER_RESPONSE_MQ = 24 * MiB * 10
TP_GROUP_BROADCAST_MQ = 4 * MiB * 6
MM_CACHE_HEADER = 32
NCCL_PER_RANK = 192 * MiB
HEADROOM_FRACTION = 0.10
HEADROOM_MIN = 256 * MiB
ROUND_TO = 64 * MiB


@dataclass(frozen=True)
class ShmBudget:
    """The computed /dev/shm need, with each term, in bytes (documented in the status)."""

    message_queues: int
    multimodal_cache: int
    kv_offload: int
    nccl: int
    headroom: int
    total: int

    def as_status(self) -> dict[str, int]:
        return {
            "messageQueuesBytes": self.message_queues,
            "multimodalCacheBytes": self.multimodal_cache,
            "kvOffloadBytes": self.kv_offload,
            "ncclBytes": self.nccl,
            "headroomBytes": self.headroom,
            "totalBytes": self.total,
        }


def shm_need(spec: IsvcSpec) -> ShmBudget:
    """The /dev/shm bytes vLLM will use for spec, term by term (see the module docstring)."""
    tp = spec.tensor_parallel_size
    multiproc = spec.device == "cpu" or tp > 1
    mq = RPC_BROADCAST_MQ + tp * WORKER_RESPONSE_MQ + TP_GROUP_BROADCAST_MQ if multiproc else 0
    mm = spec.mm_cache_bytes + MM_CACHE_HEADER if spec.mm_shm_cache else 0
    kv = spec.kv_offload_bytes
    nccl = NCCL_PER_RANK * tp if tp > 1 else 0
    subtotal = mq + mm + kv + nccl
    headroom = max(HEADROOM_MIN, int(subtotal * HEADROOM_FRACTION))
    total = -(-(subtotal + headroom) // ROUND_TO) * ROUND_TO
    return ShmBudget(mq, mm, kv, nccl, total - subtotal, total)


def effective_shm_bytes(spec: IsvcSpec, need: ShmBudget) -> int:
    """The user's explicit size if given (shm_shortfall says whether it is enough), else need."""
    return to_bytes(spec.shm_size) if spec.shm_size else need.total


def shm_shortfall(spec: IsvcSpec, need: ShmBudget) -> str | None:
    """Why an explicit sharedMemory.size is refused, with the computed need; None if fine."""
    if spec.shm_size is None:
        return None
    if to_bytes(spec.shm_size) >= need.total:
        return None
    return (
        f"spec.sharedMemory.size {spec.shm_size} is below what vLLM will put in /dev/shm: "
        f"{mib_str(need.total)} (message queues {mib_str(need.message_queues)}, multimodal "
        f"cache {mib_str(need.multimodal_cache)}, KV offload {mib_str(need.kv_offload)}, "
        f"NCCL {mib_str(need.nccl)}, headroom {mib_str(need.headroom)}); set it to at least "
        f"{mib_str(need.total)} or remove it to let the operator size it"
    )


def memory_limit_bytes(spec: IsvcSpec, shm_bytes: int) -> int:
    """tmpfs pages are charged to the container's memory cgroup: the limit must include them.

    So are a GPU checkpoint's host copies (gpu_host_copy_bytes).
    """
    return to_bytes(spec.memory) + shm_bytes + gpu_host_copy_bytes(spec)


# Host memory a GPU checkpoint adds to the pod, per GPU (estimates, NOT yet measured
# on a GPU: docs/gpu.md says how to measure them and what to change):
# - vLLM's level-2 sleep discards the weights and KV cache but (vLLM 0.32, the CPU
#   env's version) copies its "runtime" and "cudagraph" allocations into pinned host
#   memory (memfd-backed, so charged to the pod's memory cgroup) until it wakes;
#   0.30 (the GPU image's) discards those too and copies nothing;
# - cuda-checkpoint then copies whatever device memory is still allocated (the CUDA
#   context, cuBLAS/NCCL workspaces, allocations outside vLLM's pools) into host
#   memory the driver manages, which CRIU dumps and a restore maps again.
SLEEP_HOST_COPY_PER_GPU = 1024 * MiB
CUDA_CHECKPOINT_HOST_COPY_PER_GPU = 1024 * MiB


def gpu_host_copy_bytes(spec: IsvcSpec) -> int:
    """Host memory a GPU checkpoint needs beyond spec.memory; 0 on CPU.

    gpus x (SLEEP_HOST_COPY_PER_GPU + CUDA_CHECKPOINT_HOST_COPY_PER_GPU), with
    gpus the larger of the GPUs requested and the tensor-parallel ranks. Both
    copies exist at once while a checkpoint is taken, and again in a restored
    pod until vLLM wakes, so the pod's memory must hold them.
    """
    if spec.device == "cpu":
        return 0
    gpus = max(spec.gpus, spec.tensor_parallel_size, 1)
    return gpus * (SLEEP_HOST_COPY_PER_GPU + CUDA_CHECKPOINT_HOST_COPY_PER_GPU)


def memory_request_bytes(spec: IsvcSpec, shm_bytes: int) -> int:
    """The memory request: vLLM's memory plus what /dev/shm will certainly hold.

    The scheduler places pods by their requests; /dev/shm pages are memory the
    node must have, so they count in the request as in the limit. One
    exception: a multimodal cache the agent may leave off (spec.multimodal.enabled
    unset, decided from the model's config.json at launch) is in the limit and
    in /dev/shm's size, which are caps, but not in the request, so a text
    model does not reserve memory it never touches. Set enabled: true to
    reserve it.
    """
    undecided = spec.mm_cache_bytes + MM_CACHE_HEADER if spec.mm_cache_undecided else 0
    return to_bytes(spec.memory) + max(0, shm_bytes - undecided) + gpu_host_copy_bytes(spec)
