"""`kubectl rekindle gpu-check`: its dry run, its ranges and its reading of a cluster.

A real run needs a GPU node; what is tested here is what a dry run does in CI
(the plan, the objects validated by the operator's own parser, the results
file), the verdict logic, and how it counts free GPUs from the API's answers
(a recorded answer stands in for the apiserver: pure logic). The dry run
against a real cluster is in tests/cluster/test_operator_chart.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from rekindle_operator import gpu_check, kubectl_plugin
from rekindle_operator.gpu_check import Check, Options


def opts(**change: Any) -> Options:
    base: dict[str, Any] = {
        "namespace": "ns",
        "image": gpu_check.DRY_RUN_IMAGE,
        "model_source": "/models/smollm2",
        "served_name": "smollm2",
    }
    return Options(**{**base, **change})


def test_dry_run_without_a_cluster_prints_the_plan_and_writes_the_results(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "none"))
    monkeypatch.setenv("HOME", str(tmp_path))
    out = tmp_path / "r" / "gpu-check.json"
    rc = kubectl_plugin.main(["-n", "ns", "gpu-check", "--dry-run", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert text.startswith("SKIP    cluster: not reachable")
    assert "PASS    validate/InferenceService 1 x nvidia.com/gpu, TP 1" in text
    for i, step in enumerate(gpu_check.STEPS, 1):
        assert f"  {i}. {step.key}" in text
    assert "DRY-RUN\n" in text
    doc = json.loads(out.read_text())
    assert doc["verdict"] == "DRY-RUN" and doc["kind"] == "gpu-check"
    assert doc["command"] == f"kubectl rekindle -n ns gpu-check --dry-run --out {out}"
    assert [c["verdict"] for c in doc["checks"]] == ["PASS", "PASS"]
    assert set(doc["expect"]) == set(gpu_check.EXPECT)


def test_a_real_run_needs_the_gpu_image(capsys: pytest.CaptureFixture[str]) -> None:
    assert kubectl_plugin.main(["gpu-check"]) == kubectl_plugin.EXIT_USAGE
    assert "--image" in capsys.readouterr().err


def test_the_object_it_would_apply_is_checked_by_the_operators_parser() -> None:
    good = gpu_check.validate(opts())
    assert [c.verdict for c in good] == ["PASS", "PASS"]
    bad = gpu_check.validate(opts(model_source=""))
    assert bad[0].verdict == "FAIL" and "spec.model" in bad[0].note
    outcome, _ = gpu_check.run(None, opts(model_source=""), dry_run=True, progress=print)
    assert outcome == "FAIL"


def test_the_service_is_one_gpu_tp1_on_the_chosen_storage_and_node() -> None:
    obj = gpu_check.isvc_object(opts(node="gpu-node-1", storage="hostPath"))
    spec = obj["spec"]
    assert spec["resources"]["gpu"] == {"count": 1, "resourceName": "nvidia.com/gpu"}
    assert spec["runtime"]["device"] == "gpu" and "tensorParallelSize" not in spec
    assert spec["coldStart"]["storage"]["type"] == "hostPath"
    assert spec["podTemplate"]["spec"]["nodeSelector"] == {"kubernetes.io/hostname": "gpu-node-1"}
    assert gpu_check.isvc_object(opts())["spec"]["coldStart"]["storage"] == {"type": "node"}


@pytest.mark.parametrize(
    ("key", "value", "verdict"),
    [
        ("gpu_memory_after_sleep_gib", 0.4, "PASS"),
        ("gpu_memory_after_sleep_gib", 1.5, "FAIL"),
        ("restore_speedup", 2.0, "PASS"),
        ("restore_speedup", 1.9, "FAIL"),
        ("reload_gb_per_s", 0.5, "FAIL"),
    ],
)
def test_numbers_are_judged_against_their_range(key: str, value: float, verdict: str) -> None:
    c = gpu_check.judge("s", "n", value, key)
    assert c.verdict == verdict and c.expect == gpu_check.EXPECT[key].words()


def test_the_verdict_is_fail_on_any_fail_and_never_pass_in_a_dry_run() -> None:
    ok = [Check("a", "b", "PASS"), Check("a", "c", "SKIP")]
    assert gpu_check.verdict(ok, dry_run=False) == "PASS"
    assert gpu_check.verdict(ok, dry_run=True) == "DRY-RUN"
    assert gpu_check.verdict([*ok, Check("a", "d", "FAIL")], dry_run=True) == "FAIL"
    assert gpu_check.verdict(ok, dry_run=False, cpu=True) == "CPU-ONLY"  # never PASS off a GPU


def test_the_cpu_run_asks_for_no_gpu() -> None:
    spec = gpu_check.isvc_object(opts(cpu=True, storage="hostPath"))["spec"]
    assert spec["runtime"]["device"] == "cpu" and "gpu" not in spec["resources"]


class RecordedApi:
    """The apiserver's answers to the GETs gpu_nodes makes (pure logic under test)."""

    def __init__(self, nodes: list[dict[str, Any]], pods: dict[str, list[dict[str, Any]]]):
        self.nodes, self.pods = nodes, pods

    def request(self, method: str, path: str, query: dict[str, str] | None = None) -> Any:
        if path == "/api/v1/nodes":
            return {"items": self.nodes}
        assert path == "/api/v1/pods" and query is not None
        return {"items": self.pods.get(query["fieldSelector"].split("=", 1)[1], [])}


def node(name: str, gpus: str | None) -> dict[str, Any]:
    alloc = {"cpu": "16"} | ({"nvidia.com/gpu": gpus} if gpus else {})
    return {"metadata": {"name": name}, "status": {"allocatable": alloc}}


def pod(gpus: int, phase: str = "Running") -> dict[str, Any]:
    limits = {"nvidia.com/gpu": str(gpus)} if gpus else {}
    return {"spec": {"containers": [{"resources": {"limits": limits}}]}, "status": {"phase": phase}}


def test_free_gpus_are_allocatable_minus_what_running_pods_hold() -> None:
    api = RecordedApi(
        [node("cpu-only", None), node("a", "2"), node("b", "8")],
        {"a": [pod(1), pod(0)], "b": [pod(8), pod(4, "Succeeded")]},
    )
    got = {n.name: n.free for n in gpu_check.gpu_nodes(api, "nvidia.com/gpu")}  # type: ignore[arg-type]
    assert got == {"a": 1, "b": 0}
