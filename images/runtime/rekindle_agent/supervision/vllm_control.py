"""Talking to a running vLLM: release memory before a dump, wake and reload after a restore.

CPU: vLLM has no sleep mode there (`/sleep` and `/wake_up` do nothing), so
Rekindle's worker extension does the work over `/collective_rpc`:
  checkpoint  rekindle_dump_weights(dir) once, then rekindle_release_weights()
  restore     rekindle_reload_weights(dir), POST /reset_prefix_cache
GPU: vLLM's level-2 sleep discards the weights and the KV cache from the GPU
but keeps their virtual address ranges reserved; waking up a tag maps fresh
memory back at the same addresses, with undefined content:
  checkpoint  rekindle_dump_weights(dir), then POST /sleep?level=2 (cuda-checkpoint
              then moves what is left of device memory into the image)
  restore     POST /wake_up?tags=weights, rekindle_reload_weights(dir),
              POST /wake_up?tags=kv_cache, POST /reset_prefix_cache
The reload replaces vLLM's `reload_weights` (which re-reads the original model
files) with the flat dump made at checkpoint time.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rekindle_contract.rpc import DUMP_WEIGHTS, RELEASE_WEIGHTS, RELOAD_WEIGHTS


class VllmCallError(RuntimeError):
    def __init__(self, what: str, status: int | None, body: str) -> None:
        super().__init__(f"{what}: HTTP {status}: {body[:400]}")
        self.status = status
        self.body = body


def missing_method(err: VllmCallError, method: str) -> bool:
    """vLLM answers an unknown collective_rpc method with an AttributeError naming it.

    Only that one: an AttributeError raised inside the method (a vLLM version
    whose internals moved) is a failure of the call, not a missing extension.
    """
    return f"has no attribute '{method}'" in err.body


# vLLM is on loopback: never through a proxy the pod's environment names (HTTP_PROXY is
# often set for model downloads, and urllib would send 127.0.0.1 to it without NO_PROXY).
DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@dataclass
class VllmControl:
    base_url: str
    device: str = "cpu"
    timeout: float = 600.0
    calls: list[str] = field(default_factory=list)  # what was sent, in order (for status/tests)

    def _post(self, path: str, body: object | None = None) -> Any:
        self.calls.append(path if body is None else f"{path} {json.dumps(body, sort_keys=True)}")
        data = b"" if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base_url + path, data=data, method="POST")
        req.add_header("Content-Type", "application/json")
        try:
            with DIRECT.open(req, timeout=self.timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            raise VllmCallError(path, e.code, e.read().decode(errors="replace")) from e
        except (urllib.error.URLError, OSError) as e:
            raise VllmCallError(path, None, str(e)) from e
        return json.loads(raw) if raw else None

    def _expect_awake(self) -> None:
        """GET /is_sleeping must say false once every tag has been woken."""
        self.calls.append("GET /is_sleeping")
        try:
            with DIRECT.open(self.base_url + "/is_sleeping", timeout=30) as resp:
                doc = json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as e:
            raise VllmCallError("/is_sleeping", e.code, e.read().decode(errors="replace")) from e
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise VllmCallError("/is_sleeping", None, str(e)) from e
        if doc.get("is_sleeping") is not False:
            raise VllmCallError("/is_sleeping", 200, f"vLLM still sleeps after waking: {doc}")

    def rpc(self, method: str, *args: str, **kwargs: object) -> Any:
        body: dict[str, object] = {"method": method, "args": list(args)}
        if kwargs:
            body["kwargs"] = kwargs
        return self._post("/collective_rpc", body)

    def dump_weights(self, weights_dir: str) -> None:
        """The flat weight dump, once per checkpoint (nothing is freed yet)."""
        self.rpc(DUMP_WEIGHTS, weights_dir)

    def release_weights(self) -> None:
        """Free weights and KV cache (level-2 sleep on GPU, the extension on CPU)."""
        if self.device == "cuda":
            expect_status(self._post("/sleep?level=2"), "/sleep?level=2", "sleeping")
        else:
            self.rpc(RELEASE_WEIGHTS)

    def release(self, weights_dir: str) -> dict[str, float]:
        """Dump the weights once, then free weights and KV cache; phase seconds."""
        t = {}
        t0 = time.monotonic()
        self.dump_weights(weights_dir)
        t["dump_weights"] = time.monotonic() - t0
        t0 = time.monotonic()
        self.release_weights()
        t["release"] = time.monotonic() - t0
        return t

    def wake(
        self, weights_dir: str, verify: bool = True, map_weights: bool = True
    ) -> dict[str, float]:
        """Bring weights (and, on GPU, the KV cache) back after a restore; phase seconds.

        verify=False when the caller already checked the weight file's content
        (the restore's prefetch does), so it is not read for checksums twice.
        map_weights=False forbids mapping the dump (the worker otherwise maps an
        immutable dump on CPU: weights_map.map_choice); only then is the
        argument sent. A tree dumped before the argument existed (it never maps
        by default) refuses it before doing anything, and is asked again without.
        The KV cache came back empty, so the prefix cache's entries point at
        blocks whose content is gone: reset it before serving.
        """
        t = {}
        t0 = time.monotonic()
        if self.device == "cuda":
            self._post("/wake_up?tags=weights")
        kwargs: dict[str, object] = {}
        if not verify:
            kwargs["verify"] = False
        if not map_weights:
            kwargs["map_weights"] = False
        try:
            reply = self.rpc(RELOAD_WEIGHTS, weights_dir, **kwargs)
        except VllmCallError as e:
            if "map_weights" not in kwargs or "'map_weights'" not in e.body:
                raise
            del kwargs["map_weights"]
            reply = self.rpc(RELOAD_WEIGHTS, weights_dir, **kwargs)
        if self.device == "cuda":
            # Every tag is resident again only now: vLLM says "awake", not "sleeping".
            woke = self._post("/wake_up?tags=kv_cache")
            expect_status(woke, "/wake_up?tags=kv_cache", "awake")
            if not (isinstance(woke, dict) and "status" in woke):
                self._expect_awake()  # vLLM before 0.31 answers an empty 200: ask
        self._post("/reset_prefix_cache")
        t["reload_weights"] = time.monotonic() - t0
        t.update(reload_split(reply))
        return t

    def wait_health(self, timeout: float, alive: Callable[[], bool] | None = None) -> float:
        """Seconds until vLLM's /health answered 200 (see wait_health)."""
        return wait_health(self.base_url, timeout, alive)

    def greedy(self, model: str, prompts: list[str], max_tokens: int) -> list[dict[str, Any]]:
        """Greedy completions of prompts (one request): per prompt, its tokens and their
        logprobs, in the prompts' order."""
        out = self._post(
            "/v1/completions",
            {
                "model": model,
                "prompt": prompts,
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "logprobs": 1,
            },
        )
        try:
            choices = sorted(out["choices"], key=lambda c: int(c["index"]))
            answers = [
                {
                    "tokens": list(c["logprobs"]["tokens"]),
                    "logprobs": [float(x) for x in c["logprobs"]["token_logprobs"]],
                }
                for c in choices
            ]
        except (KeyError, TypeError, ValueError) as e:
            raise VllmCallError("/v1/completions", 200, f"no logprobs in the answer: {e!r}") from e
        if len(answers) != len(prompts):
            raise VllmCallError("/v1/completions", 200, f"{len(answers)} answers to {len(prompts)}")
        return answers

    def complete_one(self, model: str, prompt: str = "Hello") -> str:
        """One greedy token: proof that the engine, its workers and the weights all work."""
        out = self._post(
            "/v1/completions",
            {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0},
        )
        return str(out["choices"][0]["text"])


def reload_split(reply: Any) -> dict[str, float]:
    """What the slowest rank's reload spent reading the dump and repacking CPU GEMM
    weights (its reply's read_seconds, repack_seconds), as parts of reload_weights;
    {} from a worker that does not say (a tree dumped by an older agent)."""
    ranks = reply.get("results") if isinstance(reply, dict) else None
    docs = [r for r in ranks or [] if isinstance(r, dict)]
    out: dict[str, float] = {}
    for key, part in (("read_seconds", "reload_read"), ("repack_seconds", "reload_repack")):
        vals = [float(d[key]) for d in docs if isinstance(d.get(key), int | float)]
        if vals:
            out[part] = max(vals)
    return out


def expect_status(doc: Any, what: str, want: str) -> None:
    """vLLM's sleep routes answer {"status": ...} (older versions: an empty 200, accepted);
    any other status means the state change did not happen."""
    if isinstance(doc, dict) and "status" in doc and doc["status"] != want:
        raise VllmCallError(what, 200, f"vLLM answered status {doc['status']!r}, not {want!r}")


def wait_health(base_url: str, timeout: float, alive: Callable[[], bool] | None = None) -> float:
    """Poll /health until 200; returns seconds waited. alive(): False aborts early."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if alive is not None and not alive():
            raise RuntimeError("vLLM exited before it became healthy")
        try:
            with DIRECT.open(base_url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return time.monotonic() - t0
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.02)
    raise TimeoutError(f"vLLM at {base_url} not healthy after {timeout:.0f}s")
