"""The agent's settings: AgentArgs (the contract) read from flags, a file and the environment.

Every flag is defined once, as a field of rekindle_contract.agent_args.AgentArgs
(name, default, help, choices); the operator and the test harness build the
agent's argv from the same fields with agent_argv(), so a flag cannot exist on
one side only. Precedence: command-line flag > --config file > environment >
default.
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
import types
import typing
from dataclasses import MISSING, Field, dataclass, fields
from pathlib import Path
from typing import Any

from rekindle_contract import lora, restore_pointer
from rekindle_contract.agent_args import AgentArgs, flag
from rekindle_contract.pod import (
    API_KEY_ENV,
    CHECKPOINT_ENV,
    CHECKPOINT_SIGNATURE_ENV,
    CRIU_ENV,
    METRICS_TOKEN_ENV,
    NODE_SOCKET_ENV,
    POD_UID_ENV,
    SERVICE_UID_ENV,
    SIGNING_KEY_ENV,
    TOKEN_ENV,
)

# Settings that may also come from the environment (the pod spec sets these).
ENV_VARS = {
    "criu": CRIU_ENV,
    "restore_from": CHECKPOINT_ENV,
    "restore_signature": CHECKPOINT_SIGNATURE_ENV,
    "service_uid": SERVICE_UID_ENV,
    "token_file": TOKEN_ENV,
    "metrics_token_file": METRICS_TOKEN_ENV,
    "api_key_file": API_KEY_ENV,
    "signing_key_file": SIGNING_KEY_ENV,
    "node_socket": NODE_SOCKET_ENV,
    "pod_uid": POD_UID_ENV,
}
# Content checks that authenticate (with a signed manifest); crc32 and size do not.
SECURE_VERIFY = ("blake3", "sha256")
# Ports that may be 0 (the kernel picks; --ports-file says which).
ANY_PORT_OK = ("serve_port", "admin_port")


class ConfigError(ValueError):
    """A bad setting; the message says which and what to change."""


@dataclass
class AgentConfig(AgentArgs):
    """AgentArgs after validate(): what the agent runs with."""

    def validate(self) -> None:
        if not self.model:
            raise ConfigError("--model is required: the model directory vLLM serves")
        for f in fields(self):
            choices = f.metadata.get("choices")
            value = getattr(self, f.name)
            if choices and value not in choices:
                raise ConfigError(f"{flag(f.name)} {value!r}: use one of {', '.join(choices)}")
        self._validate_ports()
        for name in (
            "drain_timeout",
            "boot_timeout",
            "restore_timeout",
            "dump_timeout",
            "checkpoint_timeout",
            "prefetch_timeout",
            "proxy_timeout",
            "proxy_body_timeout",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{flag(name)} must be > 0 seconds")
        if self.shutdown_drain < 0:
            raise ConfigError("--shutdown-drain must be >= 0 seconds (0: cut at once)")
        for name in (
            "tensor_parallel_size",
            "prefetch_threads",
            "proxy_max_body_mb",
            "proxy_max_concurrency",
            "proxy_body_buffer_mb",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{flag(name)} must be >= 1")
        if self.proxy_body_buffer_mb < self.proxy_max_body_mb:
            raise ConfigError(
                "--proxy-body-buffer-mb must be at least --proxy-max-body-mb: a body of the "
                "largest allowed size must fit"
            )
        if self.gpu_host_copy_limit_mb < 0:
            raise ConfigError("--gpu-host-copy-limit-mb must be >= 0")
        if self.keep_resident_mb < 0:
            raise ConfigError("--keep-resident-mb must be >= 0 (0: off)")
        if self.checkpoint_timeout <= self.drain_timeout:
            raise ConfigError("--checkpoint-timeout must be longer than --drain-timeout")
        if self.node_socket and not self.pod_uid:
            raise ConfigError(
                "--node-socket needs --pod-uid (or REKINDLE_POD_UID from the downward API): "
                "the node agent answers a pod only about itself"
            )
        if (self.node_publish or self.node_store) and not self.node_socket:
            which = "--node-publish" if self.node_publish else "--node-store"
            raise ConfigError(f"{which} needs --node-socket: the node agent publishes and pulls")
        if self.node_publish and self.node_store:
            raise ConfigError(
                "--node-publish and --node-store: choose one place to publish checkpoints"
            )
        if self.signing_key_file and self.verify_checksums not in SECURE_VERIFY:
            raise ConfigError(
                f"--verify-checksums {self.verify_checksums} with --signing-key-file: a signed "
                f"checkpoint needs a cryptographic content check ({' or '.join(SECURE_VERIFY)})"
            )
        self._validate_lora()
        if self.checkpoint_root and not os.path.isabs(self.checkpoint_root):
            raise ConfigError("--checkpoint-root must be an absolute path")
        if self.service_uid and not self.checkpoint_root:
            raise ConfigError(
                "--service-uid needs --checkpoint-root: a signed restore pointer must name "
                "a directory directly below it"
            )
        if not os.path.isabs(self.run_dir):
            raise ConfigError("--run-dir must be an absolute path")
        if self.kv_store_dir and (self.device != "cuda" or not self.kv_offload_gb):
            raise ConfigError(
                "--kv-store-dir needs --device cuda and --kv-offload-gb: vLLM moves KV chunks "
                "to the store through its CPU offload, which its CPU build does not have"
            )
        self._validate_admin_tls()

    def _validate_admin_tls(self) -> None:
        """Both TLS flags or neither, and files that load: a bad certificate stops the
        agent at start, naming the flag, rather than failing every connection later."""
        if bool(self.admin_tls_cert) != bool(self.admin_tls_key):
            raise ConfigError(
                "--admin-tls-cert and --admin-tls-key go together: give both "
                "(the certificate chain and its key) or neither (plain HTTP)"
            )
        if self.admin_tls_cert and self.admin_tls_key:
            admin_tls_context(self.admin_tls_cert, self.admin_tls_key)

    def _validate_lora(self) -> None:
        if self.lora_max_adapters < 0:
            raise ConfigError("--lora-max-adapters must be >= 0 (0: LoRA off)")
        if self.lora_max_rank not in lora.MAX_RANKS:
            ranks = ", ".join(map(str, lora.MAX_RANKS))
            raise ConfigError(f"--lora-max-rank {self.lora_max_rank}: use one of {ranks}")
        try:
            adapters = lora.parse_adapters(self.lora_adapters)
        except lora.LoraError as e:
            raise ConfigError(f"--lora-adapters: {e}") from e
        if adapters and not self.lora_max_adapters:
            raise ConfigError("--lora-adapters needs --lora-max-adapters >= 1 (LoRA is off)")
        if self.lora_max_adapters and not os.path.isabs(self.model):
            raise ConfigError(
                "LoRA adapters are directories inside the model's directory: --model must "
                "be an absolute directory, not a model id"
            )
        if self.served_name in {n for n, _ in adapters}:
            raise ConfigError(
                f"--lora-adapters: {self.served_name!r} is the base model's name "
                "(--served-name); give the adapter another"
            )

    def _validate_ports(self) -> None:
        ports = {"serve_port": self.serve_port, "admin_port": self.admin_port}
        ports["vllm_port"] = self.vllm_port
        for name, port in ports.items():
            low = 0 if name in ANY_PORT_OK else 1
            if not low <= port <= 65535:
                # vLLM's port is recorded in the checkpoint: the restored server
                # listens on it again, so it must be a fixed number.
                raise ConfigError(f"{flag(name)} {port}: use {low}..65535")
        fixed = [p for p in ports.values() if p != 0]
        if len(set(fixed)) != len(fixed):
            raise ConfigError("--serve-port, --admin-port and --vllm-port must all differ")


def _no_password() -> bytes:
    """An encrypted key fails to load instead of OpenSSL prompting on a terminal PID 1 lacks."""
    return b""


def admin_tls_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    """The admin port's server side: TLS 1.2 or later with this certificate chain and key.

    Raises ConfigError naming the flag whose file is missing or unreadable, or
    both flags when the files do not hold a PEM chain and its (unencrypted) key.
    """
    for name, path in (("admin_tls_cert", cert_file), ("admin_tls_key", key_file)):
        try:
            with open(path, "rb"):
                pass
        except OSError as e:
            raise ConfigError(
                f"{flag(name)} {path}: {e.strerror or e}; mount the admin TLS Secret "
                "there or drop --admin-tls-cert and --admin-tls-key"
            ) from e
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert_file, key_file, password=_no_password)
    except ssl.SSLError as e:
        raise ConfigError(
            f"--admin-tls-cert {cert_file} and --admin-tls-key {key_file} are not a PEM "
            f"certificate chain and its unencrypted private key: {e}"
        ) from e
    return ctx


_HINTS = typing.get_type_hints(AgentArgs)


def _kind(f: Field[Any]) -> type:
    """The scalar type of a field: int for `int | None`, list for `list[str]`."""
    hint = _HINTS[f.name]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    kind = typing.get_origin(hint) or hint
    assert isinstance(kind, type), hint
    return kind


def _default(f: Field[Any]) -> Any:
    return f.default if f.default is not MISSING else None


def _help(f: Field[Any]) -> str:
    text = str(f.metadata.get("help", ""))
    if f.name in ENV_VARS:
        text += f"; env {ENV_VARS[f.name]}"
    default = _default(f)
    if default not in (None, "") and _kind(f) is not bool:
        text += f" (default: {default})"
    return text


def add_arguments(p: argparse.ArgumentParser) -> None:
    """One flag per AgentArgs field. Defaults are None, so a flag overrides only if given."""
    p.add_argument("--config", help="JSON or YAML file of settings (keys: the flag names)")
    for f in fields(AgentArgs):
        kind = _kind(f)
        if f.name == "vllm_args":
            p.add_argument("vllm_args", nargs="*", help="vLLM's own flags, after --")
        elif kind is bool:
            p.add_argument(flag(f.name), action=argparse.BooleanOptionalAction, help=_help(f))
        else:
            choices = f.metadata.get("choices")
            p.add_argument(flag(f.name), type=kind, choices=choices, help=_help(f))


def _bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    return str(v).strip().lower() in ("1", "true", "yes", "on")


def _coerce(f: Field[Any], value: Any, where: str) -> Any:
    """A file or env value as the field's type (a YAML '5' for a float, 'false' for a bool)."""
    kind = _kind(f)
    if value is None:
        return None
    if kind is bool:
        return _bool(value)
    if kind is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: {f.name} must be a list of strings")
        return [str(v) for v in value]
    try:
        return kind(value)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {f.name} {value!r} is not a {kind.__name__}") from e


