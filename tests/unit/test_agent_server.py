"""The admin API's auth and the proxy's refusal and streaming, with a fake upstream vLLM."""

from __future__ import annotations

import asyncio
from pathlib import Path

from aiohttp import ClientSession, web
from aiohttp.test_utils import TestServer
from rekindle_contract import api
from rekindle_agent.agent import Agent
from rekindle_agent.config import AgentConfig
from rekindle_agent.server import Proxy, admin_app, proxy_app

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
        model=str(tmp_path), run_dir=str(tmp_path), vllm_port=up.port or 0, worker_extension=None
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
                assert r.status == 200 and (await r.json())["state"] == "Booting"
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
