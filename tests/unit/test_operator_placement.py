"""spec.podTemplate, full EnvVars, GPUs and the multimodal decision: what the pod gets,
what is refused, and what the checkpoint fingerprint does and does not see."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from rekindle_contract.api import AgentError
from rekindle_contract.vllm_argv import MM_AUTO_ENV, takes_images
from rekindle_operator import builders as b
from rekindle_operator import pod_template as pt
from rekindle_operator import reconcile
from rekindle_operator.constants import NAME_LABEL, SERVING_LABEL
from rekindle_operator.kubectl_plugin import format_status
from rekindle_operator.pods import Agents
from rekindle_operator.quantity import mib_str, to_bytes
from rekindle_operator.shm_sizing import effective_shm_bytes, shm_need
from rekindle_operator.spec import MANAGED_ENV, IsvcSpec, SpecError, parse_spec
from rekindle_operator.spec_fingerprint import spec_fingerprint
from rekindle_operator.status import Observed, PodBoot, compute_status, pod_boot, pod_problem

REPO = Path(__file__).resolve().parents[2]
CRD = REPO / "charts" / "rekindle" / "files" / "crds" / "inferenceservices.rekindle.dev.yaml"
OWNER = {"kind": "InferenceService", "metadata": {"name": "m", "uid": "u-1"}}

PLACEMENT: dict[str, Any] = {
    "metadata": {
        "labels": {"team": "search", NAME_LABEL: "hijack", SERVING_LABEL: "false"},
        "annotations": {"owner": "ml-platform", "rekindle.dev/fingerprint": "forged"},
    },
    "spec": {
        "nodeSelector": {"pool": "gpu-a"},
        "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}
                    ]
                }
            }
        },
        "topologySpreadConstraints": [
            {"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "ScheduleAnyway"}
        ],
        "priorityClassName": "inference",
        "schedulerName": "bin-packer",
        "serviceAccountName": "vllm-reader",
        "imagePullSecrets": [{"name": "registry"}],
        "volumes": [{"name": "extra", "configMap": {"name": "prompts"}}],
        "mainContainer": {
            "volumeMounts": [{"name": "extra", "mountPath": "/etc/prompts", "readOnly": True}]
        },
    },
}


def spec(**over: Any) -> IsvcSpec:
    doc: dict[str, Any] = {
        "model": {"source": "/models/tiny"},
        "resources": {"memory": "4Gi"},
        "multimodal": {"cacheSize": "512Mi", "maxObjectMiB": 64},
    }
    doc.update(over)
    return parse_spec("m", "ns", doc)


def pod(s: IsvcSpec) -> dict[str, Any]:
    dep = b.build_deployment(s, effective_shm_bytes(s, shm_need(s)), "fp", owner=OWNER)
    out: dict[str, Any] = dep["spec"]["template"]
    return out


def main(p: dict[str, Any]) -> dict[str, Any]:
    c: dict[str, Any] = p["spec"]["containers"][0]
    return c


# --- podTemplate -------------------------------------------------------------------


def test_pod_template_lands_in_the_pod_and_the_operators_labels_win() -> None:
    p = pod(spec(podTemplate=PLACEMENT))
    meta, ps = p["metadata"], p["spec"]
    assert meta["labels"]["team"] == "search"
    assert meta["labels"][NAME_LABEL] == "m" and meta["labels"][SERVING_LABEL] == "true"
    assert meta["annotations"]["owner"] == "ml-platform"
    assert meta["annotations"]["rekindle.dev/fingerprint"] == "fp"
    for key in (
        "nodeSelector",
        "tolerations",
        "affinity",
        "topologySpreadConstraints",
        "priorityClassName",
        "schedulerName",
        "serviceAccountName",
        "imagePullSecrets",
    ):
        assert ps[key] == PLACEMENT["spec"][key], key
    # The operator's volumes stay, the user's come after; the token is still not mounted.
    names = [v["name"] for v in ps["volumes"]]
    assert names[0] == "dshm" and names[-1] == "extra" and "checkpoints" in names
    assert ps["automountServiceAccountToken"] is False
    mounts = {m["mountPath"]: m for m in main(p)["volumeMounts"]}
    assert mounts["/etc/prompts"]["readOnly"] is True and "/dev/shm" in mounts
    # The Deployment still selects its own pods.
    dep = b.build_deployment(spec(podTemplate=PLACEMENT), 2**30, "fp")
    assert dep["spec"]["selector"]["matchLabels"] == {NAME_LABEL: "m"}


def test_a_gated_pod_is_released_toward_the_warm_nodes_keeping_the_users_affinity() -> None:
    """The release adds preferred terms for the warm nodes (more weight where resident) to
    the pod's own affinity, and removes only the operator's gate."""
    from rekindle_operator import placement

    s = spec(podTemplate=PLACEMENT, coldStart={"storage": {"type": "node"}})
    pod = {"spec": b.build_deployment(s, 2**30, "fp")["spec"]["template"]["spec"]}
    pod["spec"]["schedulingGates"].append({"name": "example.com/quota"})
    ckpt = {"status": {"node": "node-a", "cachedNodes": ["node-c", "node-b"]}}
    isvc_status = {
        "nodes": [
            {"name": "node-b", "checkpointCached": True, "residentPercent": 97.0},
            {"name": "node-c", "checkpointCached": True, "residentPercent": 40.0},
            {"name": "node-z", "checkpointCached": False, "residentPercent": 100.0},
        ]
    }
    warm, resident = placement.warm_nodes(ckpt), placement.resident_nodes(isvc_status)
    assert (warm, resident) == (["node-a", "node-b", "node-c"], ["node-b"])
    patch = placement.release_patch(pod, warm, resident)
    assert patch["spec"]["schedulingGates"] == [{"name": "example.com/quota"}]
    node_aff = patch["spec"]["affinity"]["nodeAffinity"]
    assert (
        node_aff["requiredDuringSchedulingIgnoredDuringExecution"]
        == PLACEMENT["spec"]["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"
        ]
    )
    prefs = node_aff["preferredDuringSchedulingIgnoredDuringExecution"]
    # One node per term: the apiserver takes exactly one value for a node field selector.
    assert [(t["weight"], t["preference"]["matchFields"]) for t in prefs[-4:]] == [
        (w, [{"key": "metadata.name", "operator": "In", "values": [n]}])
        for w, n in (
            (placement.WARM_WEIGHT, "node-a"),
            (placement.WARM_WEIGHT, "node-b"),
            (placement.WARM_WEIGHT, "node-c"),
            (placement.RESIDENT_WEIGHT, "node-b"),
        )
    ]
    # A fleet's worth of warm nodes: bounded, the resident ones kept.
    many = [f"n{i:03}" for i in range(100)]
    big = placement.release_patch(pod, many, ["n099"])["spec"]["affinity"]["nodeAffinity"]
    added = big["preferredDuringSchedulingIgnoredDuringExecution"][len(prefs) - 4 :]
    assert len(added) == placement.MAX_PREFERRED
    assert {"values": ["n099"]}.items() <= added[-1]["preference"]["matchFields"][0].items()
    # No warm node yet: only the gate goes, the affinity is left as it is.
    bare = placement.release_patch(pod, [], ["node-b"])
    assert "affinity" not in bare["spec"] and placement.gated(pod) and not placement.gated(bare)


def test_the_nodes_a_checkpoint_was_restored_on_are_recorded_once() -> None:
    from rekindle_operator import placement

    ckpt = {"status": {"node": "node-a", "cachedNodes": ["node-b"]}}
    assert placement.cached_nodes(ckpt, ["node-a", "node-b", ""]) is None  # nothing new
    assert placement.cached_nodes(ckpt, ["node-d", "node-c", "node-d"]) == [
        "node-b",
        "node-c",
        "node-d",
    ]
    many = {"status": {"cachedNodes": [f"n{i}" for i in range(placement.MAX_CACHED_NODES)]}}
    got = placement.cached_nodes(many, ["new"])
    assert got is not None and len(got) == placement.MAX_CACHED_NODES and got[-1] == "new"


def test_without_pod_template_the_pod_is_as_before() -> None:
    ps = pod(spec())["spec"]
    assert not {"nodeSelector", "tolerations", "affinity", "runtimeClassName"} & set(ps)
    assert "envFrom" not in main(pod(spec()))


@pytest.mark.parametrize(
    ("template", "words"),
    [
        ({"spec": {"containers": [{"name": "x"}]}}, "spec.podTemplate.spec.containers is set"),
        ({"spec": {"securityContext": {"runAsUser": 0}}}, "securityContext is set by"),
        ({"spec": {"hostNetwork": True}}, "hostNetwork"),
        ({"spec": {"mainContainer": {"command": ["sh"]}}}, "mainContainer.command is the"),
        (
            {"spec": {"mainContainer": {"securityContext": {"privileged": False}}}},
            "securityContext is the operator's",
        ),
        ({"spec": {"volumes": [{"name": "dshm", "emptyDir": {}}]}}, "'dshm', a volume"),
        ({"spec": {"volumes": [{"name": "checkpoints", "emptyDir": {}}]}}, "checkpoints"),
        (
            {
                "spec": {
                    "volumes": [{"name": "v", "emptyDir": {}}],
                    "mainContainer": {"volumeMounts": [{"name": "v", "mountPath": "/dev/shm"}]},
                }
            },
            "collides with the operator's /dev/shm",
        ),
        (
            {
                "spec": {
                    "volumes": [{"name": "v", "emptyDir": {}}],
                    "mainContainer": {
                        "volumeMounts": [{"name": "v", "mountPath": "/var/run/rekindle/x"}]
                    },
                }
            },
            "/var/run/rekindle",
        ),
        (
            {
                "spec": {
                    "volumes": [{"name": "v", "emptyDir": {}}],
                    "mainContainer": {"volumeMounts": [{"name": "v", "mountPath": "/var/lib"}]},
                }
            },
            "collides",
        ),
        (
            {"spec": {"mainContainer": {"volumeMounts": [{"name": "dshm", "mountPath": "/x"}]}}},
            "not in spec.podTemplate.spec.volumes",
        ),
        ({"template": {}}, "spec.podTemplate.template is unknown"),
    ],
)
def test_fields_the_operator_owns_are_refused(template: dict[str, Any], words: str) -> None:
    with pytest.raises(SpecError, match=words.replace("(", r"\(").replace(".", r"\.")):
        spec(podTemplate=template)


def test_placement_stays_out_of_the_fingerprint_but_process_settings_do_not() -> None:
    base = spec_fingerprint(spec())
    placed = {k: v for k, v in PLACEMENT["spec"].items() if k not in ("volumes", "mainContainer")}
    moved = spec(podTemplate={"metadata": PLACEMENT["metadata"], "spec": placed})
    assert spec_fingerprint(moved) == base
    assert spec_fingerprint(spec(podTemplate={"spec": {"runtimeClassName": "nvidia"}})) != base
    assert spec_fingerprint(spec(podTemplate=PLACEMENT)) != base  # an extra mount
    # The same mount from another volume source: the process sees the same path.
    other = json.loads(json.dumps(PLACEMENT))
    other["spec"]["volumes"] = [{"name": "extra", "emptyDir": {}}]
    assert spec_fingerprint(spec(podTemplate=other)) == spec_fingerprint(
        spec(podTemplate=PLACEMENT)
    )


# --- env ------------------------------------------------------------------------------

SECRET_ENV = {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hub", "key": "token"}}}


def test_env_references_pass_through_unresolved() -> None:
    env = [
        {"name": "PLAIN", "value": "1"},
        SECRET_ENV,
        {"name": "CFG", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}},
        {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {"name": "VLLM_HOST_IP", "value": "0.0.0.0"},
    ]
    env_from = [{"secretRef": {"name": "creds"}, "prefix": "S_"}, {"configMapRef": {"name": "c"}}]
    c = main(pod(spec(env=env, envFrom=env_from)))
    by_name = {e["name"]: e for e in c["env"]}
    assert by_name["PLAIN"] == {"name": "PLAIN", "value": "1"}
    assert by_name["HF_TOKEN"] == SECRET_ENV
    assert by_name["NODE"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert by_name["VLLM_HOST_IP"]["value"] == "0.0.0.0"  # the user's entry wins
    assert [e["name"] for e in c["env"]].count("VLLM_HOST_IP") == 1
    assert c["envFrom"] == [
        {"prefix": "S_", "secretRef": {"name": "creds"}},
        {"configMapRef": {"name": "c"}},
    ]


def test_fingerprint_records_references_never_values() -> None:
    a = spec(env=[SECRET_ENV])
    other_key = {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hub", "key": "t2"}}}
    assert spec_fingerprint(a) != spec_fingerprint(spec(env=[other_key]))
    assert spec_fingerprint(a) != spec_fingerprint(spec(env=[{"name": "HF_TOKEN", "value": "x"}]))
    assert spec_fingerprint(spec(envFrom=[{"secretRef": {"name": "s"}}])) != spec_fingerprint(
        spec()
    )
    # A literal value keeps the fingerprint it had before references existed.
    plain = spec(env=[{"name": "A", "value": "1"}])
    assert [e.identity() for e in plain.env] == [["A", "1"]]


@pytest.mark.parametrize(
    ("env", "words"),
    [
        ({"name": "A", "value": "1", "valueFrom": SECRET_ENV["valueFrom"]}, "both value"),
        ({"name": "A", "valueFrom": {}}, "exactly one of secretKeyRef"),
        (
            {
                "name": "A",
                "valueFrom": {
                    "secretKeyRef": {"name": "s", "key": "k"},
                    "configMapKeyRef": {"name": "c", "key": "k"},
                },
            },
            "exactly one",
        ),
        ({"name": "REKINDLE_CHECKPOINT", "valueFrom": SECRET_ENV["valueFrom"]}, "manages"),
        ({"name": MM_AUTO_ENV, "value": "0"}, "manages"),
    ],
)
def test_bad_env_is_refused(env: dict[str, Any], words: str) -> None:
    with pytest.raises(SpecError, match=words):
        spec(env=[env])


def test_env_from_needs_exactly_one_source() -> None:
    with pytest.raises(SpecError, match="exactly one of secretRef or configMapRef"):
        spec(envFrom=[{"secretRef": {"name": "a"}, "configMapRef": {"name": "b"}}])


# --- GPUs -----------------------------------------------------------------------------


def gpu_spec(**over: Any) -> IsvcSpec:
    doc: dict[str, Any] = {
        "runtime": {"device": "gpu"},
        "resources": {"memory": "16Gi", "gpu": {"count": 2}},
        "tensorParallelSize": 2,
        "podTemplate": {"spec": {"runtimeClassName": "nvidia"}},
    }
    doc.update(over)
    return spec(**doc)


def test_gpu_pod_as_rendered() -> None:
    """The GPU InferenceService's pod: GPUs as request and limit, the runtime class,
    /dev/shm sized with NCCL per rank, CRIU's CUDA plugin directory passed."""
    s = gpu_spec()
    need = shm_need(s)
    p = pod(s)
    c = main(p)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert c["resources"]["requests"]["nvidia.com/gpu"] == 2
    assert p["spec"]["runtimeClassName"] == "nvidia"
    assert need.nccl == 2 * 192 * 2**20
    vols = {v["name"]: v for v in p["spec"]["volumes"]}
    assert to_bytes(vols["dshm"]["emptyDir"]["sizeLimit"]) == need.total
    assert "--criu-plugins" in c["command"]
    assert c["command"][c["command"].index("--device") + 1] == "cuda"


