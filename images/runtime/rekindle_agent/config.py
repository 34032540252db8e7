"""The agent's configuration: flags, environment and an optional JSON/YAML file.

Precedence: command-line flag > config file > environment > default. The
operator builds the pod's command line from these flags (docs/agent.md lists
them), so their names are part of the contract.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from rekindle_contract import api


class ConfigError(ValueError):
    """A bad setting; the message says which and what to change."""


@dataclass
class AgentConfig:
    model: str = ""
    served_name: str = "model"
    device: str = "cpu"
    max_model_len: int | None = None  # None: vLLM's default
    worker_extension: str | None = "auto"  # "auto": use Rekindle's if importable
    vllm_args: list[str] = field(default_factory=list)
    bind_host: str = "0.0.0.0"
    serve_port: int = api.SERVE_PORT
    admin_port: int = api.ADMIN_PORT
    vllm_port: int = api.VLLM_PORT
    token_file: str = api.DEFAULT_TOKEN_FILE
    run_dir: str = api.DEFAULT_RUN_DIR
    checkpoint: str | None = None  # restore from this directory at start
    checkpoint_root: str | None = None  # POST /v1/checkpoint dirs must be under it
    restore_policy: str = "if-present"
    criu: str = "criu"
    criu_plugins: str | None = None  # -L for CRIU (the CUDA plugin dir on GPU)
    mmap_restore: str = "auto"  # auto | on | off
    prefetch: bool = True
    prefetch_threads: int = 8
    verify_checksums: str = "crc32"  # crc32 | sha256 | size
    drain_timeout: float = 30.0
    boot_timeout: float = 900.0
    restore_timeout: float = 300.0
    seccomp_io_uring: bool = True
    ns_last_pid: int = 10000
    clear_shm: bool = True

    def validate(self) -> None:
        if not self.model:
            raise ConfigError("--model is required: the model directory vLLM serves")
        if self.restore_policy not in api.RESTORE_POLICIES:
            raise ConfigError(
                f"--restore-policy {self.restore_policy!r}: use one of {api.RESTORE_POLICIES}"
            )
        if self.mmap_restore not in ("auto", "on", "off"):
            raise ConfigError(f"--mmap-restore {self.mmap_restore!r}: use auto, on or off")
        if self.verify_checksums not in ("crc32", "sha256", "size"):
            raise ConfigError(
                f"--verify-checksums {self.verify_checksums!r}: use crc32, sha256 or size"
            )
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"--device {self.device!r}: use cpu or cuda")
        ports = {self.serve_port, self.admin_port, self.vllm_port}
        if len(ports) != 3:
            raise ConfigError("--serve-port, --admin-port and --vllm-port must all differ")
        if self.drain_timeout <= 0:
            raise ConfigError("--drain-timeout must be > 0 seconds")
        if self.checkpoint_root and not os.path.isabs(self.checkpoint_root):
            raise ConfigError("--checkpoint-root must be an absolute path")
        if not os.path.isabs(self.run_dir):
            raise ConfigError("--run-dir must be an absolute path")


def _bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    return str(v).lower() in ("1", "true", "yes", "on")


def load_file(path: str) -> dict[str, Any]:
    """A JSON or YAML mapping whose keys are AgentConfig field names (dashes allowed)."""
    text = Path(path).read_text()
    if path.endswith((".yaml", ".yml")):
        import yaml

        data = yaml.safe_load(text) or {}
    else:
        data = json.loads(text)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of settings")
    names = {f.name for f in fields(AgentConfig)}
    out: dict[str, Any] = {}
    for k, v in data.items():
        key = str(k).replace("-", "_")
        if key not in names:
            raise ConfigError(f"{path}: unknown setting {k!r}; known: {sorted(names)}")
        out[key] = v
    return out


def from_env(env: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if env.get(api.CRIU_ENV):
        out["criu"] = env[api.CRIU_ENV]
    if env.get("REKINDLE_CHECKPOINT"):
        out["checkpoint"] = env["REKINDLE_CHECKPOINT"]
    if env.get(api.TOKEN_ENV):
        out["token_file"] = env[api.TOKEN_ENV]
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags default to None so that only the ones given override file/env values."""
    a = p.add_argument
    a("--config", help="JSON or YAML file with settings (keys as the flag names)")
    a("--model", help="model directory vLLM serves")
    a("--served-name", help="model name in the OpenAI API (default: model)")
    a("--device", choices=["cpu", "cuda"])
    a("--max-model-len", type=int)
    a("--worker-extension", help="vLLM --worker-extension-cls; 'none' to disable")
    a("--bind-host", help="address the serve and admin ports bind to (default 0.0.0.0)")
    a("--serve-port", type=int, help=f"OpenAI API proxy port (default {api.SERVE_PORT})")
    a("--admin-port", type=int, help=f"control API port (default {api.ADMIN_PORT})")
    a("--vllm-port", type=int, help=f"vLLM's own port on 127.0.0.1 (default {api.VLLM_PORT})")
    a("--token-file", help=f"bearer token file (env {api.TOKEN_ENV})")
    a("--run-dir", help=f"vLLM's log and TMPDIR (default {api.DEFAULT_RUN_DIR})")
    a("--checkpoint", help="checkpoint directory to restore from at start")
    a("--checkpoint-root", help="POST /v1/checkpoint only writes below this directory")
    a("--restore-policy", choices=list(api.RESTORE_POLICIES))
    a("--criu", help=f"CRIU binary (env {api.CRIU_ENV}; default: criu on PATH)")
    a("--criu-plugins", help="CRIU plugin directory (-L), e.g. the CUDA plugin's")
    a("--mmap-restore", choices=["auto", "on", "off"])
    a("--prefetch", dest="prefetch", action="store_true", default=None)
    a("--no-prefetch", dest="prefetch", action="store_false")
    a("--prefetch-threads", type=int)
    a("--verify-checksums", choices=["crc32", "sha256", "size"])
    a("--drain-timeout", type=float, help="seconds to wait for in-flight requests")
    a("--boot-timeout", type=float)
    a("--restore-timeout", type=float)
    a("--no-seccomp", dest="seccomp_io_uring", action="store_false", default=None)
    a("--ns-last-pid", type=int, help="PID floor for vLLM's tree when the agent is PID 1")
    a("--no-clear-shm", dest="clear_shm", action="store_false", default=None)
    a("vllm_args", nargs="*", help="extra vLLM arguments, after --")


