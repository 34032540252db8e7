"""A real vLLM server with Rekindle's extension, for the weights tests and benchmark.

Started with the agent's own command line and environment (the contract's
vllm_argv, the agent's vllm_env), without the agent, in its own session so the
whole tree (API server, engine core, workers) is killed as one process group.
vLLM's workers import the extension by name: they run this interpreter, which
has the project installed, so no import path is set in the environment.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rekindle_agent.supervision.vllm_control import wait_health
from rekindle_agent.supervision.vllm_launch import vllm_env
from rekindle_contract.vllm_argv import VllmOptions, vllm_argv

from rekindle_dev.ports import free_port


class RpcError(RuntimeError):
    """A collective_rpc call failed; the text is what vLLM sent back."""


def http_json(method: str, url: str, body: object | None = None, timeout: float = 30.0) -> object:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        raw = resp.read()
    return json.loads(raw) if raw else None


def complete(url: str, model: str, prompt: str, max_tokens: int = 16, timeout: float = 60) -> str:
    """Greedy completion: deterministic for a fixed model, the before/after oracle."""
    out = http_json(
        "POST",
        f"{url}/v1/completions",
        {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0},
        timeout=timeout,
    )
    assert isinstance(out, dict)
    return str(out["choices"][0]["text"])


def collective_rpc(port: int, method: str, timeout: float = 300) -> list[Any]:
    """POST /collective_rpc to a vLLM on loopback (an agent's, too); the per-rank results."""
    out = http_json(
        "POST",
        f"http://127.0.0.1:{port}/collective_rpc",
        {"method": method, "args": [], "kwargs": {}},
        timeout=timeout,
    )
    assert isinstance(out, dict), out
    return list(out["results"])


@dataclass
class VllmServer:
    opts: VllmOptions
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def url(self) -> str:
        return f"http://{self.opts.host}:{self.opts.port}"

    def rpc(self, method: str, *args: str, timeout: float = 600, **kwargs: str) -> list[Any]:
        """POST /collective_rpc; the per-worker results."""
        body = {"method": method, "args": list(args), "kwargs": kwargs}
        try:
            out = http_json("POST", f"{self.url}/collective_rpc", body, timeout=timeout)
        except urllib.error.HTTPError as e:
            raise RpcError(f"{method}: HTTP {e.code}: {e.read().decode(errors='replace')}") from e
        assert isinstance(out, dict), out
        return list(out["results"])

    def post(self, path: str, timeout: float = 60) -> object:
        return http_json("POST", f"{self.url}{path}", None, timeout=timeout)


@contextmanager
def running_vllm(
    model: Path, log: Path, port: int | None = None, timeout: float = 300
) -> Iterator[VllmServer]:
    """Boot vLLM (CPU) on loopback, wait for /health, and always kill its process group."""
    opts = VllmOptions(
        model=str(model), served_name="tiny", port=port or free_port(), max_model_len=512
    )
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            vllm_argv(opts),
            env=vllm_env(opts.device),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    server = VllmServer(opts, proc, log)
    try:
        try:
            wait_health(server.url, timeout, alive=lambda: proc.poll() is None)
        except (RuntimeError, TimeoutError) as e:
            tail = log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{e}; last lines of {log}:\n{tail}") from e
        yield server
    finally:
        _kill_group(proc)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 20
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
