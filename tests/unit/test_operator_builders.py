"""Each builder's object: the parts that make the feature work."""

from __future__ import annotations

import base64

import pytest
from rekindle_contract.agent_args import AGENT_COMMAND
from rekindle_contract.api import SERVE_PORT
from rekindle_contract.pod import (
    API_KEY_DIR,
    API_KEY_ENV,
    API_KEY_FILE,
    API_KEY_KEY,
    CHECKPOINT_ENV,
    CHECKPOINT_MOUNT,
    CHECKPOINT_SIGNATURE_ENV,
    IMAGE_ENV,
    METRICS_TOKEN_ENV,
    METRICS_TOKEN_FILE,
    NODE_SOCKET,
    NODE_SOCKET_DIR,
    NODE_SOCKET_ENV,
    NODE_SOCKET_VOLUME,
    POD_UID_ENV,
    SERVICE_UID_ENV,
    SIGNING_KEY_ENV,
    SIGNING_KEY_FILE,
    SIGNING_KEY_KEY,
    TOKEN_DIR,
    TOKEN_FILE,
    TOKEN_KEY,
)
from rekindle_contract.vllm_argv import VllmOptions, vllm_argv
from rekindle_operator import admin_tls
from rekindle_operator import builders as b
from rekindle_operator.agent_command import agent_args
from rekindle_operator.constants import NAME_LABEL, SERVING_LABEL
from rekindle_operator.quantity import to_bytes
from rekindle_operator.shm_sizing import effective_shm_bytes, shm_need, shm_shortfall
from rekindle_operator.spec import AdminTLS, IsvcSpec, SpecError, parse_spec
from rekindle_operator.spec_fingerprint import spec_fingerprint

OWNER = {"kind": "InferenceService", "metadata": {"name": "tiny", "uid": "u-1"}}


def tiny(**over: object) -> IsvcSpec:
    spec: dict[str, object] = {
        "model": {"source": "/models/tiny", "servedName": "tiny"},
        "runtime": {"device": "cpu", "imagePullPolicy": "Never"},
        "resources": {"memory": "4Gi", "cpu": "1"},
        "multimodal": {"cacheSize": "512Mi", "maxObjectMiB": 64},
    }
    spec.update(over)
    return parse_spec("tiny", "ns", spec)


def deployment(s: IsvcSpec) -> dict:  # type: ignore[type-arg]
    need = shm_need(s)
    return b.build_deployment(s, effective_shm_bytes(s, need), "fp", owner=OWNER)


def container(dep: dict) -> dict:  # type: ignore[type-arg]
    return dep["spec"]["template"]["spec"]["containers"][0]  # type: ignore[no-any-return]


def test_deployment_sizes_dev_shm_and_memory_limit() -> None:
    s = tiny()
    need = shm_need(s)
    dep = deployment(s)
    vols = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    assert vols["dshm"]["emptyDir"]["medium"] == "Memory"
    assert to_bytes(vols["dshm"]["emptyDir"]["sizeLimit"]) == need.total
    mounts = {m["name"]: m["mountPath"] for m in container(dep)["volumeMounts"]}
    assert mounts["dshm"] == "/dev/shm"
    limit = to_bytes(container(dep)["resources"]["limits"]["memory"])
    assert limit == to_bytes("4Gi") + need.total


def test_memory_request_includes_dev_shm() -> None:
    s = tiny(multimodal={"enabled": True, "cacheSize": "512Mi", "maxObjectMiB": 64})
    need = shm_need(s)
    res = container(deployment(s))["resources"]
    assert to_bytes(res["requests"]["memory"]) == to_bytes("4Gi") + need.total
    assert res["requests"]["memory"] == res["limits"]["memory"]


def test_explicit_shm_size_is_used_when_big_enough() -> None:
    s = tiny(sharedMemory={"size": "8Gi"})
    dep = deployment(s)
    vols = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    assert vols["dshm"]["emptyDir"]["sizeLimit"] == "8192Mi"
    assert shm_shortfall(s, shm_need(s)) is None


