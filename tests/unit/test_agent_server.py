"""The admin API's auth and the proxy's refusal and streaming, with a fake upstream vLLM."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from aiohttp import ClientSession, web
from aiohttp.test_utils import TestServer
from rekindle_agent.agent import Agent
from rekindle_agent.config import AgentConfig
from rekindle_agent.serving.server import Proxy, admin_app, listen, proxy_app, write_ports_file
from rekindle_contract import api

TOKEN = b"unit-test-token-0123456789"


async def _upstream() -> TestServer:
    async def stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(3):
            await resp.write(f"data: {i}\n\n".encode())
            await asyncio.sleep(0.01)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", stream)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    return server


async def _scenario(tmp_path: Path) -> None:
    up = await _upstream()
    cfg = AgentConfig(
        model=str(tmp_path), run_dir=str(tmp_path), vllm_port=up.port or 0, worker_extension="none"
    )
    agent = Agent(cfg, TOKEN)
    proxy = Proxy(agent)
    admin = TestServer(admin_app(agent, proxy), host="127.0.0.1")
    serve = TestServer(proxy_app(agent, proxy), host="127.0.0.1")
    await admin.start_server()
    await serve.start_server()
    try:
        async with ClientSession() as s:
            async with s.get(admin.make_url(api.PATH_STATUS)) as r:
                assert r.status == 401
            hdr = {"Authorization": "Bearer " + TOKEN.decode()}
            async with s.get(admin.make_url(api.PATH_STATUS), headers=hdr) as r:
                doc = await r.json()
                assert r.status == 200 and doc["state"] == "Booting"
                assert set(doc) == set(api.StatusDoc.__annotations__)
            async with s.get(admin.make_url(api.PATH_READYZ)) as r:
                assert r.status == 503  # no token needed, not ready yet
            async with s.post(serve.make_url("/v1/completions"), json={}) as r:
                assert r.status == 503 and r.headers["Retry-After"]
            agent.set_state("Ready")
            async with s.post(serve.make_url("/v1/completions"), json={}) as r:
                assert r.status == 200
                assert await r.text() == "data: 0\n\ndata: 1\n\ndata: 2\n\n"
            assert proxy.inflight == 0 and proxy.idle.is_set()
            async with s.get(admin.make_url(api.PATH_METRICS), headers=hdr) as r:
                text = await r.text()
            assert "rekindle_refused_requests_total 1.0" in text
    finally:
        await proxy.close_connections()
        await admin.close()
        await serve.close()
        await up.close()
        agent.reaper.stop()


def test_auth_refusal_and_streaming(tmp_path: Path) -> None:
    asyncio.run(_scenario(tmp_path))


METRICS_TOKEN = b"unit-test-metrics-token-0123"


async def _metrics_token_reads_metrics_only(tmp_path: Path) -> None:
    cfg = AgentConfig(model=str(tmp_path), run_dir=str(tmp_path), worker_extension="none")
    agent = Agent(cfg, TOKEN, metrics_token=METRICS_TOKEN)
    admin = TestServer(admin_app(agent, Proxy(agent)), host="127.0.0.1")
    await admin.start_server()
    scrape = {"Authorization": "Bearer " + METRICS_TOKEN.decode()}
    try:
        async with ClientSession() as s:
            async with s.get(admin.make_url(api.PATH_METRICS), headers=scrape) as r:
                assert r.status == 200 and "rekindle_" in await r.text()
            for method, path in (
                ("GET", api.PATH_STATUS),
                ("POST", api.PATH_CHECKPOINT),
                ("POST", api.PATH_METRICS),
            ):
                async with s.request(method, admin.make_url(path), headers=scrape) as r:
                    assert r.status == 401, (method, path)
            wrong = {"Authorization": "Bearer " + METRICS_TOKEN.decode()[:-1] + "x"}
            async with s.get(admin.make_url(api.PATH_METRICS), headers=wrong) as r:
                assert r.status == 401
            assert agent.status.state == "Booting"  # nothing the scrape token sent acted
    finally:
        await admin.close()
        agent.reaper.stop()


def test_the_metrics_token_reads_metrics_and_nothing_else(tmp_path: Path) -> None:
    asyncio.run(_metrics_token_reads_metrics_only(tmp_path))


async def _listen_on_port_zero(tmp_path: Path) -> None:
    async def hello(_request: web.Request) -> web.Response:
        return web.Response(text="hi")

    app = web.Application()
    app.router.add_get("/", hello)
    runner, port = await listen(app, "127.0.0.1", 0)
    try:
        assert port > 0
        path = tmp_path / "ports.json"
        write_ports_file(str(path), {"serve": port, "admin": 1})
        assert json.loads(path.read_text()) == {"serve": port, "admin": 1}
        assert [p.name for p in tmp_path.iterdir()] == ["ports.json"]  # no temp file left
        async with ClientSession() as s, s.get(f"http://127.0.0.1:{port}/") as r:
            assert await r.text() == "hi"
    finally:
        await runner.cleanup()


def test_port_zero_reports_the_bound_port(tmp_path: Path) -> None:
    asyncio.run(_listen_on_port_zero(tmp_path))
