"""vLLM's shared-memory multimodal processor cache, fed real images, through the agent.

Each agent runs like a pod: PID 1 of a fresh PID + mount namespace whose
/dev/shm is its own tmpfs, of the size the test chooses. The model is the
project's generated LLaVA (rekindle_dev.vlm) with large images: 896 px in
112 px patches is still 64 placeholder tokens per image, but each processed
image puts 3 x 896 x 896 bf16 values (4.6 MiB) into the cache's ring buffer,
so a few dozen requests write more than an undersized /dev/shm holds. (The
default 224 px model writes 294 KiB per image: the same overflow would take
over a thousand requests on this machine.)

What is shown, for real:
- an image sent twice is a hit of vLLM's own cache counters the second time,
  with the same greedy answer;
- the ring buffer is /dev/shm/vllm_mm_* of --mm-processor-cache-gb GiB + 32 bytes;
- with /dev/shm as the operator sizes it (shm_sizing.shm_need) a load that writes
  more than UNDERSIZED_SHM into the cache serves; the same load against a
  /dev/shm of UNDERSIZED_SHM (large enough for vLLM's message queues, whose
  start-up check passes) kills vLLM: tmpfs allocates lazily, so the writer
  takes a SIGBUS when it touches a page past the limit;
- a checkpoint of a server with a warm cache saves the ring buffer's written
  pages with the other /dev/shm files; the restore recreates them before CRIU
  maps them again, so the restored tree's cache index (in the API process's
  memory) and the buffer agree: the same image is a hit, with the same answer,
  and new images are cached as before.

The sized agent's whole life (images, the fill, the checkpoint, the restore in
a new pod) is one module fixture that records what each step saw; each test
asserts on its part, so any of them runs alone.
"""

from __future__ import annotations

import base64
import io
import json
import os
import random
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from rekindle_dev.harness import AgentFactory, AgentProc
from rekindle_dev.vlm import TinyVlmSpec, generate_tiny_vlm
from rekindle_operator.shm_sizing import shm_need
from rekindle_operator.spec import parse_spec

pytestmark = [pytest.mark.vllm, pytest.mark.criu]

MiB = 1 << 20
GiB = 1 << 30
SERVED = "tiny-vlm"
SPEC = TinyVlmSpec(image_size=896, patch_size=112)
CACHE_GB = 0.5
ITEM_BYTES = 3 * SPEC.image_size**2 * 2  # the processed pixels, bf16, per image
# Above the 240 MiB vLLM checks for free before creating its largest message
# queue (a worker's response queue), below what the fill load writes.
UNDERSIZED_SHM = 320 * MiB
FILL_IMAGES = UNDERSIZED_SHM * 3 // 2 // ITEM_BYTES  # writes 1.5x the undersized /dev/shm


def sized_shm_bytes() -> int:
    """What the operator gives /dev/shm for this model's InferenceService (its own formula)."""
    spec = parse_spec(
        "vlm",
        "ns",
        {
            "model": {"source": "/models/tiny-vlm", "servedName": SERVED},
            "runtime": {"device": "cpu"},
            "multimodal": {"enabled": True, "cacheSize": f"{int(CACHE_GB * 1024)}Mi"},
        },
    )
    return shm_need(spec).total


def png_data_url(seed: int) -> str:
    """A distinct 16x16 PNG per seed, made here (no network), as a data URL."""
    from PIL import Image

    rng = random.Random(seed)
    img = Image.new("RGB", (16, 16))
    img.putdata([(rng.randrange(256), rng.randrange(256), rng.randrange(256)) for _ in range(256)])
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def chat(agent: AgentProc, url: str, max_tokens: int = 8, timeout: float = 120) -> tuple[int, str]:
    """A greedy chat completion about the image at url: (HTTP status, body)."""
    body = {
        "model": SERVED,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": "What is in the image?"},
                ],
            }
        ],
    }
    return agent.request("POST", "/v1/chat/completions", body, timeout=timeout)


def ask(agent: AgentProc, seed: int, max_tokens: int = 8, timeout: float = 120) -> str:
    """A greedy chat completion about one image (sent through the agent's serve port)."""
    status, text = chat(agent, png_data_url(seed), max_tokens, timeout)
    if status != 200:
        raise RuntimeError(f"HTTP {status}: {text[:500]}")
    return str(json.loads(text)["choices"][0]["message"]["content"])


