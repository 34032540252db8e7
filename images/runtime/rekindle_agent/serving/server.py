"""HTTP side of the agent: the admin API and the OpenAI reverse proxy (aiohttp).

Handlers are thin: they check the token, read state, count requests, and hand
blocking work to the Agent in a worker thread.

The proxy (serve port) forwards only the allowlisted inference routes
(serve_routes.py), only with the API key when one is configured, at most
--proxy-max-concurrency at once and bodies up to --proxy-max-body-mb, and
gives up on a vLLM that sends nothing for --proxy-timeout seconds.

With --admin-tls-cert and --admin-tls-key the admin port speaks HTTPS only
(TLS 1.2 or later) and picks up a renewed certificate from the same files; the
serve port stays plain HTTP (TLS for clients is the Service's or the ingress's).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import posixpath
import signal
import ssl
import subprocess
import threading
from pathlib import Path
from typing import Any, cast

from aiohttp import ClientError, ClientSession, ClientTimeout, TCPConnector, web
from rekindle_contract import api, lora
from rekindle_store.resident_lock import ResidentLock

from rekindle_agent.agent import Agent
from rekindle_agent.checkpointing import checkpoint
from rekindle_agent.config import ConfigError, admin_tls_context
from rekindle_agent.restoring import residency
from rekindle_agent.serving import relay, serve_routes, vllm_queue
from rekindle_agent.serving.auth import token_ok
from rekindle_agent.supervision.vllm_launch import VLLM_HOST

log = logging.getLogger("rekindle.server")
RETRY_AFTER_S = "2"
CONNECT_TIMEOUT_S = 10.0
VLLM_METRICS_TIMEOUT_S = 2.0
# How often the admin port looks for a renewed certificate (cert-manager renews
# the Secret, the kubelet swaps the mounted files within a minute or so).
CERT_CHECK_S = 60.0
UNAUTHENTICATED = {api.PATH_HEALTHZ, api.PATH_READYZ}
AGENT_KEY = web.AppKey("agent", Agent)
PROXY_KEY: web.AppKey[Proxy] = web.AppKey("proxy")
RESIDENT_KEY: web.AppKey[ResidentLock | None] = web.AppKey("resident")


class Proxy:
    """Counts in-flight requests so a checkpoint can drain them, and the request bodies
    it holds so that together they stay within --proxy-body-buffer-mb."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.inflight = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self.session: ClientSession | None = None  # reads and control calls to vLLM
        self.upstreams = relay.Upstreams(CONNECT_TIMEOUT_S)  # the serving path to vLLM
        self.vllm = relay.Address(VLLM_HOST, agent.cfg.vllm_port)
        self.forwarding = 0  # requests relayed to vLLM now (a floor for its queue)
        self.receiving = 0  # requests whose body is being read (no slot yet)
        self.body_bytes = 0  # bytes of request bodies held, received or arriving

    def hold_body_bytes(self, n: int) -> bool:
        """Count n more bytes of request body held, if they fit the buffer."""
        if self.body_bytes + n > self.agent.cfg.proxy_body_buffer_mb << 20:
            return False
        self.body_bytes += n
        return True

    def drop_body_bytes(self, n: int) -> None:
        self.body_bytes -= n

    def admit(self, capped: bool = True) -> str | None:
        """Count a request in, or say why not ("state", "busy").

        capped=False: a read of vLLM's metrics, small and never refused for the
        concurrency cap (a saturated replica is exactly the one whose queue a router
        or a scraper must see). Atomic on the event loop: state check and count
        happen with no await between.
        """
        if self.agent.status.state != "Ready":
            return "state"
        if capped and self.inflight >= self.agent.cfg.proxy_max_concurrency:
            return "busy"
        self.inflight += 1
        self.idle.clear()
        self.agent.metrics.inflight.set(self.inflight)
        return None

    def release(self) -> None:
        self.inflight -= 1
        self.agent.metrics.inflight.set(self.inflight)
        if self.inflight == 0:
            self.idle.set()

    def client(self) -> ClientSession:
        if self.session is None or self.session.closed:
            self.session = ClientSession(
                connector=TCPConnector(limit=0),
                # No total: a stream may last long; but vLLM must send something
                # every proxy_timeout seconds (a non-streamed answer: all of it).
                timeout=ClientTimeout(
                    total=None,
                    sock_connect=CONNECT_TIMEOUT_S,
                    sock_read=self.agent.cfg.proxy_timeout,
                ),
                auto_decompress=False,
            )
        return self.session

    async def close_connections(self) -> None:
        """No proxy connection to vLLM may be open while CRIU dumps it."""
        await self.upstreams.close()
        if self.session is not None:
            await self.session.close()
            self.session = None


