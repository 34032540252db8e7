"""The wake/release request sequences, against a fake vLLM that records requests."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest
from rekindle_agent.supervision.vllm_control import VllmCallError, VllmControl, missing_method


class _Fake(BaseHTTPRequestHandler):
    seen: ClassVar[list[tuple[str, object]]] = []
    unknown: ClassVar[set[str]] = set()

    def do_POST(self) -> None:
        n = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(n)) if n else None
        _Fake.seen.append((self.path, body))
        if self.path == "/collective_rpc" and body["method"] in _Fake.unknown:
            self._reply(
                500,
                {
                    "error": f"AttributeError: 'CPUWorker' object has no attribute "
                    f"'{body['method']}'"
                },
            )
        elif self.path == "/v1/completions" and isinstance(body["prompt"], list):
            # vLLM's shape with logprobs=1, the choices not in the prompts' order
            choices = [
                {
                    "index": i,
                    "text": f" t{i}",
                    "logprobs": {"tokens": [f" t{i}"], "token_logprobs": [-0.5 * i]},
                }
                for i in range(len(body["prompt"]))
            ]
            self._reply(200, {"choices": choices[::-1]})
        elif self.path == "/v1/completions":
            self._reply(200, {"choices": [{"text": " the"}]})
        elif self.path.startswith("/sleep"):
            self._reply(200, {"status": "sleeping", "level": 2})
        elif self.path.startswith("/wake_up"):
            awake = self.path.endswith("kv_cache")
            self._reply(200, {"status": "awake" if awake else "sleeping", "tags": []})
        else:
            self._reply(200, {"results": [None]})

    def _reply(self, code: int, doc: object) -> None:
        raw = json.dumps(doc).encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture()
def fake() -> Iterator[str]:
    _Fake.seen, _Fake.unknown = [], set()
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Fake)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def _rpc(method: str, *args: str) -> tuple[str, object]:
    return ("/collective_rpc", {"method": method, "args": list(args)})


def test_cpu_sequence(fake: str) -> None:
    c = VllmControl(fake, "cpu")
    c.release("/ck/weights")
    c.wake("/ck/weights")
    assert _Fake.seen == [
        _rpc("rekindle_dump_weights", "/ck/weights"),
        _rpc("rekindle_release_weights"),
        _rpc("rekindle_reload_weights", "/ck/weights"),
        ("/reset_prefix_cache", None),
    ]


def test_wake_skips_the_reload_checksums_when_told(fake: str) -> None:
    VllmControl(fake, "cpu").wake("/ck/weights", verify=False)
    assert _Fake.seen[0] == (
        "/collective_rpc",
        {"method": "rekindle_reload_weights", "args": ["/ck/weights"], "kwargs": {"verify": False}},
    )


def test_gpu_sequence_is_vllms_documented_level2_wake(fake: str) -> None:
    c = VllmControl(fake, "cuda")
    c.release("/ck/weights")
    c.wake("/ck/weights")
    assert _Fake.seen == [
        _rpc("rekindle_dump_weights", "/ck/weights"),
        ("/sleep?level=2", None),
        ("/wake_up?tags=weights", None),
        _rpc("rekindle_reload_weights", "/ck/weights"),
        ("/wake_up?tags=kv_cache", None),
        ("/reset_prefix_cache", None),
    ]
    assert c.complete_one("tiny") == " the"
    assert _Fake.seen[-1][1] == {
        "model": "tiny",
        "prompt": "Hello",
        "max_tokens": 1,
        "temperature": 0.0,
    }


def test_missing_rpc_is_recognised(fake: str) -> None:
    _Fake.unknown = {"rekindle_dump_weights"}
    with pytest.raises(VllmCallError) as e:
        VllmControl(fake, "cpu").release("/ck/weights")
    assert e.value.status == 500 and missing_method(e.value, "rekindle_dump_weights")
    assert len(_Fake.seen) == 1  # nothing released after a failed dump


def test_contract_rpc_names_are_the_extensions_methods() -> None:
    """The names the agent calls (rekindle_contract.rpc) exist on the worker extension.

    Read from the source: importing the extension would import vLLM.
    """
    import ast
    import importlib.util
    from pathlib import Path

    from rekindle_contract import rpc

    spec = importlib.util.find_spec("rekindle_agent.worker.vllm_extension")
    assert spec is not None and spec.origin is not None
    tree = ast.parse(Path(spec.origin).read_text())
    module, cls_name = rpc.WORKER_EXTENSION.rsplit(".", 1)
    assert module == "rekindle_agent.worker.vllm_extension"
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls_name]
    methods = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
    names = {v for k, v in vars(rpc).items() if k.isupper() and k != "WORKER_EXTENSION"}
    assert names and names <= methods, names - methods


# -- the GPU path against replayed vLLM answers ----------------------------------------------
# Transcribed from vLLM's dev routes (entrypoints/serve/dev/sleep and rpc api_router.py) as
# installed here, not captured on a GPU (none here). vLLM 0.32.0 (this project's CPU env):
# /sleep answers {"status": "sleeping", "level": N}; /wake_up answers
# {"status": "awake" | "sleeping", "tags": [...]}, "sleeping" until every tag is resident
# again. vLLM 0.30.0 (the GPU image's, from `make image-gpu-rootfs`): both answer an empty
# 200, and GET /is_sleeping answers {"is_sleeping": bool}. /collective_rpc answers
# {"results": [one value per worker]}; /reset_prefix_cache an empty 200. Each request must
# come in this order, or the replay answers 404 and the test fails.
GPU_RECORDING: list[tuple[str, int, object]] = [
    ("/collective_rpc", 200, {"results": [{"rank": 0, "bytes": 4096, "tensors": 3}]}),
    ("/sleep?level=2", 200, {"status": "sleeping", "level": 2}),
    ("/wake_up?tags=weights", 200, {"status": "sleeping", "tags": ["weights"]}),
    ("/collective_rpc", 200, {"results": [{"rank": 0, "bytes": 4096, "gbps": 1.5}]}),
    ("/wake_up?tags=kv_cache", 200, {"status": "awake", "tags": ["kv_cache"]}),
    ("/reset_prefix_cache", 200, None),
]
GPU_RECORDING_0_30: list[tuple[str, int, object]] = [
    GPU_RECORDING[0],
    ("/sleep?level=2", 200, None),
    ("/wake_up?tags=weights", 200, None),
    GPU_RECORDING[3],
    ("/wake_up?tags=kv_cache", 200, None),
    ("GET /is_sleeping", 200, {"is_sleeping": False}),
    ("/reset_prefix_cache", 200, None),
]


class _Replay(BaseHTTPRequestHandler):
    script: ClassVar[list[tuple[str, int, object]]] = []
    seen: ClassVar[list[str]] = []

    def do_POST(self) -> None:
        n = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(n)
        self._answer(self.path)

    def do_GET(self) -> None:
        self._answer(f"GET {self.path}")

    def _answer(self, what: str) -> None:
        _Replay.seen.append(what)
        if not _Replay.script or _Replay.script[0][0] != what:
            self._reply(404, {"detail": f"unexpected {what}"})
            return
        _, code, doc = _Replay.script.pop(0)
        self._reply(code, doc)

    def _reply(self, code: int, doc: object) -> None:
        raw = b"" if doc is None else json.dumps(doc).encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture()
def replay() -> Iterator[str]:
    _Replay.seen = []
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Replay)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


@pytest.mark.parametrize("recording", [GPU_RECORDING, GPU_RECORDING_0_30], ids=["0.32", "0.30"])
def test_gpu_release_and_wake_against_vllms_answers(
    replay: str, recording: list[tuple[str, int, object]]
) -> None:
    _Replay.script = list(recording)
    c = VllmControl(replay, "cuda")
    c.release("/ck/weights")
    c.wake("/ck/weights")
    assert _Replay.script == []  # every recorded answer was asked for, in order
    assert _Replay.seen == [path for path, _, _ in recording]


def test_an_old_vllm_still_sleeping_after_the_wake_is_an_error(replay: str) -> None:
    script = list(GPU_RECORDING_0_30[2:])
    script[3] = ("GET /is_sleeping", 200, {"is_sleeping": True})
    _Replay.script = script
    with pytest.raises(VllmCallError, match="still sleeps"):
        VllmControl(replay, "cuda").wake("/ck/weights")


def test_a_wake_that_leaves_vllm_sleeping_is_an_error(replay: str) -> None:
    script = list(GPU_RECORDING[2:])
    script[2] = ("/wake_up?tags=kv_cache", 200, {"status": "sleeping", "tags": ["kv_cache"]})
    _Replay.script = script
    with pytest.raises(VllmCallError, match="'sleeping', not 'awake'"):
        VllmControl(replay, "cuda").wake("/ck/weights")


def test_a_refused_sleep_is_an_error(replay: str) -> None:
    # vLLM without --enable-sleep-mode refuses the sleep (its error body, a 4xx/5xx status)
    _Replay.script = [
        GPU_RECORDING[0],
        ("/sleep?level=2", 400, {"error": {"message": "Sleep mode is not enabled"}}),
    ]
    with pytest.raises(VllmCallError) as e:
        VllmControl(replay, "cuda").release("/ck/weights")
    assert e.value.status == 400


def test_reload_split_takes_the_slowest_rank() -> None:
    from rekindle_agent.supervision.vllm_control import reload_split

    reply = {
        "results": [
            {"read_seconds": 0.05, "repack_seconds": 1.5},
            {"read_seconds": 0.08, "repack_seconds": 1.2},
        ]
    }
    assert reload_split(reply) == {"reload_read": 0.08, "reload_repack": 1.5}
    assert reload_split({"results": [None]}) == {}  # an older worker says nothing
    assert reload_split(None) == {}


def test_calls_to_vllm_never_take_the_environments_proxy(
    fake: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HTTP_PROXY set for model downloads must not capture the agent's loopback calls."""
    proxy = ThreadingHTTPServer(("127.0.0.1", 0), _Fake)  # records into the same list
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    proxy_url = f"http://127.0.0.1:{proxy.server_address[1]}"
    try:
        monkeypatch.setenv("HTTP_PROXY", proxy_url)
        monkeypatch.setenv("http_proxy", proxy_url)
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.delenv("no_proxy", raising=False)
        VllmControl(fake, "cpu").wake("/ck/weights")
        # Through a proxy the request line holds the absolute URL; direct, only the path.
        assert [path for path, _ in _Fake.seen] == ["/collective_rpc", "/reset_prefix_cache"]
    finally:
        proxy.shutdown()
        proxy.server_close()


