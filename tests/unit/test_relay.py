"""The relay's HTTP/1.1 upstream side: chunk framing followed exactly over any split,
answer heads, and the relay between a real aiohttp client and real upstream
sockets (streaming as it arrives, kept-alive reuse, a stale connection, a cut,
a client gone, backpressure, an HTTP/1.0 client)."""

from __future__ import annotations

import asyncio
import random
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest
from aiohttp import ClientPayloadError, ClientSession, web
from aiohttp.test_utils import TestServer
from rekindle_agent.serving import relay
from rekindle_agent.serving.relay import ChunkedBody, UpstreamError, parse_head


def _chunked(payloads: list[bytes], ext: bool = False) -> bytes:
    out = b""
    for p in payloads:
        out += b"%x%s\r\n%s\r\n" % (len(p), b";x=1" if ext else b"", p)
    return out


def _feed_split(body: ChunkedBody, data: bytes, rng: random.Random) -> bytes:
    out = b""
    pos = 0
    while pos < len(data):
        step = rng.choice((1, 2, 3, 7, 50, len(data)))
        out += b"".join(body.feed(data[pos : pos + step]))
        pos += step
    return out


@pytest.mark.parametrize("seed", range(40))
def test_chunked_body_over_any_split(seed: int) -> None:
    rng = random.Random(seed)
    payloads = [rng.randbytes(rng.choice((1, 5, 17, 300))) for _ in range(rng.randint(1, 6))]
    framed = _chunked(payloads, ext=seed % 3 == 0)
    end = b"0\r\nX-Trailer: 1\r\n\r\n" if seed % 2 else b"0\r\n\r\n"
    raw = ChunkedBody(raw=True)
    assert _feed_split(raw, framed + end, rng) == framed  # all but the last chunk, as sent
    assert raw.done and raw.extra == 0
    decoded = ChunkedBody(raw=False)
    assert _feed_split(decoded, framed + end + b"junk", rng) == b"".join(payloads)
    assert decoded.done and decoded.extra == 4


def test_chunked_body_holds_a_split_size_line_back() -> None:
    body = ChunkedBody(raw=True)
    assert body.feed(b"3\r\nabc\r\n0") == [b"3\r\nabc\r\n"]  # "0" may start the last chunk
    assert body.feed(b"\r\n\r\n") == [] and body.done
    body = ChunkedBody(raw=True)
    assert body.feed(b"3\r\nabc\r\n1") == [b"3\r\nabc\r\n"]
    assert b"".join(body.feed(b"0\r\n" + b"x" * 16 + b"\r\n")) == b"10\r\n" + b"x" * 16 + b"\r\n"
    assert not body.done


@pytest.mark.parametrize("line", [b"zz\r\n", b"-1\r\n", b"0x10\r\n", b"\r\n", b"+5\r\n"])
def test_chunked_body_refuses_bad_sizes(line: bytes) -> None:
    with pytest.raises(UpstreamError, match="bad chunk size"):
        ChunkedBody(raw=True).feed(line)


def test_chunked_body_refuses_an_endless_size_line() -> None:
    with pytest.raises(UpstreamError, match="too long"):
        ChunkedBody(raw=True).feed(b"1" * (relay.MAX_CHUNK_LINE + 1))