def refuse(agent: Agent, why: str, status: int = 503) -> web.Response:
    agent.metrics.refused.inc()
    return web.json_response(
        {"error": {"message": why, "type": "unavailable", "state": agent.status.state}},
        status=status,
        headers={"Retry-After": RETRY_AFTER_S},
    )


error = relay.error


def _gate(request: web.Request, agent: Agent) -> web.Response | None:
    """The checks before a request is admitted: API key, route, body size.

    GET /get_load alone needs no API key: it tells the number of requests running
    and waiting, nothing of them, and load-aware routers and the front (which
    holds no service's key) must read it to balance and to scale.
    """
    raw_path = request.raw_path.split("?", 1)[0]
    load_read = raw_path == api.PATH_SERVE_LOAD and request.method == "GET"
    if (
        agent.api_key is not None
        and not load_read
        and not token_ok(agent.api_key, request.headers.get("Authorization"))
    ):
        return error(
            "missing or wrong API key", 401, "authentication_error", {"WWW-Authenticate": "Bearer"}
        )
    if raw_path == api.PATH_SERVE_LOAD and request.method != "GET":
        return error(f"{request.method} not allowed on {raw_path}", 405, "invalid_request_error")
    if raw_path != api.PATH_SERVE_LOAD and not serve_routes.allowed(request.method, raw_path):
        if serve_routes.known_path(raw_path):
            return error(
                f"{request.method} not allowed on {raw_path}", 405, "invalid_request_error"
            )
        return error(f"no such route on the serve port: {raw_path}", 404, "invalid_request_error")
    limit = agent.cfg.proxy_max_body_mb << 20
    if request.content_length is not None and request.content_length > limit:
        return error(
            f"request body of {request.content_length} bytes is over the limit of {limit}",
            413,
            "invalid_request_error",
        )
    return None


class BodyRefused(Exception):
    """A request body not taken in; .response says why."""

    def __init__(self, response: web.Response) -> None:
        self.response = response


async def _read_chunks(request: web.Request, proxy: Proxy, got: list[bytes]) -> None:
    limit = proxy.agent.cfg.proxy_max_body_mb << 20
    size = 0
    while chunk := await request.content.readany():
        size += len(chunk)
        if size > limit:
            raise BodyRefused(
                error(f"request body over the limit of {limit} bytes", 413, "invalid_request_error")
            )
        if not proxy.hold_body_bytes(len(chunk)):
            raise BodyRefused(
                refuse(
                    proxy.agent, "request bodies fill the buffer (--proxy-body-buffer-mb); retry"
                )
            )
        got.append(chunk)


async def read_body(request: web.Request, proxy: Proxy, got: list[bytes]) -> None:
    """Read the request body into got within --proxy-body-timeout, counting its bytes
    against --proxy-body-buffer-mb (the caller drops them once the request is done).

    Before any slot is taken: a client that sends its body slowly, or never, holds
    only its own connection, not one of the requests vLLM may run at once.
    """
    proxy.receiving += 1
    try:
        await asyncio.wait_for(
            _read_chunks(request, proxy, got), proxy.agent.cfg.proxy_body_timeout
        )
    except TimeoutError as e:
        raise BodyRefused(
            error(
                f"the request body did not arrive within {proxy.agent.cfg.proxy_body_timeout:g}s "
                "(--proxy-body-timeout)",
                408,
                "invalid_request_error",
                {"Connection": "close"},
            )
        ) from e
    finally:
        proxy.receiving -= 1


async def proxy_handler(request: web.Request) -> web.StreamResponse:
    proxy = request.app[PROXY_KEY]
    agent = proxy.agent
    refused = _gate(request, agent)
    if refused is not None:
        return refused
    if agent.status.state != "Ready":  # before reading a body that would be refused anyway
        return refuse(agent, f"agent is {agent.status.state}; retry")
    if request.raw_path.split("?", 1)[0] == api.PATH_SERVE_LOAD:
        return await serve_load(proxy)
    chunks: list[bytes] = []
    try:
        await read_body(request, proxy, chunks)
        return await _forward(request, proxy, b"".join(chunks))
    except BodyRefused as e:
        return e.response
    finally:
        proxy.drop_body_bytes(sum(map(len, chunks)))


