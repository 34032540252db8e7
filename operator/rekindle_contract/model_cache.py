"""Where a pod finds its model: the mount points and the Hugging Face cache layout.

Shared by the operator (which mounts the volumes and tells the agent the
model's path) and the agent's `rekindle fetch-model` (which fills the cache
in an init container), so both name the same directory without talking.

Cache layout, below the cache volume's root (one tree per node or per PVC,
shared by every replica that mounts it):

    models--ORG--NAME/snapshots/COMMIT/...   the files of one commit, complete
    models--ORG--NAME/refs/REVISION          a symlink to ../snapshots/COMMIT
    models--ORG--NAME/.lock                  held while one fetch runs

A model from an S3-compatible store (spec.model.s3) has a tree of its own,
keyed by a digest of its endpoint, bucket and prefix:

    s3--KEY/snapshots/VERSION/...   the objects of one listing (VERSION: a digest
                                    of every key, size and ETag), complete
    s3--KEY/refs/current            a symlink to ../snapshots/VERSION
    s3--KEY/.lock

A snapshot directory appears only by an atomic rename of a finished download,
so a directory that exists is complete. vLLM is given the refs/ path: for a
commit pin it never changes; for a branch or tag, `fetch-model` re-points it
when the hub says the revision has moved.
"""

from __future__ import annotations

import hashlib
import re
from urllib.parse import quote

# A PVC or node-path model is mounted here, read-only; vLLM gets this path.
MODEL_MOUNT = "/var/lib/rekindle/model"
# The Hugging Face cache volume: read-write in the fetch init container,
# read-only in the serving container.
MODEL_CACHE_MOUNT = "/var/lib/rekindle/model-cache"
DEFAULT_REVISION = "main"

# The hub's repository ids: NAME or ORG/NAME, letters, digits, '.', '_', '-',
# no '--' or '..' (the hub refuses both; '--' is the cache key's separator).
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?$")
_REVISION = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_./+-]{0,254}$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


def valid_repo_id(repo_id: str) -> bool:
    """True for a hub id this cache can key on safely (no path tricks, no separator clash)."""
    return bool(_REPO_ID.match(repo_id)) and "--" not in repo_id and ".." not in repo_id


def valid_revision(revision: str) -> bool:
    """A branch, tag or commit as the CRD allows it: letters, digits, '_', '.', '/', '+',
    '-', not starting with '.', '/' or '-', no '..', at most 255 characters."""
    return bool(_REVISION.match(revision)) and ".." not in revision


def is_commit(revision: str) -> bool:
    """A full 40-hex commit id: a pin whose files never change."""
    return bool(_COMMIT.match(revision))


def repo_dir(repo_id: str) -> str:
    """The directory of one repository in the cache (the hub client's own naming)."""
    if not valid_repo_id(repo_id):
        raise ValueError(f"not a Hugging Face model id: {repo_id!r} (use ORG/NAME)")
    return "models--" + repo_id.replace("/", "--")


def ref_name(revision: str) -> str:
    """revision as one file name (a branch may contain '/')."""
    if not valid_revision(revision):
        raise ValueError(f"not a usable revision: {revision!r}")
    return quote(revision, safe="")


def model_path(repo_id: str, revision: str, root: str = MODEL_CACHE_MOUNT) -> str:
    """The path vLLM loads the model from: the revision's ref in the cache."""
    return f"{root}/{repo_dir(repo_id)}/refs/{ref_name(revision)}"


S3_REF = "current"


def s3_dir(endpoint: str, bucket: str, prefix: str) -> str:
    """The directory of one S3 model in the cache: a digest of where it is read from."""
    where = f"{endpoint.rstrip('/')}/{bucket}/{prefix.strip('/')}/"
    return "s3--" + hashlib.sha256(where.encode()).hexdigest()[:24]


def s3_model_path(endpoint: str, bucket: str, prefix: str, root: str = MODEL_CACHE_MOUNT) -> str:
    """The path vLLM loads an S3 model from: its current snapshot's ref in the cache."""
    return f"{root}/{s3_dir(endpoint, bucket, prefix)}/refs/{S3_REF}"
