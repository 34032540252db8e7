"""Models that are not in the image, served for real on the local cluster.

The project's tiny model is generated into a directory on the node (this
machine), then served by four InferenceServices (replicas 1), applied
together by one module fixture so that their vLLMs boot side by side (a
fraction of a core requested each; a test run alone still gets all four):

- from a PVC: a hostPath-backed PersistentVolume bound to a claim in the
  test's namespace, the model in a subPath of it;
- from a node path (spec.model.hostPath);
- from "the hub": a stand-in hub (tests/fake_hub.py) on this machine's node
  address, the token in a Secret; the init container downloads into the
  node's cache and vLLM serves from there;
- from the object store (spec.model.s3): the local cluster's SeaweedFS, the
  keys in a Secret; the same init container, parallel ranged reads.

Each checks the pod mounts the model read-only, vLLM loads it from the
mount, and a completion comes back through the Service. The operator fixture
deletes them when the module ends.
"""

from __future__ import annotations

import base64
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rekindle_contract.model_cache import MODEL_CACHE_MOUNT, MODEL_MOUNT, model_path, s3_model_path
from rekindle_dev.models import TinyModelSpec, generate_tiny_model

from tests.cluster import object_store
from tests.cluster.cluster_tools import NODE1, kubectl, kubectl_json
from tests.cluster.object_store import ObjectStore
from tests.cluster.operator_fixtures import (
    apply,
    host_path_claim,
    http_json,
    isvc_manifest,
    op_namespace,
    operator,
    pods_of,
    require_runtime_image,
    service_url,
    wait_status,
)
from tests.fake_hub import repo_commit, serve

__all__ = ["op_namespace", "operator"]  # fixtures used by name

pytestmark = pytest.mark.cluster
TOKEN = "hf_rekindle_test_token_5f2c"


@pytest.fixture(scope="module")
def node_dir(op_namespace: str) -> Iterator[Path]:
    """A directory on the node (this machine) holding the tiny model under tiny/."""
    root = Path(f"/var/lib/rekindle/test-models-{op_namespace}")
    generate_tiny_model(root / "tiny", TinyModelSpec())
    yield root
    shutil.rmtree(root, ignore_errors=True)


def isvc_with_model(name: str, model: dict[str, Any], host_dir: Path) -> dict[str, Any]:
    """The tiny-cpu example with model as its source, small enough that three fit."""
    doc = isvc_manifest(name, str(host_dir / "checkpoints"), resources=RESOURCES)
    doc["spec"]["model"] = {"servedName": name, **model}
    return doc


# CPU is a request, not a limit: four vLLMs boot side by side on the node's 2 cores.
RESOURCES = {"cpu": "400m", "memory": "4Gi"}
S3_PREFIX = "models/tiny/"
PV_CLAIM = "models"


def pv_and_claim(ns: str, node_dir: Path) -> str:
    """A hostPath PersistentVolume holding node_dir, bound to claim `models` in ns."""
    return host_path_claim(ns, PV_CLAIM, node_dir)


def node_address() -> str:
    node = kubectl_json("get", "node", NODE1)
    return next(a["address"] for a in node["status"]["addresses"] if a["type"] == "InternalIP")


@pytest.fixture(scope="module")
def s3() -> Iterator[ObjectStore]:
    """The cluster's S3-compatible object store (SeaweedFS)."""
    yield from object_store.deploy()


@pytest.fixture(scope="module")
def applied(
    node_dir: Path, operator: Any, op_namespace: str, s3: ObjectStore
) -> Iterator[dict[str, Any]]:
    """The four InferenceServices, applied at once; the stand-in hub serves until the
    module ends. Yields what the tests check against: the hub, its commit, the caches."""
    require_runtime_image()
    ns = op_namespace
    bucket = s3.bucket()
    for f in sorted((node_dir / "tiny").iterdir()):
        bucket.put(S3_PREFIX + f.name, f.read_bytes())
    assert apply(s3.secret_manifest("model-store", ns), ns).returncode == 0
    pv = pv_and_claim(ns, node_dir)
    hub_root = node_dir / "hub"
    (hub_root / "rekindle").mkdir(parents=True)
    shutil.copytree(node_dir / "tiny", hub_root / "rekindle" / "tiny")
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "hf-token"},
        "data": {"HF_TOKEN": base64.b64encode(TOKEN.encode()).decode()},
    }
    assert apply(secret, ns).returncode == 0
    cache = node_dir / "hf-cache"
    try:
        with serve(hub_root, token=TOKEN, host=node_address()) as hub:
            models: dict[str, dict[str, Any]] = {
                "onpvc": {"pvc": {"claimName": PV_CLAIM, "subPath": "tiny"}},
                "onnode": {"hostPath": {"path": str(node_dir / "tiny")}},
                "onhub": {
                    "huggingFace": {
                        "id": "rekindle/tiny",
                        "tokenSecretRef": {"name": "hf-token"},
                        "endpoint": hub.url,
                        "cache": {"hostPath": {"path": str(cache)}},
                    },
                    "revision": "main",
                },
                "ons3": {
                    "s3": {
                        "endpoint": s3.endpoint,
                        "bucket": object_store.BUCKET,
                        "prefix": S3_PREFIX,
                        "secretRef": {"name": "model-store"},
                        "cache": {"hostPath": {"path": str(node_dir / "s3-cache")}},
                    }
                },
            }
            for name, model in models.items():
                r = apply(isvc_with_model(name, model, node_dir), ns)
                assert r.returncode == 0, f"{name}: {r.stderr}"
            yield {
                "hub": hub,
                "commit": repo_commit(hub_root / "rekindle" / "tiny"),
                "cache": cache,
                "models": models,
            }
    finally:
        kubectl("delete", "pvc", PV_CLAIM, "-n", ns, "--wait=false", check=False)
        kubectl("delete", "pv", pv, "--wait=false", check=False)