def vllm_of(s: IsvcSpec) -> list[str]:
    """The vLLM command line the agent will build from the operator's agent settings."""
    a = agent_args(s)
    opts = VllmOptions(
        model=a.model,
        served_name=a.served_name,
        device=a.device,
        max_model_len=a.max_model_len,
        tensor_parallel_size=a.tensor_parallel_size,
        mm_shm_cache_gb=a.mm_shm_cache_gb,
        mm_shm_max_object_mb=a.mm_shm_max_object_mb,
        prefix_caching=a.prefix_caching,
        kv_offload_gb=a.kv_offload_gb,
        extra_args=tuple(a.vllm_args),
    )
    return vllm_argv(opts, python="python")


def test_agent_is_entrypoint_with_shm_cache_settings() -> None:
    cmd = container(deployment(tiny()))["command"]
    assert cmd[: len(AGENT_COMMAND)] == list(AGENT_COMMAND)
    assert "--" not in cmd  # no user vLLM flags; the operator writes none itself
    assert cmd[cmd.index("--mm-shm-cache-gb") + 1] == "0.5"
    assert cmd[cmd.index("--mm-shm-max-object-mb") + 1] == "64"
    # The restore pointer comes by env, never argv (a value starting with "-" is a flag).
    assert "--restore-from" not in cmd and not any(CHECKPOINT_ENV in a for a in cmd)
    assert cmd[cmd.index("--checkpoint-root") + 1] == CHECKPOINT_MOUNT
    assert agent_args(tiny()).device == "cpu" and "--device" not in cmd  # the agent's default
    vllm = vllm_of(tiny())
    assert vllm[vllm.index("--mm-processor-cache-type") + 1] == "shm"
    assert vllm[vllm.index("--mm-processor-cache-gb") + 1] == "0.5"
    assert vllm[vllm.index("--mm-shm-cache-max-object-size-mb") + 1] == "64"


def test_user_vllm_args_go_after_the_separator() -> None:
    cmd = container(deployment(tiny(vllmArgs=["--max-num-seqs", "4"])))["command"]
    assert cmd[cmd.index("--") + 1 :] == ["--max-num-seqs", "4"]


def test_gpu_flags_and_resources() -> None:
    s = tiny(
        runtime={"device": "gpu"},
        resources={"gpus": 2, "memory": "16Gi"},
        tensorParallelSize=2,
        kvCache={"cpuOffloadSize": "2Gi", "prefixCaching": False},
    )
    c = container(deployment(s))
    cmd = c["command"]
    assert cmd[cmd.index("--device") + 1] == "cuda"
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "2"
    assert cmd[cmd.index("--kv-offload-gb") + 1] == "2"
    assert "--no-prefix-caching" in cmd
    vllm = vllm_of(s)
    assert vllm[vllm.index("--tensor-parallel-size") + 1] == "2"
    assert vllm[vllm.index("--kv-offloading-size") + 1] == "2"
    assert "--no-enable-prefix-caching" in vllm and "--enable-sleep-mode" in vllm
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 2
    # CRIU's CUDA plugin directory, where both runtime images install it
    assert cmd[cmd.index("--criu-plugins") + 1] == "/opt/criu/patched/plugins"


def test_cpu_pods_pass_no_criu_plugins() -> None:
    assert "--criu-plugins" not in container(deployment(tiny()))["command"]


