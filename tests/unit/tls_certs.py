"""Test PKI made with the `openssl` CLI: a CA and server certificates it signs.

Real X.509 files, with the extensions a strict verifier wants (basic
constraints, key usage, key identifiers, a DNS subjectAltName), so the tests
exercise the same checks a cert-manager certificate goes through.
"""

from __future__ import annotations

import secrets
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from rekindle_dev.testenv import require

# Fails (tests/conftest.py's require_openssl) where the openssl CLI is missing, never skips.
needs_openssl = pytest.mark.usefixtures("require_openssl")

_EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]


@dataclass(frozen=True)
class Ca:
    cert: Path
    key: Path


@dataclass(frozen=True)
class ServerCert:
    cert: Path
    key: Path


def _openssl(*args: str, cwd: Path) -> None:
    require("openssl")
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_ca(directory: Path, name: str = "ca") -> Ca:
    """A self-signed CA: NAME.crt and NAME.key in directory."""
    directory.mkdir(parents=True, exist_ok=True)
    _openssl(
        "req",
        "-x509",
        *_EC,
        "-keyout",
        f"{name}.key",
        "-out",
        f"{name}.crt",
        "-days",
        "2",
        "-subj",
        f"/CN=rekindle test {name}",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
        "-addext",
        "subjectKeyIdentifier=hash",
        cwd=directory,
    )
    return Ca(directory / f"{name}.crt", directory / f"{name}.key")


def make_server_cert(ca: Ca, directory: Path, dns_name: str, name: str = "tls") -> ServerCert:
    """NAME.crt (signed by ca, SAN DNS:dns_name, serverAuth) and NAME.key in directory."""
    directory.mkdir(parents=True, exist_ok=True)
    ext = directory / f"{name}.ext"
    ext.write_text(
        f"subjectAltName=DNS:{dns_name}\n"
        "basicConstraints=critical,CA:FALSE\n"
        "keyUsage=critical,digitalSignature\n"
        "extendedKeyUsage=serverAuth\n"
        "subjectKeyIdentifier=hash\n"
        "authorityKeyIdentifier=keyid\n"
    )
    _openssl(
        "req", *_EC, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={dns_name}",
        cwd=directory,
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", str(ca.cert), "-CAkey", str(ca.key),
        "-set_serial", str(secrets.randbits(62) + 1),
        "-days", "2", "-extfile", str(ext), "-out", f"{name}.crt",
        cwd=directory,
    )  # fmt: skip
    return ServerCert(directory / f"{name}.crt", directory / f"{name}.key")
