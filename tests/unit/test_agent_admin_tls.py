"""The agent's admin port over TLS: the flags, the files checked at start, HTTPS only,
a renewed certificate picked up; in-process, with the agent's own aiohttp app."""

from __future__ import annotations

import argparse
import asyncio
import http.client
import shutil
import ssl
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from rekindle_agent import config
from rekindle_agent.agent import Agent
from rekindle_agent.config import AgentConfig, ConfigError, admin_tls_context
from rekindle_agent.serving.server import Proxy, admin_app, file_stamp, listen, reload_admin_cert
from rekindle_contract import api

from tests.unit.tls_certs import Ca, ServerCert, make_ca, make_server_cert, needs_openssl

pytestmark = needs_openssl

NAME = "tiny.ns.svc"
TOKEN = b"admin-tls-test-token-0123456789"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> tuple[Ca, ServerCert]:
    d = tmp_path_factory.mktemp("pki")
    ca = make_ca(d)
    return ca, make_server_cert(ca, d, NAME)


def tls_config(tmp_path: Path, cert: Path | None, key: Path | None) -> AgentConfig:
    return AgentConfig(
        model=str(tmp_path),
        run_dir=str(tmp_path),
        worker_extension="none",
        admin_tls_cert=str(cert) if cert else None,
        admin_tls_key=str(key) if key else None,
    )


def test_flags_come_from_the_contract(pki: tuple[Ca, ServerCert], tmp_path: Path) -> None:
    _, cert = pki
    p = argparse.ArgumentParser()
    config.add_arguments(p)
    ns = p.parse_args(
        [
            "--model",
            str(tmp_path),
            "--admin-tls-cert",
            str(cert.cert),
            "--admin-tls-key",
            str(cert.key),
        ]
    )
    cfg = config.from_args(ns, env={})
    assert (cfg.admin_tls_cert, cfg.admin_tls_key) == (str(cert.cert), str(cert.key))


def test_files_are_checked_at_start_naming_the_flag(
    pki: tuple[Ca, ServerCert], tmp_path: Path
) -> None:
    ca, cert = pki
    tls_config(tmp_path, cert.cert, cert.key).validate()  # the good pair
    with pytest.raises(ConfigError, match="go together"):
        tls_config(tmp_path, cert.cert, None).validate()
    with pytest.raises(ConfigError, match="go together"):
        tls_config(tmp_path, None, cert.key).validate()
    with pytest.raises(ConfigError, match=r"^--admin-tls-cert .*missing\.crt: No such file"):
        tls_config(tmp_path, tmp_path / "missing.crt", cert.key).validate()
    with pytest.raises(ConfigError, match=r"^--admin-tls-key .*missing\.key: No such file"):
        tls_config(tmp_path, cert.cert, tmp_path / "missing.key").validate()
    junk = tmp_path / "junk.pem"
    junk.write_text("-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n")
    with pytest.raises(ConfigError, match=r"--admin-tls-cert .* not a PEM certificate chain"):
        tls_config(tmp_path, junk, cert.key).validate()
    # A key that is not the certificate's (the CA's own key).
    with pytest.raises(ConfigError, match="not a PEM certificate chain and its"):
        tls_config(tmp_path, cert.cert, ca.key).validate()


def test_an_encrypted_key_is_refused_without_a_prompt(
    pki: tuple[Ca, ServerCert], tmp_path: Path
) -> None:
    _, cert = pki
    enc = tmp_path / "enc.key"
    subprocess.run(
        ["openssl", "pkey", "-in", str(cert.key), "-aes256", "-passout", "pass:secret"],
        check=True,
        stdout=enc.open("wb"),
        stdin=subprocess.DEVNULL,
    )
    with pytest.raises(ConfigError, match="unencrypted private key"):
        admin_tls_context(str(cert.cert), str(enc))


def _get(url: str, ca: Path | None = None) -> tuple[int, str]:
    """A GET with urllib (blocking: run it in a thread while the app serves)."""
    ctx = None
    if ca is not None:
        ctx = ssl.create_default_context(cafile=str(ca))
        ctx.check_hostname = False  # the name is checked by AgentClient's test; here: the CA
    try:
        with urllib.request.urlopen(url, timeout=5, context=ctx) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


