"""`rekindle fetch-model`: a Hugging Face model into the node's cache, before vLLM starts.

Runs as the pod's init container (the operator adds it for spec.model.huggingFace).
The cache volume is shared by every replica on a node (a hostPath) or by
whatever mounts the PVC, so:

- a snapshot directory appears only by renaming a finished download into
  place (rename is atomic on one file system): a directory there is complete,
  and a fetch killed halfway leaves only a `.tmp-*` directory the next fetch
  removes;
- one fetch per repository at a time holds an exclusive lock on the
  repository's `.lock` file; the others wait, then find the snapshot there
  and download nothing;
- a commit pin already in the cache needs no network at all; a branch or tag
  costs one lookup of the commit it points at (when the hub cannot be
  reached, the commit the cache last saw for it is used, with a warning).

The layout is rekindle_contract.model_cache's; the token is the hub
client's own HF_TOKEN (the pod takes it from a Secret) and is never printed.
HF_ENDPOINT (or --endpoint) points the client at a mirror, or at a stand-in
for the hub in tests.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from rekindle_contract.model_cache import (
    DEFAULT_REVISION,
    is_commit,
    ref_name,
    repo_dir,
)

# (repo id, revision, endpoint or None) -> the commit the revision points at.
Resolver = Callable[[str, str, str | None], str]
# (repo id, commit, directory, endpoint or None): every file of that commit into directory.
Downloader = Callable[[str, str, Path, str | None], None]


class FetchError(RuntimeError):
    """The model could not be fetched; the message says why and what to check."""


def log(msg: str) -> None:
    print(f"rekindle fetch-model: {msg}", file=sys.stderr, flush=True)


def hub_commit(repo_id: str, revision: str, endpoint: str | None) -> str:
    """The commit a branch or tag points at, from the hub's model API."""
    from huggingface_hub import HfApi

    info = HfApi(endpoint=endpoint).model_info(repo_id, revision=revision)
    if not info.sha:
        raise FetchError(f"the hub gave no commit for {repo_id}@{revision}")
    return str(info.sha)


def hub_download(repo_id: str, commit: str, dest: Path, endpoint: str | None) -> None:
    """Every file of one commit into dest (the hub client; HF_TOKEN from the environment)."""
    from huggingface_hub import snapshot_download

    snapshot_download(repo_id, revision=commit, local_dir=str(dest), endpoint=endpoint)
    # The client's bookkeeping (per-file metadata with timestamps) is not the model:
    # left in, it would differ between nodes and change the agent's model digest.
    shutil.rmtree(dest / ".cache", ignore_errors=True)


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive flock on path: other replicas' fetches of this repository wait here."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"waiting for another fetch of this model ({path})")
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def point_ref(repo: Path, revision: str, commit: str) -> None:
    """refs/REVISION -> ../snapshots/COMMIT, replaced atomically (readers never see it missing)."""
    point(repo / "refs" / ref_name(revision), f"../snapshots/{commit}")


def point(ref: Path, target: str) -> None:
    """The symlink ref -> target, replaced atomically (readers never see it missing)."""
    if ref.is_symlink() and os.readlink(ref) == target:
        return
    tmp = ref.with_name(f".tmp-{ref.name}-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    os.symlink(target, tmp)
    os.replace(tmp, ref)


def cached_commit(repo: Path, revision: str) -> str | None:
    """The commit the cache's ref for revision points at, if its snapshot is there."""
    ref = repo / "refs" / ref_name(revision)
    if not ref.is_symlink():
        return None
    commit = os.path.basename(os.readlink(ref))
    return commit if (repo / "snapshots" / commit).is_dir() else None


def _resolve(
    repo_id: str, revision: str, repo: Path, endpoint: str | None, resolve: Resolver
) -> str:
    if is_commit(revision):
        return revision
    try:
        return resolve(repo_id, revision, endpoint)
    except Exception as e:  # the hub or the network: fall back on what the cache knows
        known = cached_commit(repo, revision)
        if known is None:
            raise FetchError(
                f"cannot resolve {repo_id}@{revision} on the hub ({type(e).__name__}: {e}); "
                "check spec.model.huggingFace.id, spec.model.revision, the token Secret "
                "and that the pod reaches the hub (or its endpoint)"
            ) from e
        log(f"hub unreachable ({type(e).__name__}); using the cached {revision} = {known}")
        return known


def fetch(
    repo_id: str,
    revision: str,
    cache: Path,
    endpoint: str | None = None,
    resolve: Resolver = hub_commit,
    download: Downloader = hub_download,
) -> Path:
    """Make cache hold repo_id at revision; returns the ref path vLLM loads.

    Idempotent: safe to run in every replica at once (see the module's docstring).
    """
    repo = cache / repo_dir(repo_id)
    ref_name(revision)  # refuses an unusable revision before anything is created
    if is_commit(revision) and cached_commit(repo, revision) == revision:
        log(f"{repo_id}@{revision} already in the cache")
        return repo / "refs" / ref_name(revision)
    (repo / "snapshots").mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    with locked(repo / ".lock"):
        commit = _resolve(repo_id, revision, repo, endpoint, resolve)
        if not is_commit(commit):
            raise FetchError(f"the hub answered {commit!r} for {repo_id}@{revision}, not a commit")
        snapshot = repo / "snapshots" / commit
        if snapshot.is_dir():
            log(f"{repo_id}@{revision} ({commit}) already in the cache")
        else:
            for stale in repo.glob(".tmp-*"):  # a fetch that died halfway (we hold the lock)
                shutil.rmtree(stale, ignore_errors=True)
            tmp = repo / f".tmp-{commit}-{os.getpid()}"
            start = time.monotonic()
            log(f"downloading {repo_id}@{revision} ({commit})")
            try:
                download(repo_id, commit, tmp, endpoint)
            except Exception as e:
                shutil.rmtree(tmp, ignore_errors=True)
                raise FetchError(
                    f"download of {repo_id}@{commit} failed ({type(e).__name__}: {e})"
                ) from e
            os.rename(tmp, snapshot)
            log(f"downloaded in {time.monotonic() - start:.1f}s")
        point_ref(repo, revision, commit)
    return repo / "refs" / ref_name(revision)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `rekindle fetch-model`: a hub model (--id) or an S3 prefix (--s3-*,
    model_fetch_s3)."""
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--id", dest="repo_id", help="the hub's model id, ORG/NAME")
    which.add_argument("--s3-endpoint", help="http(s)://HOST[:PORT] of an S3-compatible store")
    p.add_argument("--revision", default=DEFAULT_REVISION, help="branch, tag or commit")
    p.add_argument("--cache", required=True, type=Path, help="the cache volume's root")
    p.add_argument(
        "--endpoint",
        default=os.environ.get("HF_ENDPOINT") or None,
        help="the hub's URL (default: HF_ENDPOINT, else the client's default)",
    )
    p.add_argument("--s3-bucket", help="with --s3-endpoint: the bucket")
    p.add_argument("--s3-prefix", help="with --s3-endpoint: the model's key prefix")
    p.add_argument("--s3-region", default="us-east-1", help="with --s3-endpoint")


def run(ns: argparse.Namespace) -> int:
    """The CLI: exit 0 with the model's path on stdout, or 1 with the reason on stderr."""
    try:
        path = fetch(ns.repo_id, ns.revision, ns.cache, ns.endpoint)
    except (FetchError, ValueError, OSError) as e:
        log(str(e))
        return 1
    print(path)
    return 0
