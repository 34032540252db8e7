"""The front (rekindle_front) against real HTTP upstreams and a scripted view of the
Kubernetes API: a request for a service with no Ready replica is held, not refused,
and served once one appears; it is answered 503 with Retry-After at the hold
timeout; /load adds vLLM's queue over the Ready replicas to the held requests;
requests the agents would not forward, or for a service that does not exist, are
answered at once and never held (they cannot wake a service).

Pure logic of the front: the real thing (KEDA waking a real service) is
tests/cluster/test_autoscaling.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from aiohttp import ClientSession, web
from aiohttp.test_utils import TestServer
from rekindle_agent.serving import vllm_queue
from rekindle_agent.serving.vllm_queue import parse_queue
from rekindle_front import load
from rekindle_front.cache import TtlCache
from rekindle_front.kube import KubeError, Replica, ready_replicas
from rekindle_front.server import Front, FrontConfig, app

WAIT = 60.0
HOLDING = FrontConfig(hold_timeout_s=WAIT, poll_s=0.01)
SHORT = FrontConfig(hold_timeout_s=0.2, poll_s=0.01)

VLLM_METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 2.0
vllm:num_requests_waiting{engine="1",model_name="tiny"} 1.0
vllm:num_requests_waiting_by_reason{reason="capacity"} 7.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="tiny"} 0.5
"""


def test_the_queue_sums_each_family_over_its_label_sets() -> None:
    assert parse_queue(VLLM_METRICS) == load.Queue(running=3.0, waiting=3.0)
    assert parse_queue("vllm:num_requests_running 4\n") == load.Queue(running=4.0)
    assert parse_queue("garbage {\n\n#\nvllm:num_requests_waiting x\n") == load.Queue()


def test_a_relayed_request_is_a_floor_for_the_queue() -> None:
    assert vllm_queue.at_least(load.Queue(0, 0), 2) == load.Queue(running=2.0)
    assert vllm_queue.at_least(load.Queue(1, 3), 2) == load.Queue(1, 3)
    assert vllm_queue.at_least(load.Queue(1, 1), 5) == load.Queue(running=4.0, waiting=1.0)


def test_a_get_load_answer_reads_back_as_the_queue_it_came_from() -> None:
    queue = parse_queue(VLLM_METRICS)
    assert queue.as_json() == {"load": 6, "running": 3.0, "waiting": 3.0}
    assert load.parse_load(queue.as_json()) == queue
    for bad in ([], {"load": 3}, {"running": "x", "waiting": 0}, {"running": -1, "waiting": 0}):
        with pytest.raises(ValueError, match="/get_load answer"):
            load.parse_load(bad)


def test_load_adds_the_held_requests() -> None:
    got = load.total([load.Queue(3, 2), load.Queue(1, 0)], held=2).as_json()
    assert got == {
        "requests": 8, "waiting": 4, "running": 4, "held": 2, "forwarded": 0, "replicas": 2,
        "unread": 0,
    }  # fmt: skip


def test_what_the_front_forwarded_is_a_floor_when_a_replica_cannot_be_read() -> None:
    got = load.total([load.Queue(1, 0), None], held=0, forwarded=5).as_json()
    assert (got["requests"], got["running"], got["unread"]) == (5, 1, 1)
    # Read queues above the floor count as they are.
    assert load.total([load.Queue(4, 3)], held=1, forwarded=2).as_json()["requests"] == 8


def test_only_ready_not_terminating_endpoints_on_the_named_port_count() -> None:
    slices = [
        {
            "ports": [{"name": "http", "port": 8000}],
            "endpoints": [
                {"addresses": ["10.0.0.1"], "conditions": {"ready": True}},
                {"addresses": ["10.0.0.2"], "conditions": {"ready": False}},
                {"addresses": ["10.0.0.3"], "conditions": {"ready": True, "terminating": True}},
            ],
        },
        {"ports": [{"name": "other", "port": 9}], "endpoints": [{"addresses": ["10.0.0.4"]}]},
    ]
    assert ready_replicas(slices, "http") == [Replica("10.0.0.1", 8000)]


