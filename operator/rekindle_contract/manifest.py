"""A checkpoint directory: its layout and manifest.json, as both sides read them.

The agent writes it (rekindle_store.manifest_io); the operator reads the
summary it records in a Checkpoint's status.
"""

from __future__ import annotations

from typing import Any, NotRequired, TypedDict

MANIFEST_FORMAT = 1
MANIFEST_NAME = "manifest.json"
VERIFIED_NAME = "verified"  # written once a restore from the checkpoint served
IMAGES_SUBDIR = "images"  # CRIU's image files
SHM_SUBDIR = "shm"  # copies of the /dev/shm files the tree maps
FILES_SUBDIR = "files"  # other files the tree holds open (vLLM's log, link-remaps, kernels)
# Below the run dir: where vLLM, Inductor, Triton and FlashInfer keep what they compile,
# so a checkpoint saves the kernels the tree maps and a restore puts them back.
RUN_CACHE_SUBDIR = "cache"
WEIGHTS_SUBDIR = "weights"  # the flat weight dump
# The only places a manifest's files may live (first path component).
SUBDIRS = (IMAGES_SUBDIR, SHM_SUBDIR, FILES_SUBDIR, WEIGHTS_SUBDIR)
SIGNATURE_KEY = "signature"  # the manifest's own key holding its signature
SIGNATURE_ALGORITHM = "hmac-sha256"


class FileEntry(TypedDict):
    path: str  # relative to the checkpoint directory
    size: int
    # Digests, hex: blake3 in what agents write now (sha256 where the blake3
    # module is missing); sha256 and crc32 in older manifests.
    blake3: NotRequired[str]
    sha256: NotRequired[str]
    crc32: NotRequired[str]


class Manifest(TypedDict, total=False):
    """manifest.json of a checkpoint directory (format MANIFEST_FORMAT)."""

    format: int
    created_at: float
    agent_version: str
    fingerprint: dict[str, Any]  # what must match for a restore
    environment: dict[str, Any]  # recorded, not enforced (kernel, CRIU version, host)
    vllm: dict[str, Any]  # argv, port, root pid, all pids of the tree, run_dir
    weights: dict[str, Any]  # released: bool, dir, reason
    canary: dict[str, Any]  # prompts, max_tokens, answers (tokens, logprobs): checked after restore
    shm_files: list[dict[str, Any]]  # name, size, mode (saved under shm/)
    extra_files: list[dict[str, Any]]  # absolute path -> saved copy under files/
    criu: dict[str, Any]  # binary, version, dump flags
    # The dumped tree's facts that decide whether a restore may map the images
    # (rekindle_agent.mapped_files.mmap_policy.tree_facts): allocators, userfaultfd, VMAs, sysctls.
    mmap: dict[str, Any]
    files: list[FileEntry]
    timings: dict[str, float]  # seconds per checkpoint phase
    verified: dict[str, Any]  # set once a restore from it served
    # Where a node agent's dump came from: namespace, pod, pod_uid, node. Signed
    # with the rest: a restore goes only into a pod of the same namespace.
    identity: dict[str, Any]
    # A node agent's dump of a tree that used a GPU: {"pids": [pids in the pod]} of the
    # processes its cuda-checkpoint checkpointed, to restore and unlock after CRIU.
    cuda: dict[str, Any]
    # HMAC-SHA256 over the canonical JSON of every other key, with the
    # InferenceService's signing key: {"algorithm", "key_id", "value"}; absent
    # when the agent had no key (an unsigned checkpoint).
    signature: dict[str, Any]
