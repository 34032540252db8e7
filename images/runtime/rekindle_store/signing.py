"""Signed manifests: HMAC-SHA256 with the InferenceService's key, checked before any use.

A checkpoint directory is data another pod wrote; whoever can write the
checkpoint volume (or copy another service's checkpoint into place) could
otherwise make the agent restore memory of their choosing, as root. The
manifest lists every file with its BLAKE3 digest, so signing the manifest
binds every byte of the checkpoint: the signature is checked first, then the
paths and modes in it (manifest_io.validate_paths), then the file contents
(prefetch.py), and only then is anything of it used.

The signature covers the canonical JSON of every key of the manifest except
`signature` itself (sorted keys, no whitespace); it lives in the manifest, so
the manifest and its signature are replaced together by one rename.
Without a key (the in-pod agent's --signing-key-file unset) the agent writes and accepts unsigned
manifests, as before, and says so in its status.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping
from typing import Any

from rekindle_contract.manifest import SIGNATURE_ALGORITHM, SIGNATURE_KEY

MIN_KEY_BYTES = 32


class SignatureError(ValueError):
    """The manifest is unsigned, altered, or signed with another key."""


def key_id(key: bytes) -> str:
    """A public tag of the key (reveals nothing of it): tells "another key" from "altered"."""
    return hmac.new(key, b"rekindle signing key id", hashlib.sha256).hexdigest()[:16]


def canonical(doc: Mapping[str, Any]) -> bytes:
    """The signed bytes: every key but the signature, sorted, compact, ASCII."""
    body = {k: v for k, v in doc.items() if k != SIGNATURE_KEY}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def signature(doc: Mapping[str, Any], key: bytes) -> dict[str, str]:
    return {
        "algorithm": SIGNATURE_ALGORITHM,
        "key_id": key_id(key),
        "value": hmac.new(key, canonical(doc), hashlib.sha256).hexdigest(),
    }


def sign(doc: dict[str, Any], key: bytes | None) -> None:
    """Sign doc in place (key None: leave it unsigned, dropping any stale signature)."""
    doc.pop(SIGNATURE_KEY, None)
    if key is not None:
        doc[SIGNATURE_KEY] = signature(doc, key)


def check(doc: Mapping[str, Any], key: bytes | None) -> None:
    """Raise SignatureError unless doc carries a valid signature by key (no key: nothing to do)."""
    if key is None:
        return
    sig = doc.get(SIGNATURE_KEY)
    if not isinstance(sig, dict) or not sig.get("value"):
        raise SignatureError(
            "the manifest is unsigned, and this agent has a signing key: only checkpoints "
            "this service signed are restored"
        )
    if sig.get("algorithm") != SIGNATURE_ALGORITHM:
        raise SignatureError(f"signature algorithm {sig.get('algorithm')!r} is not supported")
    want = signature(doc, key)
    if not hmac.compare_digest(str(sig.get("value")), want["value"]):
        if sig.get("key_id") != want["key_id"]:
            raise SignatureError(
                f"the manifest was signed with another key (key id {sig.get('key_id')!r}, "
                f"this service's is {want['key_id']!r}): another service's checkpoint?"
            )
        raise SignatureError("the manifest's signature does not match: it was altered")