async def _forward(request: web.Request, proxy: Proxy, body: bytes) -> web.StreamResponse:
    """Send the request, body in hand, to vLLM within a concurrency slot."""
    agent = proxy.agent
    why = proxy.admit()
    if why == "busy":
        return refuse(
            agent,
            f"{proxy.inflight} requests in flight, the limit (--proxy-max-concurrency); retry",
            429,
        )
    if why is not None:
        return refuse(agent, f"agent is {agent.status.state}; retry")
    proxy.forwarding += 1
    try:
        # The API key stops here: never in vLLM's memory, so never in a checkpoint.
        return await relay.relay(
            request,
            proxy.upstreams,
            proxy.vllm,
            request.raw_path,  # exactly the path the allowlist matched
            body,
            drop_headers={"authorization"} if agent.api_key is not None else (),
            timeout_s=agent.cfg.proxy_timeout,
            upstream="vLLM",
            timeout_hint="--proxy-timeout",
        )
    finally:
        proxy.forwarding -= 1
        proxy.release()


def _authorized(agent: Agent, request: web.Request) -> bool:
    """The admin token opens every route; the metrics token only GET /metrics."""
    header = request.headers.get("Authorization")
    if request.path in UNAUTHENTICATED or token_ok(agent.token, header):
        return True
    return (
        agent.metrics_token is not None
        and request.method == "GET"
        and request.path == api.PATH_METRICS
        and token_ok(agent.metrics_token, header)
    )


@web.middleware
async def auth_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    agent = request.app[AGENT_KEY]
    if not _authorized(agent, request):
        return web.json_response(
            {"error": "missing or wrong bearer token"},
            status=401,
            headers={"WWW-Authenticate": "Bearer"},
        )
    resp: web.StreamResponse = await handler(request)
    return resp


async def healthz(request: web.Request) -> web.Response:
    """Liveness: only Failed is unhealthy (a long boot or restore is alive)."""
    state = request.app[AGENT_KEY].status.state
    return web.json_response({"state": state}, status=503 if state == "Failed" else 200)


async def readyz(request: web.Request) -> web.Response:
    state = request.app[AGENT_KEY].status.state
    return web.json_response({"state": state}, status=200 if state == "Ready" else 503)


async def status(request: web.Request) -> web.Response:
    agent = request.app[AGENT_KEY]
    doc = agent.status_doc(request.app[PROXY_KEY].inflight)
    where = agent.backend.where(doc["checkpoint"])
    doc["residency"] = await asyncio.to_thread(checkpoint_residency, where)
    lock = request.app.get(RESIDENT_KEY)
    doc["resident_lock"] = cast(api.ResidentLockDoc, lock.doc()) if lock else None
    return web.json_response(doc)


def checkpoint_residency(ckpt: str | None) -> api.ResidencyDoc | None:
    """How much of ckpt is in the page cache; None without one (or when it is gone).

    Measured at most every residency.CACHE_S seconds: the operator polls the status."""
    if not ckpt:
        return None
    try:
        return cast(api.ResidencyDoc, residency.cached_residency(ckpt))
    except (OSError, ValueError, subprocess.SubprocessError) as e:
        log.warning("residency of %s: %s", ckpt, e)
        return None


def newest_checkpoint(agent: Agent) -> tuple[str, list[tuple[str, int]]] | None:
    """The checkpoint to keep resident: the one the serving vLLM came from (restored, or
    just made and proven), once Ready, so locking never competes with a restore."""
    ckpt = agent.backend.where(agent.status.checkpoint)
    if agent.status.state != "Ready" or not ckpt or not os.path.isdir(ckpt):
        return None
    return ckpt, residency.checkpoint_files(ckpt)


async def metrics(request: web.Request) -> web.Response:
    """The agent's metrics, then vLLM's own `vllm:*` families when it is serving.

    vLLM listens on loopback only, so this is the one place a scraper sees them.
    """
    body = request.app[AGENT_KEY].metrics.render() + await vllm_metrics(request.app[PROXY_KEY])
    return web.Response(body=body, content_type="text/plain", charset="utf-8")


