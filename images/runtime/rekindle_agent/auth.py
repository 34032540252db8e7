"""The admin API's bearer token: read once at start, compared in constant time."""

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


def token_ok(expected: bytes, header: str | None) -> bool:
    """Constant-time check of an 'Authorization: Bearer <token>' header."""
    if not header or not header.startswith("Bearer "):
        return False
    return hmac.compare_digest(header[len("Bearer ") :].strip().encode(), expected)
