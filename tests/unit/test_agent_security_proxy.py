"""The serve port's proxy against a fake vLLM: allowlist, API key, body and concurrency
limits, slow bodies and the body buffer, the timeout to vLLM, and a drain that gives
up with a reason.

No timing margins: the fake vLLM holds the requests that must stay in flight (or
stay silent) until the test releases them, so each outcome is decided by what the
proxy sees, not by how fast a loaded machine runs; the only timeouts that fire are
the ones under test, against requests that cannot finish before them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp import ClientSession, ClientTimeout, web
from aiohttp.test_utils import TestServer
from rekindle_agent.agent import Agent
from rekindle_agent.checkpointing import space
from rekindle_agent.config import AgentConfig
from rekindle_agent.serving.server import Proxy, admin_app, finish_in_flight, proxy_app
from rekindle_contract import api

TOKEN = b"unit-test-token-0123456789"
API_KEY = b"sk-unit-test"
KEY = {"Authorization": "Bearer " + API_KEY.decode()}
WAIT = 60.0  # for what must happen: generous, it only bounds a failing test (no hang)


class FakeVllm:
    """Answers at once, except a completion whose body says "hold": that one is answered
    only after release is set, and says it arrived on arrived."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.arrived: asyncio.Queue[None] = asyncio.Queue()
        self.release = asyncio.Event()
        self.metrics = ""  # what GET /metrics answers (Prometheus text)
        self.metrics_status = 200

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.seen.append(f"{request.method} {request.path_qs}")
        assert "Authorization" not in request.headers  # the API key stops at the agent
        if request.path == "/v1/completions":
            body = await request.json()
            if body.get("hold"):
                self.arrived.put_nowait(None)
                await self.release.wait()
            return web.json_response({"choices": [{"text": "ok"}]})
        if request.path == "/metrics":
            return web.Response(
                text=self.metrics, content_type="text/plain", status=self.metrics_status
            )
        return web.json_response({"path": request.path})

    async def wait_arrived(self, n: int) -> None:
        for _ in range(n):
            await asyncio.wait_for(self.arrived.get(), WAIT)


@dataclass
class Served:
    vllm: FakeVllm
    agent: Agent
    proxy: Proxy
    url: str  # the serve port's
    admin: str  # the admin port's


@asynccontextmanager
async def serving(tmp_path: Path, **cfg: Any) -> AsyncIterator[Served]:
    """A fake vLLM, and an agent (Ready) proxying to it with cfg."""
    vllm = FakeVllm()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", vllm.handle)
    up = TestServer(app, host="127.0.0.1")
    await up.start_server()
    config = AgentConfig(
        model=str(tmp_path),
        run_dir=str(tmp_path),
        vllm_port=up.port or 0,
        worker_extension="none",
        checkpoint_root=str(tmp_path / "ckpts"),
        **cfg,
    )
    agent = Agent(config, TOKEN, api_key=API_KEY)
    proxy = Proxy(agent)
    serve = TestServer(proxy_app(agent, proxy), host="127.0.0.1")
    admin = TestServer(admin_app(agent, proxy), host="127.0.0.1")
    await serve.start_server()
    await admin.start_server()
    try:
        agent.set_state("Ready")
        yield Served(vllm, agent, proxy, str(serve.make_url("/")), str(admin.make_url("/")))
    finally:
        vllm.release.set()
        await proxy.close_connections()
        await serve.close()
        await admin.close()
        await up.close()
        agent.reaper.stop()


async def call(s: ClientSession, method: str, url: str, **kw: Any) -> tuple[int, str]:
    async with s.request(method, url, **kw) as r:
        return r.status, await r.text()