class ScriptedKube:
    """The front's two reads: services that exist, and their Ready replicas (settable)."""

    def __init__(self, services: set[str]) -> None:
        self.services = services
        self.ready: dict[str, list[Replica]] = {}
        self.asked = asyncio.Event()  # set whenever the front looked for replicas

    async def service_exists(self, namespace: str, name: str) -> bool:
        return f"{namespace}/{name}" in self.services

    async def replicas(self, namespace: str, service: str, port_name: str) -> list[Replica]:
        assert port_name == "http"
        self.asked.set()
        return list(self.ready.get(f"{namespace}/{service}", []))

    async def close(self) -> None:
        pass


async def fake_replica(request: web.Request) -> web.StreamResponse:
    if request.path == "/get_load":  # as the agent answers it, from vLLM's metrics
        return web.json_response(parse_queue(VLLM_METRICS).as_json())
    body = await request.json()
    await asyncio.sleep(float(body.get("sleep", 0)))  # a slow answer
    return web.json_response({"path": request.path_qs, "echo": body})


@asynccontextmanager
async def running(cfg: FrontConfig) -> AsyncIterator[tuple[str, ScriptedKube, Replica]]:
    upstream_app = web.Application()
    upstream_app.router.add_route("*", "/{tail:.*}", fake_replica)
    kube = ScriptedKube({"ns/tiny"})
    async with TestServer(upstream_app, host="127.0.0.1") as upstream:
        replica = Replica("127.0.0.1", upstream.port or 0)
        front = Front(kube, cfg)  # type: ignore[arg-type]
        async with TestServer(app(front), host="127.0.0.1") as server:
            yield f"http://127.0.0.1:{server.port}", kube, replica


def sample(text: str, prefix: str) -> float:
    """The value of the one exposition line starting with prefix."""
    (line,) = [ln for ln in text.splitlines() if ln.startswith(prefix)]
    return float(line.rsplit(" ", 1)[1])


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, WAIT))


def test_a_request_at_zero_is_held_then_served_and_counted_on_load() -> None:
    async def scenario() -> None:
        async with running(HOLDING) as (url, kube, rep), ClientSession() as s:
            held = asyncio.create_task(
                s.post(f"{url}/ns/tiny/v1/completions?x=1", json={"prompt": "hi"})
            )
            await kube.asked.wait()
            for _ in range(1000):  # until the front counts it held
                got = await (await s.get(f"{url}/load/ns/tiny")).json()
                if got["held"] == 1:
                    break
                await asyncio.sleep(0.01)
            assert (got["requests"], got["waiting"], got["held"], got["replicas"]) == (1, 1, 1, 0)
            assert not held.done()
            kube.ready["ns/tiny"] = [rep]  # a replica became Ready
            resp = await held
            assert resp.status == 200
            assert await resp.json() == {
                    "path": "/v1/completions?x=1", "echo": {"prompt": "hi"},
                }  # fmt: skip
            got = await (await s.get(f"{url}/load/ns/tiny")).json()
            want = {"requests": 6, "waiting": 3, "running": 3, "held": 0, "replicas": 1}
            assert {k: got[k] for k in want} == want
            text = await (await s.get(f"{url}/metrics")).text()
            served = 'outcome="served",service="tiny"} 1.0'
            assert f'rekindle_front_hold_seconds_count{{namespace="ns",{served}' in text
            # A request that finds a Ready replica is held 0 s however long its answer takes.
            fast = 'rekindle_front_hold_seconds_bucket{le="0.1",namespace="ns",outcome="served"'
            before = sample(text, fast)
            slow = await s.post(f"{url}/ns/tiny/v1/completions", json={"sleep": 0.3})
            assert slow.status == 200
            after = sample(await (await s.get(f"{url}/metrics")).text(), fast)
            assert after == before + 1

    run(scenario())


def test_past_the_hold_timeout_the_answer_is_503_with_retry_after() -> None:
    async def scenario() -> None:
        async with running(SHORT) as (url, _kube, _rep), ClientSession() as s:
            resp = await s.post(f"{url}/ns/tiny/v1/completions", json={"prompt": "hi"})
            assert resp.status == 503
            assert resp.headers["Retry-After"] == "5"
            assert "--hold-timeout" in (await resp.json())["error"]["message"]
            got = await (await s.get(f"{url}/load/ns/tiny")).json()
            assert got["held"] == 0

    run(scenario())


