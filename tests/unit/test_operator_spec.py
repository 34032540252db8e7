"""Spec parsing and the operator-side validation (mirrors of the CRD's CEL rules)."""

from __future__ import annotations

import pytest
from rekindle_agent.config import AgentConfig
from rekindle_agent.supervision.vllm_launch import vllm_command
from rekindle_contract.vllm_argv import MANAGED_VLLM_FLAGS
from rekindle_operator import builders
from rekindle_operator import reconcile as reconcile_mod
from rekindle_operator.agent_command import agent_args, agent_command
from rekindle_operator.quantity import mib_str, parse_quantity, to_bytes
from rekindle_operator.settings import Settings
from rekindle_operator.spec import Autoscaling, IsvcSpec, SpecError, parse_spec
from rekindle_operator.spec_fingerprint import spec_fingerprint

from tests.unit.test_operator_checkpointing import FakeKube


def parse(**spec: object) -> IsvcSpec:
    return parse_spec("x", "ns", {"model": {"source": "/m"}, **spec})


def test_defaults() -> None:
    s = parse_spec("tiny", "ns", {"model": {"source": "/models/tiny"}})
    assert s.served_name == "tiny"
    assert s.device == "cpu"
    assert s.replicas == 1
    assert s.mm_shm_cache and s.mm_cache_bytes == 4 * 2**30
    assert s.storage.type == "pvc" and s.restore_policy == "IfAvailable"
    assert s.mm_enabled is None and s.mm_cache_undecided  # the agent decides from config.json
    assert (s.gpus, s.gpu_resource) == (0, "nvidia.com/gpu")
    assert s.env == () and s.env_from == () and s.pod_template.spec == {}


def test_restart_annotation_is_carried() -> None:
    s = parse_spec("a", "ns", {"model": {"source": "/m"}}, {"rekindle.dev/restartedAt": "t1"})
    assert s.restart_token == "t1"


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ({"replicas": -1}, "spec.replicas"),
        ({"tensorParallelSize": 0}, "tensorParallelSize"),
        ({"runtime": {"device": "tpu"}}, "'cpu' or 'gpu'"),
        (
            {"runtime": {"device": "gpu"}, "tensorParallelSize": 2, "resources": {"gpus": 1}},
            "spec.resources.gpus",
        ),
        ({"vllmArgs": ["--port=9000"]}, "--port"),
        ({"vllmArgs": ["--mm-processor-cache-gb", "8"]}, "spec.multimodal"),
        ({"multimodal": {"cacheSize": "64Mi", "maxObjectMiB": 128}}, "maxObjectMiB"),
        ({"coldStart": {"storage": {"type": "nfs"}}}, "'pvc', 'hostPath' or 'node'"),
        ({"coldStart": {"storage": {"type": "hostPath", "hostPath": {"path": "rel"}}}}, "absolute"),
        ({"coldStart": {"restorePolicy": "Always"}}, "IfAvailable or Never"),
        (
            {"coldStart": {"storage": {"type": "node", "node": {"publish": "s3"}}}},
            "'none', 'pvc' or 'objectStore'",
        ),
        ({"coldStart": {"storage": {"node": {"publish": "pvc"}}}}, "type: node"),
        ({"multimodal": {"cacheSize": "lots"}}, "quantity"),
        ({"resources": {"gpu": {"count": 1}}}, "device is cpu"),
        ({"env": [{"name": "A", "value": "1", "valueFrom": {}}]}, "both value and valueFrom"),
        ({"podTemplate": {"spec": {"initContainers": []}}}, "initContainers is set by"),
        ({"rollout": {"maxSurge": 0}}, "both 0"),
        ({"rollout": {"maxSurge": "0%", "maxUnavailable": 0}}, "both 0"),
        ({"rollout": {"maxUnavailable": "1"}}, "neither a count"),
        ({"rollout": {"maxSurge": -1}}, "neither a count"),
        ({"rollout": {"maxSurge": True}}, "neither a count"),
        ({"terminationGracePeriodSeconds": 3}, "outside 5-3600"),
        ({"maxConcurrentRequests": 0}, r"maxConcurrentRequests: 0 is outside 1-65536"),
        ({"disruptionBudget": {}}, "needs maxUnavailable"),
        ({"disruptionBudget": {"maxUnavailable": 0}}, "no node could ever be drained"),
        ({"disruptionBudget": {"maxUnavailable": "0%"}}, "no node could ever be drained"),
        ({"autoscaling": {}}, "needs maxReplicas"),
        ({"autoscaling": {"maxReplicas": 0}}, r"maxReplicas: 0 is not a whole number 1-1000"),
        ({"autoscaling": {"maxReplicas": 2, "minReplicas": 3}}, "minReplicas .3. is above"),
        ({"autoscaling": {"maxReplicas": 2, "metric": "gpu"}}, "metric: 'gpu'; use one of"),
        ({"autoscaling": {"maxReplicas": 2, "target": 0}}, "target: 0 is not"),
    ],
)
def test_refusals_name_the_field(spec: dict[str, object], words: str) -> None:
    with pytest.raises((SpecError, ValueError), match=words.replace("(", r"\(")):
        parse(**spec)