def test_gpu_pod_memory_holds_the_checkpoints_host_copies() -> None:
    from rekindle_operator.shm_sizing import gpu_host_copy_bytes, memory_limit_bytes

    cpu = tiny(resources={"memory": "16Gi"})
    gpu = tiny(runtime={"device": "gpu"}, resources={"gpus": 2, "memory": "16Gi"})
    assert gpu_host_copy_bytes(cpu) == 0
    per_gpu = 2 * 1024 * 2**20  # sleep's pinned copies + cuda-checkpoint's, per GPU
    assert gpu_host_copy_bytes(gpu) == 2 * per_gpu
    shm = effective_shm_bytes(gpu, shm_need(gpu))
    assert memory_limit_bytes(gpu, shm) == to_bytes("16Gi") + shm + 2 * per_gpu
    limit = container(deployment(gpu))["resources"]["limits"]["memory"]
    assert to_bytes(limit) == memory_limit_bytes(gpu, shm)


def test_mm_cache_off_has_no_shm_flags() -> None:
    s = tiny(multimodal={"shmCache": False})
    assert "--mm-shm-cache-gb" not in container(deployment(s))["command"]
    assert "--mm-processor-cache-type" not in vllm_of(s)


def test_checkpoint_pointer_comes_from_configmap_env_signed_for_the_service() -> None:
    env = {e["name"]: e for e in container(deployment(tiny()))["env"]}
    for name, key in ((CHECKPOINT_ENV, "checkpoint"), (CHECKPOINT_SIGNATURE_ENV, "signature")):
        ref = env[name]["valueFrom"]["configMapKeyRef"]
        assert (ref["name"], ref["key"], ref["optional"]) == (b.configmap_name("tiny"), key, True)
    # The owner's UID binds the signature: the agent checks it against this value.
    assert env[SERVICE_UID_ENV] == {"name": SERVICE_UID_ENV, "value": OWNER["metadata"]["uid"]}
    cm = b.build_configmap(tiny(), "/p/x", OWNER, signature="v1:u:ab")
    assert cm["data"] == {"checkpoint": "/p/x", "signature": "v1:u:ab"}
    never = tiny(coldStart={"restorePolicy": "Never"})
    assert b.build_configmap(never, "/p/x", signature="v1:u:ab")["data"] == {
        "checkpoint": "",
        "signature": "",
    }


def test_service_requires_serving_label_deployment_does_not() -> None:
    s = tiny()
    svc = b.build_service(s, OWNER)
    dep = deployment(s)
    assert svc["spec"]["selector"][SERVING_LABEL] == "true"
    assert SERVING_LABEL not in dep["spec"]["selector"]["matchLabels"]
    assert dep["spec"]["template"]["metadata"]["labels"][SERVING_LABEL] == "true"
    assert dep["spec"]["selector"]["matchLabels"] == {NAME_LABEL: "tiny"}
    assert svc["spec"]["ports"][0]["port"] == SERVE_PORT


def test_owned_objects_carry_owner_reference() -> None:
    s = tiny()
    for obj in (b.build_service(s, OWNER), deployment(s), b.build_secret(s, OWNER)):
        ref = obj["metadata"]["ownerReferences"][0]
        assert ref["uid"] == "u-1" and ref["controller"] is True


def test_secret_token_random_unless_given() -> None:
    s = tiny()
    one = b.build_secret(s)["data"][TOKEN_KEY]
    two = b.build_secret(s)["data"][TOKEN_KEY]
    assert one != two and len(base64.b64decode(one)) >= 32
    fixed = b.build_secret(s, token="abc")["data"][TOKEN_KEY]
    assert base64.b64decode(fixed) == b"abc"