def from_args(ns: argparse.Namespace, env: dict[str, str] | None = None) -> AgentConfig:
    values: dict[str, Any] = from_env(dict(os.environ) if env is None else env)
    if getattr(ns, "config", None):
        values.update(load_file(ns.config))
    for f in fields(AgentConfig):
        v = getattr(ns, f.name, None)
        if v is None or (f.name == "vllm_args" and not v):
            continue
        values[f.name] = v
    if values.get("worker_extension") in ("none", ""):
        values["worker_extension"] = None
    for key in ("prefetch", "seccomp_io_uring", "clear_shm"):
        if key in values:
            values[key] = _bool(values[key])
    cfg = AgentConfig(**values)
    cfg.validate()
    return cfg


def normalize_checkpoint(value: str | None) -> str | None:
    """Empty, or an unexpanded Kubernetes $(VAR), means: no checkpoint."""
    if not value or value.startswith("$("):
        return None
    return value


def _cmd_agent(ns: argparse.Namespace) -> int:
    """Order matters for a fast restore: prefetch first, the restore flow next,
    and only then the HTTP side (aiohttp takes about a second to import)."""
    import signal
    import threading

    try:
        cfg = from_args(ns)
    except ConfigError as e:
        print(f"rekindle agent: {e}", file=sys.stderr)
        return 2
    from rekindle_agent import early

    early.begin(cfg)
    early_stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: early_stop.set())
    from rekindle_agent.agent import Agent, read_token, setup_logging

    setup_logging()
    Path(cfg.run_dir).mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        agent = Agent(cfg, read_token(cfg.token_file))
    except ConfigError as e:
        print(f"rekindle agent: {e}", file=sys.stderr)
        return 2
    starter = threading.Thread(target=agent.start, name="start", daemon=True)
    starter.start()
    from rekindle_agent.server import run

    return run(agent, starter, early_stop)


def add_agent(sub: argparse._SubParsersAction) -> None:
    """`rekindle agent ...`: the in-pod agent (PID 1 of the runtime container)."""
    p = sub.add_parser("agent", help="run the in-pod agent: boot/restore vLLM, checkpoint it")
    add_arguments(p)
    p.set_defaults(func=_cmd_agent)