@pytest.mark.parametrize("name", ["nvidia.com/mig-1g.10gb", "amd.com/gpu", "gpu.intel.com/i915"])
def test_other_gpu_resource_names(name: str) -> None:
    c = main(pod(gpu_spec(resources={"gpu": {"count": 2, "resourceName": name}})))
    assert c["resources"]["limits"][name] == 2 and "nvidia.com/gpu" not in c["resources"]["limits"]


def test_legacy_gpus_field_still_works() -> None:
    s = spec(runtime={"device": "gpu"}, resources={"gpus": 1})
    assert (s.gpus, s.gpu_resource) == (1, "nvidia.com/gpu")
    assert main(pod(s))["resources"]["limits"]["nvidia.com/gpu"] == 1


@pytest.mark.parametrize(
    ("over", "words"),
    [
        ({"resources": {"gpu": {"count": 1}}}, "set spec.resources.gpu.count .* to at least 2"),
        ({"resources": {"gpu": {"count": 2, "resourceName": "gpu"}}}, "extended resource"),
        ({"resources": {"gpu": {"count": 2, "resourceName": "kubernetes.io/gpu"}}}, "DOMAIN"),
        ({"resources": {"gpus": 4, "gpu": {"count": 2}}}, "disagree"),
        ({"runtime": {"device": "cpu"}}, "device is cpu"),
    ],
)
def test_gpu_refusals_say_what_to_change(over: dict[str, Any], words: str) -> None:
    with pytest.raises(SpecError, match=words):
        gpu_spec(**over)