class MediaServer:
    """A loopback HTTP server with one PNG and a redirect to it; records what vLLM asks."""

    def __init__(self) -> None:
        png = base64.b64decode(png_data_url(7).split(",", 1)[1])
        seen = self.seen = []

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                seen.append(self.path)
                if self.path == "/img.png":
                    self.send_response(200)
                    self.send_header("Content-Type", "image/png")
                    self.send_header("Content-Length", str(len(png)))
                    self.end_headers()
                    self.wfile.write(png)
                elif self.path == "/redirect":
                    self.send_response(302)
                    self.send_header("Location", "/img.png")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                else:
                    self.send_error(404)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def url(self, host: str, path: str) -> str:
        return f"http://{host}:{self.httpd.server_address[1]}{path}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


# Where the sized agent may fetch media from (spec.multimodal.allowedMediaDomains).
MEDIA = {"allowed_media_domains": "127.0.0.1"}


def fill(agent: AgentProc, first_seed: int, n: int = FILL_IMAGES) -> list[str]:
    """n distinct images, 3 at a time; each outcome 'ok' or the error's text."""

    def one(seed: int) -> str:
        try:
            ask(agent, seed, max_tokens=1, timeout=60)
            return "ok"
        except Exception as e:
            return repr(e)

    with ThreadPoolExecutor(3) as pool:
        return list(pool.map(one, range(first_seed, first_seed + n)))


def mm_counters(factory: AgentFactory) -> tuple[float, float]:
    """(queries, hits) of vLLM's own multimodal cache counters, from vLLM's /metrics."""
    url = f"http://127.0.0.1:{factory.vllm_port}/metrics"
    with urllib.request.urlopen(url, timeout=30) as resp:
        text = resp.read().decode()
    values = {"vllm:mm_cache_queries_total": 0.0, "vllm:mm_cache_hits_total": 0.0}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in values:
            values[name] += float(line.rsplit(" ", 1)[1])
    return values["vllm:mm_cache_queries_total"], values["vllm:mm_cache_hits_total"]


def ring_buffers(agent: AgentProc) -> list[os.stat_result]:
    """The vllm_mm_* files in the agent's own /dev/shm (seen through its mount namespace)."""
    shm = Path(f"/proc/{agent.proc.pid}/root/dev/shm")
    return [p.stat() for p in sorted(shm.glob("vllm_mm_*"))]


def start_in_pod(factory: AgentFactory, name: str, shm_bytes: int, **overrides: Any) -> AgentProc:
    """Like factory.start(), with /dev/shm a tmpfs of shm_bytes (a pod's sized emptyDir)."""
    return factory.start(name=name, shm_size=shm_bytes, mm_shm_cache_gb=CACHE_GB, **overrides)


@pytest.fixture(scope="module")
def vlm_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate_tiny_vlm(tmp_path_factory.mktemp("models") / "tiny-vlm-896", SPEC)


def make_factory(base: Path, model: Path, criu_prefix: Path) -> AgentFactory:
    if os.geteuid() != 0:
        pytest.fail("the agent's vLLM tests need root (CRIU, namespaces, mounts)")
    return AgentFactory(base, model, criu_prefix / "patched" / "criu", served_name=SERVED)


def wait_not_ready(agent: AgentProc, timeout: float) -> str:
    """Wait until the agent leaves Ready (its vLLM died); returns its state and message."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = agent.status()
        if st.state != "Ready":
            return f"{st.state}: {st.message}"
        time.sleep(0.5)
    return "Ready"


def test_undersized_dev_shm_kills_vllm_under_image_load(
    tmp_path_factory: pytest.TempPathFactory, vlm_model: Path, criu_prefix: Path
) -> None:
    """The failure the operator's sizing prevents: vLLM starts, then dies mid-load.

    Kubernetes' default /dev/shm (64 MiB) fails vLLM's message-queue check at
    start, loudly; a /dev/shm that passes that check but is smaller than the
    multimodal cache fails later, when images arrive: the ring buffer is a
    sparse file, and writing a page past the tmpfs limit is a SIGBUS.
    """
    factory = make_factory(tmp_path_factory.mktemp("undersized"), vlm_model, criu_prefix)
    agent = start_in_pod(factory, "undersized", UNDERSIZED_SHM)
    try:
        agent.wait_ready(900)
        (ring,) = ring_buffers(agent)
        assert ring.st_size == int(CACHE_GB * GiB) + 32 > UNDERSIZED_SHM  # created: sparse
        outcomes = fill(agent, first_seed=10_000)
        state = wait_not_ready(agent, 60)
        vllm_log = (factory.run_dir / "vllm.log").read_text(errors="replace")
    finally:
        agent.stop()
        factory.stop_all()
    assert "ok" in outcomes, "no image was served before the cache outgrew /dev/shm"
    assert outcomes[-1] != "ok", "the whole load was served: /dev/shm was not too small"
    # The API server (the cache's only writer) took the SIGBUS, and the agent says so.
    assert state.startswith("Failed: vLLM exited unexpectedly (killed by SIGBUS"), (
        state,
        vllm_log[-3000:],
    )


@dataclass
class Deltas:
    """What one request moved vLLM's multimodal cache counters by."""

    queries: float
    hits: float


