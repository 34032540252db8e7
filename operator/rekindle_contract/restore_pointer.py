"""The restore pointer: which checkpoint a service's new replicas restore from.

The operator writes it into the service's ConfigMap (the `checkpoint` key:
the directory; the `signature` key: this module's signature), and each new
pod reads both through env at container start. A ConfigMap is editable by
anyone with `update configmaps` in the namespace, so a bare path would let
them point replicas at any directory of the checkpoint volume. The operator
therefore signs (path, InferenceService UID, Checkpoint UID) with the
service's signing key (HMAC-SHA256, the key that signs its manifests), and a
pod the operator made (it knows its service's UID) restores only from a
pointer that carries a valid signature and names a directory directly below
the checkpoint root whose name ends in that Checkpoint's UID prefix.

What it does not stop: replaying an older signed pointer of the same
service; its checkpoint must still match the replica's fingerprint, and the
operator rewrites the ConfigMap on its next reconcile.
"""

from __future__ import annotations

import hashlib
import hmac
import posixpath

SIGNATURE_VERSION = "v1"
# ConfigMap keys of the pointer.
PATH_KEY = "checkpoint"
SIGNATURE_KEY = "signature"


def _message(path: str, service_uid: str, checkpoint_uid: str) -> bytes:
    return "\n".join(("rekindle-restore-pointer", path, service_uid, checkpoint_uid)).encode()


def sign(key: bytes, path: str, service_uid: str, checkpoint_uid: str) -> str:
    """The pointer's signature: `v1:CHECKPOINT_UID:HEX` (the UID travels with it)."""
    mac = hmac.new(key, _message(path, service_uid, checkpoint_uid), hashlib.sha256)
    return f"{SIGNATURE_VERSION}:{checkpoint_uid}:{mac.hexdigest()}"


def problem(
    key: bytes | None, path: str, service_uid: str, signature: str | None, root: str
) -> str | None:
    """Why the pointer (path, signature) must not be restored from, or None if it may."""
    why = _path_problem(path, root)
    if why:
        return why
    if key is None:
        return "this pod has no signing key to check the restore pointer with"
    if not signature:
        return "the restore pointer carries no signature (it was not written by the operator)"
    version, _, rest = signature.partition(":")
    checkpoint_uid, _, _ = rest.partition(":")
    if version != SIGNATURE_VERSION or not checkpoint_uid:
        return f"the restore pointer's signature is not in the {SIGNATURE_VERSION} format"
    want = sign(key, path, service_uid, checkpoint_uid)
    if not hmac.compare_digest(want.encode(), signature.encode()):
        return (
            "the restore pointer's signature does not match its path and this service "
            "(altered, or written for another service or checkpoint)"
        )
    if not posixpath.basename(path).endswith("-" + checkpoint_uid[:8]):
        return f"the restore pointer's directory {path} is not the signed Checkpoint's"
    return None


def _path_problem(path: str, root: str) -> str | None:
    if not path.startswith("/") or posixpath.normpath(path) != path:
        return f"the restore pointer {path!r} is not a normalized absolute path"
    if posixpath.dirname(path) != posixpath.normpath(root):
        return f"the restore pointer {path} is not a directory directly below {root}"
    return None
