"""The admin API's bearer token and the serve port's API key: read once, compared in
constant time."""

from __future__ import annotations

import hmac
from pathlib import Path

from rekindle_store.signing import MIN_KEY_BYTES

from rekindle_agent.config import ConfigError

MIN_TOKEN_BYTES = 16


def read_secret(path: str, missing: str) -> bytes:
    """A mounted Secret's value, whitespace stripped; missing says what to mount on OSError."""
    try:
        return Path(path).read_bytes().strip()
    except OSError as e:
        raise ConfigError(missing.format(path=path, why=e.strerror or e)) from e


def read_token(path: str) -> bytes:
    token = read_secret(
        path, "token file {path}: {why}; mount the agent's Secret there or pass --token-file"
    )
    if len(token) < MIN_TOKEN_BYTES:
        raise ConfigError(
            f"token in {path} is shorter than {MIN_TOKEN_BYTES} bytes; use a random token"
        )
    return token


def read_api_key(path: str) -> bytes:
    """The serve port's API key (the user's Secret): any non-empty value."""
    key = read_secret(
        path,
        "API key file {path}: {why}; mount the API key Secret there or drop --api-key-file",
    )
    if not key or b"\n" in key:
        raise ConfigError(f"API key in {path} is empty or spans lines")
    return key


def read_signing_key(path: str) -> bytes:
    """The service's signing key (a mounted Secret): at least MIN_KEY_BYTES, whitespace stripped."""
    key = read_secret(
        path,
        "signing key file {path}: {why}; mount the service's signing key Secret there "
        "or drop --signing-key-file (checkpoints are then unsigned)",
    )
    if len(key) < MIN_KEY_BYTES:
        raise ConfigError(
            f"signing key in {path} is shorter than {MIN_KEY_BYTES} bytes; use a random key"
        )
    return key


def token_ok(expected: bytes, header: str | None) -> bool:
    """Constant-time check of an 'Authorization: Bearer <token>' header."""
    if not header or not header.startswith("Bearer "):
        return False
    return hmac.compare_digest(header[len("Bearer ") :].strip().encode(), expected)
