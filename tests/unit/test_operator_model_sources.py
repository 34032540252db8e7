"""spec.model's sources and spec.coldStart.storage: parsing, refusals, pod parts, fingerprint."""

from __future__ import annotations

from typing import Any

import pytest
from rekindle_contract.model_cache import (
    MODEL_CACHE_MOUNT,
    MODEL_MOUNT,
    model_path,
    repo_dir,
    s3_model_path,
)
from rekindle_operator import builders as b
from rekindle_operator.agent_command import agent_command
from rekindle_operator.checkpoint_storage import rwo_spread_warning
from rekindle_operator.model_source import parse_model
from rekindle_operator.shm_sizing import effective_shm_bytes, shm_need
from rekindle_operator.spec import IsvcSpec, SpecError, parse_spec
from rekindle_operator.spec_fingerprint import process_extras, spec_fingerprint

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def spec_with(model: dict[str, Any], **over: Any) -> IsvcSpec:
    return parse_spec("m", "ns", {"model": {"servedName": "m", **model}, **over})


def pod(s: IsvcSpec) -> dict[str, Any]:
    dep = b.build_deployment(s, effective_shm_bytes(s, shm_need(s)), "fp")
    return dep["spec"]["template"]["spec"]


def vllm(pod_spec: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in pod_spec["containers"] if c["name"] == b.CONTAINER)


def volume(pod_spec: dict[str, Any], name: str) -> dict[str, Any]:
    return next(v for v in pod_spec["volumes"] if v["name"] == name)


def test_image_source_is_unchanged() -> None:
    """Existing manifests: the directory goes to the agent as before, nothing is mounted."""
    s = spec_with({"source": "/models/tiny"})
    assert s.model.kind == "source" and s.model_source == "/models/tiny"
    p = pod(s)
    assert "initContainers" not in p
    assert {v["name"] for v in p["volumes"]} == {"dshm", "agent-token", "checkpoints"}
    cmd = agent_command(s)
    assert cmd[cmd.index("--model") + 1] == "/models/tiny"


def test_image_source_fingerprint_is_what_it_was() -> None:
    """The model's part of a `source:` spec's fingerprint is its path, as before."""
    import hashlib
    import json

    s = spec_with({"source": "/models/tiny"})
    before = {
        "image": s.image,
        "model": "/models/tiny",
        "served": "m",
        "device": "cpu",
        "tp": 1,
        "maxModelLen": None,
        "vllmArgs": [],
        "env": [],
        "mm": [True, 4 * 2**30, 128],
        "kv": [True, 0],
    }
    # Other settings added since only count when set (spec_fingerprint.process_extras).
    before.update(process_extras(s))
    blob = json.dumps(before, sort_keys=True, separators=(",", ":")).encode()
    assert spec_fingerprint(s) == hashlib.sha256(blob).hexdigest()[:16]


