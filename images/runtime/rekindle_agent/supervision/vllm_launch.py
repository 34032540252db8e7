"""What the agent starts vLLM with: its options (from the agent's settings) and environment.

vLLM's command line itself is built in one place, rekindle_contract.vllm_argv,
so the operator's flag checks, the agent and the checkpoint fingerprint all
see the same argv.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Mapping, Sequence

from rekindle_contract import lora
from rekindle_contract.manifest import RUN_CACHE_SUBDIR
from rekindle_contract.rpc import WORKER_EXTENSION
from rekindle_contract.vllm_argv import (
    MM_AUTO_ENV,
    LoraOptions,
    VllmOptions,
    takes_images,
    vllm_argv,
)

from rekindle_agent.config import AgentConfig
from rekindle_agent.mapped_files.weights_map import THP_ENV

VLLM_HOST = "127.0.0.1"  # vLLM is reachable only through the agent


def resolve_worker_extension(value: str) -> str | None:
    """--worker-extension: 'auto' is Rekindle's when importable here; 'none' (or '') is off."""
    if value in ("none", ""):
        return None
    if value != "auto":
        return value
    module = WORKER_EXTENSION.rsplit(".", 1)[0]
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        found = False
    return WORKER_EXTENSION if found else None


def model_config(model: str) -> dict[str, object] | None:
    """The model directory's config.json, or None when it is not a readable directory."""
    try:
        with open(os.path.join(model, "config.json"), encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def keep_mm_cache(model: str, env: Mapping[str, str]) -> bool:
    """Whether the shared-memory multimodal cache stays on for this model.

    Only asked when the operator left the choice to the agent (MM_AUTO_ENV=1,
    spec.multimodal.enabled unset): on for a model whose config.json says it
    takes images, off for a text model (it would never use the cache); on when
    the config cannot be read (the operator sized /dev/shm for it, and vLLM
    runs fine with an unused cache).
    """
    if env.get(MM_AUTO_ENV) != "1":
        return True
    config = model_config(model)
    return config is None or takes_images(config)


def media_domains(value: str | None) -> tuple[str, ...]:
    """--allowed-media-domains "a.example,b.example" as vLLM's list (empty: any host)."""
    return tuple(d.strip() for d in (value or "").split(",") if d.strip())


def vllm_options(cfg: AgentConfig, env: Mapping[str, str] | None = None) -> VllmOptions:
    mm = keep_mm_cache(cfg.model, os.environ if env is None else env)
    return VllmOptions(
        model=cfg.model,
        served_name=cfg.served_name,
        host=VLLM_HOST,
        port=cfg.vllm_port,
        device=cfg.device,
        max_model_len=cfg.max_model_len,
        tensor_parallel_size=cfg.tensor_parallel_size,
        worker_extension=resolve_worker_extension(cfg.worker_extension),
        mm_shm_cache_gb=cfg.mm_shm_cache_gb if mm else None,
        mm_shm_max_object_mb=cfg.mm_shm_max_object_mb if mm else None,
        prefix_caching=cfg.prefix_caching,
        cpu_compile=cfg.cpu_compile,
        kv_offload_gb=cfg.kv_offload_gb,
        kv_store_dir=cfg.kv_store_dir,
        allowed_media_domains=media_domains(cfg.allowed_media_domains),
        lora=lora_options(cfg),
        extra_args=tuple(cfg.vllm_args),
    )


def lora_options(cfg: AgentConfig) -> LoraOptions | None:
    """The LoRA settings (None: off), each adapter's directory made absolute below --model."""
    if not cfg.lora_max_adapters:
        return None
    adapters = tuple(
        (name, os.path.join(cfg.model, path))
        for name, path in lora.parse_adapters(cfg.lora_adapters)
    )
    return LoraOptions(cfg.lora_max_adapters, cfg.lora_max_rank, adapters)


def cpu_threads_bind(cpus: Sequence[int], ranks: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for ranks tensor-parallel CPU workers, e.g. "0,1|2,3".

    vLLM's own default ("auto") gives each rank a NUMA node and refuses to start
    when there are fewer nodes than ranks, as on most VMs and containers. So the
    CPUs this process may run on are split into ranks equal contiguous groups
    (left-over CPUs stay free for the API server and the engine core);
    "nobind" when there are fewer CPUs than ranks.
    """
    ordered = sorted(set(cpus))
    per = len(ordered) // ranks if ranks > 0 else 0
    if per == 0:
        return "nobind"
    groups = [ordered[i * per : (i + 1) * per] for i in range(ranks)]
    return "|".join(",".join(str(c) for c in g) for g in groups)


def vllm_env(
    device: str,
    base: dict[str, str] | None = None,
    run_dir: str | None = None,
    tensor_parallel_size: int = 1,
    media_redirects: bool = False,
    cpu_compile: bool = False,
    runtime_lora: bool = False,
) -> dict[str, str]:
    """Environment for vLLM: offline, no telemetry, dev endpoints for sleep/collective_rpc.

    With run_dir, temp files (and the sockets vLLM puts there) live in
    run_dir/tmp, a path that is the same in every pod, as a restored tree needs.
    On CPU with tensor parallel, each rank's OpenMP threads get their own CPUs
    (cpu_threads_bind) unless VLLM_CPU_OMP_THREADS_BIND is set already. On CPU,
    THP_MEM_ALLOC_ENABLE=1 (unless set): PyTorch then page-aligns allocations of
    2 MiB and more, which a weight reload needs to map the dump instead of
    copying it (docs/weights.md, "Mapped reload"). GPU is left as it is: its
    weights live in device memory, which is never mapped from the dump.
    Media URLs are fetched without following redirects unless media_redirects
    (vLLM follows them by default: an allowed host could send it anywhere).
    With runtime_lora, vLLM's own routes that load and unload LoRA adapters are on:
    only the agent reaches them (vLLM listens on loopback; the serve port never
    forwards them), on the admin API's behalf.
    """
    env = dict(os.environ if base is None else base)
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        VLLM_SERVER_DEV_MODE="1",
        PYTHONUNBUFFERED="1",
        # CRIU cannot dump io_uring; libuv honours this (uvloop does not: see seccomp.py).
        UV_USE_IO_URING="0",
        VLLM_MEDIA_URL_ALLOW_REDIRECTS="1" if media_redirects else "0",
    )
    if runtime_lora:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    if device == "cpu":
        env.setdefault("VLLM_TARGET_DEVICE", "cpu")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        # Not in the checkpoint fingerprint (not a fingerprinted prefix): a restored tree
        # keeps the environment it was dumped with, and one without it maps less of the
        # dump and copies the rest, so checkpoints from before it still restore.
        env.setdefault(THP_ENV, "1")
        if not cpu_compile:
            # Eager means eager: vLLM still torch.compiles a few helpers (the sampler's
            # logprob ranks), and Inductor on CPU needs a C++ compiler the image does
            # not have: the first request with logprobs killed the engine.
            env.setdefault("TORCHDYNAMO_DISABLE", "1")
        if tensor_parallel_size > 1:
            bind = cpu_threads_bind(sorted(os.sched_getaffinity(0)), tensor_parallel_size)
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", bind)
    if run_dir is not None:
        env["TMPDIR"] = os.path.join(run_dir, "tmp")
        for name, path in cache_env(run_dir).items():
            env.setdefault(name, path)
    return env


def cache_env(run_dir: str) -> dict[str, str]:
    """Where vLLM, Inductor and Triton keep what they compile: below run_dir/cache.

    A compiled kernel is loaded as a shared object, so the tree maps it from its
    cache for good, and a restore must find the same file at the same path. By
    default these caches live under $HOME and /tmp, which a new pod has empty;
    below run_dir (the same path in every pod) the checkpoint saves the files
    the tree uses and the restore puts them back (checkpoint.run_dir_files). A
    value set in the pod's environment wins (e.g. a cache shared by all pods).
    """
    cache = os.path.join(run_dir, RUN_CACHE_SUBDIR)
    return {
        "VLLM_CACHE_ROOT": os.path.join(cache, "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, "inductor"),
        "TRITON_CACHE_DIR": os.path.join(cache, "triton"),
        "FLASHINFER_WORKSPACE_BASE": os.path.join(cache, "flashinfer"),
    }


def vllm_command(cfg: AgentConfig) -> tuple[list[str], dict[str, str]]:
    """vLLM's argv and environment for cfg (what the agent starts and fingerprints)."""
    env = vllm_env(
        cfg.device,
        run_dir=cfg.run_dir,
        tensor_parallel_size=cfg.tensor_parallel_size,
        media_redirects=cfg.media_redirects,
        cpu_compile=cfg.cpu_compile,
        runtime_lora=cfg.lora_max_adapters > 0,
    )
    return vllm_argv(vllm_options(cfg)), env
