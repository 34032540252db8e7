"""The agent's HTTP API: ports, paths, states, request and reply types, a client.

Standard library only: the operator imports it (no aiohttp, torch or vLLM).

Ports (all TCP, in the pod):
  SERVE_PORT (8000)  the OpenAI API, as a reverse proxy in front of vLLM: only
                     the routes in SERVE_ROUTES (vLLM's control endpoints never
                     reach it from here; its read-only /metrics
                     does). No agent token; with the agent's
                     --api-key-file every request needs `Authorization: Bearer
                     <api key>`. While the agent drains or checkpoints, new
                     requests get 503 with Retry-After (retryable).
  ADMIN_PORT (8081)  the agent's control API: /healthz and /readyz without a
                     token (kubelet probes cannot send one), everything else
                     (/v1/status, /v1/checkpoint, /metrics) needs
                     `Authorization: Bearer <token>`. HTTPS only when the agent
                     has --admin-tls-cert/--admin-tls-key (AgentClient's ca and
                     server_name verify it); plain HTTP otherwise.
  VLLM_PORT (18000)  vLLM itself, bound to 127.0.0.1 only; never exposed.
"""

from __future__ import annotations

import http.client
import json
import ssl
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypedDict

from rekindle_contract.manifest import Manifest

SERVE_PORT = 8000
ADMIN_PORT = 8081
VLLM_PORT = 18000

# Admin API paths.
PATH_HEALTHZ = "/healthz"
PATH_READYZ = "/readyz"
PATH_STATUS = "/v1/status"
PATH_CHECKPOINT = "/v1/checkpoint"
# POST {"dir": a checkpoint directly below the checkpoint root}: this node's agent pulls
# it into its verified cache in the background (202; 409 where storage is not node).
PATH_PREWARM = "/v1/prewarm"
PATH_METRICS = "/metrics"
# POST {"name", "dir"}: vLLM loads that LoRA adapter (a directory inside the model's,
# relative to it); POST {"name"}: it drops one. Only with LoRA on (the agent's
# --lora-max-adapters); the serve port never forwards vLLM's own routes for this.
PATH_LORA_LOAD = "/v1/lora/load"
PATH_LORA_UNLOAD = "/v1/lora/unload"
# Serve port, answered by the agent itself (never forwarded): GET gives the replica's
# engine queue as {"load": running + waiting, "running": R, "waiting": W}, read from
# vLLM's own metrics. "load" is what the vLLM router's power_of_two policy polls.
PATH_SERVE_LOAD = "/get_load"

State = Literal["Booting", "Ready", "Draining", "Checkpointing", "Restoring", "Failed"]
STATES: tuple[State, ...] = ("Booting", "Ready", "Draining", "Checkpointing", "Restoring", "Failed")
Origin = Literal["none", "booted", "restored"]
RestorePolicy = Literal["never", "if-present", "require"]
RESTORE_POLICIES: tuple[RestorePolicy, ...] = ("never", "if-present", "require")

# Low-cardinality fallback reasons (metrics label and status.last_fallback.reason).
FALLBACK_REASONS = (
    "no_checkpoint",
    "manifest_invalid",
    "not_verified",
    "fingerprint_mismatch",
    "file_missing",
    "checksum_mismatch",
    "shm_restore_failed",
    "criu_restore_failed",
    "wake_failed",
    "verify_failed",
    "canary_mismatch",  # the restored vLLM answers the checkpoint's canary prompts differently
    "signature_invalid",  # unsigned, altered, or signed with another service's key
    "prefetch_timeout",  # the content check did not finish within --prefetch-timeout
    "pointer_refused",  # the restore pointer lacks the operator's valid signature
)

