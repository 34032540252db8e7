"""The admin API's bearer token and the serve port's API key: read once, compared in
constant time."""

from __future__ import annotations

import hmac
from pathlib import Path

from rekindle_agent.config import ConfigError

MIN_TOKEN_BYTES = 16


def read_token(path: str) -> bytes:
    try:
        token = Path(path).read_bytes().strip()
    except FileNotFoundError as e:
        raise ConfigError(
            f"token file {path} not found: mount the agent's Secret there or pass --token-file"
        ) from e
    if len(token) < MIN_TOKEN_BYTES:
        raise ConfigError(
            f"token in {path} is shorter than {MIN_TOKEN_BYTES} bytes; use a random token"
        )
    return token


def read_api_key(path: str) -> bytes:
    """The serve port's API key (the user's Secret): any non-empty value."""
    try:
        key = Path(path).read_bytes().strip()
    except OSError as e:
        raise ConfigError(
            f"API key file {path}: {e.strerror or e}; mount the API key Secret there "
            "or drop --api-key-file"
        ) from e
    if not key or b"\n" in key:
        raise ConfigError(f"API key in {path} is empty or spans lines")
    return key


def token_ok(expected: bytes, header: str | None) -> bool:
    """Constant-time check of an 'Authorization: Bearer <token>' header."""
    if not header or not header.startswith("Bearer "):
        return False
    return hmac.compare_digest(header[len("Bearer ") :].strip().encode(), expected)