def test_pvc_source_mounts_claim_read_only_with_subpath() -> None:
    s = spec_with({"pvc": {"claimName": "weights", "subPath": "llama/8b"}})
    assert s.model_source == MODEL_MOUNT
    p = pod(s)
    assert volume(p, "model")["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}
    mount = next(m for m in vllm(p)["volumeMounts"] if m["name"] == "model")
    assert mount == {
        "name": "model",
        "mountPath": MODEL_MOUNT,
        "readOnly": True,
        "subPath": "llama/8b",
    }
    cmd = agent_command(s)
    assert cmd[cmd.index("--model") + 1] == MODEL_MOUNT
    assert "initContainers" not in p


def test_host_path_source_mounts_node_directory_read_only() -> None:
    s = spec_with({"hostPath": {"path": "/srv/models/tiny"}})
    p = pod(s)
    assert volume(p, "model")["hostPath"] == {"path": "/srv/models/tiny", "type": "Directory"}
    mount = next(m for m in vllm(p)["volumeMounts"] if m["name"] == "model")
    assert mount["readOnly"] is True and mount["mountPath"] == MODEL_MOUNT
    assert "subPath" not in mount


def test_hugging_face_source_fetches_in_an_init_container() -> None:
    s = spec_with(
        {
            "huggingFace": {
                "id": "Qwen/Qwen3-0.6B",
                "tokenSecretRef": {"name": "hf", "key": "token"},
                "endpoint": "http://mirror.example:8080",
            },
            "revision": COMMIT,
        },
        runtime={"image": "reg/runtime:1", "imagePullPolicy": "Always"},
    )
    p = pod(s)
    (init,) = p["initContainers"]
    assert init["image"] == "reg/runtime:1" and init["imagePullPolicy"] == "Always"
    assert init["command"] == [
        "rekindle",
        "fetch-model",
        "--id",
        "Qwen/Qwen3-0.6B",
        "--revision",
        COMMIT,
        "--cache",
        MODEL_CACHE_MOUNT,
    ]
    env = {e["name"]: e for e in init["env"]}
    # The token only by reference: its value never passes through the operator.
    assert env["HF_TOKEN"] == {
        "name": "HF_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}},
    }
    assert env["HF_ENDPOINT"]["value"] == "http://mirror.example:8080"
    assert init["securityContext"]["privileged"] is False
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert init["volumeMounts"] == [{"name": "model-cache", "mountPath": MODEL_CACHE_MOUNT}]
    # The node's shared cache by default, read-only in the serving container.
    assert volume(p, "model-cache")["hostPath"] == {
        "path": "/var/lib/rekindle/model-cache",
        "type": "DirectoryOrCreate",
    }
    mount = next(m for m in vllm(p)["volumeMounts"] if m["name"] == "model-cache")
    assert mount == {"name": "model-cache", "mountPath": MODEL_CACHE_MOUNT, "readOnly": True}
    # No token in the serving container: the weights are local by then.
    assert all(e["name"] != "HF_TOKEN" for e in vllm(p)["env"])
    cmd = agent_command(s)
    path = cmd[cmd.index("--model") + 1]
    assert path == model_path("Qwen/Qwen3-0.6B", COMMIT)
    assert path == f"{MODEL_CACHE_MOUNT}/{repo_dir('Qwen/Qwen3-0.6B')}/refs/{COMMIT}"


def test_hugging_face_cache_on_a_pvc_and_default_revision() -> None:
    s = spec_with({"huggingFace": {"id": "org/m", "cache": {"pvc": {"claimName": "hf-cache"}}}})
    assert s.model.revision == "main" and s.model.token_secret is None
    p = pod(s)
    assert volume(p, "model-cache")["persistentVolumeClaim"] == {"claimName": "hf-cache"}
    env = {e["name"] for e in p["initContainers"][0]["env"]}
    assert "HF_TOKEN" not in env and "HF_ENDPOINT" not in env
    assert s.model_source.endswith("/models--org--m/refs/main")


S3 = {
    "endpoint": "http://seaweedfs.store.svc:8333/",
    "bucket": "models",
    "prefix": "smollm2",
    "secretRef": {"name": "model-store"},
}


def test_s3_source_fetches_in_an_init_container_with_the_keys_by_reference() -> None:
    s = spec_with({"s3": S3}, runtime={"image": "reg/runtime:1", "imagePullPolicy": "Always"})
    p = pod(s)
    (init,) = p["initContainers"]
    assert init["command"] == [
        "rekindle", "fetch-model",
        "--s3-endpoint", "http://seaweedfs.store.svc:8333", "--s3-bucket", "models",
        "--s3-prefix", "smollm2/", "--s3-region", "us-east-1",
        "--cache", MODEL_CACHE_MOUNT,
    ]  # fmt: skip
    assert init["env"] == [
        {
            "name": "AWS_ACCESS_KEY_ID",
            "valueFrom": {"secretKeyRef": {"name": "model-store", "key": "accessKeyID"}},
        },
        {
            "name": "AWS_SECRET_ACCESS_KEY",
            "valueFrom": {"secretKeyRef": {"name": "model-store", "key": "secretAccessKey"}},
        },
    ]
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert volume(p, "model-cache")["hostPath"]["path"] == "/var/lib/rekindle/model-cache"
    mount = next(m for m in vllm(p)["volumeMounts"] if m["name"] == "model-cache")
    assert mount["readOnly"] is True
    assert all(not e["name"].startswith("AWS_") for e in vllm(p)["env"])  # keys stay in the init
    cmd = agent_command(s)
    assert cmd[cmd.index("--model") + 1] == s3_model_path(
        "http://seaweedfs.store.svc:8333", "models", "smollm2/"
    )
    on_pvc = spec_with({"s3": {**S3, "cache": {"pvc": {"claimName": "models"}}}})
    assert volume(pod(on_pvc), "model-cache")["persistentVolumeClaim"] == {"claimName": "models"}
    # What names the weights: where they are read, not the keys or the cache.
    same = spec_with({"s3": {**S3, "secretRef": {"name": "other"}, "region": "eu-west-1"}})
    base = spec_fingerprint(spec_with({"s3": S3}))
    assert spec_fingerprint(same) == base == spec_fingerprint(on_pvc)
    assert spec_fingerprint(spec_with({"s3": {**S3, "prefix": "other/"}})) != base


@pytest.mark.parametrize(
    ("model", "words"),
    [
        ({"s3": S3, "source": "/m"}, "source, s3"),
        ({"s3": {**S3, "endpoint": "seaweedfs:8333"}}, "spec.model.s3.endpoint"),
        ({"s3": {**S3, "endpoint": "http://h:1/bucket"}}, "bucket and prefix go in their own"),
        ({"s3": {**S3, "bucket": "Bad_Bucket"}}, "not a bucket name"),
        ({"s3": {**S3, "prefix": "/abs"}}, "spec.model.s3.prefix"),
        ({"s3": {**S3, "prefix": "a/../b"}}, "without '..'"),
        ({"s3": {**S3, "secretRef": {}}}, "spec.model.s3.secretRef.name is required"),
        ({"s3": {**S3, "cache": {"hostPath": {"path": "rel"}}}}, "spec.model.s3.cache.hostPath"),
        ({}, "it has none: set one"),
        ({"source": "/m", "pvc": {"claimName": "x"}}, "source, pvc"),
        ({"hostPath": {"path": "/a"}, "huggingFace": {"id": "a/b"}}, "hostPath, huggingFace"),
        ({"source": "/m", "revision": "main"}, "spec.model.revision pins"),
        ({"pvc": {"claimName": "x"}, "revision": COMMIT}, "remove it"),
        ({"pvc": {"subPath": "a"}}, "claimName is required"),
        ({"pvc": {"claimName": "x", "subPath": "/abs"}}, "relative"),
        ({"pvc": {"claimName": "x", "subPath": "a/../../b"}}, "without '..'"),
        ({"hostPath": {"path": "models"}}, "absolute node path"),
        ({"huggingFace": {"id": "no spaces/x y"}}, "not a hub model id"),
        ({"huggingFace": {"id": "a--b/c"}}, "no '--'"),
        ({"huggingFace": {"id": "a/b"}, "revision": "../x"}, "spec.model.revision"),
        ({"huggingFace": {"id": "a/b", "tokenSecretRef": {"key": "k"}}}, "tokenSecretRef.name"),
        (
            {
                "huggingFace": {
                    "id": "a/b",
                    "cache": {"pvc": {"claimName": "c"}, "hostPath": {"path": "/c"}},
                }
            },
            "not both",
        ),
        ({"huggingFace": {"id": "a/b", "cache": {"hostPath": {"path": "c"}}}}, "absolute"),
    ],
)
def test_bad_model_specs_say_what_to_change(model: dict[str, Any], words: str) -> None:
    with pytest.raises(SpecError, match=None) as e:
        parse_spec("m", "ns", {"model": model})
    assert words in str(e.value)


def test_parse_model_kinds() -> None:
    assert parse_model({"source": "/m"}).kind == "source"
    assert parse_model({"pvc": {"claimName": "c"}}).claim_name == "c"
    hf = parse_model({"huggingFace": {"id": "a/b", "tokenSecretRef": {"name": "s"}}})
    assert hf.token_secret == ("s", "HF_TOKEN")  # the key KServe's and the hub's docs use


def test_fingerprint_covers_weights_identity_not_mount_details() -> None:
    hf = {"huggingFace": {"id": "org/m"}, "revision": COMMIT}
    base = spec_fingerprint(spec_with(hf))
    # Where the cache lives, the token and the endpoint do not change the weights.
    same = {
        "huggingFace": {
            "id": "org/m",
            "tokenSecretRef": {"name": "t"},
            "endpoint": "http://mirror",
            "cache": {"pvc": {"claimName": "other"}},
        },
        "revision": COMMIT,
    }
    assert spec_fingerprint(spec_with(same)) == base
    assert spec_fingerprint(spec_with({**hf, "revision": "main"})) != base
    assert spec_fingerprint(spec_with({"huggingFace": {"id": "org/n"}, "revision": COMMIT})) != base
    # A claim or node path is a mount detail: the agent's content digest tells volumes apart.
    pvc_a = spec_fingerprint(spec_with({"pvc": {"claimName": "a", "subPath": "x"}}))
    pvc_b = spec_fingerprint(spec_with({"pvc": {"claimName": "b"}}))
    node = spec_fingerprint(spec_with({"hostPath": {"path": "/srv/m"}}))
    assert pvc_a == pvc_b == node
    assert pvc_a != base != spec_fingerprint(spec_with({"source": MODEL_MOUNT + "x"}))


def test_checkpoint_pvc_access_mode_and_class() -> None:
    s = spec_with(
        {"source": "/m"},
        coldStart={
            "storage": {
                "type": "pvc",
                "pvc": {"accessMode": "ReadWriteMany", "storageClassName": "nfs"},
            }
        },
    )
    pvc = b.build_pvc(s)
    assert pvc is not None
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert pvc["spec"]["storageClassName"] == "nfs"
    default = b.build_pvc(spec_with({"source": "/m"}))
    assert default is not None and default["spec"]["accessModes"] == ["ReadWriteOnce"]
    with pytest.raises(SpecError, match="ReadWriteMany"):
        spec_with({"source": "/m"}, coldStart={"storage": {"pvc": {"accessMode": "ReadOnlyMany"}}})


def hostpath_spec() -> IsvcSpec:
    return spec_with(
        {"source": "/m"}, coldStart={"storage": {"type": "hostPath", "hostPath": {"path": "/d"}}}
    )


def test_node_local_checkpoints_create_pods_gated_for_placement() -> None:
    """hostPath and node storage: each new pod waits for the operator to place it
    (placement.py); a claim any node mounts needs no placement."""
    from rekindle_operator import placement

    s = hostpath_spec()
    dep = b.build_deployment(s, effective_shm_bytes(s, shm_need(s)), "fp")
    pod_spec = dep["spec"]["template"]["spec"]
    assert pod_spec["schedulingGates"] == [{"name": placement.GATE}]
    assert "nodeAffinity" not in (pod_spec.get("affinity") or {})  # decided per pod
    claim = spec_with({"source": "/m"})
    plain = b.build_deployment(claim, effective_shm_bytes(claim, shm_need(claim)), "fp")
    assert "schedulingGates" not in plain["spec"]["template"]["spec"]
    # The chart's warmPlacement: false: no gate, pods schedule without the operator.
    off = b.build_deployment(s, effective_shm_bytes(s, shm_need(s)), "fp", warm_placement=False)
    assert "schedulingGates" not in off["spec"]["template"]["spec"]


def test_read_write_once_on_several_nodes_warns() -> None:
    s = spec_with({"source": "/m"})  # pvc storage, ReadWriteOnce by default
    msg = rwo_spread_warning(s, "m-checkpoints", ["ReadWriteOnce"], ["n2", "n1", "n1"])
    assert msg is not None
    assert "m-checkpoints" in msg and "n1, n2" in msg and "accessMode: ReadWriteMany" in msg
    assert rwo_spread_warning(s, "c", ["ReadWriteOnce"], ["n1", "n1"]) is None
    assert rwo_spread_warning(s, "c", ["ReadWriteMany"], ["n1", "n2"]) is None
    assert rwo_spread_warning(hostpath_spec(), "c", ["ReadWriteOnce"], ["n1", "n2"]) is None


def test_reconcile_places_new_pods_by_the_checkpoint_node_and_warns_on_rwo_spread() -> None:
    """Through reconcile, against the in-memory apiserver of the checkpointing tests."""
    from rekindle_operator import placement
    from rekindle_operator.pods import Agents
    from rekindle_operator.reconcile import reconcile, release_pod, spec_of

    from tests.unit.test_operator_checkpointing import NS, FakeAgent, new_ckpt, pod_obj, world

    kube, events = world()
    isvc = kube.get("InferenceService", NS, "tiny")
    assert isvc is not None
    isvc["spec"]["coldStart"] = {"storage": {"type": "hostPath", "hostPath": {"path": "/d"}}}
    kube.put(isvc)
    fp = spec_fingerprint(spec_of(isvc))
    new_ckpt(
        kube,
        "good",
        phase="Ready",
        fingerprint=fp,
        path="/c/good",
        node="node-a",
        completedAt="2026-01-02T00:00:00Z",
    )
    isvc["status"] = reconcile(kube, isvc, lambda *e: events.append(e), Agents(FakeAgent()))  # type: ignore[arg-type]
    kube.put(isvc)
    dep = kube.get("Deployment", NS, "tiny")
    assert dep is not None
    template = dep["spec"]["template"]
    assert template["spec"]["schedulingGates"] == [{"name": placement.GATE}]
    new = pod_obj("tiny-new", fingerprint=fp)
    new["spec"] = dict(template["spec"])
    kube.put(new)
    assert release_pod(kube, new) == "prefers node-a"
    released = kube.get("Pod", NS, "tiny-new")
    assert released is not None and not placement.gated(released)
    pref = released["spec"]["affinity"]["nodeAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"
    ]
    assert pref[0]["preference"]["matchFields"][0]["values"] == ["node-a"]
    kube.delete("Pod", NS, "tiny-new")
    # One the pod watch missed (the operator was down): the next reconcile releases it.
    left = pod_obj("tiny-left", fingerprint=fp)
    left["spec"] = dict(template["spec"])
    kube.put(left)
    reconcile(kube, isvc, lambda *e: events.append(e), Agents(FakeAgent()))  # type: ignore[arg-type]
    after = kube.get("Pod", NS, "tiny-left")
    assert after is not None and not placement.gated(after)
    kube.delete("Pod", NS, "tiny-left")

    # PVC storage (ReadWriteOnce by default) with replicas on two nodes: one Warning.
    isvc["spec"]["coldStart"] = {"storage": {"type": "pvc"}}
    kube.put(isvc)
    for name, node in (("tiny-abc", "n1"), ("tiny-def", "n2")):
        p = pod_obj(name, fingerprint=spec_fingerprint(spec_of(isvc)))
        p["spec"] = {"nodeName": node}
        kube.put(p)
    events.clear()
    st = reconcile(kube, isvc, lambda *e: events.append(e), Agents(FakeAgent()))  # type: ignore[arg-type]
    warns = [m for k, r, m in events if r == "ReadWriteOnceMultiNode"]
    assert len(warns) == 1 and "n1, n2" in warns[0] and "tiny-checkpoints" in warns[0]
    assert st["storageWarning"] == warns[0]
    events.clear()
    isvc["status"] = st
    st = reconcile(kube, isvc, lambda *e: events.append(e), Agents(FakeAgent()))  # type: ignore[arg-type]
    assert not [e for e in events if e[1] == "ReadWriteOnceMultiNode"]  # once, not every pass
    # Back on one node: the field is removed (None in the status merge patch).
    kube.delete("Pod", NS, "tiny-def")
    isvc["status"] = st
    st = reconcile(kube, isvc, lambda *e: events.append(e), Agents(FakeAgent()))  # type: ignore[arg-type]
    assert "storageWarning" in st and st["storageWarning"] is None
    # A claim any node mounts: no gate on the template.
    dep = kube.get("Deployment", NS, "tiny")
    assert dep is not None
    assert "schedulingGates" not in dep["spec"]["template"]["spec"]
