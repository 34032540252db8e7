"""The multimodal processor cache on the real local cluster, with images.

The project's tiny vision-language model (/models/tiny-vlm in the CPU runtime
image, rekindle_dev.vlm) served through the operator with spec.multimodal:
- shm cache on: the pod's /dev/shm is the operator's computed size, vLLM has
  the shm flags, its ring buffer sits in /dev/shm at the configured size, a
  chat request with an image is answered, and the same image sent again is a
  hit of vLLM's cache (its counters, read through the agent's admin /metrics)
  with the same greedy answer;
- multimodal.enabled false: no shm flags, and images are still served;
- the failure the operator prevents: the same image and model started as a
  plain Pod, with the container runtime's default 64 MiB /dev/shm, exits at
  start (vLLM's CPU build checks the free space before creating its message
  queues: "Insufficient space in /dev/shm ...: 160 MiB required, 64 MiB
  free"), while the operator's pod of the same model serves images.
One module fixture starts all three at once (both InferenceServices and the
plain pod), so their vLLMs start side by side (half a core requested each: the
node's 2 cores fit them); a test run alone still gets all three. No test
deletes them: the module's fixtures do, at the end.
"""

from __future__ import annotations

import base64
import io
import itertools
import json
from pathlib import Path
from typing import Any

import pytest
from rekindle_operator.shm_sizing import shm_need
from rekindle_operator.spec import parse_spec

from tests.cluster.cluster_tools import kubectl, wait_until
from tests.cluster.operator_fixtures import (
    RUNTIME_IMAGE,
    OperatorProcess,
    apply,
    get,
    host_dir,
    http_json,
    isvc_manifest,
    op_namespace,
    operator,
    pods_of,
    require_runtime_image,
    service_url,
    wait_status,
)

__all__ = ["host_dir", "op_namespace", "operator"]  # fixtures used by name

pytestmark = pytest.mark.cluster

MODEL = "/models/tiny-vlm"
SERVED = "vlm"
CACHE = "256Mi"
CACHE_BYTES = 256 * 2**20
MAX_OBJECT_MIB = 16
# What Python's multiprocessing.shared_memory adds in front of vLLM's ring buffer.
RING_HEADER = 32


def vlm_manifest(name: str, host_path: str, multimodal: dict[str, Any]) -> dict[str, Any]:
    """The tiny-cpu example, serving the tiny VLM with small resources (the CPU is a
    request, not a limit: half a core each lets two boot side by side)."""
    return isvc_manifest(
        name,
        host_path,
        model={"source": MODEL, "servedName": SERVED},
        resources={"cpu": "500m", "memory": "4Gi"},
        maxModelLen=512,
        multimodal=multimodal,
    )


def png(seed: int, size: int = 96) -> str:
    """A small locally drawn image as a data URL (no network)."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (size, size), (seed * 40 % 256, 90, 200))
    ImageDraw.Draw(img).ellipse(
        (10, 10 + seed, size - 10, size - 20), fill=(250, seed * 70 % 256, 0)
    )
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def ask(url: str, image: str) -> dict[str, Any]:
    """A greedy chat completion with one image."""
    body = {
        "model": SERVED,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": image}},
                    {"type": "text", "text": "What is in this picture?"},
                ],
            }
        ],
        "max_tokens": 8,
        "temperature": 0.0,
    }
    out: dict[str, Any] = http_json(f"{url}/v1/chat/completions", body, timeout=120)
    return out


def ready(name: str, ns: str, timeout: float = 900) -> dict[str, Any]:
    def ok(o: dict[str, Any]) -> bool:
        st = o.get("status") or {}
        pods = st.get("pods") or []
        return st.get("phase") == "Ready" and len(pods) == 1 and pods[0].get("ready") is True

    return wait_status("rkis", name, ns, "1 replica Ready", ok, timeout)


def service(name: str, ns: str) -> str:
    url = service_url(name, ns)
    wait_until("the Service to answer", lambda: _answers(url), 60)
    return url


def _answers(url: str) -> bool:
    try:
        http_json(f"{url}/v1/models", timeout=5)
        return True
    except OSError:
        return False


def pod_exec(ns: str, pod: str, *cmd: str) -> str:
    r = kubectl("exec", "-n", ns, pod, "-c", "vllm", "--", *cmd, check=False)
    assert r.returncode == 0, f"{cmd}: {r.stderr}"
    return r.stdout


def vllm_cmdline(ns: str, pod: str) -> list[str]:
    """vLLM's API server argv, from /proc in the pod."""
    script = (
        "pid=$(pgrep -f -o vllm.entrypoints.openai.api_server) && "
        "tr '\\0' '\\n' < /proc/$pid/cmdline"
    )
    return pod_exec(ns, pod, "sh", "-c", script).splitlines()