def test_gpu_resource_name_is_in_the_fingerprint() -> None:
    mig = gpu_spec(resources={"gpu": {"count": 2, "resourceName": "nvidia.com/mig-3g.40gb"}})
    assert spec_fingerprint(mig) != spec_fingerprint(gpu_spec())
    more = gpu_spec(resources={"memory": "32Gi", "gpu": {"count": 2}})
    assert spec_fingerprint(more) == spec_fingerprint(gpu_spec())  # resources stay out


# --- memory request and the multimodal decision --------------------------------------


def test_memory_request_includes_dev_shm_when_the_cache_is_declared() -> None:
    s = spec(multimodal={"enabled": True, "cacheSize": "512Mi", "maxObjectMiB": 64})
    need = shm_need(s)
    r = main(pod(s))["resources"]
    assert to_bytes(r["requests"]["memory"]) == to_bytes("4Gi") + need.total
    assert r["requests"]["memory"] == r["limits"]["memory"]
    assert MM_AUTO_ENV not in {e["name"] for e in main(pod(s))["env"]}


def test_undecided_cache_is_in_the_limit_not_the_request_and_the_agent_decides() -> None:
    s = spec()  # multimodal.enabled unset
    need = shm_need(s)
    c = main(pod(s))
    assert need.multimodal_cache == 512 * 2**20 + 32
    assert to_bytes(c["resources"]["limits"]["memory"]) == to_bytes("4Gi") + need.total
    want = mib_str(to_bytes("4Gi") + need.total - need.multimodal_cache)
    assert c["resources"]["requests"]["memory"] == want
    assert {"name": MM_AUTO_ENV, "value": "1"} in c["env"]
    assert "--mm-shm-cache-gb" in c["command"]