def test_storage_pvc_or_hostpath() -> None:
    pvc_spec = tiny(coldStart={"storage": {"type": "pvc", "pvc": {"size": "5Gi"}}})
    pvc = b.build_pvc(pvc_spec, OWNER)
    assert pvc is not None
    assert pvc["spec"]["resources"]["requests"]["storage"] == "5Gi"
    assert "ownerReferences" not in pvc["metadata"]  # Retain by default
    deleting = tiny(coldStart={"storage": {"type": "pvc", "deletionPolicy": "Delete"}})
    assert b.build_pvc(deleting, OWNER)["metadata"]["ownerReferences"]  # type: ignore[index]
    hp = tiny(coldStart={"storage": {"type": "hostPath", "hostPath": {"path": "/data/ck"}}})
    assert b.build_pvc(hp) is None
    vols = {v["name"]: v for v in deployment(hp)["spec"]["template"]["spec"]["volumes"]}
    assert vols["checkpoints"]["hostPath"]["path"] == "/data/ck"
    existing = tiny(coldStart={"storage": {"pvc": {"existingClaim": "shared"}}})
    assert b.build_pvc(existing) is None
    vols = {v["name"]: v for v in deployment(existing)["spec"]["template"]["spec"]["volumes"]}
    assert vols["checkpoints"]["persistentVolumeClaim"]["claimName"] == "shared"


def test_restart_token_changes_pod_template() -> None:
    a = deployment(parse_spec("t", "ns", {"model": {"source": "/m"}}, {}))
    c = deployment(
        parse_spec("t", "ns", {"model": {"source": "/m"}}, {"rekindle.dev/restartedAt": "1"})
    )
    assert a["spec"]["template"] != c["spec"]["template"]


def test_cleanup_job_only_below_checkpoint_mount() -> None:
    s = tiny(coldStart={"storage": {"type": "hostPath", "hostPath": {"path": "/data/ck"}}})
    vol = b.checkpoint_volume(s)
    job = b.build_cleanup_job("ns", "c1", "uid-1", f"{CHECKPOINT_MOUNT}/c1-abc", vol, s.image)
    pod = job["spec"]["template"]["spec"]
    rm = pod["containers"][0]
    # The agent's CLI clears the pages images' immutable flag: that capability, no other.
    assert rm["command"] == ["rekindle", "remove-checkpoint", f"{CHECKPOINT_MOUNT}/c1-abc"]
    assert rm["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["LINUX_IMMUTABLE"]}
    assert rm["securityContext"]["privileged"] is False
    assert pod["volumes"][0]["hostPath"]["path"] == "/data/ck"
    for bad in ("/etc", f"{CHECKPOINT_MOUNT}/../x", CHECKPOINT_MOUNT):
        with pytest.raises(ValueError, match="refusing"):
            b.build_cleanup_job("ns", "c1", "uid-1", bad, vol, s.image)
    with pytest.raises(ValueError, match="refusing"):
        b.build_cleanup_job("ns", "c1", "u", f"{CHECKPOINT_MOUNT}/x", vol, s.image, sub_path="../a")


def test_cleanup_job_names_are_unique_per_checkpoint_object() -> None:
    vol = b.checkpoint_volume(tiny())
    path = f"{CHECKPOINT_MOUNT}/c-1"
    long = "c" * 70
    names = {
        b.build_cleanup_job("ns", n, uid, path, vol, "img")["metadata"]["name"]
        for n, uid in (
            ("c1", "aaaaaaaa-1"),
            ("c1", "bbbbbbbb-2"),
            (long, "cccccccc"),
            (long + "x", "dddddddd"),
        )
    }
    assert len(names) == 4
    assert all(len(n) <= 63 and not n.endswith("-") for n in names)


def test_hostpath_cleanup_runs_on_the_node_with_the_data() -> None:
    s = tiny(coldStart={"storage": {"type": "hostPath", "hostPath": {"path": "/data/ck"}}})
    job = b.build_cleanup_job(
        "ns",
        "c1",
        "u1",
        f"{CHECKPOINT_MOUNT}/c1-u1",
        b.checkpoint_volume(s),
        s.image,
        sub_path="ns/tiny",
        node="node-7",
    )
    pod = job["spec"]["template"]["spec"]
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"] == [
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["node-7"]}]}
    ]
    assert pod["containers"][0]["volumeMounts"][0]["subPath"] == "ns/tiny"
    assert pod["automountServiceAccountToken"] is False
    assert pod["containers"][0]["securityContext"]["privileged"] is False
    # A PVC follows its volume's own node affinity: no pin.
    pvc_job = b.build_cleanup_job(
        "ns",
        "c1",
        "u1",
        f"{CHECKPOINT_MOUNT}/c1-u1",
        b.checkpoint_volume(tiny()),
        "img",
        node="node-7",
    )
    assert "affinity" not in pvc_job["spec"]["template"]["spec"]


