"""The Helm chart's templates: `helm template` with various values, the output parsed.

Checks the values users set to fit the chart into their cluster (images by
digest, placement, resources, security context), that the schema refuses
bad values with a message naming them, and the optional parts (CRDs,
PodMonitor). Needs the pinned helm binary, which `scripts/build-kubernetes` builds
(`make test-unit` runs it first); fails, saying so, where it is not built.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from rekindle_dev.testenv import helm_binary, require

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "rekindle"
DIGEST = "sha256:" + "ab" * 32
PODMONITOR_API = "monitoring.coreos.com/v1/PodMonitor"


HELM = helm_binary()


@pytest.fixture(autouse=True)
def _pinned_helm() -> None:
    """The pinned helm must be built (make test-unit builds it first): fail, not skip."""
    require("helm")


def render(*sets: str, chart: Path = CHART, api_versions: tuple[str, ...] = ()) -> list[Any]:
    """The chart rendered in namespace team-a with --set values; every document, parsed."""
    out = template(*sets, chart=chart, api_versions=api_versions)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def template(
    *sets: str, chart: Path = CHART, api_versions: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    assert HELM is not None
    argv = [HELM, "template", "rk", str(chart), "-n", "team-a"]
    for s in sets:
        argv += ["--set", s]
    for a in api_versions:
        argv += ["--api-versions", a]
    return subprocess.run(argv, capture_output=True, text=True, check=False, timeout=60)


def one(docs: list[Any], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(found) == 1, f"{kind} {name}: {len(found)} rendered"
    doc: dict[str, Any] = found[0]
    return doc


def pod_spec(docs: list[Any], kind: str = "Deployment") -> dict[str, Any]:
    spec: dict[str, Any] = one(docs, kind)["spec"]["template"]["spec"]
    return spec


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}


def test_defaults_render_crds_kept_and_no_podmonitor() -> None:
    docs = render()
    crds = [d for d in docs if d["kind"] == "CustomResourceDefinition"]
    assert {c["metadata"]["name"] for c in crds} == {
        "inferenceservices.rekindle.dev",
        "checkpoints.rekindle.dev",
    }
    for c in crds:  # helm uninstall must not delete every InferenceService in the cluster
        assert c["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert not [d for d in docs if d["kind"] == "PodMonitor"]
    (container,) = pod_spec(docs)["containers"]
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert container["image"] == f"rekindle/operator:{chart['appVersion']}"
    assert env_of(container)["REKINDLE_ALLOWED_IMAGES"] == "rekindle.local/runtime-cpu:dev"
    assert "priorityClassName" not in pod_spec(docs)


def test_crds_off() -> None:
    docs = render("crds.install=false")
    assert not [d for d in docs if d["kind"] == "CustomResourceDefinition"]
    assert one(docs, "Deployment")


def test_operator_digest_wins_over_tag_in_every_pod() -> None:
    docs = render(
        "image.repository=reg.example/rk/operator", "image.tag=9.9", f"image.digest={DIGEST}"
    )
    for kind in ("Deployment", "Job"):  # the operator and the uninstall hook
        (container,) = pod_spec(docs, kind)["containers"]
        assert container["image"] == f"reg.example/rk/operator@{DIGEST}", kind
    tagged = render("image.repository=reg.example/rk/operator", "image.tag=9.9")
    assert pod_spec(tagged)["containers"][0]["image"] == "reg.example/rk/operator:9.9"


def test_runtime_images_join_the_allow_list_by_digest() -> None:
    docs = render(
        "runtimeImages.cpu.repository=reg.example/rk/runtime-cpu",
        "runtimeImages.cpu.tag=1.0",
        "runtimeImages.gpu.repository=reg.example/rk/runtime-gpu",
        "runtimeImages.gpu.tag=1.0",
        f"runtimeImages.gpu.digest={DIGEST}",
        "allowedRuntimeImages={reg.example/team/*}",
    )
    expected = [
        "reg.example/rk/runtime-cpu:1.0",
        f"reg.example/rk/runtime-gpu@{DIGEST}",
        "reg.example/team/*",
    ]
    env = env_of(pod_spec(docs)["containers"][0])
    assert env["REKINDLE_ALLOWED_IMAGES"].splitlines() == expected
    policy = one(docs, "ValidatingAdmissionPolicy")
    (allowed,) = [v for v in policy["spec"]["variables"] if v["name"] == "allowed"]
    assert yaml.safe_load(allowed["expression"]) == expected
    # No runtime image and no extra entries: nothing to enforce, no policy.
    open_docs = render("runtimeImages.cpu.repository=")
    assert not [d for d in open_docs if d["kind"] == "ValidatingAdmissionPolicy"]
    assert env_of(pod_spec(open_docs)["containers"][0])["REKINDLE_ALLOWED_IMAGES"] == ""


def test_placement_resources_and_security_reach_the_operator_pod() -> None:
    docs = render(
        "resources.requests.cpu=200m",
        "resources.limits.memory=1Gi",
        "nodeSelector.pool=system",
        "tolerations[0].key=dedicated",
        "tolerations[0].operator=Equal",
        "tolerations[0].value=system",
        "tolerations[0].effect=NoSchedule",
        "affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
        ".nodeSelectorTerms[0].matchExpressions[0].key=zone",
        "affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
        ".nodeSelectorTerms[0].matchExpressions[0].operator=Exists",
        "priorityClassName=system-cluster-critical",
        "podLabels.team=infra",
        "podSecurityContext.runAsUser=1234",
        "securityContext.readOnlyRootFilesystem=true",
    )
    toleration = {
        "key": "dedicated",
        "operator": "Equal",
        "value": "system",
        "effect": "NoSchedule",
    }
    for kind in ("Deployment", "Job"):
        spec = pod_spec(docs, kind)
        (container,) = spec["containers"]
        assert container["resources"]["requests"]["cpu"] == "200m", kind
        assert container["resources"]["limits"]["memory"] == "1Gi", kind
        assert spec["nodeSelector"] == {"pool": "system"}, kind
        assert spec["tolerations"] == [toleration], kind
        term = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert term["nodeSelectorTerms"][0]["matchExpressions"][0]["key"] == "zone", kind
        assert spec["priorityClassName"] == "system-cluster-critical", kind
        assert spec["securityContext"]["runAsUser"] == 1234, kind
        assert spec["securityContext"]["runAsNonRoot"] is True, kind  # defaults kept
        assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}, kind
    dep = one(docs, "Deployment")
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert labels["team"] == "infra"
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()


@pytest.mark.parametrize(
    ("value", "names"),
    [
        ("tolerations[0].operator=Maybe", "/tolerations/0/operator"),
        ("image.digest=latest", "/image/digest"),
        ("resources.limits.memory=lots", "/resources/limits/memory"),
        ("resources.requets.cpu=1", "requets"),
        ("imageTag=1.0", "imageTag"),
        ("podMonitor.interval=soon", "/podMonitor/interval"),
        ("podMonitor.inferenceServices[0].name=Not_A_Name", "/podMonitor/inferenceServices/0/name"),
        ("statusIntervalSeconds=-1", "statusIntervalSeconds"),
        ("runtimeImages.tpu.repository=x", "tpu"),
        ("securityContext.privilegd=true", "privilegd"),
    ],
)
def test_schema_refuses_bad_values_naming_them(value: str, names: str) -> None:
    r = template(value)
    assert r.returncode != 0, f"{value} was accepted"
    assert "schema" in r.stderr and names in r.stderr, r.stderr


def test_podmonitor_rendered_only_when_enabled_and_needs_the_crd() -> None:
    sets = (
        "podMonitor.enabled=true",
        "podMonitor.inferenceServices[0].name=tiny",
        "podMonitor.inferenceServices[1].name=llama",
        "podMonitor.inferenceServices[1].namespace=team-b",
        "podMonitor.labels.release=prometheus",
    )
    # The Prometheus Operator's CRDs are absent: a clear refusal, not an apply error later.
    missing = template(*sets)
    assert missing.returncode != 0
    assert "monitoring.coreos.com/v1 PodMonitor" in missing.stderr
    assert "podMonitor.enabled=false" in missing.stderr
    docs = render(*sets, api_versions=(PODMONITOR_API,))
    monitors = {d["metadata"]["name"]: d for d in docs if d["kind"] == "PodMonitor"}
    assert set(monitors) == {"rekindle-tiny", "rekindle-llama"}
    tiny, llama = monitors["rekindle-tiny"], monitors["rekindle-llama"]
    assert tiny["metadata"]["namespace"] == "team-a"  # the first watched namespace
    assert llama["metadata"]["namespace"] == "team-b"
    assert tiny["metadata"]["labels"]["release"] == "prometheus"
    assert tiny["spec"]["selector"]["matchLabels"] == {"rekindle.dev/inferenceservice": "tiny"}
    (endpoint,) = tiny["spec"]["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"]) == ("admin", "/metrics")
    # The scrape credential (reads /metrics only), never the agent token.
    credentials = endpoint["authorization"]["credentials"]
    assert credentials == {"name": "tiny-metrics-token", "key": "token"}
    # Prometheus is let through the InferenceService's NetworkPolicy to the admin port.
    policy = one(docs, "NetworkPolicy", "rekindle-tiny-metrics")
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"port": "admin", "protocol": "TCP"}]
    assert rule["from"][0]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "monitoring"
    }
    no_np = render(*sets, "networkPolicy.enabled=false", api_versions=(PODMONITOR_API,))
    assert not [d for d in no_np if d["kind"] == "NetworkPolicy"]
    empty = template("podMonitor.enabled=true", api_versions=(PODMONITOR_API,))
    assert empty.returncode != 0 and "podMonitor.inferenceServices is empty" in empty.stderr


def test_notes_need_no_checkout(tmp_path: Path) -> None:
    """NOTES.txt, rendered (`helm template` skips it) through a copy of the chart where a
    template passes its text to `tpl`."""
    chart = tmp_path / "rekindle"
    shutil.copytree(CHART, chart)
    (chart / "templates" / "NOTES.txt").rename(chart / "notes-source.txt")
    (chart / "templates" / "notes.yaml").write_text(
        'notes: {{ tpl (.Files.Get "notes-source.txt") . | toJson }}\n'
    )
    (notes,) = [d["notes"] for d in render(chart=chart) if "notes" in d]
    for repo_path in ("examples/", "docs/", "charts/", "'.[operator]'", "scripts/"):
        assert repo_path not in notes, repo_path
    assert "kubectl explain inferenceservice" in notes
    assert "pip install 'rekindle-vllm[operator]" in notes
    assert "kubectl rekindle -n team-a status" in notes
    # The inline InferenceService is a valid manifest naming the allowed runtime image.
    body = notes.split("<<'YAML'\n", 1)[1].split("     YAML\n", 1)[0]
    doc = yaml.safe_load("\n".join(line.removeprefix("     ") for line in body.splitlines()))
    assert doc["kind"] == "InferenceService"
    assert doc["spec"]["runtime"]["image"] == "rekindle.local/runtime-cpu:dev"


def test_warm_placement_reaches_the_operator_as_its_setting() -> None:
    """warmPlacement (default true) is the operator's REKINDLE_WARM_PLACEMENT."""

    def setting(*values: str) -> str:
        (container,) = pod_spec(render(*values), "Deployment")["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        return str(env["REKINDLE_WARM_PLACEMENT"])

    assert setting() == "true"
    assert setting("warmPlacement=false") == "false"


def test_the_front_and_keda_render_only_when_enabled_with_least_rights() -> None:
    docs = render()
    assert not [d for d in docs if d["kind"] == "APIService" or "front" in d["metadata"]["name"]]
    env = one(docs, "Deployment", "rk-rekindle")["spec"]["template"]["spec"]["containers"][0]["env"]
    assert "REKINDLE_FRONT_URL" not in {e["name"] for e in env}

    docs = render("front.enabled=true", "keda.enabled=true")
    role = one(docs, "ClusterRole", "rk-rekindle-front")
    assert role["rules"] == [
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list"]},
        {"apiGroups": ["rekindle.dev"], "resources": ["inferenceservices"], "verbs": ["get"]},
    ]
    front = one(docs, "Deployment", "rk-rekindle-front")["spec"]["template"]["spec"]
    assert front["containers"][0]["command"][-2:] == ["-m", "rekindle_front"]
    assert front["securityContext"]["runAsNonRoot"] is True
    assert "volumes" not in front  # no Secret, no token beyond its own ServiceAccount's
    env = one(docs, "Deployment", "rk-rekindle")["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {
        "name": "REKINDLE_FRONT_URL",
        "value": "http://rk-rekindle-front.team-a.svc:8080",
    } in env
    api = one(docs, "APIService", "v1beta1.external.metrics.k8s.io")
    assert api["spec"]["service"] == {"name": "keda-metrics-apiserver", "namespace": "team-a"}
    adapter = one(docs, "Deployment", "keda-metrics-apiserver")["spec"]["template"]["spec"]
    assert (
        "--metrics-service-address=keda-operator.team-a.svc.cluster.local:9666"
        in (adapter["containers"][0]["args"])
    )
    # The operator may manage ScaledObjects in its namespaces.
    rules = one(docs, "Role", "rk-rekindle")["rules"]
    assert {"apiGroups": ["keda.sh"], "resources": ["scaledobjects"],
            "verbs": ["get", "create", "patch", "delete"]} in rules  # fmt: skip


def test_a_grafana_dashboard_configmap_holds_valid_json() -> None:
    cm = one(render("grafanaDashboard.enabled=true"), "ConfigMap", "rk-rekindle-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dash = json.loads(cm["data"]["rekindle-dashboard.json"])
    titles = [p["title"] for p in dash["panels"]]
    assert any("held" in t for t in titles) and any("Cold starts" in t for t in titles)