def serving(ns: str, name: str) -> dict[str, Any]:
    """Wait for the InferenceService to serve, complete once through its Service; its pod."""

    def ready(o: dict[str, Any]) -> bool:
        st = o.get("status") or {}
        return st.get("phase") == "Ready" and (st.get("readyReplicas") or 0) == 1

    wait_status("rkis", name, ns, "1 replica Ready", ready, 900)
    (pod,) = pods_of(name, ns)
    url = service_url(name, ns)
    out = http_json(
        f"{url}/v1/completions",
        {"model": name, "prompt": "Hello, my name is", "max_tokens": 4, "temperature": 0.0},
    )
    assert out["choices"][0]["text"]
    assert out["usage"]["completion_tokens"] == 4, out["usage"]
    return pod


def exec_in(ns: str, pod: dict[str, Any], *cmd: str) -> Any:
    return kubectl("exec", "-n", ns, pod["metadata"]["name"], "-c", "vllm", "--", *cmd, check=False)


def vllm_model_arg(ns: str, pod: dict[str, Any]) -> str:
    """The --model vLLM runs with, from the process table inside the pod."""
    ps = exec_in(ns, pod, "sh", "-c", "cat /proc/[0-9]*/cmdline | tr '\\0' ' '")
    words = ps.stdout.split()
    models = [words[i + 1] for i, w in enumerate(words[:-1]) if w == "--model"]
    assert models, f"no --model in the pod's processes: {ps.stdout[:2000]}"
    return models[-1]


def test_model_on_a_pvc_serves_from_it(applied: dict[str, Any], op_namespace: str) -> None:
    ns = op_namespace
    pod = serving(ns, "onpvc")
    vol = next(v for v in pod["spec"]["volumes"] if v["name"] == "model")
    assert vol["persistentVolumeClaim"] == {"claimName": PV_CLAIM, "readOnly": True}
    assert vllm_model_arg(ns, pod) == MODEL_MOUNT
    # The subPath's content, read-only.
    assert "model.safetensors" in exec_in(ns, pod, "ls", MODEL_MOUNT).stdout
    touch = exec_in(ns, pod, "touch", f"{MODEL_MOUNT}/x")
    assert touch.returncode != 0 and "Read-only file system" in touch.stderr


def test_model_on_a_node_path_serves_from_it(
    applied: dict[str, Any], op_namespace: str, node_dir: Path
) -> None:
    ns = op_namespace
    pod = serving(ns, "onnode")
    vol = next(v for v in pod["spec"]["volumes"] if v["name"] == "model")
    assert vol["hostPath"] == {"path": str(node_dir / "tiny"), "type": "Directory"}
    assert vllm_model_arg(ns, pod) == MODEL_MOUNT
    touch = exec_in(ns, pod, "touch", f"{MODEL_MOUNT}/x")
    assert touch.returncode != 0 and "Read-only file system" in touch.stderr


def test_hugging_face_model_is_fetched_by_the_init_container_then_served(
    applied: dict[str, Any], op_namespace: str, node_dir: Path
) -> None:
    """The init container downloads from a stand-in hub (on this machine's node address,
    the token from a Secret) into the node's cache; vLLM serves from the cache."""
    ns, hub, commit, cache = op_namespace, applied["hub"], applied["commit"], applied["cache"]
    pod = serving(ns, "onhub")
    downloads = hub.downloads()
    (init,) = pod["spec"]["initContainers"]
    assert init["name"] == "fetch-model"
    token_env = next(e for e in init["env"] if e["name"] == "HF_TOKEN")
    assert token_env["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "HF_TOKEN"}
    assert all(TOKEN not in str(c) for c in pod["spec"]["containers"])
    # Each file came from the hub once, with the token; the node's cache holds the commit.
    assert sorted(downloads) == sorted(
        f"/rekindle/tiny/resolve/{commit}/{p.name}" for p in (node_dir / "tiny").iterdir()
    )
    assert hub.requests and all(auth == f"Bearer {TOKEN}" for _, _, auth in hub.requests)
    snapshot = cache / "models--rekindle--tiny" / "snapshots" / commit
    assert sorted(p.name for p in snapshot.iterdir()) == sorted(
        p.name for p in (node_dir / "tiny").iterdir()
    )
    assert vllm_model_arg(ns, pod) == model_path("rekindle/tiny", "main")
    assert vllm_model_arg(ns, pod).startswith(MODEL_CACHE_MOUNT)


def test_s3_model_is_fetched_by_the_init_container_then_served(
    applied: dict[str, Any], op_namespace: str, node_dir: Path, s3: ObjectStore
) -> None:
    """From the cluster's object store, the keys from a Secret by reference; the node's
    cache holds the listing's files, byte for byte; vLLM serves from there."""
    ns = op_namespace
    pod = serving(ns, "ons3")
    (init,) = pod["spec"]["initContainers"]
    env = {e["name"]: e for e in init["env"]}
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": "model-store",
        "key": "secretAccessKey",
    }
    assert all(s3.creds.secret_key not in str(c) for c in pod["spec"]["containers"])
    path = s3_model_path(s3.endpoint, object_store.BUCKET, S3_PREFIX)
    assert vllm_model_arg(ns, pod) == path
    snapshot = (node_dir / "s3-cache" / Path(path).relative_to(MODEL_CACHE_MOUNT)).resolve()
    assert sorted(p.name for p in snapshot.iterdir()) == sorted(
        p.name for p in (node_dir / "tiny").iterdir()
    )
    for f in (node_dir / "tiny").iterdir():
        assert (snapshot / f.name).read_bytes() == f.read_bytes(), f.name
