"""Relay one HTTP request to an upstream and its answer back, streamed: the serving
path's only copy loop, shared by the agent's serve port and the front.

The upstream side is plain HTTP/1.1 over kept-alive connections (`Upstreams`),
driven at the protocol level: each piece of the answer's body that arrives is
written to the client's socket from the upstream socket's own callback, as it came,
chunk framing included. A streamed token therefore costs one receive and one send
and no coroutine switch: a quarter to a third less CPU per streamed answer than
aiohttp's client, which decoded every chunk and encoded it again (docs/benchmarks.md,
the proxy section); what is left is mostly the send itself. On a node whose cores
vLLM also needs, that CPU is throughput.

Hop-by-hop headers never cross; a body the caller already holds goes up whole with
its length; the answer comes back as it arrives (SSE streams stay streams). An
upstream that fails before answering gets a 502 (504 when it sent nothing in time);
one that fails mid-answer has its response cut, since the status is already sent.
A client that sends faster than its reader takes stops the upstream's reads
(backpressure), and a client gone closes the upstream connection (vLLM then
aborts the request).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import cast

from aiohttp import web

log = logging.getLogger("rekindle.relay")

HOP_HEADERS = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        "expect",  # the body is in hand: nothing to continue
    }
)

# A kept-alive connection idle longer than this is not reused: uvicorn (vLLM's
# server) closes its side after 5 s idle, and a request sent into that close is lost.
IDLE_REUSE_S = 4.0
MAX_HEAD_BYTES = 64 << 10
MAX_CHUNK_LINE = 4096
# Bytes the client's socket may hold unsent before the upstream's reads pause.
CLIENT_BUFFER_LIMIT = 64 << 10
NO_BODY_STATUSES = frozenset({204, 304})


def error(
    message: str, status: int, kind: str, headers: dict[str, str] | None = None
) -> web.Response:
    """An OpenAI-style error body."""
    return web.json_response(
        {"error": {"message": message, "type": kind, "code": status}},
        status=status,
        headers=headers,
    )


class UpstreamRefused(Exception):
    """The upstream took no connection: nothing of the request reached it, so the
    caller may safely send it elsewhere or later."""


class UpstreamError(Exception):
    """The upstream broke the exchange: closed early, or sent what is not HTTP/1.1."""


@dataclass(frozen=True)
class Address:
    """Where an upstream listens: plain HTTP on host:port."""

    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


@dataclass(frozen=True)
class Head:
    """An answer's status line and headers, and how its body is delimited."""

    status: int
    reason: str
    headers: list[tuple[str, str]]
    framing: str  # "none", "length", "chunked", "close"
    length: int
    keep_alive: bool


class ChunkedBody:
    """Follows HTTP/1.1 chunk framing (RFC 9112 7.1) over pieces as they arrive.

    raw=True: what to forward is the bytes as they came, framing included, except
    the last chunk and trailers (the client's writer ends the body itself);
    raw=False: the payload alone. A chunk-size line split across pieces is held
    back until complete, so the last chunk is never half forwarded.
    """

    SIZE, DATA, DATA_END, TRAILER, DONE = range(5)

    def __init__(self, raw: bool) -> None:
        self.raw = raw
        self.state = self.SIZE
        self.left = 0  # bytes of the current chunk (or its CRLF) still to come
        self.line = b""  # a size or trailer line begun in an earlier piece
        self.extra = 0  # bytes after the body's end (a broken upstream)

    @property
    def done(self) -> bool:
        return self.state == self.DONE

    def feed(self, data: bytes) -> list[bytes]:
        """The bytes of data to pass on, in order; raises UpstreamError on bad framing."""
        out: list[bytes] = []
        raw = self.raw
        n = len(data)
        pos = 0
        start = 0  # raw: first byte of data not yet passed on
        while pos < n:
            state = self.state
            if state == self.DATA:
                take = min(self.left, n - pos)
                if not raw:
                    out.append(data[pos : pos + take])
                pos += take
                self.left -= take
                if not self.left:
                    self.state, self.left = self.DATA_END, 2
            elif state == self.DATA_END:
                take = min(self.left, n - pos)
                pos += take
                self.left -= take
                if not self.left:
                    self.state = self.SIZE
            elif state == self.SIZE:
                end = data.find(b"\n", pos)
                if end < 0:
                    if raw and pos > start:
                        out.append(data[start:pos])
                    self._hold(data[pos:])
                    return out
                line, held = self.line + data[pos:end], self.line
                self.line = b""
                size = _chunk_size(line)
                if size == 0:
                    if raw and pos > start:
                        out.append(data[start:pos])
                    self.state = self.TRAILER
                    pos = start = end + 1
                    continue
                if raw and held:  # its start was held back: pass it on now
                    out.append(held)
                self.state, self.left = self.DATA, size
                pos = end + 1
            elif state == self.TRAILER:
                end = data.find(b"\n", pos)
                if end < 0:
                    self._hold(data[pos:])
                    return out
                line = (self.line + data[pos:end]).rstrip(b"\r")
                self.line = b""
                pos = start = end + 1
                if not line:
                    self.state = self.DONE
            else:  # DONE: anything more is not part of this answer
                self.extra += n - pos
                return out
        if raw and self.state not in (self.TRAILER, self.DONE) and n > start:
            out.append(data[start:] if start else data)
        return out

    def _hold(self, part: bytes) -> None:
        self.line += part
        if len(self.line) > MAX_CHUNK_LINE:
            raise UpstreamError("chunk-size or trailer line too long")