@pytest.mark.parametrize("flag", MANAGED_VLLM_FLAGS)
def test_every_managed_vllm_flag_is_refused(flag: str) -> None:
    for args in ([flag, "1"], [f"{flag}=1"]):
        with pytest.raises(SpecError, match="manages"):
            parse(vllmArgs=args)


@pytest.mark.parametrize(
    ("arg", "flag"),
    [
        ("--served_model_name=x", "--served-model-name"),
        ("--worker_extension_cls=evil.Ext", "--worker-extension-cls"),
        ("--hos", "--host"),
        ("--hos=0.0.0.0", "--host"),
        ("--tensor_parallel", "--tensor-parallel-size"),
        ("-tp", "--tensor-parallel-size"),
        ("-tp=2", "--tensor-parallel-size"),
        ("--no-enable-sleep-mode", "--enable-sleep-mode"),
        ("--no_enable_sleep", "--enable-sleep-mode"),
    ],
)
def test_the_spellings_vllm_reads_as_a_managed_flag_are_refused(arg: str, flag: str) -> None:
    """vLLM's parser reads `_` as `-` and a unique prefix as the flag."""
    with pytest.raises(SpecError, match=f"sets {flag} \\(as {arg.split('=')[0]}: vLLM reads"):
        parse(vllmArgs=[arg, "1"])


@pytest.mark.parametrize(
    "arg", ["--max-num-seqs", "--model-impl=transformers", "--portable", "-O3", "--hf-token=x"]
)
def test_other_flags_pass(arg: str) -> None:
    parse(vllmArgs=[arg])


def test_missing_model_source() -> None:
    with pytest.raises(SpecError, match=r"spec\.model\.source"):
        parse_spec("x", "ns", {"model": {}})


def test_quantities() -> None:
    assert to_bytes("1.5Gi") == 3 * 2**29
    assert to_bytes("1k") == 1000
    assert to_bytes(3) == 3
    assert parse_quantity("500m") * 1000 == 500
    assert to_bytes("0.1") == 1  # rounded up
    assert mib_str(2**20 + 1) == "2Mi"
    with pytest.raises(ValueError, match="not a Kubernetes quantity"):
        to_bytes("12 GB")


def test_media_hosts_and_redirects_reach_vllm() -> None:
    """spec.multimodal.allowedMediaDomains becomes vLLM's --allowed-media-domains (through
    the agent's flag); redirects stay off unless allowMediaRedirects."""
    s = parse(multimodal={"allowedMediaDomains": ["images.example.com", "10.0.0.5"]})
    assert s.mm_allowed_media_domains == ("images.example.com", "10.0.0.5")
    args = agent_args(s)
    assert (args.allowed_media_domains, args.media_redirects) == (
        "images.example.com,10.0.0.5",
        False,
    )
    cfg = AgentConfig(model="/m", allowed_media_domains=args.allowed_media_domains)
    argv, env = vllm_command(cfg)
    i = argv.index("--allowed-media-domains")
    assert argv[i + 1 : i + 3] == ["images.example.com", "10.0.0.5"]
    assert env["VLLM_MEDIA_URL_ALLOW_REDIRECTS"] == "0"
    argv, env = vllm_command(AgentConfig(model="/m", media_redirects=True))
    assert "--allowed-media-domains" not in argv and env["VLLM_MEDIA_URL_ALLOW_REDIRECTS"] == "1"
    assert agent_args(parse(multimodal={"allowMediaRedirects": True})).media_redirects is True
    # Part of the fingerprint: a checkpoint of another media policy is stale.
    assert spec_fingerprint(s) != spec_fingerprint(parse())


@pytest.mark.parametrize(
    "host", ["*.example.com", "Images.example.com", "https://a.example", "a.example:443", ""]
)
def test_a_media_domain_that_is_not_a_host_name_is_refused(host: str) -> None:
    with pytest.raises(SpecError, match="is not a host name"):
        parse(multimodal={"allowedMediaDomains": [host]})


def test_rollout_and_grace_reach_the_deployment_and_the_agent() -> None:
    default = parse()
    assert (default.max_surge, default.max_unavailable, default.termination_grace_s) == (1, 0, 30)
    assert "--shutdown-drain" not in agent_command(default)  # 25: the agent's own default
    s = parse(rollout={"maxSurge": "25%", "maxUnavailable": 1}, terminationGracePeriodSeconds=120)
    dep = builders.build_deployment(s, 1 << 30, spec_fingerprint(s))
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": "25%", "maxUnavailable": 1}
    assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 120
    argv = agent_command(s)
    assert argv[argv.index("--shutdown-drain") + 1] == "115"
    short = parse(terminationGracePeriodSeconds=10)
    assert agent_args(short).shutdown_drain == 8.0  # a fifth of a short grace kept back
    # Neither changes the vLLM process: checkpoints stay valid across them.
    assert spec_fingerprint(s) == spec_fingerprint(default)


