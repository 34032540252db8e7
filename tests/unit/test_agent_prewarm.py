"""Pre-warming: the admin route's checks, and the retry of a store that cannot be reached.

The backend here stands in for the node agent's pull (pure logic: what is retried,
what ends the attempt); the real pull onto a node is tests/cluster/test_node_agent.py's.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from aiohttp import ClientSession
from aiohttp.test_utils import TestServer
from rekindle_agent.agent import Agent
from rekindle_agent.checkpointing.criu_backend import BackendError, CriuBackend
from rekindle_agent.config import AgentConfig
from rekindle_agent.restoring.prewarm import Prewarmer
from rekindle_agent.serving.server import Proxy, admin_app
from rekindle_contract import api

TOKEN = b"unit-test-token-0123456789"
ROOT = "/var/lib/rekindle/checkpoints"


class Pulls(CriuBackend):
    """Answers each pull with the next of its outcomes (an exception or an answer)."""

    def __init__(self, *outcomes: Exception | dict[str, Any]) -> None:
        self.outcomes = list(outcomes)
        self.calls: list[Path] = []

    def can_prewarm(self, ckpt: Path) -> bool:
        return True

    def prewarm(self, ckpt: Path) -> dict[str, Any]:
        self.calls.append(ckpt)
        out = self.outcomes.pop(0)
        if isinstance(out, Exception):
            raise out
        return out


def test_an_unreachable_store_is_retried_until_the_pull_lands() -> None:
    down = BackendError("store_unreachable", "the object store did not answer")
    backend = Pulls(down, down, {"bytes": 10, "seconds": 0.5, "copied": True})
    p = Prewarmer(backend, retry_s=0.01)
    started, _ = p.request(Path(f"{ROOT}/a-1"))
    p.wait(10)
    assert started and len(backend.calls) == 3
    assert (p.last.state, p.last.detail) == ("done", {"bytes": 10, "seconds": 0.5, "copied": True})


def test_bad_bytes_end_the_attempt_at_once() -> None:
    bad = BackendError("checksum_mismatch", "images/pages-1.img: digest does not match")
    backend = Pulls(bad)
    p = Prewarmer(backend, retry_s=0.01)
    p.request(Path(f"{ROOT}/a-1"))
    p.wait(10)
    assert len(backend.calls) == 1
    assert (p.last.state, p.last.detail["reason"]) == ("failed", "checksum_mismatch")


def test_the_store_is_given_up_on_after_the_deadline() -> None:
    down = BackendError("store_unreachable", "no")
    backend = Pulls(*[down] * 1000)
    p = Prewarmer(backend, retry_s=0.01, give_up_s=0.05)
    p.request(Path(f"{ROOT}/a-1"))
    p.wait(10)
    assert p.last.state == "failed" and 1 < len(backend.calls) < 1000


async def _route(tmp_path: Path) -> None:
    cfg = AgentConfig(
        model=str(tmp_path),
        run_dir=str(tmp_path),
        worker_extension="none",
        checkpoint_root=ROOT,
    )
    agent = Agent(cfg, TOKEN)
    admin = TestServer(admin_app(agent, Proxy(agent)), host="127.0.0.1")
    await admin.start_server()
    hdr = {"Authorization": "Bearer " + TOKEN.decode()}
    url = admin.make_url(api.PATH_PREWARM)
    try:
        async with ClientSession() as s:
            async with s.post(url, json={"dir": f"{ROOT}/a-1"}) as r:
                assert r.status == 401
            for bad in ("/etc", f"{ROOT}/../etc/a", f"{ROOT}/a/b", ROOT, "a-1"):
                async with s.post(url, json={"dir": bad}, headers=hdr) as r:
                    assert r.status == 400, bad
                    assert "directly below the checkpoint root" in (await r.json())["error"]
            # Storage in the pod (no node agent): nothing to pull from.
            async with s.post(url, json={"dir": f"{ROOT}/a-1"}, headers=hdr) as r:
                assert r.status == 409 and "storage type node" in (await r.json())["error"]
            agent.prewarmer = Prewarmer(Pulls({"bytes": 1}), retry_s=0.01)
            async with s.post(url, json={"dir": f"{ROOT}/a-1"}, headers=hdr) as r:
                assert r.status == 202
                assert (await r.json())["started"] is True
            agent.prewarmer.wait(10)
            assert agent.prewarmer.last.state == "done"
    finally:
        await admin.close()


def test_the_route_checks_who_asks_and_what(tmp_path: Path) -> None:
    asyncio.run(_route(tmp_path))
