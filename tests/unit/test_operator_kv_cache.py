"""spec.kvCache: prefix caching, the CPU KV offload and the shared KV chunk store, as pod specs.

What runs where (docs/caches.md, "KV cache reuse"): prefix caching everywhere;
the offload and the store (vLLM's OffloadingConnector, a CPU tier in front of
a file-system tier) on GPU only, because vLLM's CPU build refuses the offload
worker. So a CPU spec asking for either is refused with what to change, and a
GPU spec becomes a mounted store, an agent flag, and vLLM's
--kv-transfer-config.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from rekindle_agent import cli, config
from rekindle_agent.config import AgentConfig
from rekindle_agent.supervision.vllm_launch import vllm_options
from rekindle_contract.agent_args import AGENT_COMMAND, agent_argv
from rekindle_contract.vllm_argv import VllmOptions, kv_store_transfer_config, vllm_argv
from rekindle_operator import builders as b
from rekindle_operator.agent_command import KV_STORE_MOUNT, agent_args
from rekindle_operator.quantity import GiB
from rekindle_operator.shm_sizing import effective_shm_bytes, shm_need
from rekindle_operator.spec import IsvcSpec, KvStore, SpecError, parse_spec
from rekindle_operator.spec_fingerprint import spec_fingerprint

OWNER = {"kind": "InferenceService", "metadata": {"name": "m", "uid": "u-1"}}
PVC_STORE = {"pvc": {"claimName": "kv-chunks"}}


def gpu(**kv: Any) -> IsvcSpec:
    return parse_spec(
        "m",
        "ns",
        {
            "model": {"source": "/models/m"},
            "runtime": {"device": "gpu"},
            "resources": {"gpu": {"count": 1}},
            "kvCache": kv,
        },
    )


def cpu(**spec: Any) -> IsvcSpec:
    return parse_spec("m", "ns", {"model": {"source": "/models/m"}, **spec})


def pod(s: IsvcSpec) -> dict[str, Any]:
    dep = b.build_deployment(s, effective_shm_bytes(s, shm_need(s)), "fp", owner=OWNER)
    return dep["spec"]["template"]["spec"]


def agent_config(cmd: list[str]) -> AgentConfig:
    """The container's command through the agent's own parser, as the pod's agent reads it."""
    assert tuple(cmd[:2]) == AGENT_COMMAND
    ns = cli.build_parser().parse_args(cmd[1:])
    return config.from_args(ns, env={})


def vllm_of(s: IsvcSpec) -> list[str]:
    """vLLM's argv as the agent builds it from the container command the operator wrote."""
    cfg = dataclasses.replace(agent_config(b.agent_command(s)), worker_extension="none")
    return vllm_argv(vllm_options(cfg, env={}), python="python")


def transfer_config(argv: list[str]) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    return doc


# --- what the spec accepts -------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        (
            {"kvCache": {"cpuOffloadSize": "2Gi"}},
            "cpuOffloadSize needs spec.runtime.device gpu",
        ),
        (
            {"kvCache": {"sharedStore": PVC_STORE}},
            "sharedStore needs spec.runtime.device gpu",
        ),
        (
            {"kvCache": {"cpuOffloadSize": "2Gi", "sharedStore": PVC_STORE}},
            "cpuOffloadSize needs spec.runtime.device gpu",
        ),
    ],
)
def test_cpu_refuses_offload_and_store(spec: dict[str, Any], words: str) -> None:
    with pytest.raises(SpecError, match=words) as e:
        cpu(**spec)
    assert "CPU" in str(e.value)  # says why, not only what


def test_cpu_keeps_prefix_caching_and_a_zero_offload() -> None:
    s = cpu(kvCache={"prefixCaching": True, "cpuOffloadSize": "0"})
    assert s.prefix_caching and s.kv_offload_bytes == 0 and s.kv_store is None


def test_store_needs_the_cpu_offload_it_goes_through() -> None:
    with pytest.raises(SpecError, match="cpuOffloadSize above 0"):
        gpu(sharedStore=PVC_STORE)


@pytest.mark.parametrize(
    ("store", "words"),
    [
        ({}, "exactly one of pvc"),
        ({"pvc": {"claimName": "a"}, "hostPath": {"path": "/x"}}, "exactly one of pvc"),
        ({"pvc": {"readOnly": True}}, "claimName is required"),
        ({"hostPath": {"path": "relative/dir"}}, "absolute node path"),
        ({"hostPath": {"path": "/var/lib/../etc"}}, "without '..'"),
    ],
)
def test_store_volume_refusals(store: dict[str, Any], words: str) -> None:
    with pytest.raises(SpecError, match=words):
        gpu(cpuOffloadSize="4Gi", sharedStore=store)


def test_user_kv_transfer_config_collides_only_with_what_the_operator_configures() -> None:
    for form in (["--kv-transfer-config", "{}"], ["--kv-transfer-config={}"]):
        with pytest.raises(SpecError, match="remove one or the other"):
            parse_spec(
                "m",
                "ns",
                {
                    "model": {"source": "/models/m"},
                    "runtime": {"device": "gpu"},
                    "resources": {"gpu": {"count": 1}},
                    "kvCache": {"cpuOffloadSize": "1Gi"},
                    "vllmArgs": form,
                },
            )
    # Without offload or store the user may configure a connector (LMCache...) themselves.
    s = cpu(vllmArgs=["--kv-transfer-config", '{"kv_connector":"LMCacheConnectorV1"}'])
    assert "--kv-transfer-config" in vllm_of(s)


