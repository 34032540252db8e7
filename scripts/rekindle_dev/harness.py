"""Run agents as pods would, on one machine: for the tests and `rekindle bench local`.

Each agent runs as PID 1 of a fresh PID and mount namespace
(`unshare --pid --fork --mount-proc --mount`) with its own tmpfs on /dev/shm:
a restore then meets an empty /dev/shm and free PIDs exactly as in a new pod,
and the host's /dev/shm is never touched. Killing the namespace's PID 1 kills
everything in it.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from rekindle_contract.api import AgentClient, StatusReply

RUNTIME_DIR = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class AgentProc:
    """One agent process and how to talk to it."""

    def __init__(
        self,
        argv: list[str],
        log: Path,
        serve_port: int,
        admin_port: int,
        token: str,
        env: dict[str, str],
    ) -> None:
        self.log = log
        self.serve_url = f"http://127.0.0.1:{serve_port}"
        self.admin_url = f"http://127.0.0.1:{admin_port}"
        self.client = AgentClient(self.admin_url, token, timeout=30)
        self.token = token
        self.launched = time.monotonic()
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env
            )

    def status(self) -> StatusReply:
        return self.client.status()

    def wait_ready(self, timeout: float = 300, poll: float = 0.2) -> StatusReply:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"agent exited {self.proc.returncode}:\n{self.tail()}")
            if self.client.ready():
                return self.status()
            try:
                st = self.status()
                if st.state == "Failed":
                    raise RuntimeError(f"agent Failed: {st.raw}\n{self.tail()}")
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(poll)
        raise TimeoutError(f"agent not Ready after {timeout}s:\n{self.tail()}")

    def complete(
        self, prompt: str, max_tokens: int = 12, stream: bool = False, model: str = "tiny"
    ) -> str:
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": stream,
        }
        req = urllib.request.Request(
            self.serve_url + "/v1/completions",
            data=json.dumps(body).encode(),
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=120) as resp:
            raw = resp.read().decode()
        if not stream:
            return str(json.loads(raw)["choices"][0]["text"])
        text = ""
        for line in raw.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
        if not raw.rstrip().endswith("data: [DONE]"):
            raise RuntimeError(f"stream ended without [DONE]: {raw[-200:]}")
        return text

    def tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(30)
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)


class AgentFactory:
    """Agents that share a model, token, vLLM port and run dir (like pods of one service)."""

    def __init__(self, base: Path, model: Path, criu: Path, served_name: str = "tiny") -> None:
        self.base = base
        self.model = model
        self.criu = criu
        self.served_name = served_name
        self.token = secrets.token_hex(24)
        self.token_file = base / "token"
        self.token_file.write_text(self.token + "\n")
        os.chmod(self.token_file, 0o600)
        self.vllm_port = free_port()
        self.run_dir = base / "run"
        self.checkpoints = base / "checkpoints"
        self.checkpoints.mkdir(mode=0o700, exist_ok=True)
        self.started: list[AgentProc] = []
        self.env = dict(os.environ)
        self.env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(RUNTIME_DIR), self.env.get("PYTHONPATH", "")) if p
        )

    def argv(self, serve: int, admin: int, extra: tuple[str, ...]) -> list[str]:
        return [
            sys.executable,
            "-m",
            "rekindle_dev.cli",
            "agent",
            "--model",
            str(self.model),
            "--served-name",
            self.served_name,
            "--max-model-len",
            "512",
            "--bind-host",
            "127.0.0.1",
            "--serve-port",
            str(serve),
            "--admin-port",
            str(admin),
            "--vllm-port",
            str(self.vllm_port),
            "--token-file",
            str(self.token_file),
            "--run-dir",
            str(self.run_dir),
            "--checkpoint-root",
            str(self.checkpoints),
            "--criu",
            str(self.criu),
            *extra,
        ]

    def start(self, *extra: str, name: str = "agent", fresh_ns: bool = True) -> AgentProc:
        serve, admin = free_port(), free_port()
        agent = self.argv(serve, admin, extra)
        argv = agent
        if fresh_ns:
            argv = [
                "unshare",
                "--pid",
                "--fork",
                "--mount-proc",
                "--mount",
                "--",
                "sh",
                "-c",
                'mount -t tmpfs -o size=6g,mode=1777 shm /dev/shm && exec "$@"',
                "sh",
                *agent,
            ]
        log = self.base / f"{name}-{len(self.started)}.log"
        proc = AgentProc(argv, log, serve, admin, self.token, self.env)
        self.started.append(proc)
        return proc

    def stop_all(self) -> None:
        for a in self.started:
            a.stop()