def test_text_model_declared_has_no_cache() -> None:
    s = spec(multimodal={"enabled": False, "cacheSize": "512Mi", "maxObjectMiB": 64})
    need = shm_need(s)
    c = main(pod(s))
    assert need.multimodal_cache == 0 and "--mm-shm-cache-gb" not in c["command"]
    assert MM_AUTO_ENV not in {e["name"] for e in c["env"]}
    assert to_bytes(c["resources"]["requests"]["memory"]) == to_bytes("4Gi") + need.total
    # maxObjectMiB above cacheSize does not matter when there is no cache
    spec(multimodal={"enabled": False, "cacheSize": "1Mi", "maxObjectMiB": 64})


@pytest.mark.parametrize(
    ("config", "images"),
    [
        ({"architectures": ["LlamaForCausalLM"]}, False),
        ({"architectures": ["Qwen2_5_VLForConditionalGeneration"]}, True),
        ({"architectures": ["Custom"], "vision_config": {"hidden_size": 8}}, True),
        ({}, False),
    ],
)
def test_takes_images(config: dict[str, Any], images: bool) -> None:
    assert takes_images(config) is images


def test_the_agent_keeps_the_cache_only_for_image_models(tmp_path: Path) -> None:
    from rekindle_agent.supervision.vllm_launch import keep_mm_cache

    text, vision = tmp_path / "text", tmp_path / "vision"
    text.mkdir()
    vision.mkdir()
    (text / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (vision / "config.json").write_text(json.dumps({"vision_config": {}}))
    auto = {MM_AUTO_ENV: "1"}
    assert keep_mm_cache(str(text), auto) is False
    assert keep_mm_cache(str(vision), auto) is True
    assert keep_mm_cache(str(tmp_path / "missing"), auto) is True  # the budget is there
    assert keep_mm_cache(str(text), {}) is True  # the operator decided: enabled true


# --- Pending pods ---------------------------------------------------------------------

UNSCHEDULABLE = {
    "metadata": {"name": "m-1", "creationTimestamp": "2026-01-01T00:00:00Z"},
    "status": {
        "phase": "Pending",
        "conditions": [
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": "0/1 nodes are available: 1 node(s) had untolerated taint "
                "{rekindle.dev/test: x}.",
            }
        ],
    },
}