def _chunk_size(line: bytes) -> int:
    text = line.split(b";", 1)[0].strip()
    try:
        size = int(text, 16)
    except ValueError:
        size = -1
    if size < 0 or not text or text.startswith((b"+", b"-", b"0x", b"0X")):
        raise UpstreamError(f"bad chunk size {text[:20]!r}")
    return size


def parse_head(block: bytes, method: str) -> Head:
    """An answer's head (up to, not including, the blank line); raises UpstreamError."""
    lines = block.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise UpstreamError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
    status = int(parts[1])
    headers: list[tuple[str, str]] = []
    length: str | None = None
    coding: str | None = None
    connection = ""
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise UpstreamError(f"bad header line: {line[:80]!r}")
        value = value.strip()
        lower = name.lower()
        if lower == "content-length":
            if length is not None and length != value:
                raise UpstreamError("conflicting Content-Length headers")
            length = value
        elif lower == "transfer-encoding":
            coding = value.lower() if coding is None else f"{coding}, {value.lower()}"
        elif lower == "connection":
            connection = value.lower()
        headers.append((name, value))
    keep_alive = "close" not in connection if parts[0] == "HTTP/1.1" else "keep-alive" in connection
    if method == "HEAD" or status in NO_BODY_STATUSES or status < 200:
        return Head(status, parts[2] if len(parts) > 2 else "", headers, "none", 0, keep_alive)
    reason = parts[2] if len(parts) > 2 else ""
    if coding is not None:
        if coding.rsplit(",", 1)[-1].strip() == "chunked":
            return Head(status, reason, headers, "chunked", 0, keep_alive)
        return Head(status, reason, headers, "close", 0, False)
    if length is not None:
        if not length.isdigit():
            raise UpstreamError(f"bad Content-Length {length[:20]!r}")
        return Head(status, reason, headers, "length", int(length), keep_alive)
    return Head(status, reason, headers, "close", 0, False)


