"""`kubectl rekindle` argument handling and the objects/patches it sends."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import pytest
from rekindle_operator import cluster_bench as bench
from rekindle_operator.kube import KubeError
from rekindle_operator.kubectl_plugin import (
    build_parser,
    checkpoint_object,
    format_status,
    main,
    restart_patch,
)


def parse(*argv: str) -> object:
    return build_parser().parse_args(list(argv))


def test_checkpoint_args() -> None:
    a = parse("-n", "prod", "checkpoint", "tiny", "--wait", "--timeout", "90")
    assert (a.cmd, a.name, a.wait, a.timeout, a.namespace) == (
        "checkpoint",
        "tiny",
        True,
        90.0,
        "prod",
    )  # type: ignore[attr-defined]


def test_bench_args() -> None:
    a = parse("bench", "tiny", "--trials", "5", "--json", "r.json", "--plot", "r.png")
    assert a.trials == 5 and str(a.json) == "r.json" and str(a.plot) == "r.png"  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "argv",
    [
        ("bench", "tiny", "--trials", "0"),
        ("bench", "tiny", "--trials", "x"),
        ("checkpoint", "tiny", "--timeout", "-1"),
        ("checkpoint",),
        ("frobnicate", "tiny"),
        ("status", "tiny", "-o", "yaml"),
    ],
)
def test_bad_args_exit_with_usage(
    argv: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        parse(*argv)
    assert e.value.code == 2
    assert "usage" in capsys.readouterr().err


def test_checkpoint_object() -> None:
    o = checkpoint_object("tiny", "ns", None, None, retain=False, timeout=30)
    assert o["kind"] == "Checkpoint" and o["metadata"]["name"].startswith("tiny-")
    assert o["spec"] == {
        "inferenceService": "tiny",
        "deletionPolicy": "Delete",
        "timeoutSeconds": 60,
    }
    o = checkpoint_object("tiny", "ns", "mine", "tiny-abc", retain=True, timeout=600)
    assert o["metadata"]["name"] == "mine"
    assert o["spec"]["pod"] == "tiny-abc" and o["spec"]["deletionPolicy"] == "Retain"


def test_restart_patch() -> None:
    assert restart_patch("T") == {"metadata": {"annotations": {"rekindle.dev/restartedAt": "T"}}}


def test_format_status_mentions_boot_paths_and_stale() -> None:
    isvc = {
        "metadata": {"name": "tiny"},
        "status": {
            "phase": "Ready",
            "replicas": 1,
            "readyReplicas": 1,
            "checkpoint": "c2",
            "sharedMemory": {"size": "1216Mi", "totalBytes": 1216 * 2**20},
            "pods": [
                {
                    "name": "tiny-a",
                    "origin": "booted",
                    "reason": "checksum_mismatch",
                    "ready": True,
                    "agentReadySeconds": 41.2,
                    "node": "gpu-1",
                    "coldStartPath": "boot",
                }
            ],
            "nodes": [
                {
                    "name": "gpu-1",
                    "replicas": 1,
                    "ready": 1,
                    "checkpointCached": False,
                    "coldStartSeconds": {"boot": 40.0},
                },
                {
                    "name": "gpu-2",
                    "replicas": 1,
                    "ready": 1,
                    "checkpointCached": True,
                    "residentPercent": 88.5,
                    "coldStartSeconds": {"restoreAfterPull": 6.2},
                },
            ],
            "lastColdStartSeconds": {"booted": 40.0, "restored": 3.1},
        },
    }
    ck = [
        {
            "metadata": {"name": "c1", "creationTimestamp": "1"},
            "spec": {"inferenceService": "tiny"},
            "status": {"phase": "Ready", "stale": True},
        },
        {
            "metadata": {"name": "c2", "creationTimestamp": "2"},
            "spec": {"inferenceService": "tiny"},
            "status": {
                "phase": "Ready",
                "node": "gpu-2",
                "cachedNodes": ["gpu-3", "gpu-1"],
                "publication": "published to http://s3:8333/ck/c2/ (9 bytes, 0.1 s)",
            },
        },
    ]
    text = format_status(isvc, ck)
    assert "c2: Ready on gpu-1, gpu-2, gpu-3\n      published to http://s3:8333/ck/c2/" in text
    assert "pod tiny-a on gpu-1: boot (checksum_mismatch)" in text
    assert "gpu-1: 1/1 ready, checkpoint not proven here, slowest cold start: boot 40.0s" in text
    assert (
        "gpu-2: 1/1 ready, checkpoint cached (88.5% resident), slowest cold start: "
        "restoreAfterPull 6.2s"
    ) in text
    assert "c1: Ready STALE" in text
    assert "restored 3.1s" in text
    assert "agent ready in 41.2s" in text


def test_bench_summary_and_table() -> None:
    trials = [bench.Trial("naive", i, 30.0 + i, 31.0 + i, "booted", "", 28.0) for i in range(3)] + [
        bench.Trial("restore", i, 3.0 + i, 3.5 + i, "restored", "", 1.5) for i in range(3)
    ]
    s = bench.summarize_trials(trials)
    assert s["naive"]["first_token_s"]["median"] == 32.0
    assert s["restore"]["ready_s"]["min"] == 3.0 and s["restore"]["ready_s"]["max"] == 5.0
    assert s["restore"]["agent_ready_s"]["median"] == 1.5
    text = bench.table(s)
    assert "speedup" in text and f"{32.0 / 4.5:.1f}x" in text
    assert "agent ready" in text and "1.50s [1.50-1.50]" in text
    assert "p25" in bench.summarize([1.0, 2.0, 3.0, 4.0])


def test_bench_without_the_agents_figure() -> None:
    trials = [bench.Trial("naive", 0, 30.0, 31.0, "booted", "")]
    s = bench.summarize_trials(trials)
    assert "agent_ready_s" not in s["naive"]
    assert "speedup" not in bench.table(s)


def test_bench_writes_json_and_png(tmp_path: Path) -> None:
    trials = [
        bench.Trial("naive", 0, 30.0, 31.0, "booted", "", 29.0),
        bench.Trial("restore", 0, 3.0, 3.5, "restored", "", 2.0),
    ]
    bench.write_json(tmp_path / "r.json", trials, {"command": "kubectl rekindle bench tiny"})
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["summary"]["restore"]["first_token_s"]["median"] == 3.5
    assert [t["origin"] for t in doc["trials"]] == ["booted", "restored"]
    assert [t["agent_ready_s"] for t in doc["trials"]] == [29.0, 2.0]
    bench.plot(trials, tmp_path / "r.png", "t")
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bench.plot(trials[:1], tmp_path / "one.png", "t")
    assert (tmp_path / "one.png").stat().st_size > 0


class ProxyKube:
    """Records what the bench asks the apiserver; answers like the service proxy."""

    def __init__(self, answers: list[Any]) -> None:
        self.answers = answers
        self.requests: list[tuple[str, str, Any]] = []
        self.pod: dict[str, Any] = {"metadata": {"annotations": {}}}

    def request(self, method: str, path: str, body: Any = None, **_: Any) -> Any:
        self.requests.append((method, path, body))
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    def get(self, kind: str, ns: str, name: str) -> dict[str, Any]:
        return self.pod


def test_first_token_goes_through_the_apiserver_service_proxy() -> None:
    from rekindle_operator.pods import service_completion

    kube = ProxyKube([KubeError(503, "no endpoints available"), {"choices": [{"text": "x"}]}])
    assert not service_completion(kube, "ns", "tiny", "tiny")  # type: ignore[arg-type]
    assert service_completion(kube, "ns", "tiny", "tiny")  # type: ignore[arg-type]
    method, path, body = kube.requests[-1]
    assert method == "POST"
    assert path == "/api/v1/namespaces/ns/services/tiny:8000/proxy/v1/completions"
    assert body["model"] == "tiny" and body["max_tokens"] == 1


def test_pod_report_reads_what_the_operator_mirrored() -> None:
    kube = ProxyKube([])
    kube.pod["metadata"]["annotations"] = {
        "rekindle.dev/boot-path": "restored",
        "rekindle.dev/agent-ready-seconds": "2.250",
    }
    assert bench.pod_report(kube, "ns", "p") == ("restored", "", 2.25)  # type: ignore[arg-type]
    kube.pod["metadata"]["annotations"] = {"rekindle.dev/boot-path": "booted"}
    assert bench.pod_report(kube, "ns", "p", wait_s=0) == ("booted", "", None)  # type: ignore[arg-type]


def test_bench_refuses_a_service_with_an_api_key() -> None:
    """The apiserver's service proxy drops Authorization: say so instead of timing out."""
    from rekindle_operator import cluster_bench

    class OneIsvc:
        def get(self, kind: str, ns: str, name: str) -> dict:
            return {
                "spec": {"model": {}, "apiKeySecretRef": {"name": "k", "key": "key"}},
                "status": {"checkpoint": "c1"},
            }

    with pytest.raises(SystemExit, match="apiKeySecretRef"):
        cluster_bench.run(OneIsvc(), "ns", "tiny", 1)  # type: ignore[arg-type]


