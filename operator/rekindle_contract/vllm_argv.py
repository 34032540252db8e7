"""vLLM's command line, built in one place.

The agent starts vLLM with vllm_argv(); the operator never builds vLLM flags
itself: it passes the features (tensor parallel, shm caches, KV settings) as
agent flags (agent_args.py), and refuses user flags that collide with these.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rekindle_contract.api import VLLM_PORT
from rekindle_contract.rpc import WORKER_EXTENSION

# Flags vllm_argv() sets; a user passing them in spec.vllmArgs would silently
# fight the operator (ports, shm cache sizing), so the CRD refuses them (a unit
# test checks the CRD's rule against this list; tests/vllm checks the spellings
# against vLLM's own parser). And --config: vLLM reads flags from that file,
# so it could set those the agent leaves at vLLM's default (--enable-sleep-mode
# on CPU, --kv-offloading-*).
MANAGED_VLLM_FLAGS = (
    "--config",
    "--model",
    "--served-model-name",
    "--host",
    "--port",
    "--tensor-parallel-size",
    "--mm-processor-cache-type",
    "--mm-processor-cache-gb",
    "--mm-shm-cache-max-object-size-mb",
    "--worker-extension-cls",
    "--enable-sleep-mode",
    "--kv-offloading-size",
    "--kv-offloading-backend",
    "--allowed-media-domains",
    "--enable-lora",
    "--max-loras",
    "--max-lora-rank",
    "--lora-modules",
)
# vLLM's short spellings of managed flags.
MANAGED_VLLM_ALIASES = {"-tp": "--tensor-parallel-size"}
# Managed switches vLLM also takes as `--no-NAME` (argparse's BooleanOptionalAction).
MANAGED_VLLM_SWITCHES = ("--enable-sleep-mode", "--enable-lora")


def managed_flag(arg: str) -> str | None:
    """The managed flag arg would set in vLLM's parser, or None.

    vLLM's parser reads `_` as `-` in flag names and, like argparse, takes a
    unique prefix of a flag for the flag (`--hos` is `--host`), so an exact
    match is not enough: arg is managed when its name, `_` read as `-`, is a
    managed flag or a prefix of one (at least one letter after the dashes), or
    the `--no-` form (or a prefix of it) of a managed switch. tests/vllm checks
    this against vLLM's own parser, spelling by spelling.
    """
    name = arg.split("=", 1)[0]
    for alias, flag in MANAGED_VLLM_ALIASES.items():
        if name.startswith(alias):
            return flag
    if not name.startswith("--") or len(name) < 3:
        return None
    norm = name.replace("_", "-")
    for flag in MANAGED_VLLM_FLAGS:
        if flag.startswith(norm):
            return flag
    if norm.startswith("--no-") and len(norm) > len("--no-"):
        for flag in MANAGED_VLLM_SWITCHES:
            if flag.startswith("--" + norm[len("--no-") :]):
                return flag
    return None


# Set by the operator when spec.multimodal.enabled is unset: the agent keeps the
# shared-memory multimodal cache only if the model takes images (takes_images on
# its config.json), since the operator cannot read the model's config itself.
MM_AUTO_ENV = "REKINDLE_MM_CACHE_AUTO"

# Architectures (config.json "architectures") of models that take images, for
# configs that do not carry a vision_config of their own.
VISION_ARCHITECTURES = frozenset(
    {
        "LlavaForConditionalGeneration",
        "LlavaNextForConditionalGeneration",
        "LlavaOnevisionForConditionalGeneration",
        "Qwen2VLForConditionalGeneration",
        "Qwen2_5_VLForConditionalGeneration",
        "MllamaForConditionalGeneration",
        "PaliGemmaForConditionalGeneration",
        "Gemma3ForConditionalGeneration",
        "Idefics3ForConditionalGeneration",
        "InternVLChatModel",
        "Phi3VForCausalLM",
        "MiniCPMV",
        "PixtralForConditionalGeneration",
        "Mistral3ForConditionalGeneration",
        "Llama4ForConditionalGeneration",
    }
)


def takes_images(config: Mapping[str, Any]) -> bool:
    """Whether a Hugging Face config.json describes a model with an image input.

    A vision tower shows as a vision_config section; older or custom configs
    are recognised by their architecture name.
    """
    if isinstance(config.get("vision_config"), Mapping):
        return True
    archs = config.get("architectures") or []
    return any(str(a) in VISION_ARCHITECTURES for a in archs)


@dataclass(frozen=True)
class LoraOptions:
    """vLLM's LoRA serving: adapters in one batch, their largest rank, and the adapters
    served from the start as (name, absolute directory)."""

    max_adapters: int = 1
    max_rank: int = 16
    adapters: tuple[tuple[str, str], ...] = ()


def lora_argv(lora: LoraOptions) -> list[str]:
    cmd = [
        "--enable-lora",
        "--max-loras",
        str(lora.max_adapters),
        "--max-lora-rank",
        str(lora.max_rank),
    ]
    if lora.adapters:
        cmd += ["--lora-modules", *(f"{name}={path}" for name, path in lora.adapters)]
    return cmd


@dataclass(frozen=True)
class VllmOptions:
    """What to serve and how; `extra_args` are the user's, passed through verbatim."""

    model: str
    served_name: str = "model"
    host: str = "127.0.0.1"
    port: int = VLLM_PORT
    device: str = "cpu"  # cpu | cuda
    max_model_len: int | None = None  # None: vLLM's default (the model's context)
    tensor_parallel_size: int = 1
    worker_extension: str | None = WORKER_EXTENSION
    mm_shm_cache_gb: float | None = None  # None: vLLM's default cache type
    mm_shm_max_object_mb: int | None = None
    prefix_caching: bool = True
    cpu_compile: bool = False  # on CPU: torch.compile, not --enforce-eager
    kv_offload_gb: float | None = None  # vLLM's native CPU KV offload
    # A directory of KV blocks shared by pods (vLLM's file-system offload tier,
    # behind the CPU offload of kv_offload_gb); None: off. GPU only.
    kv_store_dir: str | None = None
    # Hosts vLLM may fetch media URLs (image_url ...) from; empty: any host.
    allowed_media_domains: tuple[str, ...] = ()
    lora: LoraOptions | None = None  # None: LoRA off
    extra_args: tuple[str, ...] = field(default_factory=tuple)


