"""A real vLLM server with Rekindle's extension, for the weights tests and benchmark.

Started in its own session so the whole tree (API server, engine core,
workers) is killed as one process group.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.error
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rekindle_agent.vllm_control import wait_health
from rekindle_agent.vllm_launch import VllmConfig, base_url, http_json, vllm_command, vllm_env


class RpcError(RuntimeError):
    """A collective_rpc call failed; the text is what vLLM sent back."""


@dataclass
class VllmServer:
    cfg: VllmConfig
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def url(self) -> str:
        return base_url(self.cfg)

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


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def running_vllm(
    model: Path, log: Path, port: int | None = None, timeout: float = 300
) -> Iterator[VllmServer]:
    """Boot vLLM (CPU) on loopback, wait for /health, and always kill its process group."""
    cfg = VllmConfig(model=str(model), port=port or free_port())
    env = vllm_env(cfg)
    # vLLM's workers import the extension by name: the agent package must be importable.
    agent_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (agent_root, env.get("PYTHONPATH")) if p)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            vllm_command(cfg),
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    server = VllmServer(cfg, proc, log)
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
