"""Relay one HTTP request to an upstream and its answer back, streamed: the serving
path's only copy loop, shared by the agent's serve port and the front.

Hop-by-hop headers never cross; a body the caller already holds goes up whole;
the answer comes back chunk by chunk as it arrives (SSE streams stay streams). An
upstream that fails before answering gets a 502 (504 when it sent nothing in
time); one that fails mid-answer has its response cut, since the status is
already sent.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable

from aiohttp import ClientConnectorError, ClientError, ClientSession, web

log = logging.getLogger("rekindle.relay")

HOP_HEADERS = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)


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


async def relay(
    request: web.Request,
    client: ClientSession,
    url: str,
    body: bytes,
    *,
    drop_headers: Iterable[str] = (),
    timeout_s: float,
    upstream: str = "upstream",
    timeout_hint: str = "",
    refused_is_error: bool = True,
) -> web.StreamResponse:
    """Send request (its body in hand) to url and stream the answer back.

    With refused_is_error=False a refused connection raises UpstreamRefused
    instead of answering 502 (the front holds the request and retries).
    """
    drop = HOP_HEADERS | {h.lower() for h in drop_headers}
    headers = {k: v for k, v in request.headers.items() if k.lower() not in drop}
    resp: web.StreamResponse | None = None
    try:
        async with client.request(request.method, url, headers=headers, data=body or None) as up:
            resp = web.StreamResponse(
                status=up.status,
                headers={k: v for k, v in up.headers.items() if k.lower() not in HOP_HEADERS},
            )
            if up.content_length is not None:
                resp.content_length = up.content_length
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp
    except (ClientError, TimeoutError) as e:
        if resp is not None and resp.prepared:
            # Mid-stream: the status is sent; cut the response short.
            log.warning("relay: %s stopped sending mid-response: %r", upstream, e)
            with contextlib.suppress(Exception):
                if request.transport is not None:
                    request.transport.close()
            return resp
        if isinstance(e, TimeoutError):
            hint = f" ({timeout_hint})" if timeout_hint else ""
            return error(f"{upstream} sent nothing for {timeout_s:g}s{hint}", 504, "timeout")
        if not refused_is_error and _refused(e):
            raise UpstreamRefused(str(e)) from e
        return error(f"{upstream} unreachable: {e}", 502, "upstream_error")


def _refused(e: BaseException) -> bool:
    """A connection the upstream never accepted (refused, no route): nothing was sent."""
    return isinstance(e, ClientConnectorError)