@dataclass
class SizedRun:
    """One agent in a /dev/shm sized by the operator's formula, then its restore: what each
    step saw (the tests below assert on it, each on its own)."""

    answers: dict[int, str] = field(default_factory=dict)  # greedy answer per image seed
    sights: list[Deltas] = field(default_factory=list)  # image 1, image 1 again, image 2
    second: str = ""  # image 1's answer the second time
    ring_after_two: os.stat_result | None = None
    shm_bytes: int = 0  # the pod's /dev/shm, as statvfs sees it
    fill: list[str] = field(default_factory=list)
    ring_after_fill: os.stat_result | None = None
    state_after_fill: str = ""
    warm: list[str] = field(default_factory=list)  # image 1 twice after the fill
    warm_hits: float = 0.0  # hits the second of those added
    ring_before: os.stat_result | None = None  # at the checkpoint
    manifest: dict[str, Any] = field(default_factory=dict)
    saved_blocks: int = 0  # the ring buffer's copy in the checkpoint, allocated bytes
    restored: dict[str, Any] = field(default_factory=dict)  # the restored agent's status
    ring_after: os.stat_result | None = None
    restored_answers: list[str] = field(default_factory=list)  # 1, then 3 twice
    restored_sights: list[Deltas] = field(default_factory=list)  # 1; 3 and 3 together
    restored_state: str = ""
    media: dict[str, tuple[int, str]] = field(default_factory=dict)  # case -> (status, body)
    media_seen: list[str] = field(default_factory=list)  # paths the media server was asked


def _sight(factory: AgentFactory, agent: AgentProc, seed: int) -> tuple[str, Deltas]:
    q0, h0 = mm_counters(factory)
    answer = ask(agent, seed)
    q1, h1 = mm_counters(factory)
    return answer, Deltas(q1 - q0, h1 - h0)


@pytest.fixture(scope="module")
def sized(tmp_path_factory: pytest.TempPathFactory, vlm_model: Path, criu_prefix: Path) -> SizedRun:
    """Boot in a /dev/shm the operator sized; two images; the fill load; a checkpoint of the
    warm server; a restore in a new pod of the same size; images again."""
    factory = make_factory(tmp_path_factory.mktemp("sized"), vlm_model, criu_prefix)
    r = SizedRun()
    try:
        agent = start_in_pod(factory, "sized", sized_shm_bytes(), **MEDIA)
        agent.wait_ready(900)
        r.answers[1], first = _sight(factory, agent, 1)
        r.second, again = _sight(factory, agent, 1)
        r.answers[2], _ = _sight(factory, agent, 2)
        r.sights = [first, again]
        media = MediaServer()
        try:
            cases = {
                "allowed": ("127.0.0.1", "/img.png"),
                "other_host": ("localhost", "/img.png"),
                "redirect": ("127.0.0.1", "/redirect"),
            }
            r.media = {k: chat(agent, media.url(*where)) for k, where in cases.items()}
            r.media_seen = list(media.seen)
        finally:
            media.close()
        (r.ring_after_two,) = ring_buffers(agent)
        shm = os.statvfs(f"/proc/{agent.proc.pid}/root/dev/shm")
        r.shm_bytes = shm.f_blocks * shm.f_frsize

        r.fill = fill(agent, first_seed=10_000)
        (r.ring_after_fill,) = ring_buffers(agent)
        r.state_after_fill = agent.status().state

        # The fill may have evicted image 1: send it again so it is in the cache.
        r.warm = [ask(agent, 1)]
        h0 = mm_counters(factory)[1]
        r.warm.append(ask(agent, 1))
        r.warm_hits = mm_counters(factory)[1] - h0
        (r.ring_before,) = ring_buffers(agent)
        ckpt = factory.checkpoints / "warm"
        r.manifest = dict(agent.client.checkpoint(str(ckpt), timeout=900))
        for f in r.manifest["shm_files"]:
            if str(f["name"]).startswith("vllm_mm_"):
                r.saved_blocks = (ckpt / "shm" / str(f["name"])).stat().st_blocks * 512
        agent.stop()  # its vLLM's port, shared like pods', is the restored one's

        restored = start_in_pod(
            factory, "restored", sized_shm_bytes(), restore_from=str(ckpt), **MEDIA
        )
        r.restored = dict(restored.wait_ready(600).raw)
        (r.ring_after,) = ring_buffers(restored)
        answer, deltas = _sight(factory, restored, 1)  # vLLM's counters came back with it
        r.restored_answers.append(answer)
        r.restored_sights.append(deltas)
        q0, h0 = mm_counters(factory)
        r.restored_answers += [ask(restored, 3), ask(restored, 3)]
        q1, h1 = mm_counters(factory)
        r.restored_sights.append(Deltas(q1 - q0, h1 - h0))
        r.restored_state = restored.status().state
    except BaseException:
        for a in factory.started:
            print(a.tail(100))
        raise
    finally:
        factory.stop_all()
        factory.remove_checkpoints()
    return r