MISSING = "AttributeError: 'CPUWorker' object has no attribute 'rekindle_dump_weights'"
INSIDE = "AttributeError: 'GPUModelRunner' object has no attribute 'model'"


class _DumpFails:
    """A VllmControl whose weight dump answers with body (and that records the rest)."""

    def __init__(self, device: str, body: str) -> None:
        self.device, self.body, self.released = device, body, False

    def dump_weights(self, weights_dir: str) -> None:
        raise VllmCallError("/collective_rpc rekindle_dump_weights", 500, self.body)

    def release_weights(self) -> None:
        self.released = True


def test_only_the_missing_method_itself_counts_as_missing() -> None:
    assert missing_method(VllmCallError("x", 500, MISSING), "rekindle_dump_weights")
    # An AttributeError from inside vLLM (its internals moved) is a failed call.
    assert not missing_method(VllmCallError("x", 500, INSIDE), "rekindle_dump_weights")
    assert not missing_method(VllmCallError("x", 500, MISSING), "rekindle_release_weights")


def test_without_the_extension_cpu_dumps_unreleased_gpu_refuses(tmp_path: Path) -> None:
    from rekindle_agent.checkpointing import checkpoint

    cpu = _DumpFails("cpu", MISSING)
    weights, _ = checkpoint._release(cpu, tmp_path / "w")  # type: ignore[arg-type]
    assert weights["released"] is False and "not available" in weights["reason"]
    # On GPU cuda-checkpoint would copy every weight to host memory: refused.
    gpu = _DumpFails("cuda", MISSING)
    with pytest.raises(checkpoint.CheckpointError, match="GPU checkpoint without release") as e:
        checkpoint._release(gpu, tmp_path / "w")  # type: ignore[arg-type]
    assert e.value.reason == "release_failed" and not gpu.released
    # Any other AttributeError fails the checkpoint, on CPU too: never a silent no-release.
    with pytest.raises(checkpoint.CheckpointError, match="dumping the weights failed"):
        checkpoint._release(_DumpFails("cpu", INSIDE), tmp_path / "w")  # type: ignore[arg-type]


def test_greedy_asks_once_for_every_prompt_with_logprobs_in_their_order(fake: str) -> None:
    c = VllmControl(fake, "cpu")
    got = c.greedy("tiny", ["a", "b", "c"], 4)
    assert got == [
        {"tokens": [" t0"], "logprobs": [-0.0]},
        {"tokens": [" t1"], "logprobs": [-0.5]},
        {"tokens": [" t2"], "logprobs": [-1.0]},
    ]
    assert _Fake.seen == [
        (
            "/v1/completions",
            {
                "model": "tiny",
                "prompt": ["a", "b", "c"],
                "max_tokens": 4,
                "temperature": 0.0,
                "logprobs": 1,
            },
        )
    ]
