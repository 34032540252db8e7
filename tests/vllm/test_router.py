"""A real load-aware router in front of two replicas reads their load from the serve port.

The vLLM router (vllm-project/router, from PyPI; scripts/build-vllm-router) with
its power_of_two policy polls each worker's GET /get_load, which the agent
answers from vLLM's own running + waiting gauges. One replica (restored from the
session's tiny checkpoint) is kept busy by clients that talk to it directly, past
the router; the other (booted beside it on its own vLLM port) is idle. Requests
sent through the router must then all land on the idle one.

The router only knows the busy replica's queue from /get_load: the load bypasses
it, so its own in-flight counts are zero for both, and without the serve port's
answer it would pick either replica at random (all ROUTED on one side by chance:
1 in 2**ROUTED). That the router polled is read off the busy agent's
rekindle_serve_load_reads_total, not waited for with a sleep.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from rekindle_dev.ports import free_port

from tests.vllm.conftest import AgentFactory, AgentProc, TinyCheckpoint

pytestmark = [pytest.mark.vllm, pytest.mark.criu]

REPO = Path(__file__).resolve().parents[2]
POLL_S = 1  # the router's --worker-startup-check-interval, which is also its load poll
BUSY_CLIENTS = 6  # requests kept in flight on the busy replica
ROUTED = 8  # sequential requests through the router
DEADLINE_S = 120.0


@pytest.fixture(scope="module")
def router_bin() -> Path:
    """The pinned vllm-router (installed into its cached venv on first use)."""
    run = subprocess.run(
        [str(REPO / "scripts" / "build-vllm-router")], capture_output=True, text=True
    )
    if run.returncode != 0:
        pytest.fail(f"scripts/build-vllm-router failed:\n{run.stderr}")
    return Path(run.stdout.strip().splitlines()[-1])


def _get(url: str, timeout: float = 10) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return str(r.read().decode())


def _post(url: str, body: dict[str, object], timeout: float = 120) -> dict[str, object]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return dict(json.loads(r.read()))


def _sum(text: str, family: str) -> float:
    """The sum of one family's samples over its label sets, in Prometheus text."""
    return sum(
        float(line.rsplit(None, 1)[1])
        for line in text.splitlines()
        if line.startswith(family + "{") or line.startswith(family + " ")
    )


def _served(agent: AgentProc) -> float:
    """Requests this replica's vLLM finished (its own counter, read on the serve port)."""
    return _sum(_get(agent.serve_url + "/metrics"), "vllm:request_success_total")


def _load_reads(agent: AgentProc) -> float:
    req = urllib.request.Request(
        agent.admin_url + "/metrics", headers={"Authorization": f"Bearer {agent.token}"}
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        return _sum(r.read().decode(), "rekindle_serve_load_reads_total")


def _until(what: str, done: Callable[[], bool]) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"after {DEADLINE_S:.0f}s: {what}")
        time.sleep(0.1)


def _keep_busy(agent: AgentProc, stop: threading.Event, errors: list[str]) -> None:
    """Long completions, one after another, straight to the replica (past the router)."""
    body = {"model": "tiny", "prompt": "The river", "max_tokens": 400, "ignore_eos": True}
    while not stop.is_set():
        try:
            _post(agent.serve_url + "/v1/completions", body)
        except Exception as e:  # recorded: the test fails on it
            errors.append(repr(e))
            return


@pytest.fixture
def replicas(
    agent_factory: AgentFactory, tiny_ckpt: TinyCheckpoint
) -> Iterator[tuple[AgentProc, AgentProc]]:
    """(busy, idle): a restore of the tiny checkpoint, and a boot on another vLLM port."""
    busy = agent_factory.start(name="router-busy", restore_from=str(tiny_ckpt.path))
    idle = agent_factory.start(
        name="router-idle", vllm_port=free_port(exclude={agent_factory.vllm_port})
    )
    try:
        busy.wait_ready(300)
        idle.wait_ready(600)
        yield busy, idle
    except BaseException:
        print(busy.tail(60), idle.tail(60), sep="\n")
        raise
    finally:
        busy.stop()
        idle.stop()


@pytest.fixture
def router(
    router_bin: Path, replicas: tuple[AgentProc, AgentProc], tmp_path: Path
) -> Iterator[str]:
    port = free_port()
    metrics_port = free_port(exclude={port})
    log = (tmp_path / "router.log").open("wb")
    proc = subprocess.Popen(
        [
            str(router_bin),
            *("--host", "127.0.0.1", "--port", str(port)),
            *("--worker-urls", *(r.serve_url for r in replicas)),
            *("--policy", "power_of_two"),
            *("--worker-startup-check-interval", str(POLL_S)),
            *("--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)),
            *("--log-level", "warning"),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:

        def up() -> bool:
            assert proc.poll() is None, (tmp_path / "router.log").read_text()[-2000:]
            try:
                return _get(url + "/health", timeout=2) is not None
            except OSError:
                return False

        _until("the router answered /health", up)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def test_router_routes_away_from_the_loaded_replica(
    replicas: tuple[AgentProc, AgentProc], router: str
) -> None:
    busy, idle = replicas
    stop, errors = threading.Event(), list[str]()
    clients = [
        threading.Thread(target=_keep_busy, args=(busy, stop, errors)) for _ in range(BUSY_CLIENTS)
    ]
    for c in clients:
        c.start()
    try:
        load = busy.serve_url + "/get_load"
        _until(
            f"the busy replica's /get_load reads {BUSY_CLIENTS - 1} or more",
            lambda: json.loads(_get(load))["load"] >= BUSY_CLIENTS - 1,
        )
        assert json.loads(_get(idle.serve_url + "/get_load"))["load"] == 0

        # The router's own view, read live from both serve ports (a read it could not
        # make shows as -1: on these two saturated cores, ask again).
        def router_sees_it() -> bool:
            got = json.loads(_get(router + "/get_loads"))["workers"]
            seen = {w["worker"]: w["load"] for w in got}
            return seen[busy.serve_url] >= 1 and seen[idle.serve_url] == 0

        _until("the router sees the busy replica loaded and the idle one idle", router_sees_it)
        # Its policy's cache: refreshed by a poll made after the load was up.
        polled = _load_reads(busy)
        _until(
            "the router polled the busy replica's /get_load again",
            lambda: _load_reads(busy) > polled,
        )

        before = _served(idle)
        for i in range(ROUTED):
            body = {"model": "tiny", "prompt": f"Route {i}", "max_tokens": 4}
            assert _post(router + "/v1/completions", body)["choices"], i
        served = _served(idle) - before
        assert json.loads(_get(load))["load"] >= 1, "the busy replica went idle: proved nothing"
        assert not errors, errors
    finally:
        stop.set()
        for c in clients:
            c.join(DEADLINE_S)
    print(f"router: {served:.0f} of {ROUTED} on the idle replica")
    assert served == ROUTED