def test_the_concurrency_cap_reaches_the_agent_and_keeps_checkpoints_valid() -> None:
    default = parse()
    assert default.max_concurrent_requests == 256
    assert "--proxy-max-concurrency" not in agent_command(default)  # the agent's own default
    s = parse(maxConcurrentRequests=32)
    argv = agent_command(s)
    assert argv[argv.index("--proxy-max-concurrency") + 1] == "32"
    assert spec_fingerprint(s) == spec_fingerprint(default)  # the proxy's, not vLLM's


def test_a_disruption_budget_is_owned_applied_and_removed_when_unset() -> None:
    kube = FakeKube()
    body = {"metadata": {"name": "x", "namespace": "ns", "uid": "u1"}}
    with_budget = parse(disruptionBudget={"maxUnavailable": "25%"})
    reconcile_mod.ensure_disruption_budget(kube, body, with_budget)  # type: ignore[arg-type]
    pdb = kube.get("PodDisruptionBudget", "ns", "x")
    assert pdb is not None and pdb["spec"] == {
        "maxUnavailable": "25%",
        "selector": {"matchLabels": builders.selector_labels("x")},
        "unhealthyPodEvictionPolicy": "AlwaysAllow",
    }
    assert pdb["metadata"]["ownerReferences"][0]["uid"] == "u1"
    reconcile_mod.ensure_disruption_budget(kube, body, parse())  # type: ignore[arg-type]
    assert kube.get("PodDisruptionBudget", "ns", "x") is None
    # Somebody else's of that name is left alone.
    kube.put({"kind": "PodDisruptionBudget", "metadata": {"name": "x", "namespace": "ns"}})
    reconcile_mod.ensure_disruption_budget(kube, body, parse())  # type: ignore[arg-type]
    assert kube.get("PodDisruptionBudget", "ns", "x") is not None


def test_autoscaling_parses_with_its_defaults() -> None:
    a = parse(autoscaling={"maxReplicas": 3}).autoscaling
    assert a == Autoscaling(
        min_replicas=1, max_replicas=3, metric="requests", target=8, scale_down_delay_s=300
    )
    assert parse().autoscaling is None


def test_a_scaled_object_reads_the_fronts_load_and_is_removed_when_unset() -> None:
    kube = FakeKube()
    body = {"metadata": {"name": "x", "namespace": "ns", "uid": "u1"}}
    spec = parse(
        autoscaling={
            "minReplicas": 0, "maxReplicas": 4, "metric": "waiting", "target": 3,
            "scaleDownDelay": 45,
        }
    )  # fmt: skip
    reconcile_mod.ensure_scaled_object(kube, body, spec, "http://front:8080/")  # type: ignore[arg-type]
    so = kube.get("ScaledObject", "ns", "x")
    assert so is not None and so["apiVersion"] == "keda.sh/v1alpha1"
    assert so["metadata"]["ownerReferences"][0]["uid"] == "u1"
    got = so["spec"]
    assert got["scaleTargetRef"] == {
        "apiVersion": "rekindle.dev/v1alpha1", "kind": "InferenceService", "name": "x",
    }  # fmt: skip
    assert (got["minReplicaCount"], got["maxReplicaCount"], got["cooldownPeriod"]) == (0, 4, 45)
    behavior = got["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] == 45
    assert got["triggers"] == [
        {
            "type": "metrics-api",
            "metricType": "AverageValue",
            "metadata": {
                "url": "http://front:8080/load/ns/x",
                "format": "json",
                "valueLocation": "waiting",
                "targetValue": "3",
                "activationTargetValue": "0",
            },
        }
    ]
    reconcile_mod.ensure_scaled_object(kube, body, parse(), "http://front:8080")  # type: ignore[arg-type]
    assert kube.get("ScaledObject", "ns", "x") is None


def test_autoscaling_needs_the_front_and_takes_an_api_key() -> None:
    spec = parse(autoscaling={"maxReplicas": 2})
    with pytest.raises(SpecError, match=r"front\.enabled=true"):
        reconcile_mod.check_autoscaling(spec, Settings())
    reconcile_mod.check_autoscaling(spec, Settings(front_url="http://front:8080"))
    keyed = parse(autoscaling={"maxReplicas": 2}, apiKeySecretRef={"name": "k"})
    reconcile_mod.check_autoscaling(keyed, Settings(front_url="http://front:8080"))