# Why a checkpoint failed (status.last_checkpoint.reason). Whatever the reason,
# the agent ends serving again (or Failed, for the watchdog) and the partial
# checkpoint directory is removed.
CHECKPOINT_FAILURE_REASONS = (
    "drain_timeout",  # in-flight requests outlived --drain-timeout; nothing was touched
    "canary_failed",  # vLLM did not answer the canary prompts; nothing was touched
    "io_uring",  # the tree holds an io_uring CRIU cannot dump
    "release_failed",  # the weights could not be dumped or released
    "gpu_memory_left",  # sleep left more on the GPU than --gpu-host-copy-limit-mb; undone
    "insufficient_space",  # refused before draining: the estimate does not fit the volume
    "volume_full",  # ENOSPC / EDQUOT on the checkpoint volume
    "read_only",  # EROFS on the checkpoint volume
    "io_error",  # any other OSError writing the checkpoint
    "criu_failed",  # criu dump exited non-zero
    "criu_timeout",  # criu dump outlived --dump-timeout (killed; vLLM booted again)
    "verify_restore_failed",  # the proving restore did not serve
    "unsupported",  # the tree holds something a restore would not recreate
    "watchdog",  # the whole checkpoint outlived --checkpoint-timeout: agent Failed
    "internal",  # anything else (a bug): still a defined end state
)