async def vllm_metrics(proxy: Proxy) -> bytes:
    """vLLM's `vllm:*` families for the admin /metrics; empty when they cannot be read:
    the agent's own metrics must never wait on, or fail with, vLLM's."""
    text = await read_vllm_metrics(proxy)
    return b"" if text is None else only_vllm_families(text)


async def read_vllm_metrics(proxy: Proxy) -> bytes | None:
    """vLLM's /metrics, counted as an in-flight request so a checkpoint drains it.

    None when vLLM is not serving (restoring, checkpointing), answers other than 200,
    or not within VLLM_METRICS_TIMEOUT_S.
    """
    if proxy.admit(capped=False) is not None:
        return None
    try:
        async with proxy.client().get(
            proxy.agent.vllm_url + "/metrics",
            # The proxy's session never decompresses: ask for plain text.
            headers={"Accept-Encoding": "identity"},
            timeout=ClientTimeout(total=VLLM_METRICS_TIMEOUT_S),
        ) as resp:
            return await resp.read() if resp.status == 200 else None
    except (ClientError, TimeoutError):
        return None
    finally:
        proxy.release()


async def serve_load(proxy: Proxy) -> web.Response:
    """GET /get_load on the serve port: this replica's engine queue, for load-aware routers.

    The agent answers it, from vLLM's own running and waiting gauges: vLLM has no
    such route, and its /load counts HTTP requests only with a flag we do not set.
    Read on each call (a router polls every few seconds), never cached, so a
    router never balances on a stale queue. The requests the agent is relaying to
    vLLM are a floor for running + waiting, and the answer when vLLM is too busy
    to answer its metrics in time: a saturated replica must never read as idle.
    """
    text = await read_vllm_metrics(proxy)
    if text is None and proxy.agent.status.state != "Ready":
        return refuse(proxy.agent, "vLLM's metrics could not be read; retry")
    read = vllm_queue.parse_queue(text.decode("utf-8", "replace")) if text else vllm_queue.Queue()
    queue = vllm_queue.at_least(read, proxy.forwarding)
    proxy.agent.metrics.load_reads.inc()
    return web.json_response(queue.as_json())


def only_vllm_families(text: bytes) -> bytes:
    """Keep vLLM's `vllm:` families; drop its process_/python_ ones, which would
    clash with the agent's own registry's names in one exposition."""
    kept = []
    for line in text.splitlines(keepends=True):
        words = line.split()
        name = words[2] if line.startswith(b"#") and len(words) > 2 else line
        if name.startswith(b"vllm:"):
            kept.append(line)
    return b"".join(kept)


def _checkpoint_refused(
    agent: Agent,
    target: object,
    reason: str,
    message: str,
    status: int,
    headers: dict[str, str] | None = None,
) -> web.Response:
    """A checkpoint given up before anything was dumped: recorded, counted, answered."""
    agent.status.last_checkpoint = {
        "dir": str(target),
        "ok": False,
        "reason": reason,
        "error": message,
    }
    agent.metrics.checkpoints.labels("failed").inc()
    return web.json_response({"error": message, "reason": reason}, status=status, headers=headers)