def admin_metrics(ns: str, pod: str) -> str:
    """The agent's admin /metrics (vLLM's vllm:* families appended), as the operator reads."""
    code = (
        "import urllib.request as u;"
        "t=open('/var/run/rekindle/token').read().strip();"
        "r=u.Request('http://127.0.0.1:8081/metrics',headers={'Authorization':'Bearer '+t});"
        "print(u.urlopen(r,timeout=10).read().decode())"
    )
    return pod_exec(ns, pod, "python3", "-c", code)


def counter(text: str, name: str) -> float:
    """A Prometheus counter summed over its labels (exposed as NAME_total)."""
    total = 0.0
    for line in text.splitlines():
        metric, _, value = line.partition(" ")
        if metric.split("{", 1)[0] in (name, f"{name}_total") and value:
            total += float(value.split()[0])
    return total


@pytest.fixture(scope="module")
def applied(host_dir: Path, operator: OperatorProcess, op_namespace: str) -> None:
    """What the module runs, started at once: both InferenceServices (shm cache on,
    small; multimodal off) and the plain pod. The operator fixture deletes the services
    when the module ends, the namespace's deletion the pod."""
    require_runtime_image()
    mm = {"enabled": True, "shmCache": True, "cacheSize": CACHE, "maxObjectMiB": MAX_OBJECT_MIB}
    for name, multimodal in (("vlm", mm), ("vlm-off", {"enabled": False})):
        r = apply(vlm_manifest(name, str(host_dir), multimodal), op_namespace)
        assert r.returncode == 0, r.stderr
    r = apply(plain_pod(PLAIN), op_namespace)
    assert r.returncode == 0, r.stderr


def serving(name: str, ns: str) -> dict[str, Any]:
    """Once its one replica is Ready: the InferenceService, its pod's name, the Service URL."""
    obj = ready(name, ns)
    (pod,) = pods_of(name, ns)
    return {"isvc": obj, "pod": pod["metadata"]["name"], "url": service(name, ns)}


@pytest.fixture(scope="module")
def cached(applied: None, op_namespace: str) -> dict[str, Any]:
    """The tiny VLM with vLLM's shm cache on."""
    return serving("vlm", op_namespace)


@pytest.fixture(scope="module")
def uncached(applied: None, op_namespace: str) -> dict[str, Any]:
    """The tiny VLM with spec.multimodal.enabled false."""
    return serving("vlm-off", op_namespace)


def test_pod_has_computed_dev_shm_shm_flags_and_ring_buffer(
    cached: dict[str, Any], op_namespace: str
) -> None:
    ns, pod = op_namespace, cached["pod"]
    spec = parse_spec("vlm", ns, cached["isvc"]["spec"])
    need = shm_need(spec)
    assert need.multimodal_cache == CACHE_BYTES + RING_HEADER
    df = pod_exec(ns, pod, "df", "-k", "/dev/shm")
    assert int(df.splitlines()[-1].split()[1]) * 1024 == need.total
    argv = vllm_cmdline(ns, pod)
    flags = dict(itertools.pairwise(argv))
    assert flags.get("--mm-processor-cache-type") == "shm", argv
    assert flags.get("--mm-processor-cache-gb") == "0.25", argv
    assert flags.get("--mm-shm-cache-max-object-size-mb") == str(MAX_OBJECT_MIB), argv
    # vLLM's ring buffer: one POSIX shm object of the cache's size plus its header.
    sizes = pod_exec(ns, pod, "sh", "-c", "stat -c '%s %n' /dev/shm/*").splitlines()
    assert any(int(s.split()[0]) == CACHE_BYTES + RING_HEADER for s in sizes), sizes


QUERIES, HITS = "vllm:mm_cache_queries", "vllm:mm_cache_hits"


def metrics_after(ns: str, pod: str, earlier: str) -> str:
    """The admin /metrics once vLLM has counted a multimodal cache query since `earlier`.

    vLLM exports the cache's counters from its output loop, which may run after the
    reply went out: a read right after the reply could miss the request, and a check
    that a counter did not move would then prove nothing."""
    out = ""

    def counted() -> bool:
        nonlocal out
        out = admin_metrics(ns, pod)
        return counter(out, QUERIES) > counter(earlier, QUERIES)

    wait_until("vLLM to count the request's multimodal cache query", counted, 60)
    return out