def load_file(path: str) -> dict[str, Any]:
    """A JSON or YAML mapping whose keys are AgentArgs field names (dashes allowed)."""
    text = Path(path).read_text()
    if path.endswith((".yaml", ".yml")):
        import yaml

        data = yaml.safe_load(text) or {}
    else:
        data = json.loads(text)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of settings")
    by_name = {f.name: f for f in fields(AgentArgs)}
    out: dict[str, Any] = {}
    for k, v in data.items():
        key = str(k).replace("-", "_")
        if key not in by_name:
            raise ConfigError(f"{path}: unknown setting {k!r}; known: {sorted(by_name)}")
        out[key] = _coerce(by_name[key], v, path)
    return out


def from_env(env: dict[str, str]) -> dict[str, Any]:
    return {name: env[var] for name, var in ENV_VARS.items() if env.get(var)}


def normalize_checkpoint(value: str | None) -> str | None:
    """Empty, or an unexpanded Kubernetes $(VAR) (the variable is not set), means: none."""
    if not value or value.startswith("$("):
        return None
    return value


def refuse_unsigned_pointer(cfg: AgentConfig, signing_key: bytes | None) -> str | None:
    """Why cfg's --restore-from must be ignored (the pod then boots), or None.

    Only a pod the operator made knows its service's UID (--service-uid); for
    it the pointer comes from a ConfigMap that more people can edit than the
    Deployment, so it must carry the operator's signature
    (rekindle_contract.restore_pointer). An agent started by hand trusts its flags.
    """
    if not cfg.restore_from or not cfg.service_uid:
        return None
    return restore_pointer.problem(
        signing_key,
        cfg.restore_from,
        cfg.service_uid,
        cfg.restore_signature,
        cfg.checkpoint_root or "",
    )


def check_model_dir(model: str) -> None:
    """Refuse a model path that is not a directory here, before vLLM starts.

    vLLM takes a missing path for a hub id and fails with "Repo id must be in the
    form ...", which points nowhere near the cause.
    """
    if model.startswith("/") and not Path(model).is_dir():
        raise ConfigError(
            f"--model {model}: no such directory in this container. spec.model.source names a "
            "directory inside the runtime image; for weights outside it use spec.model.pvc, "
            "spec.model.hostPath or spec.model.huggingFace"
        )


def from_args(ns: argparse.Namespace, env: dict[str, str] | None = None) -> AgentConfig:
    """The validated settings: flags over the --config file over env over defaults."""
    values: dict[str, Any] = from_env(dict(os.environ) if env is None else env)
    if getattr(ns, "config", None):
        values.update(load_file(ns.config))
    for f in fields(AgentArgs):
        v = getattr(ns, f.name, None)
        if v is None or (f.name == "vllm_args" and not v):
            continue
        values[f.name] = v
    values["restore_from"] = normalize_checkpoint(values.get("restore_from"))
    cfg = AgentConfig(**values)
    cfg.validate()
    return cfg