async def post_checkpoint(request: web.Request) -> web.Response:
    agent = request.app[AGENT_KEY]
    proxy = request.app[PROXY_KEY]
    try:
        data = await request.json()
        target = checkpoint.check_target(str(data.get("dir", "")), agent.cfg.checkpoint_root)
    except (ValueError, json.JSONDecodeError, AttributeError) as e:
        return web.json_response({"error": f"bad request: {e}"}, status=400)
    if agent.status.restored_with_mmap and not agent.criu_info().mmap_restore:
        # Only the patched CRIU (the one that has --mmap-restore) dumps memory that is
        # still mapped from the old pages image as the anonymous memory it stands for.
        return web.json_response(
            {
                "error": "this vLLM was restored with the mmap restore and still maps "
                f"{agent.status.checkpoint}; {agent.cfg.criu} cannot dump such memory "
                "as its own. Use the patched CRIU or checkpoint a pod with "
                "restored_with_mmap=false"
            },
            status=409,
        )
    if agent.status.state != "Ready" or not agent.flow_lock.acquire(blocking=False):
        return web.json_response(
            {"error": f"agent is {agent.status.state}; checkpoint only from Ready"},
            status=409,
            headers={"Retry-After": RETRY_AFTER_S},
        )
    no_room = await asyncio.to_thread(agent.space_problem, target)
    if no_room is not None:  # before draining: serving untouched
        agent.flow_lock.release()
        return _checkpoint_refused(agent, target, "insufficient_space", no_room, 507)
    try:
        agent.guard(f"the checkpoint to {target}", target)
        agent.set_state("Draining", f"checkpoint to {target}")
        try:
            await asyncio.wait_for(proxy.idle.wait(), agent.cfg.drain_timeout)
        except TimeoutError:
            message = (
                f"{proxy.inflight} requests still running after "
                f"{agent.cfg.drain_timeout:g}s; checkpoint cancelled, retry later "
                "or raise --drain-timeout"
            )
            agent.unguard()
            agent.set_state("Ready", "drain timed out; checkpoint cancelled")
            return _checkpoint_refused(
                agent, target, "drain_timeout", message, 503, {"Retry-After": RETRY_AFTER_S}
            )
        await proxy.close_connections()
        agent.set_state("Checkpointing", f"dumping to {target}")
        flow = asyncio.ensure_future(asyncio.to_thread(agent.run_checkpoint, target))
        while not flow.done() and not agent.terminal:
            await asyncio.wait({flow}, timeout=0.5)
        if agent.terminal:
            # The watchdog ended it: the thread is abandoned (or came back with
            # whatever killing CRIU made of it); the watchdog's reason stands,
            # once it has recorded everything.
            await asyncio.to_thread(agent.flow_aborted.wait, 60)
            if flow.done():
                flow.exception()  # retrieved, so asyncio does not log it
            return web.json_response(
                {
                    "error": agent.status.message,
                    "reason": "watchdog",
                    "status": agent.status_doc(proxy.inflight),
                },
                status=500,
            )
        try:
            man = flow.result()
        except checkpoint.CheckpointError as e:
            return web.json_response(
                {
                    "error": str(e),
                    "reason": e.reason,
                    "status": agent.status_doc(proxy.inflight),
                },
                status=500,
            )
        return web.json_response(man)
    finally:
        agent.unguard()
        agent.flow_lock.release()


async def post_prewarm(request: web.Request) -> web.Response:
    """Start pulling a checkpoint into this node's cache (restoring/prewarm.py)."""
    agent = request.app[AGENT_KEY]
    try:
        data = await request.json()
        target = str(data.get("dir", ""))
    except (json.JSONDecodeError, AttributeError) as e:
        return web.json_response({"error": f"bad request: {e}"}, status=400)
    root = posixpath.normpath(agent.cfg.checkpoint_root or "/")
    if (
        not target.startswith("/")
        or posixpath.normpath(target) != target
        or posixpath.dirname(target) != root
    ):
        why = f"'dir' must be a directory directly below the checkpoint root {root}"
        return web.json_response({"error": why}, status=400)
    if not agent.prewarmer.supported(Path(target)):
        return web.json_response(
            {
                "error": "pre-warming needs storage type node with a published checkpoint "
                "(spec.coldStart.storage.node.publish)"
            },
            status=409,
        )
    started, state = agent.prewarmer.request(Path(target))
    body = {"started": started, "checkpoint": state.checkpoint, "state": state.state}
    return web.json_response(body, status=202)


async def _lora_body(request: web.Request, keys: tuple[str, ...]) -> dict[str, str]:
    """The JSON object's string fields keys, each required; ValueError says what is wrong."""
    try:
        data = await request.json()
    except json.JSONDecodeError as e:
        raise ValueError(f"the body is not JSON: {e}") from e
    if not isinstance(data, dict) or not all(isinstance(data.get(k), str) for k in keys):
        raise ValueError(f"the body must be a JSON object with {' and '.join(keys)} (strings)")
    return {k: data[k] for k in keys}


async def _to_vllm(proxy: Proxy, path: str, body: dict[str, str]) -> web.Response:
    """POST body to vLLM's own route path, counted in flight (a checkpoint drains it)."""
    why = proxy.admit(capped=False)
    if why is not None:
        return refuse(proxy.agent, f"agent is {proxy.agent.status.state}; retry")
    try:
        async with proxy.client().post(
            proxy.agent.vllm_url + path, json=body, timeout=ClientTimeout(total=120)
        ) as resp:
            text = await resp.text()
        if resp.status != 200:
            return web.json_response({"error": text.strip()}, status=resp.status)
        return web.json_response({"result": text.strip()})
    except (ClientError, TimeoutError) as e:
        return web.json_response({"error": f"vLLM unreachable: {e!r}"}, status=502)
    finally:
        proxy.release()