def test_parse_head_framing_and_keep_alive() -> None:
    head = parse_head(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                      b"Transfer-Encoding: chunked", "POST")  # fmt: skip
    assert (head.status, head.reason, head.framing, head.keep_alive) == (200, "OK", "chunked", True)
    assert ("Content-Type", "text/event-stream") in head.headers
    head = parse_head(b"HTTP/1.1 404 Not Found\r\ncontent-length: 12\r\nConnection: close", "GET")
    assert (head.framing, head.length, head.keep_alive) == ("length", 12, False)
    assert parse_head(b"HTTP/1.0 200 OK\r\ncontent-length: 1", "GET").keep_alive is False
    assert parse_head(b"HTTP/1.1 200 OK", "GET").framing == "close"
    assert parse_head(b"HTTP/1.1 200 OK\r\nContent-Length: 5", "HEAD").framing == "none"
    assert parse_head(b"HTTP/1.1 204 No Content", "POST").framing == "none"
    assert parse_head(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip", "GET").framing == "close"


@pytest.mark.parametrize(
    "block",
    [
        b"SMTP 220 hello",
        b"HTTP/1.1 abc OK",
        b"HTTP/1.1 200 OK\r\nno colon here",
        b"HTTP/1.1 200 OK\r\n bad: folded",
        b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2",
        b"HTTP/1.1 200 OK\r\nContent-Length: -3",
    ],
)
def test_parse_head_refuses_what_is_not_http(block: bytes) -> None:
    with pytest.raises(UpstreamError):
        parse_head(block, "GET")


# --- the relay between real sockets ---------------------------------------------


@pytest.fixture(params=["asyncio", "uvloop"])
def loop(request: pytest.FixtureRequest) -> str:
    """Each socket test on asyncio's loop and on uvloop's, the agent's (whose
    transports are not asyncio classes, only alike)."""
    return str(request.param)


def run(scenario: Callable[[], Awaitable[None]], loop: str) -> None:
    if loop == "uvloop":
        uvloop = pytest.importorskip("uvloop", reason="no uvloop: the agent runs on asyncio's loop")
        uvloop.run(scenario())
    else:
        asyncio.run(scenario())


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Upstream:
    """A real aiohttp server as the upstream; counts the connections it accepted."""

    def __init__(self, app: web.Application) -> None:
        self.server = TestServer(app, host="127.0.0.1")
        self.peers: set[tuple[str, int]] = set()

        @web.middleware
        async def count(
            request: web.Request, handler: Callable[..., Awaitable[web.StreamResponse]]
        ) -> web.StreamResponse:
            assert request.transport is not None
            self.peers.add(request.transport.get_extra_info("peername"))
            return await handler(request)

        app.middlewares.append(count)

    @property
    def address(self) -> relay.Address:
        assert self.server.port is not None
        return relay.Address("127.0.0.1", self.server.port)


class Front:
    """The relay's own server, run as the agent runs it (a handler is not cancelled
    when its client goes away: aiohttp's test server would cancel it)."""

    def __init__(self, runner: web.AppRunner) -> None:
        self.runner = runner
        self.port = int(runner.addresses[0][1])

    def make_url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"


@asynccontextmanager
async def front_for(
    upstreams: relay.Upstreams, address: relay.Address, timeout_s: float = 10.0
) -> AsyncIterator[Front]:
    """A relay in front of address (every path forwarded), served as the agent serves."""

    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        return await relay.relay(
            request, upstreams, address, request.raw_path, body,
            drop_headers={"authorization"}, timeout_s=timeout_s, upstream="up",
        )  # fmt: skip

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", forward)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield Front(runner)
    finally:
        await runner.cleanup()


@asynccontextmanager
async def relayed(
    upstream_app: web.Application, timeout_s: float = 10.0
) -> AsyncIterator[tuple[Upstream, Front, relay.Upstreams]]:
    """The upstream, and a relay in front of it (every path forwarded)."""
    up = Upstream(upstream_app)
    await up.server.start_server()
    upstreams = relay.Upstreams(connect_timeout_s=2.0)
    try:
        async with front_for(upstreams, up.address, timeout_s) as front:
            yield up, front, upstreams
    finally:
        await upstreams.close()
        await up.server.close()


RawServe = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@asynccontextmanager
async def raw_upstream(serve: RawServe) -> AsyncIterator[tuple[relay.Address, relay.Upstreams]]:
    """An upstream written byte by byte (serve), and the pool that reaches it."""
    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    upstreams = relay.Upstreams(connect_timeout_s=2.0)
    try:
        yield relay.Address("127.0.0.1", server.sockets[0].getsockname()[1]), upstreams
    finally:
        await upstreams.close()
        server.close()


def test_a_stream_arrives_as_it_is_sent_and_the_connection_is_reused(loop: str) -> None:
    async def scenario() -> None:
        step = asyncio.Event()
        seen: dict[str, str | None] = {}

        async def stream(request: web.Request) -> web.StreamResponse:
            seen["auth"] = request.headers.get("Authorization")
            seen["x"] = request.headers.get("X-Client")
            seen["body"] = (await request.read()).decode()
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b"data: 1\n\n")
            await step.wait()  # the second event only after the client saw the first
            await resp.write(b"data: 2\n\n")
            await resp.write_eof()
            return resp

        async def plain(request: web.Request) -> web.Response:
            return web.json_response({"n": 42}, status=201)

        app = web.Application()
        app.router.add_post("/stream", stream)
        app.router.add_get("/plain", plain)
        async with relayed(app) as (up, front, _), ClientSession() as s:
            headers = {"Authorization": "Bearer k", "X-Client": "c1"}
            async with s.post(front.make_url("/stream"), data=b"prompt", headers=headers) as r:
                assert r.status == 200 and r.headers["Content-Type"] == "text/event-stream"
                assert await r.content.readuntil(b"\n\n") == b"data: 1\n\n"
                step.set()
                assert await r.content.read() == b"data: 2\n\n"
            assert seen == {"auth": None, "x": "c1", "body": "prompt"}
            for _ in range(3):
                async with s.get(front.make_url("/plain")) as r:
                    assert r.status == 201 and await r.json() == {"n": 42}
            assert len(up.peers) == 1  # one kept-alive connection carried all four

    run(scenario, loop)


def test_a_kept_alive_connection_closed_under_a_request_is_retried_once(loop: str) -> None:
    """The upstream closes a reused connection on the next request without reading
    it (an idle close crossing the request): the relay sends it again on a new one."""

    async def scenario() -> None:
        connections = 0

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal connections
            connections += 1
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await reader.readuntil(b"\r\n\r\n")  # the next request: dropped unread
            writer.close()

        request = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
        async with raw_upstream(serve) as (address, upstreams):
            for expected in (1, 2):
                exchange = await upstreams.open(address, "GET", request, 5.0)
                assert exchange.head.result().status == 200 and connections == expected
                exchange.left = 0  # the 2-byte body came with the head
                exchange.finished.set_result(None)
                upstreams.release(exchange)

    run(scenario, loop)