def test_unknown_routes_and_services_are_answered_at_once_never_held() -> None:
    async def scenario() -> None:
        async with running(HOLDING) as (url, kube, _rep), ClientSession() as s:
            for method, path, status in (
                ("POST", "/ns/tiny/sleep", 404),  # a control route: never forwarded
                ("POST", "/ns/tiny/v1/../sleep", 404),
                ("POST", "/ns/other/v1/completions", 404),  # no such InferenceService
            ):
                resp = await s.request(method, url + path, json={})
                assert resp.status == status, path
            assert not kube.asked.is_set()

    run(scenario())


def test_a_replica_that_refuses_the_connection_sends_the_request_back_to_waiting() -> None:
    async def scenario() -> None:
        async with running(HOLDING) as (url, kube, rep):
            gone = Replica("127.0.0.1", 1)  # nothing listens on port 1
            kube.ready["ns/tiny"] = [gone]
            async with ClientSession() as s:
                task = asyncio.create_task(s.post(f"{url}/ns/tiny/v1/completions", json={}))
                for _ in range(1000):
                    if (await (await s.get(f"{url}/load/ns/tiny")).json())["held"] == 1:
                        break
                    await asyncio.sleep(0.01)
                kube.ready["ns/tiny"] = [rep]
                assert (await task).status == 200

    run(scenario())


@pytest.mark.parametrize("inflight,want", [({}, None), ({"http://a:1": 2}, "b")])
def test_the_replica_with_fewest_requests_from_the_front_is_picked(
    inflight: dict[str, int], want: str | None
) -> None:
    front = Front(ScriptedKube(set()), FrontConfig())  # type: ignore[arg-type]
    front.inflight.update(inflight)
    picked = front.pick([Replica("a", 1), Replica("b", 1)])
    assert want is None or picked.address == want


def test_the_cache_shares_one_fetch_among_concurrent_callers_and_expires() -> None:
    now = [0.0]
    cache: TtlCache[str, int] = TtlCache(1.0, clock=lambda: now[0])
    calls: list[int] = []
    gate = asyncio.Event()

    async def fetch() -> int:
        calls.append(1)
        await gate.wait()
        return len(calls)

    async def scenario() -> None:
        waiting = [asyncio.create_task(cache.get("k", fetch)) for _ in range(50)]
        await asyncio.sleep(0)
        gate.set()
        assert await asyncio.gather(*waiting) == [1] * 50
        assert await cache.get("k", fetch) == 1  # fresh: no fetch
        now[0] = 1.5
        assert await cache.get("k", fetch) == 2  # expired: one more
        assert len(calls) == 2

        async def broken() -> int:
            raise KubeError("no")

        with pytest.raises(KubeError):
            await cache.get("x", broken)
        assert await cache.get("x", fetch) == 3  # an error is not cached

    run(scenario())


def test_over_max_held_a_request_is_refused_at_once_and_the_counts_go_back_to_zero() -> None:
    async def scenario() -> None:
        cfg = FrontConfig(hold_timeout_s=WAIT, poll_s=0.01, max_held=1)
        async with running(cfg) as (url, kube, rep), ClientSession() as s:
            first = asyncio.create_task(s.post(f"{url}/ns/tiny/v1/completions", json={}))
            for _ in range(1000):
                if (await (await s.get(f"{url}/load/ns/tiny")).json())["held"] == 1:
                    break
                await asyncio.sleep(0.01)
            second = await s.post(f"{url}/ns/tiny/v1/completions", json={})
            assert second.status == 503
            assert "--max-held" in (await second.json())["error"]["message"]
            kube.ready["ns/tiny"] = [rep]
            assert (await first).status == 200
            got = await (await s.get(f"{url}/load/ns/tiny")).json()
            assert (got["held"], got["forwarded"]) == (0, 0)

    run(scenario())