def vllm_argv(opts: VllmOptions, python: str = sys.executable) -> list[str]:
    """The argv that starts vLLM's OpenAI server for opts."""
    cmd = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        opts.model,
        "--served-model-name",
        opts.served_name,
        "--host",
        opts.host,
        "--port",
        str(opts.port),
    ]
    if opts.max_model_len is not None:
        cmd += ["--max-model-len", str(opts.max_model_len)]
    if opts.tensor_parallel_size > 1:
        cmd += ["--tensor-parallel-size", str(opts.tensor_parallel_size)]
    if opts.device == "cpu":
        if not opts.cpu_compile:
            # No CUDA graphs on CPU, and eager boots fastest (compiling: cpu_compile).
            cmd += ["--enforce-eager"]
    else:
        cmd += ["--enable-sleep-mode"]
    if opts.worker_extension:
        cmd += ["--worker-extension-cls", opts.worker_extension]
    if opts.mm_shm_cache_gb is not None:
        cmd += [
            "--mm-processor-cache-type",
            "shm",
            "--mm-processor-cache-gb",
            f"{opts.mm_shm_cache_gb:g}",
        ]
        if opts.mm_shm_max_object_mb is not None:
            cmd += ["--mm-shm-cache-max-object-size-mb", str(opts.mm_shm_max_object_mb)]
    if not opts.prefix_caching:
        cmd.append("--no-enable-prefix-caching")
    if opts.kv_store_dir:
        if not opts.kv_offload_gb:
            raise ValueError("kv_store_dir needs kv_offload_gb: blocks reach the store through it")
        config = kv_store_transfer_config(int(opts.kv_offload_gb * 2**30), opts.kv_store_dir)
        cmd += ["--kv-transfer-config", json.dumps(config, separators=(",", ":"))]
    elif opts.kv_offload_gb:
        cmd += [
            "--kv-offloading-backend",
            "native",
            "--kv-offloading-size",
            f"{opts.kv_offload_gb:g}",
        ]
    if opts.allowed_media_domains:
        cmd += ["--allowed-media-domains", *opts.allowed_media_domains]
    if opts.lora is not None:
        cmd += lora_argv(opts.lora)
    return cmd + list(opts.extra_args)


def kv_store_transfer_config(cpu_bytes: int, store_dir: str) -> dict[str, Any]:
    """vLLM's --kv-transfer-config for a KV block store on a (shared) file system.

    vLLM's in-tree OffloadingConnector with its tiering spec: a CPU tier of
    cpu_bytes (the same region --kv-offloading-size maps in /dev/shm) in front
    of a file-system tier that writes one file per chunk of tokens, named by
    the chain hash of the chunk's tokens under a per-model directory of
    store_dir. Pods that mount the same store_dir reuse each other's chunks.
    vLLM 0.32 runs it on CUDA and XPU only (its CPU build refuses the offload
    worker), which is why the operator allows it for device gpu only.
    """
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": cpu_bytes,
            "secondary_tiers": [{"type": "fs", "root_dir": store_dir}],
        },
    }