def test_pending_pods_say_why() -> None:
    assert (pod_problem(UNSCHEDULABLE) or "").startswith("Unschedulable: 0/1 nodes")
    config_error = {
        "metadata": {"name": "m-2"},
        "status": {
            "containerStatuses": [
                {
                    "name": "vllm",
                    "state": {
                        "waiting": {
                            "reason": "CreateContainerConfigError",
                            "message": 'secret "hub" not found',
                        }
                    },
                }
            ]
        },
    }
    assert pod_problem(config_error) == ('CreateContainerConfigError: vllm: secret "hub" not found')
    starting = {
        "status": {"containerStatuses": [{"state": {"waiting": {"reason": "ContainerCreating"}}}]}
    }
    assert pod_problem(starting) is None


def test_pending_reason_reaches_status_and_kubectl_rekindle_status() -> None:
    boot = pod_boot(UNSCHEDULABLE, None, "pod has no IP yet")
    assert boot.reason.startswith("Unschedulable") and boot.stuck
    st = compute_status(
        {},
        Observed(
            spec_replicas=1,
            deployment={"status": {"replicas": 1, "readyReplicas": 0}},
            pods=(boot,),
            checkpoint=None,
            shm_bytes=2**30,
            shm_need={"totalBytes": 2**30},
            shm_error=None,
            selector="s",
            endpoint="e",
        ),
    )
    assert st["pods"][0]["reason"].startswith("Unschedulable: 0/1 nodes")
    ready = next(c for c in st["conditions"] if c["type"] == "Ready")
    assert "untolerated taint" in ready["message"]
    text = format_status({"metadata": {"name": "m"}, "status": st}, [])
    assert "pod m-1: unknown (Unschedulable: 0/1 nodes are available" in text


