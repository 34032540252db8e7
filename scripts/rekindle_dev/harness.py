"""Run agents as pods would, on one machine: for the tests and `rekindle-dev bench local`.

Each agent runs as PID 1 of a fresh PID and mount namespace
(`unshare --pid --fork --mount-proc --mount`) with its own tmpfs on /dev/shm:
a restore then meets an empty /dev/shm and free PIDs exactly as in a new pod,
and the host's /dev/shm is never touched. Killing the namespace's PID 1 kills
everything in it.

Ports cannot collide: every port an agent binds (serve, admin, and vLLM's,
which must be known in advance) comes from rekindle_dev.ports, outside the
range the kernel hands out, and the agent reports what it bound in its
--ports-file, which AgentProc reads (one left by an earlier run in a reused
work dir is deleted first, and the agent's log restarts). Not port 0 for the agent: the agents share
the host's network namespace (pods would not), and a restored vLLM tree
listens again on the ephemeral ports it had (torch's and vLLM's internal
servers), which a port-0 bind of the agent restoring it, or of any agent
before, could hold. The agent's argv is built by the contract's agent_argv(),
as the operator builds a pod's.

stop() returns only once nothing of the agent is left: its PID namespace is
empty (every process of the tree it booted or restored is gone, zombies
included, so its sockets are closed and vLLM's port is free unless another
agent holds it). It raises when that is not so within its deadline, rather
than let the next agent meet what this one left.

Agents get vLLM's model info cache seeded as the runtime image seeds it
(modelinfo_seed_dir), so a boot here costs what a boot in a pod costs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from rekindle_agent.mapped_files.immutable import remove_tree
from rekindle_agent.supervision import modelinfo_seed
from rekindle_agent.supervision.vllm_process import wait_port_free
from rekindle_contract.agent_args import AgentArgs, agent_argv
from rekindle_contract.api import AgentClient, StatusReply
from rekindle_contract.pod import CHECKPOINT_ENV, CRIU_ENV, TOKEN_ENV

from rekindle_dev.ports import free_port

# The installed agent, run by this interpreter (the one that has the project installed).
AGENT_COMMAND = (sys.executable, "-m", "rekindle_agent.cli", "agent")
# The size of the agent's private /dev/shm unless start() is told otherwise.
DEFAULT_SHM = "6g"
# The architectures of the models run here: the tiny, wide and SmolLM2 models are
# Llama, the size ladder's Qwen2, the tiny VLM LLaVA.
SEED_ARCHS = ("LlamaForCausalLM", "Qwen2ForCausalLM", "LlavaForConditionalGeneration")


def modelinfo_seed_dir(cache_root: Path | None = None) -> Path:
    """vLLM's model info cache for SEED_ARCHS, made once per vLLM and seed format under
    the cache root (as images/runtime/build makes the image's): each agent factory's
    first boot then starts no extra Python process to work it out, as in a pod."""
    from rekindle_dev.smollm2 import default_cache_root

    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        raise RuntimeError("vLLM is not installed in this interpreter's environment")
    registry = Path(spec.origin).parent / "model_executor" / "models" / "registry.py"
    key = hashlib.sha256(
        registry.read_bytes()
        + Path(modelinfo_seed.__file__).read_bytes()
        + ",".join(SEED_ARCHS).encode()
    ).hexdigest()[:12]
    out = (cache_root or default_cache_root()) / f"vllm-modelinfos-{key}"
    if not out.is_dir():
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        cmd = [sys.executable, "-m", modelinfo_seed.__name__, "--out", str(tmp), *SEED_ARCHS]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        tmp.rename(out)
    return out


def fresh_ns_argv(shm_size: str | int = DEFAULT_SHM) -> list[str]:
    """A fresh PID + mount namespace with an empty, private /dev/shm of shm_size (tmpfs's
    size= syntax, or bytes), then exec "$@" (the agent): a pod with its emptyDir."""
    mount = f'mount -t tmpfs -o size={shm_size},mode=1777 shm /dev/shm && exec "$@"'
    return ["unshare", "--pid", "--fork", "--mount-proc", "--mount", "--", "sh", "-c", mount, "sh"]


# How long stop() waits for the agent's PID namespace to empty and vLLM's port to free.
STOP_DEADLINE_S = 30.0


def pid_namespace(pid: int, link: str = "pid") -> str | None:
    """The PID namespace (its /proc link text, e.g. "pid:[4026532]") of pid, or None if gone.

    link "pid_for_children": the one pid's children get (unshare's new one).
    """
    try:
        return os.readlink(f"/proc/{pid}/ns/{link}")
    except OSError:
        return None


def namespace_members(ns: str) -> list[int]:
    """Host PIDs of every process (zombies too) whose PID namespace is ns."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and pid_namespace(int(entry)) == ns:
            out.append(int(entry))
    return out