async def _allowlist_and_limits(tmp_path: Path) -> None:
    async with (
        serving(tmp_path, proxy_max_body_mb=1, proxy_timeout=WAIT) as sv,
        ClientSession(timeout=ClientTimeout(total=WAIT)) as s,
    ):
        vllm, proxy, url = sv.vllm, sv.proxy, sv.url
        # The key is checked first, on every path.
        for path in ("v1/completions", "collective_rpc", "health", "nope"):
            assert (await call(s, "POST", url + path, json={}))[0] == 401
            bad = {"Authorization": "Bearer sk-wrong"}
            assert (await call(s, "POST", url + path, json={}, headers=bad))[0] == 401
        # With it: the API passes, the control endpoints do not exist here.
        assert (await call(s, "POST", url + "v1/completions", json={}, headers=KEY))[0] == 200
        assert (await call(s, "GET", url + "v1/models", headers=KEY))[0] == 200
        for path in ("collective_rpc", "sleep?level=1", "wake_up", "reset_prefix_cache"):
            status, text = await call(s, "POST", url + path, json={"method": "x"}, headers=KEY)
            assert status == 404 and "no such route" in text, (path, text)
        assert (await call(s, "GET", url + "v1/completions", headers=KEY))[0] == 405
        assert (await call(s, "POST", url + "v1/completions/../../sleep", headers=KEY))[0] == 404
        assert vllm.seen == ["POST /v1/completions", "GET /v1/models"]
        # Body limit (1 MiB), both declared and chunked; neither reaches vLLM.
        big = b"x" * ((1 << 20) + 1)
        assert (await call(s, "POST", url + "v1/completions", data=big, headers=KEY))[0] == 413

        async def chunks() -> AsyncIterator[bytes]:
            for _ in range(3):
                yield b"y" * (1 << 19)

        status, _ = await call(s, "POST", url + "v1/completions", data=chunks(), headers=KEY)
        assert status == 413
        assert vllm.seen == ["POST /v1/completions", "GET /v1/models"]
        assert proxy.inflight == 0


def test_proxy_allowlist_api_key_and_body_limit(tmp_path: Path) -> None:
    asyncio.run(_allowlist_and_limits(tmp_path))


async def _silent_vllm(tmp_path: Path) -> None:
    async with (
        serving(tmp_path, proxy_timeout=0.5) as sv,
        ClientSession(timeout=ClientTimeout(total=WAIT)) as s,
    ):
        vllm, proxy, url = sv.vllm, sv.proxy, sv.url
        # vLLM silent past --proxy-timeout (it answers only when released, after): 504,
        # not a hung client.
        status, text = await call(s, "POST", url + "v1/completions", json={"hold": 1}, headers=KEY)
        assert status == 504 and "--proxy-timeout" in text, text
        assert vllm.arrived.qsize() == 1  # it did reach vLLM, which stayed silent
        assert proxy.inflight == 0


def test_proxy_times_out_a_silent_vllm(tmp_path: Path) -> None:
    asyncio.run(_silent_vllm(tmp_path))


async def _concurrency_and_drain(tmp_path: Path) -> None:
    limits = {"proxy_max_concurrency": 2, "proxy_timeout": WAIT, "drain_timeout": 0.3}
    async with (
        serving(tmp_path, **limits) as sv,
        ClientSession(timeout=ClientTimeout(total=WAIT)) as s,
    ):
        vllm, proxy, url = sv.vllm, sv.proxy, sv.url
        # Concurrency: 2 in flight (held by vLLM), the third gets 429 with Retry-After.
        held = [
            asyncio.ensure_future(
                call(s, "POST", url + "v1/completions", json={"hold": 1}, headers=KEY)
            )
            for _ in range(2)
        ]
        await vllm.wait_arrived(2)
        assert proxy.inflight == 2
        async with s.post(url + "v1/completions", json={}, headers=KEY) as r:
            assert r.status == 429 and r.headers["Retry-After"]
        # ... and a checkpoint meanwhile gives up draining, with the reason: the two
        # cannot finish before it gives up, vLLM holds them.
        tok = {"Authorization": "Bearer " + TOKEN.decode()}
        body = {"dir": str(tmp_path / "ckpts/c")}
        async with s.post(sv.admin + api.PATH_CHECKPOINT.lstrip("/"), json=body, headers=tok) as r:
            reply = await r.json()
            assert r.status == 503 and reply["reason"] == "drain_timeout", reply
            assert reply["error"].startswith("2 requests still running after 0.3s"), reply
        assert proxy.inflight == 2 and not any(h.done() for h in held)
        doc = sv.agent.status_doc()
        assert doc["state"] == "Ready"
        assert doc["last_checkpoint"] is not None
        assert doc["last_checkpoint"]["reason"] == "drain_timeout"
        vllm.release.set()
        assert [st for st, _ in await asyncio.wait_for(asyncio.gather(*held), WAIT)] == [200, 200]
        assert proxy.inflight == 0
        assert vllm.seen.count("POST /v1/completions") == 2  # the refused one never reached it


def test_proxy_concurrency_limit_and_drain_timeout(tmp_path: Path) -> None:
    asyncio.run(_concurrency_and_drain(tmp_path))