def test_image_is_served_and_a_repeat_hits_the_shm_cache(
    cached: dict[str, Any], op_namespace: str
) -> None:
    ns, pod, url = op_namespace, cached["pod"], cached["url"]
    image = png(1)
    before = admin_metrics(ns, pod)
    first = ask(url, image)
    mid = metrics_after(ns, pod, before)
    second = ask(url, image)
    after = metrics_after(ns, pod, mid)
    assert first["usage"]["completion_tokens"] > 0
    assert first["usage"]["prompt_tokens"] > 50, "the image's placeholder tokens are missing"
    # Greedy decoding of fixed weights: the cached image gives the same answer.
    assert second["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]

    def delta(a: str, b: str, name: str) -> float:
        return counter(b, name) - counter(a, name)

    # One image per request: one query each; the new image misses, its repeat hits.
    assert (delta(before, mid, QUERIES), delta(before, mid, HITS)) == (1, 0), mid
    assert (delta(mid, after, QUERIES), delta(mid, after, HITS)) == (1, 1), after
    # A different image is processed, not served from the cache.
    third = ask(url, png(2))
    assert third["usage"]["completion_tokens"] > 0
    last = metrics_after(ns, pod, after)
    assert (delta(after, last, QUERIES), delta(after, last, HITS)) == (1, 0), last


def plain_pod(name: str) -> dict[str, Any]:
    """The runtime image running vLLM on the tiny VLM as the agent would, without the
    operator: no /dev/shm volume, so the container runtime's default (64 MiB) applies."""
    argv = [
        "python3",
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        MODEL,
        "--served-model-name",
        SERVED,
        "--max-model-len",
        "512",
        "--enforce-eager",
        "--mm-processor-cache-type",
        "shm",
        "--mm-processor-cache-gb",
        "0.25",
        "--mm-shm-cache-max-object-size-mb",
        str(MAX_OBJECT_MIB),
    ]
    env = {
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 5,
            "containers": [
                {
                    "name": "vllm",
                    "image": RUNTIME_IMAGE,
                    "imagePullPolicy": "Never",
                    "command": argv,
                    "env": [{"name": k, "value": v} for k, v in env.items()],
                    "resources": {
                        "requests": {"cpu": "500m", "memory": "2Gi"},
                        "limits": {"memory": "3Gi"},
                    },
                }
            ],
        },
    }


PLAIN = "plain-vlm"
# What vLLM's CPU build says when /dev/shm cannot hold its engine message queues
# (it checks the free space before creating each one, and exits).
SHM_ERROR = "Insufficient space in /dev/shm"


def terminated(pod: dict[str, Any]) -> dict[str, Any] | None:
    """The container's termination state, once it has ended."""
    for c in (pod.get("status") or {}).get("containerStatuses") or []:
        state = (c.get("state") or {}).get("terminated")
        if state:
            return dict(state)
    return None


def test_plain_pod_with_default_dev_shm_fails_where_the_operator_pod_serves(
    applied: None, cached: dict[str, Any], op_namespace: str
) -> None:
    """The same image, model and vLLM flags as the operator's pod (`cached`), started
    as a plain Pod: the default /dev/shm is too small; the operator's pod serves."""
    ns, name = op_namespace, PLAIN
    wait_until(
        "the plain pod to end",
        lambda: terminated(get("pod", name, ns) or {}) is not None,
        600,
        namespace=ns,
    )
    state = terminated(get("pod", name, ns) or {}) or {}
    logs = kubectl("logs", "-n", ns, name, check=False).stdout
    assert state.get("exitCode") != 0, state
    assert "Application startup complete" not in logs, logs[-4000:]
    # The actual error: a queue of 160 MiB does not fit in the 64 MiB default.
    line = _first_line(logs, SHM_ERROR)
    assert line, f"no /dev/shm error in the log (exit {state}):\n{logs[-4000:]}"
    assert "64 MiB free" in line, line
    print(f"plain pod: exit {state.get('exitCode')} ({state.get('reason')}): {line}")
    # The operator's pod of the same model: /dev/shm sized past 64 MiB, and it serves.
    st = cached["isvc"]["status"]["sharedMemory"]
    assert st["totalBytes"] > 64 * 2**20, json.dumps(st)
    out = ask(cached["url"], png(4))
    assert out["usage"]["completion_tokens"] > 0


def _first_line(text: str, needle: str) -> str:
    return next((ln for ln in text.splitlines() if needle in ln), "")


def test_multimodal_disabled_has_no_shm_flags_and_serves(
    uncached: dict[str, Any], op_namespace: str
) -> None:
    ns, name = op_namespace, uncached["pod"]
    argv = vllm_cmdline(ns, name)
    assert not [a for a in argv if a.startswith("--mm-")], argv
    need = shm_need(parse_spec("vlm-off", ns, uncached["isvc"]["spec"]))
    assert need.multimodal_cache == 0
    df = pod_exec(ns, name, "df", "-k", "/dev/shm")
    assert int(df.splitlines()[-1].split()[1]) * 1024 == need.total
    out = ask(uncached["url"], png(3))
    assert out["usage"]["completion_tokens"] > 0