class _Connection(asyncio.Protocol):
    """One kept-alive connection to an upstream, carrying one exchange at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop, address: Address) -> None:
        self.loop = loop
        self.address = address
        self.transport: asyncio.Transport | None = None
        self.exchange: _Exchange | None = None
        self.idle_since = loop.time()
        self.lost: asyncio.Future[None] = loop.create_future()

    @property
    def open(self) -> bool:
        return self.transport is not None and not self.transport.is_closing()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, only alike.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self.exchange is None:  # nothing asked: an upstream talking out of turn
            self.close()
            return
        self.exchange.received(data)

    def eof_received(self) -> bool | None:
        return None  # close the transport: connection_lost ends any exchange

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if not self.lost.done():
            self.lost.set_result(None)
        if self.exchange is not None:
            self.exchange.upstream_closed(exc)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class _Exchange:
    """One request on a connection and its answer, forwarded to one client.

    The answer's head resolves `head`; its body goes to the client's transport
    (after `attach`; held until then) straight from the connection's data callback;
    `finished` resolves when the body is complete, or fails. The handler sleeps
    on `wake`, set when the body ends or when the client's socket is full and the
    upstream's reads were paused (`paused`): the handler then waits for the client
    to drain and calls `resume`.
    """

    def __init__(self, conn: _Connection, method: str, timeout_s: float) -> None:
        loop = conn.loop
        self.conn = conn
        self.method = method
        self.timeout_s = timeout_s
        self.head: asyncio.Future[Head] = loop.create_future()
        self.finished: asyncio.Future[None] = loop.create_future()
        self.wake: asyncio.Future[None] | None = None
        self.paused = False
        self.buffer = bytearray()  # the head, then body bytes before attach
        self.parsed: Head | None = None
        self.got_bytes = False
        self.last = loop.time()
        self.sink: asyncio.Transport | None = None
        self.frame = False  # close-delimited answer to a chunked client: frame it here
        self.chunks: ChunkedBody | None = None
        self.left = 0  # length framing: body bytes still to come
        self.reusable = False
        self.timer = loop.call_later(timeout_s, self._check_idle)

    # --- from the connection -------------------------------------------------

    def received(self, data: bytes) -> None:
        self.last = self.conn.loop.time()
        self.got_bytes = True
        if self.parsed is None:
            self._head_bytes(data)
        elif self.sink is None:
            self.buffer += data
            if len(self.buffer) > CLIENT_BUFFER_LIMIT and not self.paused:
                self._pause()
        else:
            self._forward(data)

    def upstream_closed(self, exc: Exception | None) -> None:
        head = self.parsed
        if head is not None and head.framing == "close" and exc is None:
            self.reusable = False
            self._finish()  # its body ends with the connection (any held part follows)
        else:
            why = f": {exc!r}" if exc else ""
            self._fail(UpstreamError(f"closed the connection{why}"))

    # --- from the handler ------------------------------------------------------

    def attach(self, sink: asyncio.Transport, client_chunked: bool) -> None:
        """Pass the body on to the client's transport (its headers are sent)."""
        head = self.parsed
        assert head is not None
        self.sink = sink
        if head.framing == "chunked":
            self.chunks = ChunkedBody(raw=client_chunked)
        self.frame = head.framing == "close" and client_chunked
        pending, self.buffer = bytes(self.buffer), bytearray()
        if head.framing == "none" or (head.framing == "length" and not self.left):
            if pending:
                self.reusable = False
            self._finish()
        elif pending:
            self._forward(pending)

    def resume(self) -> None:
        """The client drained: read the upstream again."""
        self.paused = False
        if self.conn.transport is not None and not self.finished.done():
            self.conn.transport.resume_reading()

    # --- internals -------------------------------------------------------------

    def _head_bytes(self, data: bytes) -> None:
        self.buffer += data
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(self.buffer) > MAX_HEAD_BYTES:
                self._fail(UpstreamError("answer head too large"))
            return
        try:
            head = parse_head(bytes(self.buffer[:end]), self.method)
        except UpstreamError as e:
            return self._fail(e)
        rest = bytes(self.buffer[end + 4 :])
        self.buffer = bytearray()
        if head.status < 200:  # interim (100 Continue): the real head follows
            if rest:
                self._head_bytes(rest)
            return
        self.parsed = head
        self.left = head.length
        self.reusable = head.keep_alive
        self.buffer += rest
        self.head.set_result(head)

    def _forward(self, data: bytes) -> None:
        """Pass a piece of the body on, by the answer's framing and the client's."""
        sink = self.sink
        head = self.parsed
        assert sink is not None and head is not None
        if self.finished.done() and head.framing != "close":
            self.reusable = False  # bytes past the end of the answer
            return
        if sink.is_closing():  # the client went away: stop vLLM's work too
            return self._fail(ConnectionResetError("the client closed the connection"))
        framing = head.framing
        if framing == "chunked":
            assert self.chunks is not None
            try:
                pieces = self.chunks.feed(data)
            except UpstreamError as e:
                return self._fail(e)
            for piece in pieces:
                sink.write(piece)
            if self.chunks.done:
                if self.chunks.extra:
                    self.reusable = False  # more than the answer: do not trust the rest
                return self._finish()
        elif framing == "length":
            if len(data) > self.left:
                self.reusable = False
                data = data[: self.left]
            self.left -= len(data)
            sink.write(data)
            if not self.left:
                return self._finish()
        elif self.frame:
            sink.write(b"%x\r\n%b\r\n" % (len(data), data))
        else:
            sink.write(data)
        if not self.paused and sink.get_write_buffer_size() > CLIENT_BUFFER_LIMIT:
            self._pause()

    def _pause(self) -> None:
        """Stop reading the upstream until the handler saw the client drain."""
        transport = self.conn.transport
        if transport is not None:
            transport.pause_reading()
            self.paused = True
            self._signal()

    def _signal(self) -> None:
        if self.wake is not None and not self.wake.done():
            self.wake.set_result(None)

    def _finish(self) -> None:
        self.timer.cancel()
        if not self.finished.done():
            self.finished.set_result(None)
        self._signal()

    def _fail(self, e: BaseException) -> None:
        self.timer.cancel()
        self.reusable = False
        for fut in (self.head, self.finished):
            if not fut.done():
                fut.set_exception(e)
                fut.exception()  # marked retrieved: the handler awaits only one of them
        self._signal()
        self.conn.close()

    def _check_idle(self) -> None:
        if self.finished.done():
            return
        idle = 0.0 if self.paused else self.conn.loop.time() - self.last
        if idle >= self.timeout_s:  # a paused read is the client's slowness, not vLLM's
            self._fail(TimeoutError(f"nothing for {self.timeout_s:g}s"))
        else:
            self.timer = self.conn.loop.call_later(self.timeout_s - idle, self._check_idle)


