"""The agent's command line: every flag once, with its default and help.

The operator's builders and the test harness make the agent's argv with
agent_argv(); the agent builds its argument parser from the same fields
(rekindle_agent.config), so the two cannot drift apart. A field's flag is its
name with dashes; a bool field is a --name / --no-name pair.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from rekindle_contract.api import ADMIN_PORT, RESTORE_POLICIES, SERVE_PORT, VLLM_PORT
from rekindle_contract.pod import RUN_DIR, TOKEN_FILE

# The console script the runtime images install (`rekindle agent ...`).
AGENT_COMMAND = ("rekindle", "agent")

MMAP_MODES = ("auto", "on", "off")
# blake3 (the default) is the one check that also authenticates: with a signing
# key the manifest is signed and its BLAKE3 digests bind every byte; crc32 and
# size only catch damage, and the agent refuses them when a signing key is set.
VERIFY_MODES = ("blake3", "crc32", "sha256", "size")
DEVICES = ("cpu", "cuda")
# Where the runtime images (CPU and GPU) install CRIU's CUDA plugin; the operator
# passes it as --criu-plugins for device cuda.
CUDA_PLUGIN_DIR = "/opt/criu/patched/plugins"


def _opt(help: str, choices: tuple[str, ...] | None = None, **kw: Any) -> Any:
    return field(metadata={"help": help, "choices": choices}, **kw)


@dataclass
class AgentArgs:
    """Settings of `rekindle agent`; vllm_args are vLLM flags passed after `--`."""

    model: str = _opt("model directory vLLM serves", default="")
    served_name: str = _opt("model name in the OpenAI API", default="model")
    device: str = _opt("cpu or cuda", DEVICES, default="cpu")
    max_model_len: int | None = _opt("vLLM --max-model-len (default: the model's)", default=None)
    tensor_parallel_size: int = _opt("vLLM tensor-parallel ranks in this pod", default=1)
    mm_shm_cache_gb: float | None = _opt(
        "vLLM's shared-memory multimodal cache size in GiB (unset: off)", default=None
    )
    mm_shm_max_object_mb: int | None = _opt("largest object in that cache, MiB", default=None)
    prefix_caching: bool = _opt("vLLM automatic prefix caching", default=True)
    cpu_compile: bool = _opt(
        "on CPU, torch.compile (vLLM's default on GPU) instead of --enforce-eager", default=False
    )
    kv_offload_gb: float | None = _opt("vLLM native CPU KV offload, GiB (unset: off)", default=None)
    worker_extension: str = _opt(
        "vLLM --worker-extension-cls; 'auto': Rekindle's if importable; 'none': off",
        default="auto",
    )
    bind_host: str = _opt("address the serve and admin ports bind to", default="0.0.0.0")
    serve_port: int = _opt("OpenAI API proxy port (0: any free port)", default=SERVE_PORT)
    admin_port: int = _opt("control API port (0: any free port)", default=ADMIN_PORT)
    vllm_port: int = _opt("vLLM's own port on 127.0.0.1", default=VLLM_PORT)
    ports_file: str | None = _opt(
        "write the bound ports here as JSON once listening (for port 0)", default=None
    )
    token_file: str = _opt("bearer token file of the admin API", default=TOKEN_FILE)
    metrics_token_file: str | None = _opt(
        "bearer token file that reads GET /metrics on the admin port and nothing else "
        "(the scrape credential); unset: only --token-file's token reads it",
        default=None,
    )
    run_dir: str = _opt("vLLM's log and TMPDIR; same path in every pod", default=RUN_DIR)
    restore_from: str | None = _opt("checkpoint directory to restore from at start", default=None)
    restore_signature: str | None = _opt(
        "the operator's signature of --restore-from (rekindle_contract.restore_pointer)",
        default=None,
    )
    service_uid: str | None = _opt(
        "UID of the InferenceService this pod serves; set, --restore-from is only used with "
        "a valid --restore-signature for it, directly below --checkpoint-root",
        default=None,
    )
    checkpoint_root: str | None = _opt(
        "POST /v1/checkpoint only writes below this directory", default=None
    )
    restore_policy: str = _opt(
        "never, if-present or require", RESTORE_POLICIES, default="if-present"
    )
    criu: str = _opt("CRIU binary", default="criu")
    criu_plugins: str | None = _opt(
        "CRIU plugin directory (-L), e.g. the CUDA plugin's", default=None
    )
    cuda_checkpoint: str = _opt(
        "NVIDIA's cuda-checkpoint (a path, or a name looked up on PATH) that CRIU's CUDA "
        "plugin runs: its directory goes first on CRIU's PATH (device cuda only)",
        default="cuda-checkpoint",
    )
    gpu_host_copy_limit_mb: int = _opt(
        "device cuda: the most GPU memory (MiB per GPU) vLLM's level-2 sleep may leave, "
        "which cuda-checkpoint copies into the pod's host memory; a checkpoint over it is "
        "refused with the weights put back (the operator budgets 1024 MiB per GPU)",
        default=1024,
    )
    mmap_restore: str = _opt("zero-copy restore: auto, on or off", MMAP_MODES, default="auto")
    prefetch: bool = _opt("read the checkpoint into the page cache while restoring", default=True)
    prefetch_threads: int = _opt("prefetch reader threads", default=8)
    verify_checksums: str = _opt("content check on restore", VERIFY_MODES, default="blake3")
    drain_timeout: float = _opt("seconds to wait for in-flight requests", default=30.0)
    boot_timeout: float = _opt("seconds a normal boot may take", default=900.0)
    restore_timeout: float = _opt("seconds CRIU's restore may take", default=300.0)
    seccomp_io_uring: bool = _opt("refuse io_uring to vLLM (CRIU cannot dump it)", default=True)
    ns_last_pid: int = _opt("PID floor for vLLM's tree when the agent is PID 1", default=10000)
    clear_shm: bool = _opt("remove stale /dev/shm files at start (as PID 1)", default=True)
    # Security and bounds (docs/security.md). Added after the fields above, so
    # an older argv means what it meant.
    api_key_file: str | None = _opt(
        "file with the API key every request on the serve port must send as "
        "'Authorization: Bearer KEY' (a mounted Secret); unset: no key",
        default=None,
    )
    signing_key_file: str | None = _opt(
        "file with the key (>= 32 bytes, a mounted Secret, one per InferenceService) that "
        "signs checkpoint manifests (HMAC-SHA256); a restore refuses a manifest it did not "
        "sign. Unset: checkpoints are unsigned",
        default=None,
    )
    node_socket: str | None = _opt(
        "the node agent's socket (its emptyDir in this pod): the node agent runs CRIU and "
        "holds the checkpoints, the pod needs no privilege. Unset: the agent runs CRIU itself",
        default=None,
    )
    pod_uid: str | None = _opt(
        "this pod's UID (the downward API), what the agent asks the node agent about",
        default=None,
    )
    node_publish: bool = _opt(
        "with --node-socket: the checkpoint volume is shared storage; the node agent copies "
        "each proven checkpoint there, and pulls one its cache lacks back from there "
        "(verifying every byte)",
        default=False,
    )
    node_store: bool = _opt(
        "with --node-socket: the node agent publishes each proven checkpoint to its object "
        "store (the chart's nodeAgent.objectStore), and pulls one its cache lacks from there "
        "(parallel ranged reads, verifying every byte)",
        default=False,
    )
    dump_timeout: float = _opt("seconds CRIU's dump may take", default=600.0)
    checkpoint_timeout: float = _opt(
        "watchdog: seconds a whole checkpoint (drain, dump, proving restore) may take "
        "before the agent gives up and turns Failed",
        default=1800.0,
    )
    prefetch_timeout: float = _opt(
        "seconds a restore waits for the prefetch (and its content check)", default=600.0
    )
    proxy_timeout: float = _opt(
        "seconds the serve port's proxy waits for vLLM to send anything", default=600.0
    )
    proxy_max_body_mb: int = _opt("largest request body the serve port accepts, MiB", default=32)
    proxy_body_timeout: float = _opt(
        "seconds a client has to send its whole request body (else 408); a request takes "
        "a concurrency slot only once its body is in",
        default=60.0,
    )
    proxy_body_buffer_mb: int = _opt(
        "request bodies the serve port holds at once (received or being received), MiB; "
        "past it a request gets 503 with Retry-After",
        default=256,
    )
    proxy_max_concurrency: int = _opt(
        "requests the serve port forwards at once; more get 429 with Retry-After", default=256
    )
    # The admin port over TLS (docs/security.md, "Admin API over TLS"). The
    # serve port stays plain HTTP: TLS for clients is the Service's or the
    # ingress's job.
    admin_tls_cert: str | None = _opt(
        "PEM certificate chain the admin port serves HTTPS with (a kubernetes.io/tls "
        "Secret's tls.crt), with --admin-tls-key; the admin port then speaks HTTPS only, "
        "TLS 1.2 or later. Unset: plain HTTP",
        default=None,
    )
    admin_tls_key: str | None = _opt(
        "PEM private key of --admin-tls-cert (the Secret's tls.key), unencrypted", default=None
    )
    # A KV block store several pods share (docs/caches.md, "KV cache reuse").
    kv_store_dir: str | None = _opt(
        "directory of a KV chunk store shared by pods (vLLM's file-system offload tier "
        "behind --kv-offload-gb, which it needs; device cuda only). Unset: off",
        default=None,
    )
    # Keep the newest checkpoint in the page cache (docs/agent.md, "Page-cache residency").
    keep_resident_mb: int = _opt(
        "lock up to this many MiB of the newest checkpoint this pod restored or made in the "
        "page cache (vmtouch -l; needs CAP_IPC_LOCK; counts against the pod's memory "
        "limit). 0: off",
        default=0,
    )
    # What vLLM may fetch for a request (docs/security.md, "Media URLs").
    allowed_media_domains: str | None = _opt(
        "comma-separated hosts vLLM may fetch media URLs from (vLLM's "
        "--allowed-media-domains); unset: any host",
        default=None,
    )
    media_redirects: bool = _opt(
        "let vLLM follow HTTP redirects when it fetches a media URL (off: a redirect is "
        "an error, so an allowed host cannot send vLLM elsewhere)",
        default=False,
    )
    # LoRA serving (docs/agent.md, "LoRA adapters").
    lora_max_adapters: int = _opt(
        "serve LoRA adapters, at most this many in one batch (vLLM's --max-loras); 0: LoRA off",
        default=0,
    )
    lora_max_rank: int = _opt("largest LoRA rank served (vLLM's --max-lora-rank)", default=16)
    lora_adapters: str | None = _opt(
        "LoRA adapters served from the start: NAME=DIR,... with each DIR inside --model's "
        "directory, relative to it (rekindle_contract.lora)",
        default=None,
    )
    # Shutdown (docs/agent.md, "Shutdown"): within the pod's termination grace (30 s).
    shutdown_drain: float = _opt(
        "seconds after SIGTERM in which requests in flight (streams too) may finish; new "
        "ones get 503 with Retry-After at once. Keep it below the pod's "
        "terminationGracePeriodSeconds",
        default=25.0,
    )
    vllm_args: list[str] = field(default_factory=list, metadata={"help": "vLLM flags after --"})


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def defaults() -> dict[str, Any]:
    """Every field's default value, by name."""
    return {f.name: getattr(AgentArgs(), f.name) for f in fields(AgentArgs)}


def _number(v: float) -> str:
    """Short where exact ("30", "0.5"), else every digit: the agent parses back v."""
    short = f"{v:g}"
    return short if float(short) == v else repr(v)


def agent_argv(args: AgentArgs, command: tuple[str, ...] = AGENT_COMMAND) -> list[str]:
    """The agent's argv for args: the command, every non-default flag, `--`, vLLM's flags."""
    base = defaults()
    out = [*command, "--model", args.model]
    for f in fields(AgentArgs):
        value = getattr(args, f.name)
        if f.name in ("model", "vllm_args") or value == base[f.name]:
            continue
        if isinstance(value, bool):
            out.append(flag(f.name) if value else "--no-" + f.name.replace("_", "-"))
        elif value is not None:
            out += [flag(f.name), _number(value) if isinstance(value, float) else str(value)]
    if args.vllm_args:
        out += ["--", *args.vllm_args]
    return out