# The serve port forwards only these (method, path) routes to vLLM: its
# OpenAI-compatible (and Anthropic-compatible) inference API, tokenization and
# health. A path segment written `{id}` matches one segment of [A-Za-z0-9_.-].
# Everything else (vLLM's /collective_rpc, /sleep, /wake_up, /reset_*,
# /pause, /update_weights, LoRA loading, profiling, /metrics ...) gets 404 there:
# only the agent reaches those, on 127.0.0.1.
SERVE_ROUTES: tuple[tuple[str, str], ...] = (
    ("GET", "/health"),
    # vLLM's own Prometheus metrics (queue, KV cache use, latencies; counts, never
    # prompts), read-only: what load-aware routers and autoscalers read from the port
    # they route to. The agent's own metrics stay on the admin port.
    ("GET", "/metrics"),
    ("GET", "/version"),
    ("GET", "/v1/models"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/embeddings"),
    ("POST", "/v1/responses"),
    ("GET", "/v1/responses/{id}"),
    ("POST", "/v1/responses/{id}/cancel"),
    ("POST", "/v1/audio/transcriptions"),
    ("POST", "/v1/audio/translations"),
    ("POST", "/v1/messages"),
    ("POST", "/v1/messages/count_tokens"),
    ("POST", "/v1/score"),
    ("POST", "/v1/rerank"),
    ("POST", "/v2/rerank"),
    ("POST", "/score"),
    ("POST", "/rerank"),
    ("POST", "/pooling"),
    ("POST", "/classify"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
)


class CheckpointRequest(TypedDict):
    """POST /v1/checkpoint body: where to write (below the agent's --checkpoint-root)."""

    dir: str


class LastCheckpoint(TypedDict, total=False):
    """StatusDoc.last_checkpoint: the agent's most recent checkpoint, finished or failed."""

    dir: str
    ok: bool
    error: str  # when not ok
    reason: str  # when not ok: one of CHECKPOINT_FAILURE_REASONS
    timings: dict[str, float]  # seconds per phase, when ok
    # How its pages images are protected for the replicas that map them:
    # "immutable" (chattr +i), or "read-only: <why not immutable>".
    images_protection: str
    # The same for the weight dump, which reloads map only when "immutable";
    # "none: ..." when the checkpoint has no weight dump.
    weights_protection: str
    # Node storage with publishing: where the node agent copied it on shared storage
    # ("published to ..."), or why not ("not published, only this node has it: ...").
    published: str


class RestoreMemoryDoc(TypedDict):
    """StatusDoc.restore_memory: how the last restore brought the memory back, and why."""

    path: Literal["mmap", "copy"]  # mapped from the images (--mmap-restore) or copied
    why: str


class SecurityDoc(TypedDict):
    """StatusDoc.security: what protects this agent's checkpoints and serve port."""

    checkpoint_signing: str  # "hmac-sha256" (with a key id) or "unsigned"
    signing_key_id: str | None  # a public tag of the key (not the key), to match services
    verify: str  # the content check a restore runs (--verify-checksums)
    serve_api_key: bool  # the serve port requires an API key
    # The checkpoint this pod restores from, inside the pod: "read-only" (a
    # read-only bind mount over it), "read-write: <why not>", or "none".
    checkpoint_mount: str
    admin_tls: bool  # the admin port serves HTTPS only (--admin-tls-cert, --admin-tls-key)


class ResidencyDoc(TypedDict):
    """StatusDoc.residency: how much of the pod's checkpoint is in the node's page cache."""

    path: str
    files: int
    bytes: int  # the files' size in whole pages
    resident_bytes: int
    percent: float
    tool: str  # vmtouch, or mincore where vmtouch is not installed
    seconds: float  # what asking cost


class ResidentLockDoc(TypedDict):
    """StatusDoc.resident_lock: the checkpoint locked in the page cache (--keep-resident-mb)."""

    budget_bytes: int
    checkpoint: str | None
    files: int
    locked_bytes: int
    why: str  # what was left out or why nothing is locked ("" when all is)


class StatusDoc(TypedDict):
    """GET /v1/status: the agent's state and how its vLLM came up."""

    state: State
    ready: bool
    origin: Origin
    restored_with_mmap: bool
    restore_memory: RestoreMemoryDoc | None  # None until a restore was tried
    checkpoint: str | None  # the checkpoint the running vLLM came from
    message: str
    started_at: float  # wall clock when the agent started
    ready_at: float | None  # wall clock when it last became Ready
    timings: dict[str, dict[str, float]]  # boot/restore/checkpoint phase seconds
    last_fallback: dict[str, Any] | None  # reason, message, at
    last_checkpoint: LastCheckpoint | None
    weights_rpc: str  # available | unavailable | unknown
    vllm_pid: int | None
    inflight: int
    states: list[str]
    security: SecurityDoc
    # The checkpoint the running vLLM came from, in the page cache (None: no checkpoint).
    residency: ResidencyDoc | None
    resident_lock: ResidentLockDoc | None  # None: --keep-resident-mb 0


@dataclass
class StatusReply:
    """GET /v1/status, parsed; fields an older agent lacks take their defaults."""

    state: State
    origin: Origin
    ready: bool
    checkpoint: str | None
    timings: dict[str, dict[str, float]] = field(default_factory=dict)
    last_fallback: dict[str, Any] | None = None
    restored_with_mmap: bool = False
    restore_memory: dict[str, Any] | None = None
    message: str = ""
    started_at: float | None = None
    ready_at: float | None = None
    last_checkpoint: LastCheckpoint | None = None
    security: dict[str, Any] = field(default_factory=dict)
    residency: dict[str, Any] | None = None
    raw: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StatusReply:
        return cls(
            state=data["state"],
            origin=data.get("origin", "none"),
            ready=bool(data.get("ready", False)),
            checkpoint=data.get("checkpoint"),
            timings=data.get("timings", {}),
            last_fallback=data.get("last_fallback"),
            restored_with_mmap=bool(data.get("restored_with_mmap", False)),
            restore_memory=data.get("restore_memory"),
            message=str(data.get("message", "")),
            started_at=data.get("started_at"),
            ready_at=data.get("ready_at"),
            last_checkpoint=data.get("last_checkpoint"),
            security=dict(data.get("security") or {}),
            residency=data.get("residency"),
            raw=data,
        )

    def start_to_ready_seconds(self) -> float | None:
        """Agent start to its last Ready, on the agent's own clock; None before the first."""
        if self.started_at is None or self.ready_at is None:
            return None
        return max(0.0, self.ready_at - self.started_at)


class AgentError(RuntimeError):
    """The agent answered with an error status; .status and .body say which."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"agent answered HTTP {status}: {body[:500]}")
        self.status = status
        self.body = body


def client_tls_context(ca: bytes | str | None) -> ssl.SSLContext:
    """TLS 1.2 or later, trusting only ca: PEM bytes, or a PEM file's path (None: the system's).

    Only the given CA, not the system's as well: the agent's certificate comes
    from the service's own issuer, and any public CA's certificate for the
    same name must not pass.
    """
    if isinstance(ca, bytes):
        ctx = ssl.create_default_context(cadata=ca.decode("ascii"))
    else:
        ctx = ssl.create_default_context(cafile=ca)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


class NamedHTTPSConnection(http.client.HTTPSConnection):
    """HTTPS to one address (a pod IP) with the certificate checked against another name.

    Pod IPs are not known when the certificate is issued, so it names a DNS
    name (the Service's) instead: the TCP connection goes to the URL's host,
    while SNI and the hostname check use server_name.
    """

    def __init__(self, host: str, *, server_name: str, context: ssl.SSLContext, **kw: Any) -> None:
        super().__init__(host, context=context, **kw)
        self.server_name = server_name
        self.tls = context

    def connect(self) -> None:
        http.client.HTTPConnection.connect(self)  # TCP (and a proxy's tunnel), no TLS yet
        self.sock = self.tls.wrap_socket(self.sock, server_hostname=self.server_name)


class NamedHTTPSHandler(urllib.request.HTTPSHandler):
    """urllib's HTTPS with NamedHTTPSConnection: errors stay urllib's (HTTPError, URLError)."""

    def __init__(self, context: ssl.SSLContext, server_name: str) -> None:
        super().__init__(context=context)
        self.tls = context
        self.server_name = server_name

    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        def connection(host: str, **kw: Any) -> http.client.HTTPConnection:
            return NamedHTTPSConnection(host, server_name=self.server_name, context=self.tls, **kw)

        return self.do_open(connection, req)


class AgentClient:
    """Stdlib client of the admin API (the operator's side).

    For an agent with --admin-tls-cert: an https:// base_url, ca (the issuer's
    PEM, as bytes or a file's path) and server_name (the DNS name in the
    agent's certificate, checked even though base_url names the pod's IP).
    """

    def __init__(
        self,
        base_url: str,
        token: str,
        timeout: float = 30.0,
        *,
        ca: bytes | str | None = None,
        server_name: str | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.timeout = timeout
        self._open = _opener(self.base_url, ca, server_name)

    def _call(
        self, method: str, path: str, body: object | None = None, timeout: float | None = None
    ) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base_url + path, data=data, method=method)
        req.add_header("Authorization", f"Bearer {self.token}")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with self._open(req, timeout=timeout or self.timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            raise AgentError(e.code, e.read().decode(errors="replace")) from e
        return json.loads(raw) if raw else None

    def status(self) -> StatusReply:
        return StatusReply.from_json(self._call("GET", PATH_STATUS))

    def checkpoint(self, directory: str, timeout: float = 900.0) -> Manifest:
        """Drain, dump, verify by restoring; returns the manifest. Blocks until done."""
        body: CheckpointRequest = {"dir": directory}
        out: Manifest = self._call("POST", PATH_CHECKPOINT, body, timeout=timeout)
        return out

    def prewarm(self, directory: str) -> dict[str, Any]:
        """Have this pod's node cache the checkpoint directory names (answers at once)."""
        out: dict[str, Any] = self._call("POST", PATH_PREWARM, {"dir": directory})
        return out

    def load_lora(self, name: str, directory: str) -> dict[str, Any]:
        """Have vLLM load the adapter in directory (relative to the model's) as name."""
        out: dict[str, Any] = self._call("POST", PATH_LORA_LOAD, {"name": name, "dir": directory})
        return out

    def unload_lora(self, name: str) -> dict[str, Any]:
        out: dict[str, Any] = self._call("POST", PATH_LORA_UNLOAD, {"name": name})
        return out

    def ready(self) -> bool:
        req = urllib.request.Request(self.base_url + PATH_READYZ)
        try:
            with self._open(req, timeout=self.timeout) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False


class RefuseRedirects(urllib.request.HTTPRedirectHandler):
    """A 3xx is an error, never followed: a redirect would send the bearer token to
    whatever host an impostor (or a compromised pod) names."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None  # urllib then raises the 3xx as an HTTPError


def _opener(base_url: str, ca: bytes | str | None, server_name: str | None) -> Callable[..., Any]:
    """An opener that goes straight to base_url: no environment proxy (HTTP_PROXY would
    see the token), no redirects; with TLS settings, one that verifies with them.

    A CA or a server name with a plain http:// URL is refused rather than
    ignored: the caller meant TLS, and the token must not go out in clear.
    """
    handlers: list[urllib.request.BaseHandler] = [
        urllib.request.ProxyHandler({}),
        RefuseRedirects(),
    ]
    if ca is not None or server_name is not None:
        url = urllib.parse.urlsplit(base_url)
        if url.scheme != "https":
            raise ValueError(f"{base_url}: a CA or server name needs an https:// URL")
        handlers.append(
            NamedHTTPSHandler(client_tls_context(ca), server_name or url.hostname or "")
        )
    return urllib.request.build_opener(*handlers).open