async def post_lora_load(request: web.Request) -> web.Response:
    """Load a LoRA adapter from a directory inside the model's: vLLM's own
    /v1/load_lora_adapter, reached only from here (the serve port never forwards it).

    The adapter then lives in vLLM's memory: the next checkpoint holds it, and every
    replica restored from that checkpoint serves it.
    """
    agent, proxy = request.app[AGENT_KEY], request.app[PROXY_KEY]
    if not agent.cfg.lora_max_adapters:
        return web.json_response({"error": "LoRA is off: set spec.lora"}, status=409)
    try:
        body = await _lora_body(request, ("name", "dir"))
        name, rel = lora.check_name(body["name"]), lora.check_dir(body["dir"])
    except ValueError as e:
        return web.json_response({"error": str(e)}, status=400)
    path = os.path.join(agent.cfg.model, rel)
    if not os.path.isfile(os.path.join(path, "adapter_config.json")):
        why = f"{rel} is not a LoRA adapter in the model's directory (no adapter_config.json)"
        return web.json_response({"error": why}, status=404)
    return await _to_vllm(proxy, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})


async def post_lora_unload(request: web.Request) -> web.Response:
    """Drop a loaded LoRA adapter (vLLM's /v1/unload_lora_adapter)."""
    agent, proxy = request.app[AGENT_KEY], request.app[PROXY_KEY]
    if not agent.cfg.lora_max_adapters:
        return web.json_response({"error": "LoRA is off: set spec.lora"}, status=409)
    try:
        name = lora.check_name((await _lora_body(request, ("name",)))["name"])
    except ValueError as e:
        return web.json_response({"error": str(e)}, status=400)
    return await _to_vllm(proxy, "/v1/unload_lora_adapter", {"lora_name": name})


def admin_app(agent: Agent, proxy: Proxy, lock: ResidentLock | None = None) -> web.Application:
    app = web.Application(middlewares=[auth_middleware])
    app[AGENT_KEY] = agent
    app[PROXY_KEY] = proxy
    app[RESIDENT_KEY] = lock
    app.router.add_get(api.PATH_HEALTHZ, healthz)
    app.router.add_get(api.PATH_READYZ, readyz)
    app.router.add_get(api.PATH_STATUS, status)
    app.router.add_get(api.PATH_METRICS, metrics)
    app.router.add_post(api.PATH_CHECKPOINT, post_checkpoint)
    app.router.add_post(api.PATH_PREWARM, post_prewarm)
    app.router.add_post(api.PATH_LORA_LOAD, post_lora_load)
    app.router.add_post(api.PATH_LORA_UNLOAD, post_lora_unload)
    return app


def proxy_app(agent: Agent, proxy: Proxy) -> web.Application:
    # read_body enforces the body limit itself (413, and the buffer's budget).
    app = web.Application(client_max_size=agent.cfg.proxy_max_body_mb << 20)
    app[AGENT_KEY] = agent
    app[PROXY_KEY] = proxy
    app.router.add_route("*", "/{tail:.*}", proxy_handler)
    return app


def write_ports_file(path: str, ports: dict[str, int]) -> None:
    """{"serve": N, "admin": M}, atomically: a reader sees the whole file or none."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(ports, f)
    os.replace(tmp, path)


async def listen(
    app: web.Application, host: str, port: int, tls: ssl.SSLContext | None = None
) -> tuple[web.AppRunner, int]:
    """Serve app on host:port (HTTPS only with tls); returns the runner and the port bound
    (port 0: the kernel's)."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port, ssl_context=tls).start()
    return runner, int(runner.addresses[0][1])


Stamp = tuple[tuple[int, int, int], ...]


def file_stamp(*paths: str) -> Stamp:
    """(inode, mtime, size) of each file, links followed: the kubelet replaces a mounted
    Secret's files by swapping a symlink, so a renewal shows as a new inode."""
    return tuple((st.st_ino, st.st_mtime_ns, st.st_size) for st in map(os.stat, paths))


def reload_admin_cert(tls: ssl.SSLContext, cert: str, key: str, seen: Stamp) -> Stamp:
    """Load renewed files into the live context (new connections get them); returns the
    stamp now served. A pair that does not load is logged and the old one kept."""
    try:
        now = file_stamp(cert, key)
        if now == seen:
            return seen
        admin_tls_context(cert, key)  # the new pair loads on its own: never half-load `tls`
        tls.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError, ConfigError) as e:
        log.warning("admin TLS: keeping the certificate loaded before: %s", e)
        return seen
    log.info("admin TLS: loaded the renewed certificate from %s", cert)
    return now