class Upstreams:
    """Kept-alive HTTP/1.1 connections to upstreams, one exchange at a time each.

    A connection goes back to the pool only after a complete, well-delimited answer
    that did not ask to close; one idle for IDLE_REUSE_S is dropped instead of reused.
    """

    def __init__(self, connect_timeout_s: float) -> None:
        self.connect_timeout_s = connect_timeout_s
        self._idle: dict[Address, list[_Connection]] = {}
        self._busy: set[_Connection] = set()

    async def open(self, address: Address, method: str, data: bytes, timeout_s: float) -> _Exchange:
        """Send a request (head and body in data); the exchange once its answer's head came.

        A reused connection the upstream closed before answering (its idle close
        crossing the request) is retried once on a new one: the upstream read none
        of it. Raises UpstreamRefused (nothing sent), TimeoutError, UpstreamError.
        """
        conn = self._reused(address)
        while True:
            fresh = conn is None
            if conn is None:
                conn = await self._connect(address)
            exchange = self._start(conn, method, data, timeout_s)
            try:
                await exchange.head
                return exchange
            except UpstreamError:
                self.release(exchange)
                if fresh or exchange.got_bytes:
                    raise
                conn = None
            except BaseException:
                self.release(exchange)
                raise

    def release(self, exchange: _Exchange) -> None:
        """The exchange is over: its connection back to the pool, or closed."""
        conn = exchange.conn
        exchange.timer.cancel()
        conn.exchange = None
        self._busy.discard(conn)
        done = exchange.finished.done() and not exchange.finished.exception()
        if done and exchange.reusable and conn.open:
            conn.idle_since = conn.loop.time()
            self._idle.setdefault(conn.address, []).append(conn)
        else:
            conn.close()

    async def close(self) -> None:
        """Close every connection and wait (briefly) until they are closed."""
        conns = [c for idle in self._idle.values() for c in idle] + list(self._busy)
        self._idle.clear()
        for conn in conns:
            conn.close()
        waits = [conn.lost for conn in conns if not conn.lost.done()]
        if waits:
            await asyncio.wait(waits, timeout=1.0)

    def _reused(self, address: Address) -> _Connection | None:
        idle = self._idle.get(address)
        if not idle:
            return None
        loop = idle[-1].loop
        now = loop.time()
        while idle:
            conn = idle.pop()
            if conn.open and now - conn.idle_since < IDLE_REUSE_S:
                return conn
            conn.close()
        return None

    async def _connect(self, address: Address) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: _Connection(loop, address), address.host, address.port
                )
        except TimeoutError as e:
            raise UpstreamRefused(f"no connection in {self.connect_timeout_s:g}s") from e
        except OSError as e:
            raise UpstreamRefused(str(e)) from e
        return conn

    def _start(self, conn: _Connection, method: str, data: bytes, timeout_s: float) -> _Exchange:
        exchange = _Exchange(conn, method, timeout_s)
        conn.exchange = exchange
        self._busy.add(conn)
        assert conn.transport is not None
        conn.transport.write(data)
        return exchange