def test_pods_see_only_their_own_checkpoint_directory_and_no_api_token() -> None:
    dep = deployment(tiny())
    pod = dep["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    mounts = {m["name"]: m for m in container(dep)["volumeMounts"]}
    assert mounts["checkpoints"]["mountPath"] == CHECKPOINT_MOUNT
    assert mounts["checkpoints"]["subPath"] == "ns/tiny" == b.storage_subpath("ns", "tiny")
    assert mounts["agent-token"]["readOnly"] is True
    other = deployment(parse_spec("tiny", "team-b", {"model": {"source": "/m"}}))
    other_mount = next(m for m in container(other)["volumeMounts"] if m["name"] == "checkpoints")
    assert other_mount["subPath"] == "team-b/tiny"
    assert b.checkpoint_path("c1", "0123456789") == f"{CHECKPOINT_MOUNT}/c1-01234567"


def test_egress_limits_the_pods_to_dns_and_the_given_ranges() -> None:
    np = b.build_network_policy(
        tiny(egress={"cidrs": ["10.20.0.0/16", "2001:db8::/32"]}), "rk", {"app": "op"}
    )
    spec = np["spec"]
    assert spec["policyTypes"] == ["Ingress", "Egress"]
    dns, ranges = spec["egress"]
    assert dns["to"] == [
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
            "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}},
        }
    ]
    assert dns["ports"] == [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]
    assert ranges == {
        "to": [{"ipBlock": {"cidr": "10.20.0.0/16"}}, {"ipBlock": {"cidr": "2001:db8::/32"}}]
    }
    # No ranges: DNS only. No spec.egress: no Egress at all.
    only_dns = b.build_network_policy(tiny(egress={"cidrs": []}), "rk", {"app": "op"})
    assert only_dns["spec"]["egress"] == [dns]
    assert "egress" not in b.build_network_policy(tiny(), "rk", {"app": "op"})["spec"]


@pytest.mark.parametrize("cidr", ["10.0.0.1/8", "10.0.0.0/33", "example.com", ""])
def test_an_egress_range_that_is_not_a_network_is_refused(cidr: str) -> None:
    with pytest.raises(SpecError, match=r"spec\.egress\.cidrs: .* is not a network in CIDR"):
        tiny(egress={"cidrs": [cidr]})


def test_network_policy_admin_port_only_from_the_operator() -> None:
    np = b.build_network_policy(tiny(), "rekindle-system", {"app": "op"}, owner=OWNER)
    assert np["kind"] == "NetworkPolicy" and np["metadata"]["namespace"] == "ns"
    assert np["metadata"]["ownerReferences"][0]["name"] == "tiny"
    spec = np["spec"]
    assert spec["podSelector"] == {"matchLabels": {NAME_LABEL: "tiny"}}
    assert spec["policyTypes"] == ["Ingress"]
    serve, admin = spec["ingress"]
    assert serve == {"ports": [{"port": "http", "protocol": "TCP"}]}  # from anywhere
    assert admin["ports"] == [{"port": "admin", "protocol": "TCP"}]
    assert admin["from"] == [
        {
            "namespaceSelector": {
                "matchLabels": {"kubernetes.io/metadata.name": "rekindle-system"}
            },
            "podSelector": {"matchLabels": {"app": "op"}},
        }
    ]
    # The named ports exist on the container.
    ports = {p["name"] for p in container(deployment(tiny()))["ports"]}
    assert {"http", "admin"} <= ports