# --- connection settings and errors, as kubectl users expect them ----------------------
def _kubeconfig(path: Path, servers: dict[str, str], current: str) -> Path:
    """A kubeconfig with one context per server (namespace team-NAME)."""
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": n, "cluster": {"server": s}} for n, s in servers.items()],
        "users": [{"name": "u", "user": {"token": "t0ken"}}],
        "contexts": [
            {"name": n, "context": {"cluster": n, "user": "u", "namespace": f"team-{n}"}}
            for n in servers
        ],
        "current-context": current,
    }
    path.write_text(json.dumps(doc))  # JSON is YAML
    return path


def test_no_kubeconfig_is_one_line_and_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "absent"))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert main(["status", "tiny"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no kubeconfig found") and err.count("\n") == 1, err
    assert "KUBECONFIG" in err and "--kubeconfig" in err
    # A context that the kubeconfig lacks: the same exit status, the loader's reason.
    kc = _kubeconfig(tmp_path / "kc", {"a": "http://127.0.0.1:1"}, "a")
    assert main(["--kubeconfig", str(kc), "--context", "zz", "status", "tiny"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: kubeconfig:") and "zz" in err and err.count("\n") == 1, err


def test_the_context_picks_server_and_namespace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A loopback stand-in for an apiserver answers 404 to everything and records what it
    was asked: --context b reaches b's server, in b's namespace; the current context
    (a, nothing listening) is unreachable: one line, exit status 3."""
    seen: list[tuple[str, str | None]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append((self.path, self.headers.get("Authorization")))
            body = json.dumps({"kind": "Status", "code": 404, "message": "not found"}).encode()
            self.send_response(404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        kc = _kubeconfig(
            tmp_path / "kc", {"a": "http://127.0.0.1:1", "b": f"http://127.0.0.1:{port}"}, "a"
        )
        assert main(["--kubeconfig", str(kc), "status", "tiny"]) == 3
        err = capsys.readouterr().err
        assert err.startswith("error: cannot reach the cluster") and "port=1" in err, err
        assert err.count("\n") == 1 and not seen
        with pytest.raises(SystemExit, match="not found in namespace team-b"):
            main(["--kubeconfig", str(kc), "--context", "b", "status", "tiny"])
        assert seen == [
            (
                "/apis/rekindle.dev/v1alpha1/namespaces/team-b/inferenceservices/tiny",
                "Bearer t0ken",
            )
        ]
    finally:
        server.shutdown()
        server.server_close()


def test_bench_asks_before_it_disturbs_a_serving_service(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from rekindle_operator import kubectl_plugin as plugin

    class Isvc:
        def __init__(self, ready: int) -> None:
            self.ready = ready

        def get(self, kind: str, ns: str, name: str) -> dict[str, Any]:
            return {"status": {"readyReplicas": self.ready}}

    assert plugin.bench_disturbs(Isvc(0), "ns", "tiny", scale_out=False) == ""
    said = plugin.bench_disturbs(Isvc(2), "ns", "tiny", scale_out=False)
    assert "serves 2 ready replica(s)" in said and "scales it to 0" in said
    assert "cordoned" in plugin.bench_disturbs(Isvc(0), "ns", "tiny", scale_out=True)
    monkeypatch.setattr(plugin, "_kube", lambda args: Isvc(1))
    ran: list[str] = []
    monkeypatch.setattr("rekindle_operator.cluster_bench.run", lambda *a, **k: ran.append("x"))
    # Not a terminal: refused with how to go on, nothing run.
    monkeypatch.setattr("sys.stdin.isatty", lambda: False)
    assert plugin.main(["-n", "ns", "bench", "tiny"]) == plugin.EXIT_USAGE
    assert "pass --yes" in capsys.readouterr().err and ran == []
    # A terminal: the answer decides.
    monkeypatch.setattr("sys.stdin.isatty", lambda: True)
    monkeypatch.setattr("builtins.input", lambda prompt: "n")
    assert plugin.main(["-n", "ns", "bench", "tiny"]) == plugin.EXIT_USAGE and ran == []