async def _admin_over_tls(tmp_path: Path, ca: Ca, cert: ServerCert) -> None:
    cfg = tls_config(tmp_path, cert.cert, cert.key)
    cfg.validate()
    agent = Agent(cfg, TOKEN)
    tls = admin_tls_context(str(cert.cert), str(cert.key))
    runner, port = await listen(admin_app(agent, Proxy(agent)), "127.0.0.1", 0, tls)
    https, plain = f"https://127.0.0.1:{port}", f"http://127.0.0.1:{port}"
    try:
        client = api.AgentClient(https, TOKEN.decode(), 5, ca=str(ca.cert), server_name=NAME)
        st = await asyncio.to_thread(client.status)
        assert st.state == "Booting" and st.security["admin_tls"] is True
        # The probes' paths answer over HTTPS without a token (kubelet: no verification).
        status, _ = await asyncio.to_thread(_get, https + api.PATH_HEALTHZ, ca.cert)
        assert status == 200
        status, _ = await asyncio.to_thread(_get, https + api.PATH_STATUS, ca.cert)
        assert status == 401  # TLS is not a credential: the token is still needed
        # Plain HTTP on the admin port gets no answer at all.
        with pytest.raises((urllib.error.URLError, ConnectionError, http.client.HTTPException)):
            await asyncio.to_thread(_get, plain + api.PATH_HEALTHZ)
        with pytest.raises((urllib.error.URLError, ConnectionError, http.client.HTTPException)):
            await asyncio.to_thread(_get, plain + api.PATH_STATUS)
    finally:
        await runner.cleanup()
        agent.reaper.stop()


def test_admin_port_speaks_tls_only(pki: tuple[Ca, ServerCert], tmp_path: Path) -> None:
    asyncio.run(_admin_over_tls(tmp_path, *pki))


def test_plain_agent_says_so(tmp_path: Path) -> None:
    agent = Agent(tls_config(tmp_path, None, None), TOKEN)
    try:
        assert agent.status_doc()["security"]["admin_tls"] is False
    finally:
        agent.reaper.stop()


async def _renewal(tmp_path: Path, ca: Ca, cert: ServerCert) -> None:
    """cert-manager renews the Secret, the kubelet swaps the files: new connections get the
    new certificate; a broken pair is not loaded, the one before stays."""
    live = tmp_path / "live"
    live.mkdir()
    crt, key = live / "tls.crt", live / "tls.key"
    shutil.copy(cert.cert, crt)
    shutil.copy(cert.key, key)
    new_ca = make_ca(tmp_path / "new", "new-ca")
    renewed = make_server_cert(new_ca, tmp_path / "new", NAME)
    tls = admin_tls_context(str(crt), str(key))
    seen = file_stamp(str(crt), str(key))
    cfg = tls_config(tmp_path, crt, key)
    agent = Agent(cfg, TOKEN)
    runner, port = await listen(admin_app(agent, Proxy(agent)), "127.0.0.1", 0, tls)
    url = f"https://127.0.0.1:{port}{api.PATH_HEALTHZ}"
    try:
        assert reload_admin_cert(tls, str(crt), str(key), seen) == seen  # nothing changed
        assert (await asyncio.to_thread(_get, url, ca.cert))[0] == 200
        # A half-written pair (new certificate, old key) is not loaded.
        shutil.copy(renewed.cert, crt.with_suffix(".new"))
        crt.with_suffix(".new").replace(crt)
        assert reload_admin_cert(tls, str(crt), str(key), seen) == seen
        assert (await asyncio.to_thread(_get, url, ca.cert))[0] == 200
        # The whole new pair: loaded, and only the new CA verifies now.
        shutil.copy(renewed.key, key.with_suffix(".new"))
        key.with_suffix(".new").replace(key)
        now = reload_admin_cert(tls, str(crt), str(key), seen)
        assert now != seen
        assert (await asyncio.to_thread(_get, url, new_ca.cert))[0] == 200
        with pytest.raises(urllib.error.URLError):
            await asyncio.to_thread(_get, url, ca.cert)
    finally:
        await runner.cleanup()
        agent.reaper.stop()


def test_a_renewed_certificate_is_served(pki: tuple[Ca, ServerCert], tmp_path: Path) -> None:
    asyncio.run(_renewal(tmp_path, *pki))
