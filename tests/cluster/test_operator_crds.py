"""The CRDs against the real apiserver: refusals at apply time, defaults, scale, dry-run builders.

These need only the cluster (no operator, no runtime image).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml
from rekindle_operator import builders as b
from rekindle_operator.shm_sizing import effective_shm_bytes, shm_need
from rekindle_operator.spec import parse_spec
from rekindle_operator.spec_fingerprint import spec_fingerprint

from tests.cluster.cluster_tools import REPO, helm, kubectl, kubectl_json
from tests.cluster.operator_fixtures import apply, install_crds, isvc_manifest

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module", autouse=True)
def crds(cluster: dict[str, str]) -> None:
    install_crds()


def refused(namespace: str, obj: dict[str, Any]) -> str:
    r = apply(obj, namespace)
    assert r.returncode != 0, f"apply was accepted: {r.stdout}"
    return r.stderr


def sample(**spec: Any) -> dict[str, Any]:
    return isvc_manifest("tiny", "/var/lib/rekindle/test", **spec)


def test_sample_is_accepted_and_defaulted(namespace: str) -> None:
    r = apply(sample(), namespace)
    assert r.returncode == 0, r.stderr
    obj = kubectl_json("get", "rkis", "tiny", "-n", namespace)
    spec = obj["spec"]
    assert spec["kvCache"] == {"prefixCaching": True, "cpuOffloadSize": "0"}
    assert spec["coldStart"]["restorePolicy"] == "IfAvailable"
    assert spec["coldStart"]["storage"]["deletionPolicy"] == "Retain"
    assert spec["tensorParallelSize"] == 1
    # The short name and the category work with kubectl.
    assert "tiny" in kubectl("get", "rekindle", "-n", namespace).stdout


def test_lora_is_accepted_and_defaulted(namespace: str) -> None:
    lora = {"adapters": [{"name": "sql", "path": "adapters/sql-v2"}]}
    r = apply(sample(lora=lora), namespace)
    assert r.returncode == 0, r.stderr
    got = kubectl_json("get", "rkis", "tiny", "-n", namespace)["spec"]["lora"]
    assert got == {"maxAdapters": 1, "maxRank": 16, **lora}
    assert parse_spec("tiny", namespace, {"model": {"source": "/m"}, "lora": got}).lora


def test_shm_below_multimodal_cache_refused_with_what_to_change(namespace: str) -> None:
    err = refused(namespace, sample(sharedMemory={"size": "256Mi"}))
    assert "spec.sharedMemory.size 256Mi is below spec.multimodal.cacheSize 512Mi" in err
    assert "Raise spec.sharedMemory.size" in err


def test_unknown_field_refused(namespace: str) -> None:
    err = refused(namespace, sample(sharedMemroy={"size": "2Gi"}))
    assert 'unknown field "spec.sharedMemroy"' in err


def test_negative_replicas_refused(namespace: str) -> None:
    err = refused(namespace, sample(replicas=-1))
    assert "spec.replicas" in err and "greater than or equal to 0" in err


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ({"vllmArgs": ["--port=9000"]}, "flag the operator manages"),
        ({"vllmArgs": ["--served_model_name=x"]}, "flag the operator manages"),  # vLLM: _ is -
        ({"vllmArgs": ["--no-enable-sleep-mode"]}, "flag the operator manages"),
        ({"vllmArgs": ["--config=/models/x.yaml"]}, "flag the operator manages"),
        (
            {"multimodal": {"allowedMediaDomains": ["*.example.com"]}},
            "spec.multimodal.allowedMediaDomains[0]",
        ),
        ({"runtime": {"device": "gpu"}, "tensorParallelSize": 2}, "set spec.resources.gpus"),
        ({"multimodal": {"cacheSize": "64Mi", "maxObjectMiB": 128}}, "lower maxObjectMiB"),
        ({"multimodal": {"cacheSize": "lots"}}, "must be a non-negative quantity"),
        ({"sharedMemory": {"size": "big"}}, "must be a quantity such as 2Gi"),
        (
            {"coldStart": {"storage": {"type": "hostPath", "hostPath": {"path": "rel"}}}},
            "must be an absolute path",
        ),
        (
            {"coldStart": {"storage": {"type": "pvc", "node": {"publish": "pvc"}}}},
            "node.publish needs spec.coldStart.storage.type: node",
        ),
        ({"runtime": {"device": "tpu"}}, "supported values"),
        ({"adminTLS": {"serverName": "tiny.ns.svc"}}, "spec.adminTLS.secretName: Required"),
        ({"adminTLS": {"secretName": "Not_A_Name"}}, "spec.adminTLS.secretName"),
        ({"rollout": {"maxSurge": 0, "maxUnavailable": "0%"}}, "may not both be 0"),
        ({"rollout": {"maxSurge": 0}}, "may not both be 0"),  # maxUnavailable's default is 0
        ({"rollout": {"maxSurge": "150%"}}, "a count (0 or more) or a percentage"),
        ({"terminationGracePeriodSeconds": 2}, "greater than or equal to 5"),
        ({"maxConcurrentRequests": 0}, "greater than or equal to 1"),
        ({"vllmArgs": ["--enable_lora"]}, "flag the operator manages"),
        ({"lora": {"maxRank": 12}}, "supported values"),
        ({"lora": {"adapters": [{"name": "sql", "path": "a/../b"}]}}, "without '.', '..'"),
        ({"lora": {"adapters": [{"name": "sql", "path": "/abs"}]}}, "spec.lora.adapters[0].path"),
        ({"lora": {"adapters": [{"name": ".x", "path": "a"}]}}, "spec.lora.adapters[0].name"),
        (
            {"lora": {"adapters": [{"name": "a", "path": "x"}, {"name": "a", "path": "y"}]}},
            "Duplicate value",
        ),
    ],
)
def test_other_refusals(namespace: str, spec: dict[str, Any], words: str) -> None:
    assert words in refused(namespace, sample(**spec))


def test_checkpoint_spec_is_immutable(namespace: str) -> None:
    ck = {
        "apiVersion": "rekindle.dev/v1alpha1",
        "kind": "Checkpoint",
        "metadata": {"name": "c1"},
        "spec": {"inferenceService": "tiny"},
    }
    assert apply(ck, namespace).returncode == 0
    ck["spec"]["inferenceService"] = "other"
    assert "spec is immutable" in refused(namespace, ck)
    bad = {**ck, "metadata": {"name": "c2"}, "spec": {"inferenceService": "Not_A_Name"}}
    assert "spec.inferenceService" in refused(namespace, bad)


def test_scale_subresource(namespace: str) -> None:
    assert apply(sample(), namespace).returncode == 0
    kubectl("scale", "rkis/tiny", "-n", namespace, "--replicas=3")
    assert kubectl_json("get", "rkis", "tiny", "-n", namespace)["spec"]["replicas"] == 3
    # status.selector feeds HPA/KEDA through the scale subresource.
    kubectl(
        "patch",
        "rkis/tiny",
        "-n",
        namespace,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps({"status": {"replicas": 2, "selector": b.selector_string("tiny")}}),
    )
    path = f"/apis/rekindle.dev/v1alpha1/namespaces/{namespace}/inferenceservices/tiny/scale"
    scale = json.loads(kubectl("get", "--raw", path).stdout)
    assert scale["spec"]["replicas"] == 3 and scale["status"]["replicas"] == 2
    assert scale["status"]["selector"] == "rekindle.dev/inferenceservice=tiny"


def test_builders_pass_server_side_validation(namespace: str) -> None:
    assert apply(sample(), namespace).returncode == 0
    owner = kubectl_json("get", "rkis", "tiny", "-n", namespace)
    spec = parse_spec("tiny", namespace, owner["spec"])
    need = shm_need(spec)
    objs = [
        b.build_deployment(spec, effective_shm_bytes(spec, need), spec_fingerprint(spec), owner),
        b.build_service(spec, owner),
        b.build_secret(spec, owner),
        b.build_configmap(spec, "", owner),
        b.build_cleanup_job(
            namespace,
            "c1",
            "0123456789",
            "/var/lib/rekindle/checkpoints/c1-01234567",
            b.checkpoint_volume(spec),
            spec.image,
            sub_path=b.storage_subpath(namespace, "tiny"),
            node="some-node",
        ),
        b.build_network_policy(
            spec, "rekindle-system", {"app.kubernetes.io/name": "rekindle"}, owner
        ),
    ]
    pvc_spec = parse_spec(
        "tiny", namespace, {**owner["spec"], "coldStart": {"storage": {"type": "pvc"}}}
    )
    objs.append(b.build_pvc(pvc_spec, owner))  # type: ignore[arg-type]
    # With spec.adminTLS: the Secret volume, the flags, HTTPS probes.
    tls_spec = parse_spec(
        "tiny", namespace, {**owner["spec"], "adminTLS": {"secretName": "tiny-admin-tls"}}
    )
    tls_shm = effective_shm_bytes(tls_spec, shm_need(tls_spec))
    objs.append(b.build_deployment(tls_spec, tls_shm, spec_fingerprint(tls_spec), owner))
    # With spec.egress: the NetworkPolicy's Egress rules (DNS, IPv4 and IPv6 ranges).
    egress = parse_spec(
        "tiny", namespace, {**owner["spec"], "egress": {"cidrs": ["10.20.0.0/16", "fd00::/8"]}}
    )
    objs.append(b.build_network_policy(egress, "rekindle-system", {"app": "op"}, owner))
    objs.append(b.build_metrics_secret(spec, owner))
    budget = {**owner["spec"], "disruptionBudget": {"maxUnavailable": "25%"}}
    objs.append(b.build_disruption_budget(parse_spec("tiny", namespace, budget), owner))  # type: ignore[arg-type]
    for obj in objs:
        r = apply(obj, namespace, "--dry-run=server")
        assert r.returncode == 0, f"{obj['kind']}: {r.stderr}"


def _docs(out: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(out) if d]


def test_chart_renders_and_validates(namespace: str) -> None:
    chart = str(REPO / "charts" / "rekindle")
    lint = helm("lint", chart)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    out = helm("template", "rk", chart, "-n", namespace).stdout
    docs = _docs(out)
    kinds = {d["kind"] for d in docs}
    assert {
        "Deployment",
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    } <= kinds
    # The default is namespaced: no cluster-wide rights at all.
    assert not kinds & {"ClusterRole", "ClusterRoleBinding"}
    roles = {
        (d["metadata"]["namespace"], d["metadata"]["name"]) for d in docs if d["kind"] == "Role"
    }
    assert roles == {(namespace, "rk-rekindle"), (namespace, "rk-rekindle-self")}
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert f"--namespace={namespace}" in args
    env = {e["name"]: e for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["REKINDLE_ALLOWED_IMAGES"]["value"] == "rekindle.local/runtime-cpu:dev"
    assert "app.kubernetes.io/instance=rk" in env["REKINDLE_OPERATOR_POD_LABELS"]["value"]
    r = kubectl("apply", "-n", namespace, "--dry-run=server", "-f", "-", input=out, check=False)
    assert r.returncode == 0, r.stderr
    scoped = helm(
        "template", "rk", chart, "-n", namespace, "--set", f"watchNamespaces={{{namespace},b}}"
    ).stdout
    roles = {
        (d["metadata"]["namespace"], d["metadata"]["name"])
        for d in _docs(scoped)
        if d["kind"] == "Role"
    }
    assert roles == {
        (namespace, "rk-rekindle"),
        ("b", "rk-rekindle"),
        (namespace, "rk-rekindle-self"),
    }
    assert "--namespace=" + namespace in scoped and "--namespace=b" in scoped
    # Cluster-wide only when asked: a ClusterRole with the namespaced rules, no --namespace.
    wide = _docs(
        helm("template", "rk", chart, "-n", namespace, "--set", "rbac.clusterWide=true").stdout
    )
    names = {d["metadata"]["name"] for d in wide if d["kind"] == "ClusterRole"}
    assert names == {"rk-rekindle"}
    (wdep,) = [d for d in wide if d["kind"] == "Deployment"]
    assert not [
        a for a in wdep["spec"]["template"]["spec"]["containers"][0]["args"] if "namespace" in a
    ]
    (binding,) = [d for d in wide if d["kind"] == "ValidatingAdmissionPolicyBinding"]
    assert "matchResources" not in binding["spec"]  # every namespace
    bad = helm("template", "rk", chart, "--set", "statusIntervalSeconds=-1", check=False)
    assert bad.returncode != 0 and "statusIntervalSeconds" in bad.stderr


MODEL_COMMIT = "0123456789abcdef0123456789abcdef01234567"
S3_MODEL = {
    "endpoint": "http://s3.local:8333",
    "bucket": "models",
    "prefix": "tiny/",
    "secretRef": {"name": "store"},
}


@pytest.mark.parametrize(
    ("model", "words"),
    [
        ({"servedName": "x"}, "needs exactly one of source"),
        ({"source": "/m", "pvc": {"claimName": "w"}}, "needs exactly one of source"),
        ({"source": "/m", "revision": "main"}, "spec.model.revision pins a Hugging Face revision"),
        ({"pvc": {"subPath": "a"}}, "spec.model.pvc.claimName: Required"),
        ({"pvc": {"claimName": "w", "subPath": "../x"}}, "relative to the volume's root"),
        ({"hostPath": {"path": "models"}}, "absolute node path"),
        ({"huggingFace": {"id": "org/a b"}}, "spec.model.huggingFace.id"),
        ({"huggingFace": {"id": "a--b/c"}}, "may not contain '--'"),
        ({"huggingFace": {"id": "a/b"}, "revision": "x..y"}, "may not contain '..'"),
        ({"huggingFace": {"id": "a/b", "tokenSecretRef": {"key": "k"}}}, "tokenSecretRef.name"),
        ({"huggingFace": {"id": "a/b", "endpoint": "ftp://x"}}, "spec.model.huggingFace.endpoint"),
        (
            {
                "huggingFace": {
                    "id": "a/b",
                    "cache": {"pvc": {"claimName": "c"}, "hostPath": {"path": "/c"}},
                }
            },
            "takes hostPath or pvc, not both",
        ),
        ({"s3": {**S3_MODEL, "prefix": "../up"}}, "spec.model.s3.prefix must be relative"),
        ({"s3": {**S3_MODEL, "endpoint": "s3.local"}}, "spec.model.s3.endpoint"),
        ({"s3": {k: v for k, v in S3_MODEL.items() if k != "secretRef"}}, "secretRef: Required"),
        ({"s3": S3_MODEL, "hostPath": {"path": "/m"}}, "needs exactly one of source"),
    ],
)
def test_model_source_refusals(namespace: str, model: dict[str, Any], words: str) -> None:
    assert words in refused(namespace, sample(model=model))


def test_checkpoint_pvc_access_mode(namespace: str) -> None:
    storage = {"type": "pvc", "pvc": {"accessMode": "ReadOnlyMany"}}
    assert "supported values" in refused(namespace, sample(coldStart={"storage": storage}))
    storage["pvc"]["accessMode"] = "ReadWriteMany"
    r = apply(sample(coldStart={"storage": storage}), namespace)
    assert r.returncode == 0, r.stderr


def test_model_sources_accepted_and_their_pods_validate(namespace: str) -> None:
    """Each source kind passes the CRD, and its Deployment (init container, Secret
    reference, cache volume) the apiserver."""
    models = {
        "pvc": {"pvc": {"claimName": "weights", "subPath": "tiny"}},
        "node": {"hostPath": {"path": "/srv/models/tiny"}},
        "hf": {
            "huggingFace": {
                "id": "Qwen/Qwen3-0.6B",
                "tokenSecretRef": {"name": "hf-token"},
                "cache": {"pvc": {"claimName": "hf-cache"}},
            },
            "revision": MODEL_COMMIT,
        },
        "s3": {"s3": S3_MODEL},
    }
    for name, model in models.items():
        doc = sample(model={"servedName": "tiny", **model})
        doc["metadata"]["name"] = name
        r = apply(doc, namespace)
        assert r.returncode == 0, f"{name}: {r.stderr}"
        owner = kubectl_json("get", "rkis", name, "-n", namespace)
        if name not in ("hf", "s3"):  # (their token key and region are defaulted, below)
            assert owner["spec"]["model"] == {"servedName": "tiny", **model}
        spec = parse_spec(name, namespace, owner["spec"])
        dep = b.build_deployment(
            spec, effective_shm_bytes(spec, shm_need(spec)), spec_fingerprint(spec), owner
        )
        r = apply(dep, namespace, "--dry-run=server")
        assert r.returncode == 0, f"{name}: {r.stderr}"
    s3 = kubectl_json("get", "rkis", "s3", "-n", namespace)
    assert s3["spec"]["model"]["s3"] == {**S3_MODEL, "region": "us-east-1"}
    hf = kubectl_json("get", "rkis", "hf", "-n", namespace)
    # The CRD defaults the token's key to the name the hub client reads.
    assert hf["spec"]["model"]["huggingFace"]["tokenSecretRef"] == {
        "name": "hf-token",
        "key": "HF_TOKEN",
    }


def test_a_gated_pod_takes_the_operators_release(namespace: str) -> None:
    """Warm placement against the real apiserver: a node-storage service's pod is created
    gated, and the release (the gate removed, one preferred term per warm node beside the
    user's affinity) is an update the apiserver accepts for a gated pod. The pod never
    schedules here (the gate is kept on the dry run)."""
    from rekindle_operator import placement

    doc = sample(model={"servedName": "tiny", "source": "/models/tiny"})
    doc["metadata"]["name"] = "gated"
    doc["spec"]["coldStart"] = {"storage": {"type": "node"}}
    doc["spec"]["podTemplate"] = {
        "spec": {
            "affinity": {
                "nodeAffinity": {
                    "preferredDuringSchedulingIgnoredDuringExecution": [
                        {
                            "weight": 10,
                            "preference": {
                                "matchExpressions": [
                                    {"key": "zone", "operator": "In", "values": ["a", "b"]}
                                ]
                            },
                        }
                    ]
                }
            }
        }
    }
    assert apply(doc, namespace).returncode == 0
    owner = kubectl_json("get", "rkis", "gated", "-n", namespace)
    spec = parse_spec("gated", namespace, owner["spec"])
    template = b.build_deployment(
        spec, effective_shm_bytes(spec, shm_need(spec)), spec_fingerprint(spec), owner
    )["spec"]["template"]
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "gated-0"}, **template}
    pod["metadata"] = {**template["metadata"], "name": "gated-0"}
    assert apply(pod, namespace).returncode == 0
    try:
        created = kubectl_json("get", "pod", "gated-0", "-n", namespace)
        assert placement.gated(created)
        patch = placement.release_patch(created, ["node-a", "node-b"], ["node-b"])
        r = kubectl(
            "patch", "pod", "gated-0", "-n", namespace, "--type=merge",
            "-p", json.dumps(patch), "--dry-run=server", "-o", "json", check=False,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        released = json.loads(r.stdout)
        assert not placement.gated(released)
        terms = released["spec"]["affinity"]["nodeAffinity"][
            "preferredDuringSchedulingIgnoredDuringExecution"
        ]
        assert len(terms) == 4 and terms[0]["weight"] == 10  # the user's term kept first
    finally:
        kubectl("delete", "pod", "gated-0", "-n", namespace, "--wait=false", check=False)
