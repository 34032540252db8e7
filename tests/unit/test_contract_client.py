"""The operator's admin client sends its bearer token only to the URL it was given:
never along a redirect, never through a proxy named by the environment."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from rekindle_contract.api import AgentClient, AgentError

TOKEN = "admin-token-0123456789abcdef"


class Recorder:
    """A loopback HTTP server that records the Authorization header of every request
    and answers each with `reply(path)` -> (status, headers)."""

    def __init__(self, reply: object) -> None:
        self.seen: list[tuple[str, str | None]] = []
        rec = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                rec.seen.append((self.path, self.headers.get("Authorization")))
                code, headers = rec.reply(self.path)
                self.send_response(code)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args: object) -> None:
                pass

        self.reply = reply  # type: ignore[assignment]
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture()
def elsewhere() -> Iterator[Recorder]:
    rec = Recorder(lambda path: (200, {}))
    yield rec
    rec.close()


def test_a_redirect_is_an_error_and_the_token_stays(elsewhere: Recorder) -> None:
    impostor = Recorder(lambda path: (302, {"Location": elsewhere.url + "/stolen"}))
    try:
        with pytest.raises(AgentError) as e:
            AgentClient(impostor.url, TOKEN, timeout=10)._call("GET", "/v1/status")
        assert e.value.status == 302
        assert impostor.seen == [("/v1/status", f"Bearer {TOKEN}")]
        assert elsewhere.seen == []
        assert AgentClient(impostor.url, TOKEN, timeout=10).ready() is False
        assert elsewhere.seen == []
    finally:
        impostor.close()


def test_environment_proxies_are_not_used(
    elsewhere: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent = Recorder(lambda path: (200, {}))
    try:
        for var in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY"):
            monkeypatch.setenv(var, elsewhere.url)
        for var in ("NO_PROXY", "no_proxy"):
            monkeypatch.delenv(var, raising=False)
        assert AgentClient(agent.url, TOKEN, timeout=10)._call("GET", "/v1/status") == {}
        assert agent.seen == [("/v1/status", f"Bearer {TOKEN}")]
        assert elsewhere.seen == []  # the proxy never saw the request (nor the token)
    finally:
        agent.close()
