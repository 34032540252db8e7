"""How Rekindle launches and talks to a vLLM OpenAI server.

One place builds vLLM's command line and environment, so the agent, the tests
and the benchmarks all run the server the same way (and a checkpoint's
fingerprint can include exactly what was run).
"""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass, field

WORKER_EXTENSION = "rekindle_agent.vllm_extension.RekindleWorkerExtension"


@dataclass(frozen=True)
class VllmConfig:
    """What to serve and how; `extra_args` are passed through verbatim."""

    model: str
    served_name: str = "tiny"
    host: str = "127.0.0.1"
    port: int = 8000
    device: str = "cpu"
    max_model_len: int | None = 512  # None: vLLM's default (the model's context)
    tensor_parallel_size: int = 1
    worker_extension: str | None = WORKER_EXTENSION
    mm_shm_cache_gb: float | None = None
    mm_shm_max_object_mb: int | None = None
    extra_args: tuple[str, ...] = field(default_factory=tuple)


def vllm_command(cfg: VllmConfig, python: str = sys.executable) -> list[str]:
    """The argv that starts vLLM's OpenAI server for cfg."""
    cmd = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        cfg.model,
        "--served-model-name",
        cfg.served_name,
        "--host",
        cfg.host,
        "--port",
        str(cfg.port),
    ]
    if cfg.max_model_len is not None:
        cmd += ["--max-model-len", str(cfg.max_model_len)]
    if cfg.tensor_parallel_size > 1:
        cmd += ["--tensor-parallel-size", str(cfg.tensor_parallel_size)]
    if cfg.device == "cpu":
        # No CUDA graphs and no inductor on CPU: eager is what serves fastest to boot.
        cmd += ["--enforce-eager"]
    else:
        cmd += ["--enable-sleep-mode"]
    if cfg.worker_extension:
        cmd += ["--worker-extension-cls", cfg.worker_extension]
    if cfg.mm_shm_cache_gb is not None:
        cmd += [
            "--mm-processor-cache-type",
            "shm",
            "--mm-processor-cache-gb",
            f"{cfg.mm_shm_cache_gb:g}",
        ]
        if cfg.mm_shm_max_object_mb is not None:
            cmd += ["--mm-shm-cache-max-object-size-mb", str(cfg.mm_shm_max_object_mb)]
    return cmd + list(cfg.extra_args)


def vllm_env(cfg: VllmConfig, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for vLLM: offline, no telemetry, dev endpoints for sleep/collective_rpc."""
    env = dict(os.environ if base is None else base)
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        VLLM_SERVER_DEV_MODE="1",
        PYTHONUNBUFFERED="1",
    )
    if cfg.device == "cpu":
        env.setdefault("VLLM_TARGET_DEVICE", "cpu")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return env


def base_url(cfg: VllmConfig) -> str:
    return f"http://{cfg.host}:{cfg.port}"


def http_json(method: str, url: str, body: object | None = None, timeout: float = 30.0) -> object:
    """A small JSON HTTP call with the stdlib (the agent must not depend on requests)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        raw = resp.read()
    return json.loads(raw) if raw else None


def complete(url: str, model: str, prompt: str, max_tokens: int = 16, timeout: float = 60) -> str:
    """Greedy completion: deterministic for a fixed model, the before/after oracle."""
    out = http_json(
        "POST",
        f"{url}/v1/completions",
        {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0},
        timeout=timeout,
    )
    assert isinstance(out, dict)
    return str(out["choices"][0]["text"])