def test_media_urls_come_only_from_allowed_hosts_and_never_by_redirect(sized: SizedRun) -> None:
    """vLLM's own checks, as the operator configures them (allowedMediaDomains, redirects off):
    a host outside the list is refused before any connection; a redirect is not followed."""
    assert sized.media["allowed"][0] == 200, sized.media
    assert sized.media["other_host"][0] == 400, sized.media
    assert "allowed domains" in sized.media["other_host"][1], sized.media
    assert sized.media["redirect"][0] >= 400, sized.media
    # localhost was never fetched; the redirect's target was never fetched after it.
    assert sized.media_seen == ["/img.png", "/redirect"], sized.media_seen


def test_same_image_twice_is_a_shm_cache_hit(sized: SizedRun) -> None:
    first, again = sized.sights
    assert (first.queries, first.hits) == (1, 0), "the first sight of an image is a miss"
    assert (again.queries, again.hits) == (1, 1), "the same image again is a hit"
    assert sized.second == sized.answers[1]
    # The image reaches the model: another image gives another greedy answer.
    assert sized.answers[2] != sized.answers[1]


def test_ring_buffer_is_in_dev_shm_at_the_configured_size(sized: SizedRun) -> None:
    ring = sized.ring_after_two
    assert ring is not None
    assert ring.st_size == int(CACHE_GB * GiB) + 32  # the data, then vLLM's 32-byte header
    # Sparse: only what images were written occupies memory (2 images so far).
    assert 2 * ITEM_BYTES <= ring.st_blocks * 512 < 8 * ITEM_BYTES
    assert sized.shm_bytes == sized_shm_bytes()


def test_operator_sized_dev_shm_serves_the_load_that_kills_an_undersized_one(
    sized: SizedRun,
) -> None:
    errors = [o for o in sized.fill if o != "ok"]
    assert not errors, errors[:3]
    assert len(sized.fill) == FILL_IMAGES
    # More than the undersized /dev/shm could hold went through the buffer.
    assert sized.ring_after_fill is not None
    assert sized.ring_after_fill.st_blocks * 512 > UNDERSIZED_SHM
    assert sized.state_after_fill == "Ready"


def test_checkpoint_and_restore_keep_a_warm_cache_consistent(sized: SizedRun) -> None:
    """The ring buffer's pages travel with the checkpoint; the restored cache still hits."""
    assert sized.warm == [sized.answers[1]] * 2 and sized.warm_hits == 1
    assert sized.ring_before is not None and sized.ring_after is not None
    saved = [f for f in sized.manifest["shm_files"] if str(f["name"]).startswith("vllm_mm_")]
    assert [f["size"] for f in saved] == [sized.ring_before.st_size]
    assert sized.saved_blocks >= ITEM_BYTES  # written pages, holes kept
    st = sized.restored
    assert st["origin"] == "restored" and st["last_fallback"] is None, st
    assert sized.ring_after.st_size == sized.ring_before.st_size
    restored_1, new, new_again = sized.restored_answers
    assert restored_1 == sized.answers[1]
    one, three = sized.restored_sights
    assert (one.queries, one.hits) == (1, 1), "the restored cache lost image 1"
    assert new_again == new
    assert (three.queries, three.hits) == (2, 1), "a new image after the restore is not cached"
    assert sized.restored_state == "Ready"
