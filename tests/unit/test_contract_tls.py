"""AgentClient over HTTPS against a real TLS server: the CA and the name are both checked.

The server is the standard library's http.server wrapped in ssl, with a CA and
a server certificate made by the openssl CLI; the client connects to
127.0.0.1 and checks the certificate against a DNS name, as the operator
connects to a pod IP and checks the Service's name.
"""

from __future__ import annotations

import http.server
import json
import ssl
import threading
import urllib.error
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from rekindle_contract.api import AgentClient, AgentError, client_tls_context

from tests.unit.tls_certs import Ca, ServerCert, make_ca, make_server_cert, needs_openssl

pytestmark = needs_openssl

NAME = "tiny.ns.svc"
HOSTNAME_MISMATCH, IP_ADDRESS_MISMATCH = 62, 64  # OpenSSL's X509_V_ERR_* codes
TOKEN = "contract-tls-token"


class Handler(http.server.BaseHTTPRequestHandler):
    """/v1/status with the token; /readyz without."""

    def do_GET(self) -> None:
        if self.path == "/readyz":
            self._send(200, {"state": "Ready"})
        elif self.headers.get("Authorization") != f"Bearer {TOKEN}":
            self._send(401, {"error": "missing or wrong bearer token"})
        else:
            self._send(200, {"state": "Ready", "origin": "booted", "ready": True})

    def _send(self, status: int, doc: object) -> None:
        body = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: object) -> None:
        pass


@contextmanager
def https_server(cert: ServerCert) -> Iterator[str]:
    """https://127.0.0.1:PORT serving cert, TLS 1.2 or later."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert.cert, cert.key)
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"https://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> tuple[Ca, Ca, ServerCert]:
    """(the service's CA, another CA, a certificate for NAME from the first)."""
    d = tmp_path_factory.mktemp("pki")
    ca = make_ca(d, "ca")
    other = make_ca(d, "other-ca")
    return ca, other, make_server_cert(ca, d, NAME)


def test_right_ca_and_name_verify(pki: tuple[Ca, Ca, ServerCert]) -> None:
    ca, _, cert = pki
    with https_server(cert) as url:
        as_bytes = AgentClient(url, TOKEN, 5, ca=ca.cert.read_bytes(), server_name=NAME)
        assert as_bytes.status().state == "Ready"
        assert as_bytes.ready()
        as_file = AgentClient(url, TOKEN, 5, ca=str(ca.cert), server_name=NAME)
        assert as_file.status().origin == "booted"
        wrong_token = AgentClient(url, "nope", 5, ca=ca.cert.read_bytes(), server_name=NAME)
        with pytest.raises(AgentError) as err:
            wrong_token.status()
        assert err.value.status == 401


def test_another_ca_is_refused(pki: tuple[Ca, Ca, ServerCert]) -> None:
    _, other, cert = pki
    with https_server(cert) as url:
        client = AgentClient(url, TOKEN, 5, ca=other.cert.read_bytes(), server_name=NAME)
        with pytest.raises(urllib.error.URLError) as err:
            client.status()
        assert isinstance(err.value.reason, ssl.SSLCertVerificationError)
        assert "certificate verify failed" in str(err.value.reason)
        assert not client.ready()


@pytest.mark.parametrize("name", ["other.ns.svc", None])
def test_another_name_is_refused(pki: tuple[Ca, Ca, ServerCert], name: str | None) -> None:
    """A certificate of the same CA for another service, or the bare IP (the default
    without server_name), does not pass."""
    ca, _, cert = pki
    with https_server(cert) as url:
        client = AgentClient(url, TOKEN, 5, ca=ca.cert.read_bytes(), server_name=name)
        with pytest.raises(urllib.error.URLError) as err:
            client.status()
        reason = err.value.reason
        assert isinstance(reason, ssl.SSLCertVerificationError)
        assert reason.verify_code in (HOSTNAME_MISMATCH, IP_ADDRESS_MISMATCH), reason


def test_tls_settings_with_a_plain_url_are_refused(pki: tuple[Ca, Ca, ServerCert]) -> None:
    """The caller meant TLS: the token must not go out in clear instead."""
    ca, _, _ = pki
    with pytest.raises(ValueError, match="https://"):
        AgentClient("http://10.0.0.1:8081", TOKEN, ca=ca.cert.read_bytes(), server_name=NAME)


def test_client_context_is_tls12_or_later_and_trusts_only_the_ca(
    pki: tuple[Ca, Ca, ServerCert], tmp_path: Path
) -> None:
    ca, _, _ = pki
    ctx = client_tls_context(ca.cert.read_bytes())
    assert ctx.minimum_version >= ssl.TLSVersion.TLSv1_2
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname
    assert len(ctx.get_ca_certs()) == 1
    (tmp_path / "junk.pem").write_text("not a certificate")
    with pytest.raises(ssl.SSLError):
        client_tls_context(str(tmp_path / "junk.pem"))
