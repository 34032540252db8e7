"""The serve port's proxy against a fake vLLM: allowlist, API key, body and concurrency
limits, the timeout to vLLM, and a drain that gives up with a reason."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from aiohttp import ClientSession, web
from aiohttp.test_utils import TestServer
from rekindle_agent.agent import Agent
from rekindle_agent.config import AgentConfig
from rekindle_agent.server import Proxy, admin_app, proxy_app
from rekindle_contract import api

TOKEN = b"unit-test-token-0123456789"
API_KEY = b"sk-unit-test"


async def _upstream(seen: list[str]) -> TestServer:
    async def anything(request: web.Request) -> web.StreamResponse:
        seen.append(f"{request.method} {request.path_qs}")
        assert "Authorization" not in request.headers  # the API key stops at the agent
        if request.path == "/v1/completions":
            body = await request.json()
            if body.get("slow"):
                await asyncio.sleep(float(body["slow"]))
            return web.json_response({"choices": [{"text": "ok"}]})
        return web.json_response({"path": request.path})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", anything)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    return server


async def _scenario(tmp_path: Path) -> None:
    seen: list[str] = []
    up = await _upstream(seen)
    cfg = AgentConfig(
        model=str(tmp_path),
        run_dir=str(tmp_path),
        vllm_port=up.port or 0,
        worker_extension="none",
        proxy_max_body_mb=1,
        proxy_max_concurrency=2,
        proxy_timeout=1.5,
        drain_timeout=0.3,
        checkpoint_root=str(tmp_path / "ckpts"),
    )
    agent = Agent(cfg, TOKEN, api_key=API_KEY)
    proxy = Proxy(agent)
    serve = TestServer(proxy_app(agent, proxy), host="127.0.0.1")
    admin = TestServer(admin_app(agent, proxy), host="127.0.0.1")
    await serve.start_server()
    await admin.start_server()
    key = {"Authorization": "Bearer " + API_KEY.decode()}
    tok = {"Authorization": "Bearer " + TOKEN.decode()}
    try:
        agent.set_state("Ready")
        async with ClientSession() as s:

            async def call(method: str, path: str, **kw: Any) -> tuple[int, Any]:
                async with s.request(method, serve.make_url(path), **kw) as r:
                    return r.status, await r.text()

            # The key is checked first, on every path.
            for path in ("/v1/completions", "/collective_rpc", "/health", "/nope"):
                assert (await call("POST", path, json={}))[0] == 401
                bad = {"Authorization": "Bearer sk-wrong"}
                assert (await call("POST", path, json={}, headers=bad))[0] == 401
            # With it: the API passes, the control endpoints do not exist here.
            assert (await call("POST", "/v1/completions", json={}, headers=key))[0] == 200
            assert (await call("GET", "/v1/models", headers=key))[0] == 200
            for path in ("/collective_rpc", "/sleep?level=1", "/wake_up", "/reset_prefix_cache"):
                status, text = await call("POST", path, json={"method": "x"}, headers=key)
                assert status == 404 and "no such route" in text, (path, text)
            assert (await call("GET", "/v1/completions", headers=key))[0] == 405
            assert (await call("POST", "/v1/completions/../../sleep", headers=key))[0] == 404
            assert seen == ["POST /v1/completions", "GET /v1/models"]
            # Body limit (1 MiB), both declared and chunked.
            big = b"x" * ((1 << 20) + 1)
            assert (await call("POST", "/v1/completions", data=big, headers=key))[0] == 413

            async def chunks() -> Any:
                for _ in range(3):
                    yield b"y" * (1 << 19)

            status, _ = await call("POST", "/v1/completions", data=chunks(), headers=key)
            assert status == 413
            # vLLM silent past --proxy-timeout: 504, not a hung client.
            status, text = await call("POST", "/v1/completions", json={"slow": 2.5}, headers=key)
            assert status == 504 and "--proxy-timeout" in text
            # Concurrency: 2 in flight, the third gets 429 with Retry-After.
            slow = [
                asyncio.ensure_future(
                    call("POST", "/v1/completions", json={"slow": 1.0}, headers=key)
                )
                for _ in range(2)
            ]
            await asyncio.sleep(0.15)
            async with s.post(serve.make_url("/v1/completions"), json={}, headers=key) as r:
                assert r.status == 429 and r.headers["Retry-After"]
            # ... and a checkpoint meanwhile gives up draining, with the reason.
            async with s.post(
                admin.make_url(api.PATH_CHECKPOINT),
                json={"dir": str(tmp_path / "ckpts/c")},
                headers=tok,
            ) as r:
                body = await r.json()
                assert r.status == 503 and body["reason"] == "drain_timeout", body
            doc = agent.status_doc()
            assert doc["state"] == "Ready"
            assert doc["last_checkpoint"] is not None
            assert doc["last_checkpoint"]["reason"] == "drain_timeout"
            assert [st for st, _ in await asyncio.gather(*slow)] == [200, 200]
            assert proxy.inflight == 0
    finally:
        await proxy.close_connections()
        await serve.close()
        await admin.close()
        await up.close()
        agent.reaper.stop()


def test_proxy_limits_and_allowlist(tmp_path: Path) -> None:
    asyncio.run(_scenario(tmp_path))