def test_container_can_run_criu() -> None:
    sc = container(deployment(tiny()))["securityContext"]
    assert sc["privileged"] is True
    assert sc["seccompProfile"] == {"type": "Unconfined"}


def test_node_mode_pods_need_no_privilege() -> None:
    """storage type node: the node agent runs CRIU; the pod is Pod Security restricted
    in what it asks for (the apiserver enforces baseline in tests/cluster)."""
    dep = deployment(tiny(coldStart={"storage": {"type": "node"}}))
    pod = dep["spec"]["template"]["spec"]
    c = container(dep)
    assert c["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "runAsNonRoot": True,
        "runAsUser": 65534,
        "runAsGroup": 65534,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert pod["securityContext"]["fsGroup"] == 65534
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert not [v for v in pod["volumes"] if "hostPath" in v or "persistentVolumeClaim" in v]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[NODE_SOCKET_VOLUME] == {"name": NODE_SOCKET_VOLUME, "emptyDir": {}}
    assert volumes["checkpoints"] == {"name": "checkpoints", "emptyDir": {}}
    assert volumes["agent-token"]["projected"]["defaultMode"] == 0o440
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts[NODE_SOCKET_VOLUME] == NODE_SOCKET_DIR
    env = {e["name"]: e for e in c["env"]}
    assert env[NODE_SOCKET_ENV]["value"] == NODE_SOCKET
    assert env[POD_UID_ENV]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.uid"}}
    assert env["HOME"]["value"].startswith("/tmp/")
    # The default stays as it was: a privileged pod whose agent runs CRIU.
    assert container(deployment(tiny()))["securityContext"]["privileged"] is True


def test_node_mode_publishing_puts_the_claim_where_the_scratch_was() -> None:
    """publish pvc: the claim (made like type pvc's) is the checkpoint volume, the agent is
    told to publish, and the pods stay unprivileged with no hostPath."""
    s = tiny(
        coldStart={"storage": {"type": "node", "node": {"publish": "pvc"}, "pvc": {"size": "5Gi"}}}
    )
    dep = deployment(s)
    pod = dep["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["checkpoints"] == {
        "name": "checkpoints",
        "persistentVolumeClaim": {"claimName": "tiny-checkpoints"},
    }
    pvc = b.build_pvc(s)
    assert pvc is not None and pvc["spec"]["resources"]["requests"]["storage"] == "5Gi"
    assert "--node-publish" in container(dep)["command"]
    assert container(dep)["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert not [v for v in pod["volumes"] if "hostPath" in v]
    # Without publishing: no claim, no flag.
    plain = tiny(coldStart={"storage": {"type": "node"}})
    assert b.build_pvc(plain) is None
    argv = container(deployment(plain))["command"]
    assert "--node-publish" not in argv


def test_cleanup_of_a_node_agents_copy_needs_no_capability() -> None:
    """What the node agent published belongs to the pods' user and is never immutable:
    the Job removes it as that user with every capability dropped (Pod Security
    restricted would admit it)."""
    s = tiny(coldStart={"storage": {"type": "node", "node": {"publish": "pvc"}}})
    job = b.build_cleanup_job(
        "ns",
        "c1",
        "u1",
        f"{CHECKPOINT_MOUNT}/c1-u1",
        b.checkpoint_volume(s),
        s.image,
        written_by_node_agent=True,
    )
    sc = job["spec"]["template"]["spec"]["containers"][0]["securityContext"]
    assert sc["capabilities"] == {"drop": ["ALL"]} and sc["runAsUser"] == 65534
    assert sc["runAsNonRoot"] is True
    assert sc["allowPrivilegeEscalation"] is False and sc["privileged"] is False
    agents = b.build_cleanup_job(
        "ns", "c1", "u1", f"{CHECKPOINT_MOUNT}/c1-u1", b.checkpoint_volume(tiny()), s.image
    )
    sc = agents["spec"]["template"]["spec"]["containers"][0]["securityContext"]
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["LINUX_IMMUTABLE"]}


def test_workers_bind_loopback_so_a_new_pod_ip_does_not_break_restore() -> None:
    env = {e["name"]: e.get("value") for e in container(deployment(tiny()))["env"]}
    assert env["GLOO_SOCKET_IFNAME"] == "lo" and env["VLLM_HOST_IP"] == "127.0.0.1"
    mine = tiny(env=[{"name": "GLOO_SOCKET_IFNAME", "value": "eth1"}])
    names = [e["name"] for e in container(deployment(mine))["env"]]
    assert names.count("GLOO_SOCKET_IFNAME") == 1


def test_signing_key_secret_and_its_read_only_mount() -> None:
    s = tiny()
    sec = b.build_signing_secret(s, owner=OWNER)
    assert sec["metadata"]["name"] == "tiny-signing-key"
    key = base64.b64decode(sec["data"][SIGNING_KEY_KEY])
    assert len(key) >= 32
    assert b.build_signing_secret(s)["data"] != sec["data"]  # random per InferenceService
    dep = deployment(s)
    vols = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    proj = vols["agent-token"]["projected"]
    assert proj["defaultMode"] == 0o400
    assert [src["secret"]["name"] for src in proj["sources"]] == [
        "tiny-agent-token",
        "tiny-signing-key",
        "tiny-metrics-token",
    ]
    items = [i["path"] for src in proj["sources"] for i in src["secret"]["items"]]
    assert [f"{TOKEN_DIR}/{p}" for p in items] == [
        TOKEN_FILE,
        SIGNING_KEY_FILE,
        METRICS_TOKEN_FILE,
    ]
    mounts = {m["name"]: m for m in container(dep)["volumeMounts"]}
    assert mounts["agent-token"] == {
        "name": "agent-token",
        "mountPath": TOKEN_DIR,
        "readOnly": True,
    }
    env = {e["name"]: e.get("value") for e in container(dep)["env"]}
    assert env[SIGNING_KEY_ENV] == SIGNING_KEY_FILE
    assert env[METRICS_TOKEN_ENV] == METRICS_TOKEN_FILE
    assert env[IMAGE_ENV] == s.image
    assert API_KEY_ENV not in env and "api-key" not in vols


def test_the_scrape_token_is_a_secret_of_its_own() -> None:
    sec = b.build_metrics_secret(tiny(), owner=OWNER)
    assert sec["metadata"]["name"] == "tiny-metrics-token"
    assert sec["metadata"]["ownerReferences"][0]["uid"] == OWNER["metadata"]["uid"]
    token = base64.b64decode(sec["data"][TOKEN_KEY])
    assert len(token) >= 32 and b.build_metrics_secret(tiny())["data"] != sec["data"]


def test_api_key_from_the_users_secret() -> None:
    s = tiny(apiKeySecretRef={"name": "my-keys", "key": "serve"})
    assert s.api_key_secret == ("my-keys", "serve")
    dep = deployment(s)
    vols = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    assert vols["api-key"]["secret"] == {
        "secretName": "my-keys",
        "items": [{"key": "serve", "path": API_KEY_KEY}],
        "defaultMode": 0o400,
    }
    mounts = {m["name"]: m for m in container(dep)["volumeMounts"]}
    assert mounts["api-key"] == {"name": "api-key", "mountPath": API_KEY_DIR, "readOnly": True}
    env = {e["name"]: e.get("value") for e in container(dep)["env"]}
    assert env[API_KEY_ENV] == API_KEY_FILE
    assert tiny(apiKeySecretRef={"name": "k"}).api_key_secret == ("k", "api-key")


def test_admin_tls_mounts_the_secret_passes_the_flags_and_probes_https() -> None:
    s = tiny(adminTLS={"secretName": "tiny-admin-tls"})
    assert s.admin_tls == AdminTLS("tiny-admin-tls", "tiny.ns.svc")  # the default name
    dep = deployment(s)
    pod = dep["spec"]["template"]
    vols = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert vols["admin-tls"]["secret"] == {
        "secretName": "tiny-admin-tls",
        # The certificate and key only: ca.crt is the operator's, not the pod's.
        "items": [{"key": "tls.crt", "path": "tls.crt"}, {"key": "tls.key", "path": "tls.key"}],
        "defaultMode": 0o400,
    }
    mounts = {m["name"]: m for m in container(dep)["volumeMounts"]}
    assert mounts["admin-tls"] == {
        "name": "admin-tls",
        "mountPath": admin_tls.DIR,
        "readOnly": True,
    }
    cmd = container(dep)["command"]
    assert cmd[cmd.index("--admin-tls-cert") + 1] == f"{admin_tls.DIR}/tls.crt"
    assert cmd[cmd.index("--admin-tls-key") + 1] == f"{admin_tls.DIR}/tls.key"
    for probe in ("readinessProbe", "livenessProbe"):
        assert container(dep)[probe]["httpGet"]["scheme"] == "HTTPS"
        assert container(dep)[probe]["httpGet"]["port"] == "admin"
    assert pod["metadata"]["annotations"][admin_tls.ANN_SERVER_NAME] == "tiny.ns.svc"
    assert admin_tls.pod_tls(pod) == admin_tls.PodTLS("tiny-admin-tls", "tiny.ns.svc")
    # The certificate never reaches vLLM: a checkpoint made without TLS still fits.
    assert spec_fingerprint(s) == spec_fingerprint(tiny())


def test_admin_tls_server_name_and_required_secret() -> None:
    s = tiny(adminTLS={"secretName": "t", "serverName": "agents.example.internal"})
    assert s.admin_tls == AdminTLS("t", "agents.example.internal")
    pod = deployment(s)["spec"]["template"]
    assert pod["metadata"]["annotations"][admin_tls.ANN_SERVER_NAME] == "agents.example.internal"
    with pytest.raises(SpecError, match=r"spec.adminTLS.secretName is required"):
        tiny(adminTLS={"serverName": "x.y"})


def test_without_admin_tls_the_admin_port_is_plain_http() -> None:
    dep = deployment(tiny())
    pod = dep["spec"]["template"]
    assert "scheme" not in container(dep)["readinessProbe"]["httpGet"]
    assert "scheme" not in container(dep)["livenessProbe"]["httpGet"]
    assert "--admin-tls-cert" not in container(dep)["command"]
    assert "admin-tls" not in {v["name"] for v in pod["spec"]["volumes"]}
    assert admin_tls.ANN_SERVER_NAME not in pod["metadata"]["annotations"]
    assert admin_tls.pod_tls(pod) is None


@pytest.mark.parametrize("name", ["REKINDLE_IMAGE", "REKINDLE_CHECKPOINT", "REKINDLE_API_KEY_FILE"])
def test_env_the_operator_manages_is_refused(name: str) -> None:
    with pytest.raises(SpecError, match=f"spec.env sets {name}"):
        tiny(env=[{"name": name, "value": "x"}])


def test_a_node_cache_eviction_runs_on_that_node_without_any_privilege() -> None:
    """kubectl rekindle bench --scale-out's Job: the named node's agent drops its copy."""
    path = f"{CHECKPOINT_MOUNT}/c1-u1"
    job = b.build_cleanup_job(
        "ns", "c1", "u1", path, {}, "img", node="node-2", from_node_cache=True
    )
    pod = job["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["command"] == ["rekindle", "remove-checkpoint", "--from-node-cache", path]
    assert pod["nodeName"] == "node-2" and "affinity" not in pod
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert c["securityContext"]["runAsNonRoot"] is True
    assert [v["name"] for v in pod["volumes"]] == [c["volumeMounts"][0]["name"]]
    assert "emptyDir" in pod["volumes"][0]