QUEUE = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 1.0
"""


async def _load_for_routers(tmp_path: Path) -> None:
    async with (
        serving(tmp_path, proxy_max_concurrency=1, proxy_timeout=WAIT) as sv,
        ClientSession(timeout=ClientTimeout(total=WAIT)) as s,
    ):
        url = sv.url + api.PATH_SERVE_LOAD.lstrip("/")
        sv.vllm.metrics = QUEUE
        # The one route open without the API key: routers and the front hold none.
        async with s.get(url) as r:
            assert r.status == 200, await r.text()
            assert await r.json() == {"load": 3, "running": 2.0, "waiting": 1.0}
        assert (await call(s, "POST", url))[0] == 401  # only GET is open
        assert (await call(s, "POST", url, headers=KEY))[0] == 405
        assert (await call(s, "GET", url + "/../v1/models"))[0] == 401  # no way past it
        # The one slot taken (the cap is 1): a completion is refused, the load still read.
        held = asyncio.ensure_future(
            call(s, "POST", sv.url + "v1/completions", json={"hold": 1}, headers=KEY)
        )
        await sv.vllm.wait_arrived(1)
        assert (await call(s, "POST", sv.url + "v1/completions", json={}, headers=KEY))[0] == 429
        async with s.get(url) as r:
            assert r.status == 200 and (await r.json())["load"] == 3
        # vLLM's metrics unreadable (too busy to answer in time): the request the agent
        # is relaying still counts, so the replica never reads as idle.
        sv.vllm.metrics_status = 500
        async with s.get(url) as r:
            assert r.status == 200 and await r.json() == {"load": 1, "running": 1.0, "waiting": 0.0}
        sv.vllm.metrics_status = 200
        sv.vllm.release.set()
        assert (await asyncio.wait_for(held, WAIT))[0] == 200
        # Not serving (draining for a checkpoint, restoring): no queue to read, retry later.
        sv.agent.set_state("Draining")
        async with s.get(url) as r:
            assert r.status == 503 and r.headers["Retry-After"]
        assert sv.vllm.seen.count("GET /metrics") == 3  # the agent answered, vLLM was only read
        reads = sv.agent.metrics.registry.get_sample_value("rekindle_serve_load_reads_total")
        assert reads == 3  # the three answered


def test_serve_port_load_for_routers(tmp_path: Path) -> None:
    """GET /get_load: vLLM's running + waiting, answered by the agent without the API key;
    never capped."""
    asyncio.run(_load_for_routers(tmp_path))


async def _slow_body(port: int, declared: int, sent: bytes) -> tuple[asyncio.StreamReader, Any]:
    """A client that declares a body, sends part of it, and then sends nothing."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: agent\r\nContent-Type: application/json\r\n"
        + b"Authorization: Bearer " + API_KEY + b"\r\n"
        + f"Content-Length: {declared}\r\n\r\n".encode()
        + sent
    )  # fmt: skip
    await writer.drain()
    return reader, writer


async def _until(what: str, cond: Any) -> None:
    """A bounded poll of the proxy's own counters (no sleep that decides anything)."""
    try:
        async with asyncio.timeout(WAIT):
            while not cond():
                await asyncio.sleep(0.01)
    except TimeoutError:
        raise AssertionError(f"not within {WAIT:g}s: {what}") from None


async def _slow_bodies_hold_no_slot(tmp_path: Path) -> None:
    limits = {"proxy_max_concurrency": 2, "proxy_body_timeout": 1.0, "proxy_timeout": WAIT}
    async with (
        serving(tmp_path, **limits) as sv,
        ClientSession(timeout=ClientTimeout(total=WAIT)) as s,
    ):
        port = int(sv.url.rsplit(":", 1)[1].strip("/"))
        slow = [await _slow_body(port, 100, b'{"prompt": ') for _ in range(5)]
        await _until("5 bodies arriving", lambda: sv.proxy.receiving == 5)
        # More slow clients than slots, and yet no slot is taken: requests still pass.
        assert sv.proxy.inflight == 0
        assert (await call(s, "POST", sv.url + "v1/completions", json={}, headers=KEY))[0] == 200
        # Each slow client is cut off at --proxy-body-timeout, and nothing reached vLLM.
        for reader, writer in slow:
            status_line = await asyncio.wait_for(reader.readline(), WAIT)
            assert status_line.startswith(b"HTTP/1.1 408"), status_line
            writer.close()
        assert sv.proxy.receiving == 0 and sv.proxy.body_bytes == 0
        assert sv.vllm.seen == ["POST /v1/completions"]


def test_a_slow_body_holds_no_slot_and_is_cut_off(tmp_path: Path) -> None:
    asyncio.run(_slow_bodies_hold_no_slot(tmp_path))