def request_head(
    method: str,
    target: str,
    address: Address,
    headers: Iterable[tuple[str, str]],
    drop: frozenset[str],
    body_length: int,
) -> bytes:
    """The request line and headers sent upstream: the client's, less drop, with Host
    and the body's length."""
    lines = [f"{method} {target} HTTP/1.1", f"Host: {address}"]
    lines += [f"{name}: {value}" for name, value in headers if name.lower() not in drop]
    if body_length or method in ("POST", "PUT", "PATCH"):
        lines.append(f"Content-Length: {body_length}")
    lines.append("\r\n")
    return "\r\n".join(lines).encode("utf-8", "surrogateescape")


async def relay(
    request: web.Request,
    upstreams: Upstreams,
    address: Address,
    target: str,
    body: bytes,
    *,
    drop_headers: Iterable[str] = (),
    timeout_s: float,
    upstream: str = "upstream",
    timeout_hint: str = "",
    refused_is_error: bool = True,
) -> web.StreamResponse:
    """Send request (its body in hand) to target at address and stream the answer back.

    With refused_is_error=False a refused connection raises UpstreamRefused
    instead of answering 502 (the front holds the request and retries).
    """
    drop = HOP_HEADERS | {h.lower() for h in drop_headers} if drop_headers else HOP_HEADERS
    data = request_head(request.method, target, address, request.headers.items(), drop, len(body))
    try:
        exchange = await upstreams.open(address, request.method, data + body, timeout_s)
    except UpstreamRefused as e:
        if not refused_is_error:
            raise
        return error(f"{upstream} unreachable: {e}", 502, "upstream_error")
    except TimeoutError:
        hint = f" ({timeout_hint})" if timeout_hint else ""
        return error(f"{upstream} sent nothing for {timeout_s:g}s{hint}", 504, "timeout")
    except UpstreamError as e:
        return error(f"{upstream} failed: {e}", 502, "upstream_error")
    try:
        return await _answer(request, exchange, upstream)
    finally:
        upstreams.release(exchange)


async def _answer(request: web.Request, exchange: _Exchange, upstream: str) -> web.StreamResponse:
    """The answer's head to the client, then its body as the connection passes it on."""
    head = exchange.head.result()
    resp = web.StreamResponse(status=head.status, reason=head.reason or None)
    for name, value in head.headers:
        if name.lower() not in HOP_HEADERS:
            resp.headers.add(name, value)
    if head.framing == "length":
        resp.content_length = head.length
    try:
        await resp.prepare(request)
        transport = request.transport
        if transport is None:
            raise ConnectionResetError("the client closed the connection")
        exchange.attach(transport, resp.headers.get("Transfer-Encoding") == "chunked")
        while not exchange.finished.done():
            if exchange.paused:
                await request.writer.drain()
                exchange.resume()
                continue
            exchange.wake = exchange.conn.loop.create_future()
            await exchange.wake
        exchange.finished.result()
        await resp.write_eof()
    except (UpstreamError, TimeoutError, ConnectionError) as e:
        # Mid-answer: the status is sent; cut the response short.
        log.warning("relay: %s stopped mid-answer: %r", upstream, e)
        if request.transport is not None:
            with contextlib.suppress(Exception):
                request.transport.close()
    return resp