def test_an_upstream_cut_mid_answer_cuts_the_client(loop: str) -> None:
    async def scenario() -> None:
        async def cut(request: web.Request) -> web.StreamResponse:
            resp = web.StreamResponse()
            await resp.prepare(request)
            await resp.write(b"partial")
            assert request.transport is not None
            request.transport.close()
            return resp

        app = web.Application()
        app.router.add_get("/", cut)
        async with (
            relayed(app) as (_, front, _u),
            ClientSession() as s,
            s.get(front.make_url("/")) as r,
        ):
            assert r.status == 200
            with pytest.raises(ClientPayloadError):
                await r.read()

    run(scenario, loop)


def test_refused_unreachable_and_silent_upstreams(loop: str) -> None:
    async def scenario() -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            closed = relay.Address("127.0.0.1", sock.getsockname()[1])  # bound, not listening
        upstreams = relay.Upstreams(connect_timeout_s=2.0)
        with pytest.raises(relay.UpstreamRefused):
            await upstreams.open(closed, "GET", b"GET / HTTP/1.1\r\n\r\n", 5.0)

        async def silent(request: web.Request) -> web.Response:
            await asyncio.sleep(30)
            return web.Response()

        app = web.Application()
        app.router.add_get("/", silent)
        async with (
            relayed(app, timeout_s=0.3) as (_, front, _u),
            ClientSession() as s,
            s.get(front.make_url("/")) as r,
        ):
            assert r.status == 504
            assert "up sent nothing for 0.3s" in (await r.json())["error"]["message"]

    run(scenario, loop)


def test_a_client_gone_closes_the_upstream_connection(loop: str) -> None:
    async def scenario() -> None:
        upstream_saw_close = asyncio.Event()

        async def endless(request: web.Request) -> web.StreamResponse:
            resp = web.StreamResponse()
            await resp.prepare(request)
            try:
                while True:
                    await resp.write(b"x" * 100)
                    await asyncio.sleep(0.01)
            except (ConnectionError, asyncio.CancelledError):
                upstream_saw_close.set()  # a write failed, or the test server cancelled
                raise
            return resp

        app = web.Application()
        app.router.add_get("/", endless)
        async with relayed(app) as (_, front, _u):
            reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            await reader.readexactly(50)
            writer.close()
            await asyncio.wait_for(upstream_saw_close.wait(), 10)

    run(scenario, loop)


def test_a_slow_client_gets_a_large_answer_whole(loop: str) -> None:
    """Backpressure: the upstream's reads pause while the client's socket is full."""

    async def scenario() -> None:
        blob = random.Random(1).randbytes(8 << 20)

        async def large(request: web.Request) -> web.Response:
            return web.Response(body=blob)

        app = web.Application()
        app.router.add_get("/", large)
        async with relayed(app) as (_, front, _u):
            reader, writer = await asyncio.open_connection("127.0.0.1", front.port, limit=1 << 16)
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            head = await reader.readuntil(b"\r\n\r\n")
            assert b"Content-Length: %d" % len(blob) in head
            got = bytearray()
            while len(got) < len(blob):
                got += await reader.read(1 << 16)
                if len(got) < 1 << 20:
                    await asyncio.sleep(0.01)  # slow at first: the relay must wait
            assert bytes(got) == blob
            writer.close()

    run(scenario, loop)


def test_a_chunked_answer_to_an_http_1_0_client_is_decoded(loop: str) -> None:
    async def scenario() -> None:
        async def stream(request: web.Request) -> web.StreamResponse:
            resp = web.StreamResponse()
            await resp.prepare(request)
            for part in (b"ab", b"cd"):
                await resp.write(part)
            await resp.write_eof()
            return resp

        app = web.Application()
        app.router.add_get("/", stream)
        async with relayed(app) as (_, front, _u):
            reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
            writer.write(b"GET / HTTP/1.0\r\n\r\n")
            answer = await asyncio.wait_for(reader.read(), 10)  # until the relay closes
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.0 200") and b"chunked" not in head.lower()
            assert body == b"abcd"
            writer.close()

    run(scenario, loop)


def test_a_close_delimited_answer_reaches_a_chunked_client_whole(loop: str) -> None:
    async def scenario() -> None:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nfirst ")
            await writer.drain()
            writer.write(b"and last")
            writer.close()

        async with (
            raw_upstream(serve) as (address, upstreams),
            front_for(upstreams, address) as front,
            ClientSession() as s,
            s.get(front.make_url("/")) as r,
        ):
            assert r.headers["Transfer-Encoding"] == "chunked"
            assert await r.read() == b"first and last"

    run(scenario, loop)