async def _bodies_share_one_buffer(tmp_path: Path) -> None:
    limits = {
        "proxy_max_body_mb": 1,
        "proxy_body_buffer_mb": 1,
        "proxy_body_timeout": 1.0,
        "proxy_timeout": WAIT,
    }
    async with (
        serving(tmp_path, **limits) as sv,
        ClientSession(timeout=ClientTimeout(total=WAIT)) as s,
    ):
        port = int(sv.url.rsplit(":", 1)[1].strip("/"))
        reader, writer = await _slow_body(port, 1 << 20, b" " * (768 << 10))
        await _until("768 KiB held", lambda: sv.proxy.body_bytes == 768 << 10)
        half = b'{"prompt": "' + b"x" * (512 << 10) + b'"}'
        status, text = await call(s, "POST", sv.url + "v1/completions", data=half, headers=KEY)
        assert status == 503 and "--proxy-body-buffer-mb" in text, text
        status_line = await asyncio.wait_for(reader.readline(), WAIT)
        assert status_line.startswith(b"HTTP/1.1 408"), status_line
        writer.close()
        await _until("the buffer is empty", lambda: sv.proxy.body_bytes == 0)
        status, _ = await call(s, "POST", sv.url + "v1/completions", data=half, headers=KEY)
        assert status == 200


def test_request_bodies_share_one_bounded_buffer(tmp_path: Path) -> None:
    asyncio.run(_bodies_share_one_buffer(tmp_path))


async def _no_room(tmp_path: Path) -> None:
    async with (
        serving(tmp_path, proxy_timeout=WAIT) as sv,
        ClientSession(timeout=ClientTimeout(total=WAIT)) as s,
    ):
        tok = {"Authorization": "Bearer " + TOKEN.decode()}
        body = {"dir": str(tmp_path / "ckpts/c")}
        async with s.post(sv.admin + api.PATH_CHECKPOINT.lstrip("/"), json=body, headers=tok) as r:
            reply = await r.json()
            assert r.status == 507 and reply["reason"] == "insufficient_space", reply
            assert "GiB needed" in reply["error"] and "GiB free" in reply["error"], reply
        doc = sv.agent.status_doc()
        assert doc["state"] == "Ready"  # never drained: serving untouched
        assert doc["last_checkpoint"] is not None
        assert doc["last_checkpoint"]["reason"] == "insufficient_space"
        assert not (tmp_path / "ckpts/c").exists()
        assert (await call(s, "POST", sv.url + "v1/completions", json={}, headers=KEY))[0] == 200


def test_a_checkpoint_that_would_not_fit_is_refused_before_draining(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(space, "free_bytes", lambda target: 1 << 20)  # 1 MiB free
    asyncio.run(_no_room(tmp_path))


async def _stopping(tmp_path: Path) -> None:
    async with (
        serving(tmp_path, proxy_timeout=WAIT, shutdown_drain=WAIT) as sv,
        ClientSession(timeout=ClientTimeout(total=WAIT)) as s,
    ):
        held = asyncio.create_task(
            call(s, "POST", sv.url + "v1/completions", json={"hold": 1}, headers=KEY)
        )
        await sv.vllm.wait_arrived(1)
        stopping = asyncio.create_task(finish_in_flight(sv.agent, sv.proxy))
        # SIGTERM: a new request is refused at once, retryable, and /readyz fails ...
        status, text = await call(s, "POST", sv.url + "v1/completions", json={}, headers=KEY)
        assert status == 503 and "Draining" in text, text
        assert (await call(s, "GET", sv.admin + "readyz"))[0] == 503
        assert not stopping.done()  # ... while the one in flight is waited for
        sv.vllm.release.set()
        assert await held == (200, '{"choices": [{"text": "ok"}]}')
        await asyncio.wait_for(stopping, WAIT)
    async with (
        serving(tmp_path, proxy_timeout=WAIT, shutdown_drain=0.2) as sv,
        ClientSession(timeout=ClientTimeout(total=WAIT)) as s,
    ):
        held = asyncio.create_task(
            call(s, "POST", sv.url + "v1/completions", json={"hold": 1}, headers=KEY)
        )
        await sv.vllm.wait_arrived(1)
        # One that cannot finish within --shutdown-drain: given up on, not waited for.
        await asyncio.wait_for(finish_in_flight(sv.agent, sv.proxy), WAIT)
        assert sv.proxy.inflight == 1
        sv.vllm.release.set()
        await held


def test_sigterm_lets_requests_in_flight_finish_and_refuses_new_ones(tmp_path: Path) -> None:
    asyncio.run(_stopping(tmp_path))
