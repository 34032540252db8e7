"""The front's HTTP side: forward to a Ready replica, hold while there is none,
and answer the autoscaler's /load.

A held request waits for a Ready replica, polling the service's EndpointSlices
every --poll seconds; a replica that refuses the connection (it just went away)
sends the request back to waiting, since nothing of it was sent. Past
--hold-timeout it is answered 503 with Retry-After. Requests for a path the
agents would not forward, or for a service that does not exist, are answered
at once and never held, so they cannot wake a service.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import Counter as Tally
from dataclasses import dataclass
from typing import Any

from aiohttp import ClientError, ClientSession, ClientTimeout, TCPConnector, web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from rekindle_agent.serving import relay, serve_routes
from rekindle_contract import api

from rekindle_front import load
from rekindle_front.cache import TtlCache
from rekindle_front.kube import KubeError, KubeReader, Replica

log = logging.getLogger("rekindle.front")
SERVE_PORT_NAME = "http"
# How long the front trusts what it read from the API server: Ready replicas for a
# poll interval (FrontConfig.poll_s), a service's existence for this long.
EXISTS_TTL_S = 10.0
HOLD_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120, 300)
# Below KEDA's own HTTP timeout (3 s): a busy replica's slow /get_load must not make
# /load late; the front's own in-flight count stands in for what it could not read.
LOAD_TIMEOUT_S = 1.5
CONNECT_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class FrontConfig:
    hold_timeout_s: float = 120.0
    poll_s: float = 0.25
    max_held: int = 1024
    max_body_mb: int = 64
    upstream_timeout_s: float = 600.0
    retry_after_s: int = 5


class FrontMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.held = Gauge(
            "rekindle_front_held_requests",
            "Requests held while their service has no Ready replica",
            ["namespace", "service"],
            registry=r,
        )
        self.hold_seconds = Histogram(
            "rekindle_front_hold_seconds",
            "Time a request waited for a Ready replica (0 when one was Ready), by outcome",
            ["namespace", "service", "outcome"],
            buckets=HOLD_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            "rekindle_front_requests_total",
            "Requests answered by the front, by status code",
            ["namespace", "service", "code"],
            registry=r,
        )


class Front:
    """State shared by the handlers: held and in-flight counts, the upstream session."""

    def __init__(self, kube: KubeReader, cfg: FrontConfig) -> None:
        self.kube = kube
        self.cfg = cfg
        self.metrics = FrontMetrics()
        self.held: Tally[tuple[str, str]] = Tally()
        self.inflight: Tally[str] = Tally()  # per replica URL
        self.forwarded: Tally[tuple[str, str]] = Tally()  # in flight per service
        self.session: ClientSession | None = None  # the replicas' /get_load reads
        self.upstreams = relay.Upstreams(CONNECT_TIMEOUT_S)  # requests relayed
        self.ready_cache: TtlCache[tuple[str, str], list[Replica]] = TtlCache(cfg.poll_s)
        self.exists_cache: TtlCache[tuple[str, str], bool] = TtlCache(EXISTS_TTL_S)

    def client(self) -> ClientSession:
        if self.session is None or self.session.closed:
            self.session = ClientSession(
                connector=TCPConnector(limit=0),
                timeout=ClientTimeout(
                    total=None,
                    sock_connect=CONNECT_TIMEOUT_S,
                    sock_read=self.cfg.upstream_timeout_s,
                ),
            )
        return self.session

    def pick(self, replicas: list[Replica]) -> Replica:
        """The replica this front has the fewest requests in flight to (ties: any)."""
        least = min(self.inflight[r.url] for r in replicas)
        return random.choice([r for r in replicas if self.inflight[r.url] == least])

    async def close(self) -> None:
        await self.upstreams.close()
        if self.session is not None:
            await self.session.close()
        await self.kube.close()


FRONT_KEY: web.AppKey[Front] = web.AppKey("front", Front)


def unavailable(message: str, retry_after_s: int) -> web.Response:
    return relay.error(message, 503, "unavailable", {"Retry-After": str(retry_after_s)})


async def _replicas(front: Front, ns: str, name: str) -> list[Replica]:
    try:
        return await front.ready_cache.get(
            (ns, name), lambda: front.kube.replicas(ns, name, SERVE_PORT_NAME)
        )
    except (KubeError, ClientError, TimeoutError) as e:
        log.warning("reading %s/%s's replicas: %s", ns, name, e)
        return []


async def forward(request: web.Request) -> web.StreamResponse:
    front = request.app[FRONT_KEY]
    ns, name = request.match_info["namespace"], request.match_info["service"]
    resp = await _forward(request, front, ns, name)
    front.metrics.requests.labels(ns, name, str(resp.status)).inc()
    return resp


def _tail(request: web.Request, ns: str, name: str) -> str | None:
    """The path after /NS/NAME (its query kept) if the agents would forward it, else None."""
    prefix = f"/{ns}/{name}/"
    raw = request.raw_path
    tail = raw[len(prefix) - 1 :] if raw.startswith(prefix) else ""
    return tail if serve_routes.allowed(request.method, tail.split("?", 1)[0]) else None


async def _forward(request: web.Request, front: Front, ns: str, name: str) -> web.StreamResponse:
    tail = _tail(request, ns, name)
    if tail is None:
        return relay.error(
            f"no such route: {request.method} {request.raw_path}", 404, "invalid_request_error"
        )
    try:
        exists = await front.exists_cache.get(
            (ns, name), lambda: front.kube.service_exists(ns, name)
        )
    except (KubeError, ClientError, TimeoutError) as e:
        return unavailable(
            f"cannot read InferenceService {ns}/{name}: {e}", front.cfg.retry_after_s
        )
    if not exists:
        return relay.error(f"no InferenceService {ns}/{name}", 404, "invalid_request_error")
    body = await request.read()
    hold = Hold(front, ns, name)
    try:
        while True:
            replicas = await _replicas(front, ns, name)
            if replicas:
                hold.release()  # held no more: counted as forwarded from here
                waited = hold.elapsed()  # the hold ends here, not with the answer
                resp = await _send(front, request, front.pick(replicas), tail, body, (ns, name))
                if resp is not None:
                    hold.observe("served", waited)
                    return resp
            refused = hold.take()
            if refused is not None:
                return refused
            await asyncio.sleep(front.cfg.poll_s)
    finally:
        hold.release()


class Hold:
    """One request's wait for a Ready replica: counted in held (what /load and the
    held gauge report) only while it waits; its hold time observed once."""

    def __init__(self, front: Front, ns: str, name: str) -> None:
        self.front, self.ns, self.name = front, ns, name
        self.start = time.monotonic()
        self.counted = False

    def take(self) -> web.Response | None:
        """Count the request held (if not yet); a response when it may wait no longer."""
        front, key = self.front, (self.ns, self.name)
        if not self.counted:
            if front.held[key] >= front.cfg.max_held:
                return unavailable(
                    f"{front.held[key]} requests already wait for {self.ns}/{self.name} "
                    "(--max-held)",
                    front.cfg.retry_after_s,
                )
            self.counted = True
            self._count(+1)
        if time.monotonic() - self.start >= front.cfg.hold_timeout_s:
            self.observe("timeout")
            return unavailable(
                f"no replica of {self.ns}/{self.name} became Ready within "
                f"{front.cfg.hold_timeout_s:g}s (--hold-timeout)",
                front.cfg.retry_after_s,
            )
        return None

    def release(self) -> None:
        if self.counted:
            self.counted = False
            self._count(-1)

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def observe(self, outcome: str, seconds: float | None = None) -> None:
        self.front.metrics.hold_seconds.labels(self.ns, self.name, outcome).observe(
            self.elapsed() if seconds is None else seconds
        )

    def _count(self, delta: int) -> None:
        key = (self.ns, self.name)
        self.front.held[key] += delta
        self.front.metrics.held.labels(self.ns, self.name).set(self.front.held[key])


async def _send(
    front: Front,
    request: web.Request,
    replica: Replica,
    tail: str,
    body: bytes,
    key: tuple[str, str],
) -> web.StreamResponse | None:
    """Relay the request to replica; None if it refused the connection (it went away
    before taking the request: nothing was sent, so the request may wait for another)."""
    front.inflight[replica.url] += 1
    front.forwarded[key] += 1
    try:
        return await relay.relay(
            request,
            front.upstreams,
            relay.Address(replica.address, replica.port),
            tail,
            body,
            timeout_s=front.cfg.upstream_timeout_s,
            upstream=f"replica {replica.address}",
            refused_is_error=False,
        )
    except relay.UpstreamRefused:
        return None
    finally:
        _decrement(front.inflight, replica.url)
        _decrement(front.forwarded, key)


def _decrement(tally: Tally[Any], key: Any) -> None:
    """One less; no zero entries kept (replicas and services come and go)."""
    tally[key] -= 1
    if not tally[key]:
        del tally[key]


async def _queue(front: Front, replica: Replica) -> load.Queue | None:
    """One replica's queue from its serve port's GET /get_load (vLLM's own gauges, read
    by its agent; open without the service's API key); None: not readable."""
    url = replica.url + api.PATH_SERVE_LOAD
    try:
        async with front.client().get(url, timeout=ClientTimeout(total=LOAD_TIMEOUT_S)) as r:
            if r.status != 200:
                log.warning("%s: HTTP %d", url, r.status)
                return None
            return load.parse_load(await r.json())
    except (ClientError, TimeoutError, ValueError) as e:
        log.warning("%s: %r", url, e)
        return None


async def service_load(request: web.Request) -> web.Response:
    """vLLM's queue over the service's Ready replicas, plus the requests held here."""
    front = request.app[FRONT_KEY]
    ns, name = request.match_info["namespace"], request.match_info["service"]
    key = (ns, name)
    replicas = await _replicas(front, ns, name)
    queues = await asyncio.gather(*(_queue(front, r) for r in replicas))
    got = load.total(list(queues), held=front.held[key], forwarded=front.forwarded[key])
    return web.json_response(got.as_json())


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[FRONT_KEY].metrics.registry)
    return web.Response(body=body, content_type="text/plain", charset="utf-8")


async def healthz(_request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


def app(front: Front) -> web.Application:
    a = web.Application(client_max_size=front.cfg.max_body_mb << 20)
    a[FRONT_KEY] = front
    a.router.add_get("/healthz", healthz)
    a.router.add_get("/metrics", metrics)
    a.router.add_get("/load/{namespace}/{service}", service_load)
    a.router.add_route("*", "/{namespace}/{service}/{tail:.*}", forward)

    async def closing(_a: web.Application) -> None:
        with contextlib.suppress(Exception):
            await front.close()

    a.on_cleanup.append(closing)
    return a