# --- the CRD says the same as the operator --------------------------------------------


def crd_spec_props() -> dict[str, Any]:
    doc = yaml.safe_load(CRD.read_text())
    (v,) = doc["spec"]["versions"]
    props: dict[str, Any] = v["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    return props


def quoted_list(rule: str) -> list[str]:
    """The first CEL list literal of quoted strings in a rule."""
    return sorted(ast.literal_eval(rule[rule.index("[") : rule.index("]") + 1]))


def test_crd_reserved_volumes_and_paths_match_the_operator() -> None:
    tpl = crd_spec_props()["podTemplate"]["properties"]["spec"]["properties"]
    assert set(tpl) == {*pt.POD_FIELDS, "mainContainer"}
    (vol_rule,) = tpl["volumes"]["x-kubernetes-validations"]
    assert quoted_list(vol_rule["rule"]) == sorted(pt.RESERVED_VOLUMES)
    mounts = tpl["mainContainer"]["properties"]["volumeMounts"]
    (mount_rule,) = mounts["x-kubernetes-validations"]
    assert quoted_list(mount_rule["rule"]) == sorted(pt.RESERVED_MOUNT_PATHS)
    gpu = crd_spec_props()["resources"]["properties"]["gpu"]["properties"]
    assert gpu["resourceName"]["pattern"] == pt.GPU_RESOURCE_PATTERN
    assert gpu["resourceName"]["default"] == pt.DEFAULT_GPU_RESOURCE


def test_crd_managed_env_rule_names_every_managed_variable() -> None:
    (rule,) = crd_spec_props()["env"]["x-kubernetes-validations"]
    for name in MANAGED_ENV:
        assert f"'{name}'" in rule["rule"], name


def test_every_operator_volume_is_reserved() -> None:
    """With every optional volume on, the operator's volume names are all in the list."""
    s = spec(
        apiKeySecretRef={"name": "key"},
        adminTLS={"secretName": "tls"},
        model={"huggingFace": {"id": "org/model"}, "revision": "0" * 40},
    )
    names = {v["name"] for v in pod(s)["spec"]["volumes"]}
    assert names <= set(pt.RESERVED_VOLUMES), names - set(pt.RESERVED_VOLUMES)
    paths = {m["mountPath"] for m in main(pod(s))["volumeMounts"]}
    assert all(pt.reserved_path(p) for p in paths), paths


def test_a_pod_whose_terms_the_apiserver_refuses_is_released_without_them() -> None:
    """Never left gated: a 422 on the placement terms releases the pod with the gate
    removed alone, and says so."""
    from rekindle_operator import placement
    from rekindle_operator.kube import KubeError
    from rekindle_operator.reconcile import release_pod

    class Api:
        def __init__(self) -> None:
            self.patches: list[dict[str, Any]] = []

        def get(self, kind: str, ns: str, name: str) -> dict[str, Any]:
            if kind == "InferenceService":
                return {"status": {"checkpoint": "c1"}}
            return {"status": {"node": "node-a"}}

        def merge_patch(self, kind: str, ns: str, name: str, patch: dict[str, Any]) -> None:
            self.patches.append(patch)
            if "affinity" in patch["spec"]:
                raise KubeError(422, "Pod is invalid: spec.affinity: a rule of this apiserver")

    api = Api()
    pod = {
        "metadata": {"name": "p", "namespace": "ns", "labels": {NAME_LABEL: "m"}},
        "spec": {"schedulingGates": [{"name": placement.GATE}]},
    }
    said = release_pod(api, pod)  # type: ignore[arg-type]
    assert said.startswith("released without placement terms (Pod is invalid")
    assert api.patches[-1] == {"spec": {"schedulingGates": []}}


# --- pre-warming -----------------------------------------------------------------


class AskedAgents:
    """Records whom the operator asks to pre-warm (the agent's side: test_agent_prewarm)."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, str]] = []

    def prewarm_once(self, pod: dict[str, Any], token: str, path: str, tls: bool) -> bool:
        self.asked.append((pod["metadata"]["name"], path))
        return True


def _boot(name: str, node: str, ready: bool, origin: str, path: str | None) -> PodBoot:
    return PodBoot(name, ready, origin, "", path, None, node=node)


@pytest.mark.parametrize(
    ("storage", "want"),
    [
        ({"type": "node", "node": {"publish": "objectStore"}}, ["p3"]),
        ({"type": "node", "node": {"publish": "pvc"}, "pvc": {"existingClaim": "c"}}, ["p3"]),
        ({"type": "node"}, []),  # nothing published: nowhere to pull from
        ({"type": "hostPath", "hostPath": {"path": "/d"}}, []),
    ],
)
def test_one_ready_replica_per_node_without_the_checkpoint_is_asked_to_prewarm(
    monkeypatch: pytest.MonkeyPatch, storage: dict[str, Any], want: list[str]
) -> None:
    path = "/var/lib/rekindle/checkpoints/ck-1"
    ck = {"metadata": {"name": "ck"}, "status": {"path": path, "node": "a"}}
    pods = (
        _boot("p1", "a", True, "booted", path),  # where it was made
        _boot("p2", "b", True, "restored", path),  # b's cache holds it (mapped)
        _boot("p3", "c", True, "booted", path),
        _boot("p4", "c", True, "booted", path),  # c asked once, through p3
        _boot("p5", "d", False, "booted", path),  # not Ready: not asked
    )
    monkeypatch.setattr(reconcile, "read_token", lambda *_: "token")
    monkeypatch.setattr(
        reconcile,
        "service_pods",
        lambda *_: [{"metadata": {"name": p.name, "uid": p.name}} for p in pods],
    )
    agents = AskedAgents()
    s = spec(coldStart={"storage": storage})
    reconcile.prewarm_nodes(None, s, [ck], "ck", pods, agents)  # type: ignore[arg-type]
    assert agents.asked == [(name, path) for name in want]


class PrewarmAnswers:
    """An agent's answers to POST /v1/prewarm, one per call (an exception or a body)."""

    def __init__(self, *answers: Exception | dict[str, Any]) -> None:
        self.answers = list(answers)
        self.calls = 0

    def __call__(self, url: str, token: str, tls: Any = None) -> PrewarmAnswers:
        return self

    def prewarm(self, directory: str) -> dict[str, Any]:
        self.calls += 1
        out = self.answers.pop(0)
        if isinstance(out, Exception):
            raise out
        return out


def _pod(uid: str) -> dict[str, Any]:
    return {
        "metadata": {"name": uid, "uid": uid, "namespace": "ns"},
        "status": {"podIP": "10.0.0.9"},
    }


def test_each_pod_is_asked_once_unless_it_was_not_reached_or_busy() -> None:
    path = "/var/lib/rekindle/checkpoints/ck-1"
    answers = PrewarmAnswers(
        ConnectionRefusedError("not listening yet"),  # not reached: asked again
        {"started": False, "checkpoint": "/var/lib/rekindle/checkpoints/old", "state": "running"},
        {"started": True, "checkpoint": path, "state": "running"},
        AgentError(404, "no such route"),  # an older agent: asked once, not again
    )
    agents = Agents(client_for=answers)  # type: ignore[arg-type]
    asked = [agents.prewarm_once(_pod("p1"), "t", path) for _ in range(4)]
    assert asked == [False, False, True, False] and answers.calls == 3
    assert agents.prewarm_once(_pod("p2"), "t", path) is False  # the 404
    assert agents.prewarm_once(_pod("p2"), "t", path) is False and answers.calls == 4
