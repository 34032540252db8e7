"""The CRDs in the chart: the contract HPA, kubectl and the operator rely on."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from rekindle_contract.vllm_argv import (
    MANAGED_VLLM_ALIASES,
    MANAGED_VLLM_FLAGS,
    MANAGED_VLLM_SWITCHES,
)
from rekindle_operator.constants import CKPT_PLURAL, GROUP, ISVC_PLURAL, VERSION

CRDS = Path(__file__).resolve().parents[2] / "charts" / "rekindle" / "files" / "crds"


def crd(plural: str) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((CRDS / f"{plural}.{GROUP}.yaml").read_text())
    return doc


def version(doc: dict[str, Any]) -> dict[str, Any]:
    (v,) = [v for v in doc["spec"]["versions"] if v["name"] == VERSION]
    return v  # type: ignore[no-any-return]


def rules(node: Any) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if isinstance(node, dict):
        out += node.get("x-kubernetes-validations", [])
        for v in node.values():
            out += rules(v)
    elif isinstance(node, list):
        for v in node:
            out += rules(v)
    return out


def test_isvc_scale_subresource_counts_all_replicas() -> None:
    v = version(crd(ISVC_PLURAL))
    scale = v["subresources"]["scale"]
    assert scale == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    assert "status" in v["subresources"]


def test_short_names_do_not_collide_with_kserve() -> None:
    assert "isvc" not in crd(ISVC_PLURAL)["spec"]["names"]["shortNames"]
    assert "rkcp" in crd(CKPT_PLURAL)["spec"]["names"]["shortNames"]


def test_schema_defaults_match_the_operator() -> None:
    from rekindle_operator.spec import IsvcSpec, Storage

    props = version(crd(ISVC_PLURAL))["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "properties"
    ]
    assert props["replicas"]["minimum"] == 0
    assert props["runtime"]["properties"]["device"]["default"] == IsvcSpec.device
    assert props["runtime"]["properties"]["image"]["default"] == IsvcSpec.image
    assert (
        props["multimodal"]["properties"]["maxObjectMiB"]["default"] == IsvcSpec.mm_max_object_mib
    )
    gpu = props["resources"]["properties"]["gpu"]["properties"]
    assert gpu["resourceName"]["default"] == IsvcSpec.gpu_resource
    assert "default" not in props["multimodal"]["properties"]["enabled"]  # unset: the agent decides
    cold = props["coldStart"]["properties"]
    assert cold["restorePolicy"]["default"] == IsvcSpec.restore_policy
    assert cold["storage"]["properties"]["deletionPolicy"]["default"] == Storage.deletion_policy


def test_cel_rules_have_messages_that_say_what_to_change() -> None:
    for plural in (ISVC_PLURAL, CKPT_PLURAL):
        for r in rules(version(crd(plural))["schema"]):
            msg = r.get("message") or r.get("messageExpression")
            assert msg, r
    isvc_rules = rules(version(crd(ISVC_PLURAL))["schema"])
    shm = [r for r in isvc_rules if "sharedMemory.size" in r["rule"] and "quantity(" in r["rule"]]
    assert shm and "Raise spec.sharedMemory.size" in shm[0]["messageExpression"]


def test_printer_columns() -> None:
    cols = {c["name"] for c in version(crd(ISVC_PLURAL))["additionalPrinterColumns"]}
    assert {"Replicas", "Ready", "Phase", "Checkpoint", "SHM"} <= cols
    cols = {c["name"] for c in version(crd(CKPT_PLURAL))["additionalPrinterColumns"]}
    assert {"InferenceService", "Phase", "Size", "Stale"} <= cols


def test_vllm_args_rule_refuses_exactly_the_managed_flags() -> None:
    """The CEL regex and vllm_argv()'s list of the flags it sets must not drift apart."""
    props = version(crd(ISVC_PLURAL))["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "properties"
    ]
    (rule,) = [r["rule"] for r in rules(props["vllmArgs"])]
    m = re.search(r"\^\((.*)\)\(=\.\*\)\?\$", rule)
    assert m, rule
    spelled = sorted(a.replace("[-_]", "-") for a in m.group(1).split("|"))
    negated = ["--no-" + s[2:] for s in MANAGED_VLLM_SWITCHES]
    assert spelled == sorted([*MANAGED_VLLM_FLAGS, *MANAGED_VLLM_ALIASES, *negated])
    pattern = re.compile(f"^({m.group(1)})(=.*)?$")
    for flag in MANAGED_VLLM_FLAGS:
        assert pattern.match(flag) and pattern.match(f"{flag}=1")
        assert pattern.match(flag[:2] + flag[2:].replace("-", "_"))  # vLLM reads _ as -
    assert pattern.match("-tp") and pattern.match("--served_model-name=x")
    assert pattern.match("--no_enable-sleep_mode")
    assert not pattern.match("--max-num-seqs") and not pattern.match("--portable")


def test_admin_tls_needs_a_secret_name() -> None:
    props = version(crd(ISVC_PLURAL))["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "properties"
    ]
    tls = props["adminTLS"]
    assert tls["required"] == ["secretName"]
    assert set(tls["properties"]) == {"secretName", "serverName"}
    dns = re.compile(tls["properties"]["serverName"]["pattern"])
    assert dns.match("tiny.ns.svc") and not dns.match("Tiny.ns.svc") and not dns.match("*.ns.svc")
    assert re.compile(tls["properties"]["secretName"]["pattern"]).match("tiny-admin-tls")