class AgentProc:
    """One agent process and how to talk to it."""

    def __init__(
        self,
        argv: list[str],
        log: Path,
        ports_file: Path,
        token: str,
        env: dict[str, str],
        own_pid_ns: bool = False,
    ) -> None:
        """Launch argv; own_pid_ns: argv makes a new PID namespace for the agent
        (fresh_ns_argv), which stop() then waits to be empty."""
        self.log = log
        self.own_pid_ns = own_pid_ns
        self.ports_file = ports_file
        self.token = token
        self.api_key: str | None = None  # sent on the serve port when set
        self._ports: dict[str, int] | None = None
        self._client: AgentClient | None = None
        self.vllm_port: int | None = None  # waited free by stop(): the next agent binds it
        self.launched = time.monotonic()
        # A reused work dir holds the last run's files under the same names: a
        # ports file left there would point ports() at that run's (dead, or
        # someone else's) agent before this one wrote its own.
        ports_file.unlink(missing_ok=True)
        # In the log's directory, never the checkout: `python -m` puts the working directory
        # on sys.path, and the agent fingerprints the package metadata it finds there (a pip
        # install in the checkout between a dump and its restore would fail the restore).
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=env,
                cwd=log.parent,
            )

    def ports(self, timeout: float = 120) -> dict[str, int]:
        """{"serve": N, "admin": M} as the agent bound them (waits for its --ports-file)."""
        deadline = time.monotonic() + timeout
        while self._ports is None:
            try:
                self._ports = {
                    k: int(v) for k, v in json.loads(self.ports_file.read_text()).items()
                }
            except (FileNotFoundError, ValueError):
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"agent exited {self.proc.returncode} before listening:\n{self.tail()}"
                    ) from None
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"agent not listening after {timeout}s:\n{self.tail()}"
                    ) from None
                time.sleep(0.01)
        return self._ports

    @property
    def serve_url(self) -> str:
        return f"http://127.0.0.1:{self.ports()['serve']}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.ports()['admin']}"

    @property
    def client(self) -> AgentClient:
        if self._client is None:
            self._client = AgentClient(self.admin_url, self.token, timeout=30)
        return self._client

    def status(self) -> StatusReply:
        return self.client.status()

    def wait_state(
        self, states: tuple[str, ...], timeout: float = 120, poll: float = 0.1
    ) -> StatusReply:
        """Poll the status until the state is one of states (Failed included, no raise)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                st = self.status()
                if st.state in states:
                    return st
            except (urllib.error.URLError, ConnectionError, OSError):
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"agent exited {self.proc.returncode}:\n{self.tail()}"
                    ) from None
            time.sleep(poll)
        raise TimeoutError(f"agent not in {states} after {timeout}s:\n{self.tail()}")

    def request(
        self,
        method: str,
        path: str,
        body: object | None = None,
        headers: dict[str, str] | None = None,
        timeout: float = 60,
    ) -> tuple[int, str]:
        """A raw request on the serve port: (HTTP status, body text), errors included."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.serve_url + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        for k, v in (headers or {}).items():
            req.add_header(k, v)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, resp.read().decode(errors="replace")
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")

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
        headers = {"Content-Type": "application/json"}
        if self.api_key is not None:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(
            self.serve_url + "/v1/completions",
            data=json.dumps(body).encode(),
            method="POST",
            headers=headers,
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

    def namespace(self) -> str | None:
        """The agent's own PID namespace (None: not started in one, or already gone)."""
        if not self.own_pid_ns or self.proc.poll() is not None:
            return None
        ns = pid_namespace(self.proc.pid, "pid_for_children")
        return None if ns is None or ns == pid_namespace(self.proc.pid) else ns

    def tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        """End the agent and everything it started; return once all of it is gone.

        Killing the namespace's PID 1 makes the kernel kill the rest of it, and
        `unshare` (our child, reaped here) exits only after its child, the
        namespace's PID 1, whose exit waits for every other process there to be
        reaped. That is checked rather than assumed: a process left behind
        would hold vLLM's port or PIDs the next restore needs.
        """
        ns = self.namespace()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(STOP_DEADLINE_S)
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(STOP_DEADLINE_S)
        deadline = time.monotonic() + STOP_DEADLINE_S
        left = namespace_members(ns) if ns else []
        while left and time.monotonic() < deadline:
            time.sleep(0.05)
            left = namespace_members(ns) if ns else []
        if left:
            raise RuntimeError(f"agent {self.log.name}: processes {left} outlived it in {ns}")
        if not self.own_pid_ns and self.vllm_port is not None:
            # Not in a namespace of its own (fresh_ns=False): its vLLM runs in its own
            # session and may outlive the agent by a moment; the factory's next agent would
            # refuse the port while it is still held. (Not an error when it stays held: an
            # agent that was refused the port leaves it to the agent that holds it.)
            wait_port_free("127.0.0.1", self.vllm_port, STOP_DEADLINE_S)


class AgentFactory:
    """Agents that share a model, token, vLLM port and run dir (like pods of one service).

    Unlike pods they also share the network: while one agent's vLLM holds the
    port, another agent of the factory that boots goes Failed (the agent
    refuses a vLLM it did not start) rather than serving the first one's.
    """

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
        # Settings come from the flags only: nothing of the caller's pod-like env leaks in.
        self.env = {
            k: v for k, v in os.environ.items() if k not in (CHECKPOINT_ENV, CRIU_ENV, TOKEN_ENV)
        }
        self.env.setdefault(modelinfo_seed.SEED_ENV, str(modelinfo_seed_dir()))

    def args(self, **overrides: Any) -> AgentArgs:
        """The agent's settings: this factory's, with overrides (AgentArgs field names)."""
        serve = free_port()
        admin = free_port(exclude={serve, self.vllm_port})
        base = AgentArgs(
            model=str(self.model),
            served_name=self.served_name,
            max_model_len=512,
            bind_host="127.0.0.1",
            serve_port=serve,
            admin_port=admin,
            vllm_port=self.vllm_port,
            token_file=str(self.token_file),
            run_dir=str(self.run_dir),
            checkpoint_root=str(self.checkpoints),
            criu=str(self.criu),
        )
        return dataclasses.replace(base, **overrides)

    def start(
        self,
        name: str = "agent",
        fresh_ns: bool = True,
        shm_size: str | int = DEFAULT_SHM,
        **overrides: Any,
    ) -> AgentProc:
        """Launch an agent (settings: args(**overrides)); it is not Ready yet.

        fresh_ns: in its own PID + mount namespace with a private /dev/shm of shm_size.
        """
        stem = f"{name}-{len(self.started)}"
        ports_file = self.base / f"{stem}.ports.json"
        argv = agent_argv(self.args(ports_file=str(ports_file), **overrides), AGENT_COMMAND)
        if fresh_ns:
            argv = [*fresh_ns_argv(shm_size), *argv]
        proc = AgentProc(
            argv, self.base / f"{stem}.log", ports_file, self.token, self.env, own_pid_ns=fresh_ns
        )
        proc.vllm_port = int(overrides.get("vllm_port", self.vllm_port))
        key_file = overrides.get("api_key_file")
        if key_file:  # the serve port needs it: send it on completions
            proc.api_key = Path(key_file).read_text().strip()
        self.started.append(proc)
        return proc

    def stop_all(self) -> None:
        """Stop every agent started here (each is tried); the first failure is raised."""
        errors = []
        for a in self.started:
            try:
                a.stop()
            except Exception as e:
                errors.append(e)
        if errors:
            raise errors[0]

    def remove_checkpoints(self) -> None:
        """Delete every checkpoint made here (immutable files included), keeping the logs.

        A test session makes GBs of checkpoints; removed when their fixture ends, a
        suite needs the disk of the checkpoints in use, not of all it ever made.
        """
        if self.checkpoints.exists():
            remove_tree(self.checkpoints)