async def keep_admin_cert_fresh(tls: ssl.SSLContext, cert: str, key: str) -> None:
    """Every CERT_CHECK_S, load the certificate again if its files changed."""
    seen: Stamp = ()
    with contextlib.suppress(OSError):
        seen = file_stamp(cert, key)
    while True:
        await asyncio.sleep(CERT_CHECK_S)
        seen = reload_admin_cert(tls, cert, key, seen)


async def serve(agent: Agent, starter: threading.Thread, early_stop: threading.Event) -> None:
    """Serve HTTP while the flow started in starter (boot or restore) runs on."""
    cfg = agent.cfg
    proxy = Proxy(agent)
    tls = None
    renewals: asyncio.Task[None] | None = None
    if cfg.admin_tls_cert and cfg.admin_tls_key:
        tls = admin_tls_context(cfg.admin_tls_cert, cfg.admin_tls_key)
        renewals = asyncio.create_task(
            keep_admin_cert_fresh(tls, cfg.admin_tls_cert, cfg.admin_tls_key)
        )
    lock, keeper_stop = None, threading.Event()
    if cfg.keep_resident_mb > 0:
        lock = ResidentLock(cfg.keep_resident_mb << 20, on_spawn=agent.reaper.exempt)
        threading.Thread(
            target=residency.follow,
            args=(lock, lambda: newest_checkpoint(agent), keeper_stop),
            name="keep-resident",
            daemon=True,
        ).start()
    admin, admin_port = await listen(
        admin_app(agent, proxy, lock), cfg.bind_host, cfg.admin_port, tls
    )
    serving, serve_port = await listen(proxy_app(agent, proxy), cfg.bind_host, cfg.serve_port)
    if cfg.ports_file:
        write_ports_file(cfg.ports_file, {"serve": serve_port, "admin": admin_port})
    log.info(
        "agent: admin (%s) on %s:%d, OpenAI proxy on %s:%d, vLLM on %s",
        "HTTPS" if tls else "HTTP",
        cfg.bind_host,
        admin_port,
        cfg.bind_host,
        serve_port,
        agent.vllm_url,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if early_stop.is_set():
        stop.set()
    threading.Thread(target=agent.watch, name="watch", daemon=True).start()
    await stop.wait()
    log.info("agent: stopping")
    agent.stopping = True
    await finish_in_flight(agent, proxy)
    keeper_stop.set()
    if lock is not None:
        lock.release()
    if renewals is not None:
        renewals.cancel()
    with contextlib.suppress(Exception):
        await proxy.close_connections()
    for runner in (admin, serving):
        await runner.cleanup()
    # A boot or restore still running is cut short by killing vLLM's tree.
    await asyncio.to_thread(agent.shutdown)
    await asyncio.to_thread(starter.join, 30)


async def finish_in_flight(agent: Agent, proxy: Proxy) -> None:
    """SIGTERM: new requests are refused at once (503 with Retry-After; /readyz fails, so
    the endpoint leaves the Service) and those in flight, streams too, may finish within
    --shutdown-drain seconds; then whatever is left is cut."""
    if agent.status.state == "Ready":
        agent.set_state("Draining", "stopping: requests in flight may finish")
    if proxy.inflight == 0:
        return
    log.info("stopping: %d request(s) in flight may finish", proxy.inflight)
    try:
        await asyncio.wait_for(proxy.idle.wait(), agent.cfg.shutdown_drain)
    except TimeoutError:
        log.warning(
            "stopping: %d request(s) still running after %gs (--shutdown-drain) are cut",
            proxy.inflight,
            agent.cfg.shutdown_drain,
        )


def run(agent: Agent, starter: threading.Thread, early_stop: threading.Event) -> int:
    """The agent's event loop: uvloop's (libuv) where installed, as vLLM's own server
    runs; it relays each streamed chunk with less CPU than asyncio's own loop."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(agent, starter, early_stop))
    else:
        uvloop.run(serve(agent, starter, early_stop))
    return 0