# --- what the pod gets -------------------------------------------------------------


def test_prefix_caching_off_reaches_vllm() -> None:
    assert "--no-enable-prefix-caching" in vllm_of(cpu(kvCache={"prefixCaching": False}))
    assert "--no-enable-prefix-caching" not in vllm_of(cpu())


def test_offload_alone_uses_vllms_native_backend() -> None:
    argv = vllm_of(gpu(cpuOffloadSize="3Gi"))
    assert argv[argv.index("--kv-offloading-backend") + 1] == "native"
    assert argv[argv.index("--kv-offloading-size") + 1] == "3"
    assert "--kv-transfer-config" not in argv
    assert KV_STORE_MOUNT not in json.dumps(pod(gpu(cpuOffloadSize="3Gi")))


def test_pvc_store_is_mounted_and_configured() -> None:
    s = gpu(cpuOffloadSize="4Gi", sharedStore=PVC_STORE)
    assert s.kv_store == KvStore(claim_name="kv-chunks")
    spec = pod(s)
    vols = {v["name"]: v for v in spec["volumes"]}
    assert vols[b.KV_STORE_VOLUME] == {
        "name": b.KV_STORE_VOLUME,
        "persistentVolumeClaim": {"claimName": "kv-chunks"},
    }
    (mount,) = [m for m in spec["containers"][0]["volumeMounts"] if m["name"] == b.KV_STORE_VOLUME]
    assert mount["mountPath"] == KV_STORE_MOUNT and not mount.get("readOnly")
    cmd = spec["containers"][0]["command"]
    assert cmd[cmd.index("--kv-store-dir") + 1] == KV_STORE_MOUNT
    argv = vllm_of(s)
    # The store replaces the plain offload flags: one connector, configured once.
    assert "--kv-offloading-backend" not in argv and "--kv-offloading-size" not in argv
    cfg = transfer_config(argv)
    assert cfg["kv_connector"] == "OffloadingConnector" and cfg["kv_role"] == "kv_both"
    extra = cfg["kv_connector_extra_config"]
    assert extra["spec_name"] == "TieringOffloadingSpec"
    assert extra["cpu_bytes_to_use"] == 4 * GiB
    assert extra["secondary_tiers"] == [{"type": "fs", "root_dir": KV_STORE_MOUNT}]


def test_host_path_store_is_a_node_directory() -> None:
    s = gpu(cpuOffloadSize="1Gi", sharedStore={"hostPath": {"path": "/var/lib/kv"}})
    vols = {v["name"]: v for v in pod(s)["volumes"]}
    assert vols[b.KV_STORE_VOLUME]["hostPath"] == {
        "path": "/var/lib/kv",
        "type": "DirectoryOrCreate",
    }
    assert transfer_config(vllm_of(s))["kv_connector_extra_config"]["cpu_bytes_to_use"] == GiB


def test_no_store_no_volume_and_no_flag() -> None:
    spec = pod(cpu())
    assert b.KV_STORE_VOLUME not in {v["name"] for v in spec["volumes"]}
    assert "--kv-store-dir" not in spec["containers"][0]["command"]
    assert agent_args(cpu()).kv_store_dir is None


def test_dev_shm_counts_the_cpu_tier_once() -> None:
    """The store's CPU tier is the offload region itself: /dev/shm grows by it, not twice."""
    plain = shm_need(gpu(cpuOffloadSize="4Gi"))
    stored = shm_need(gpu(cpuOffloadSize="4Gi", sharedStore=PVC_STORE))
    assert stored == plain and stored.kv_offload == 4 * GiB


def test_fingerprint_counts_the_store_not_its_volume() -> None:
    """A checkpoint of a pod without the connector never restores into one with it."""
    plain = spec_fingerprint(gpu(cpuOffloadSize="4Gi"))
    pvc = spec_fingerprint(gpu(cpuOffloadSize="4Gi", sharedStore=PVC_STORE))
    node = spec_fingerprint(gpu(cpuOffloadSize="4Gi", sharedStore={"hostPath": {"path": "/kv"}}))
    assert pvc != plain
    assert pvc == node


def test_contract_refuses_a_store_without_the_cpu_tier() -> None:
    with pytest.raises(ValueError, match="kv_offload_gb"):
        vllm_argv(VllmOptions(model="/m", device="cuda", kv_store_dir="/kv"))
    assert kv_store_transfer_config(1, "/kv")["kv_connector_extra_config"]["cpu_bytes_to_use"] == 1


def test_agent_flag_round_trips() -> None:
    cfg = agent_config(agent_argv(agent_args(gpu(cpuOffloadSize="2Gi", sharedStore=PVC_STORE))))
    assert cfg.kv_store_dir == KV_STORE_MOUNT and cfg.kv_offload_gb == 2.0


@pytest.mark.parametrize(
    "extra",
    [["--kv-store-dir", "/kv"], ["--kv-store-dir", "/kv", "--kv-offload-gb", "1"]],
)
def test_agent_refuses_a_store_it_cannot_run(extra: list[str]) -> None:
    """An agent started by hand (not by the operator) says what to change, before vLLM starts."""
    with pytest.raises(config.ConfigError, match="--kv-store-dir needs --device cuda"):
        agent_config([*AGENT_COMMAND, "--model", "/models/m", *extra])
