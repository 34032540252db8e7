from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest
from rekindle_agent import cli, config, state
from rekindle_agent.config import normalize_checkpoint
from rekindle_agent.serving.auth import token_ok
from rekindle_contract import api
from rekindle_contract.agent_args import AGENT_COMMAND, AgentArgs, agent_argv
from rekindle_contract.pod import CHECKPOINT_ENV, CRIU_ENV


def _parse(argv: list[str], env: dict[str, str] | None = None) -> config.AgentConfig:
    p = argparse.ArgumentParser()
    config.add_arguments(p)
    return config.from_args(p.parse_args(argv), env=env or {})


def _parse_command(argv: list[str], env: dict[str, str] | None = None) -> config.AgentConfig:
    """A whole `rekindle agent ...` command line, through the agent's own parser."""
    assert tuple(argv[:2]) == AGENT_COMMAND
    ns = cli.build_parser().parse_args(argv[1:])
    assert ns.func is cli.run_agent
    return config.from_args(ns, env=env or {})


def test_precedence_flag_over_file_over_env(tmp_path: Path) -> None:
    f = tmp_path / "agent.json"
    f.write_text(json.dumps({"model": "/m", "criu": "/file/criu", "drain-timeout": 5}))
    cfg = _parse(["--config", str(f)], env={CRIU_ENV: "/env/criu"})
    assert (cfg.criu, cfg.drain_timeout, cfg.model) == ("/file/criu", 5, "/m")
    cfg = _parse(["--config", str(f), "--criu", "/flag/criu"], env={CRIU_ENV: "/env/criu"})
    assert cfg.criu == "/flag/criu"
    assert _parse(["--model", "/m"], env={CRIU_ENV: "/env/criu"}).criu == "/env/criu"


def test_defaults_and_passthrough() -> None:
    cfg = _parse(["--model", "/m", "--no-prefetch", "--", "--dtype", "float32"])
    assert (cfg.serve_port, cfg.admin_port, cfg.vllm_port) == (8000, 8081, 18000)
    assert cfg.prefetch is False and cfg.seccomp_io_uring is True
    assert cfg.vllm_args == ["--dtype", "float32"]
    assert cfg.restore_policy == "if-present"
    assert dataclasses.asdict(_parse(["--model", "/m"])) == dataclasses.asdict(AgentArgs("/m"))


def test_every_setting_round_trips_through_agent_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the operator and the harness write (agent_argv) is what the agent reads back."""
    # The certificate files are loaded at validation (test_agent_admin_tls.py); here
    # only the argv matters.
    monkeypatch.setattr(config, "admin_tls_context", lambda cert, key: None)
    args = AgentArgs(
        model="/models/m",
        served_name="llama",
        device="cuda",
        max_model_len=4096,
        tensor_parallel_size=2,
        mm_shm_cache_gb=1.5,
        mm_shm_max_object_mb=64,
        prefix_caching=False,
        cpu_compile=True,
        kv_offload_gb=4.0,
        worker_extension="none",
        bind_host="127.0.0.1",
        serve_port=0,
        admin_port=0,
        vllm_port=19000,
        ports_file="/tmp/ports.json",
        token_file="/secrets/token",
        metrics_token_file="/secrets/metrics-token",
        run_dir="/run/rekindle",
        restore_from="/ckpt/c1",
        restore_signature="v1:0d5a6c7e:00",
        service_uid="5e1f0c2a-2222-4a3b-9c2d-0123456789ab",
        checkpoint_root="/ckpt",
        restore_policy="require",
        criu="/opt/criu/bin/criu",
        criu_plugins="/opt/criu/plugins",
        cuda_checkpoint="/opt/nvidia/bin/cuda-checkpoint",
        mmap_restore="on",
        prefetch=False,
        prefetch_threads=3,
        verify_checksums="sha256",
        drain_timeout=12.5,
        boot_timeout=60.0,
        restore_timeout=30.0,
        seccomp_io_uring=False,
        lora_max_adapters=3,
        lora_max_rank=64,
        lora_adapters="sql=adapters/sql,chat=adapters/chat-v2",
        ns_last_pid=20000,
        clear_shm=False,
        api_key_file="/secrets/api-key",
        signing_key_file="/secrets/signing-key",
        node_socket="/run/rekindle-node/node.sock",
        pod_uid="0d5a6c7e-1111-4a3b-9c2d-0123456789ab",
        node_publish=True,
        dump_timeout=45.0,
        checkpoint_timeout=120.0,
        prefetch_timeout=33.0,
        proxy_timeout=7.5,
        proxy_max_body_mb=8,
        proxy_body_timeout=12.0,
        proxy_body_buffer_mb=64,
        proxy_max_concurrency=3,
        admin_tls_cert="/secrets/tls/tls.crt",
        admin_tls_key="/secrets/tls/tls.key",
        kv_store_dir="/var/lib/rekindle/kv-store",
        allowed_media_domains="images.example.com,10.0.0.5",
        media_redirects=True,
        shutdown_drain=12.5,
        keep_resident_mb=256,
        gpu_host_copy_limit_mb=2048,
        vllm_args=["--dtype", "float32", "--seed", "7"],
    )
    # Where checkpoints are published is one choice of two flags: the other one's
    # round trip is the second argv.
    store = dataclasses.replace(args, node_publish=False, node_store=True)
    defaults = AgentArgs()
    same_as_default = [
        f.name
        for f in dataclasses.fields(AgentArgs)
        if f.name != "model"
        and getattr(args, f.name) == getattr(defaults, f.name)
        and getattr(store, f.name) == getattr(defaults, f.name)
    ]
    assert not same_as_default, f"give these a non-default value: {same_as_default}"
    for one in (args, store):
        cfg = _parse_command(agent_argv(one))
        assert dataclasses.asdict(cfg) == dataclasses.asdict(one)


def test_the_checkpoint_to_restore_comes_from_the_pods_env() -> None:
    """The operator's argv names no checkpoint: REKINDLE_CHECKPOINT (from the restore
    pointer's ConfigMap key, optional) does; unset or empty means boot."""
    argv = agent_argv(
        AgentArgs(
            model="/models/m",
            served_name="m",
            checkpoint_root="/var/lib/rekindle/checkpoints",
            prefetch=False,
            vllm_args=["--max-num-seqs", "8"],
        )
    )
    assert "--restore-from" not in argv
    cfg = _parse_command(argv)
    assert cfg.restore_from is None and cfg.prefetch is False
    assert cfg.vllm_args == ["--max-num-seqs", "8"]
    assert _parse_command(argv, {CHECKPOINT_ENV: ""}).restore_from is None
    assert _parse_command(argv, {CHECKPOINT_ENV: "/ckpt/c2"}).restore_from == "/ckpt/c2"


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        ([], "--model is required"),
        (["--model", "/m", "--serve-port", "8081"], "must all differ"),
        (["--model", "/m", "--vllm-port", "0"], "--vllm-port 0"),
        (["--model", "/m", "--run-dir", "rel"], "absolute"),
        (["--model", "/m", "--drain-timeout", "0"], "drain-timeout"),
        (["--model", "/m", "--node-publish"], "--node-publish needs --node-socket"),
        (["--model", "/m", "--node-store"], "--node-store needs --node-socket"),
        (
            [
                "--model",
                "/m",
                "--node-socket",
                "/s",
                "--pod-uid",
                "u",
                "--node-store",
                "--node-publish",
            ],
            "choose one place to publish",
        ),
    ],
)
def test_bad_settings_say_what_to_change(argv: list[str], needle: str) -> None:
    with pytest.raises(config.ConfigError, match=needle):
        _parse(argv)


def test_port_zero_for_the_agents_own_ports() -> None:
    cfg = _parse(["--model", "/m", "--serve-port", "0", "--admin-port", "0"])
    assert (cfg.serve_port, cfg.admin_port) == (0, 0)


def test_file_values_are_checked_like_flags(tmp_path: Path) -> None:
    f = tmp_path / "a.json"
    f.write_text(json.dumps({"model": "/m", "prot": 1}))
    with pytest.raises(config.ConfigError, match="unknown setting 'prot'"):
        _parse(["--config", str(f)])
    f.write_text(json.dumps({"model": "/m", "mmap-restore": "maybe"}))
    with pytest.raises(config.ConfigError, match="--mmap-restore 'maybe'"):
        _parse(["--config", str(f)])
    f.write_text(json.dumps({"model": "/m", "prefetch": "false", "prefetch_threads": "3"}))
    cfg = _parse(["--config", str(f)])
    assert cfg.prefetch is False and cfg.prefetch_threads == 3


def test_checkpoint_env_and_unexpanded_k8s_var() -> None:
    assert _parse(["--model", "/m"], env={CHECKPOINT_ENV: "/c/1"}).restore_from == "/c/1"
    assert normalize_checkpoint("$(REKINDLE_CHECKPOINT)") is None
    assert normalize_checkpoint("") is None
    assert normalize_checkpoint("/c/1") == "/c/1"


def test_token_check() -> None:
    tok = b"s3cret-token-0123456789"
    assert token_ok(tok, "Bearer s3cret-token-0123456789")
    assert not token_ok(tok, "Bearer s3cret-token-012345678")
    assert not token_ok(tok, "s3cret-token-0123456789")
    assert not token_ok(tok, None)


def test_state_transitions_and_ready_at() -> None:
    st = state.Status()
    assert st.to_json()["ready_at"] is None
    for s in ("Ready", "Draining", "Checkpointing", "Restoring", "Ready"):
        st.set_state(s)  # type: ignore[arg-type]
    with pytest.raises(state.TransitionError):
        st.set_state("Checkpointing")  # must drain first
    st.record_fallback("checksum_mismatch", "pages-1.img")
    doc = st.to_json(vllm_pid=42, inflight=3)
    assert doc["ready"] and doc["last_fallback"]["reason"] == "checksum_mismatch"
    assert doc["ready_at"] is not None and doc["ready_at"] >= doc["started_at"]
    assert (doc["vllm_pid"], doc["inflight"]) == (42, 3)
    assert set(doc) == set(api.StatusDoc.__annotations__)
    assert set(state.TRANSITIONS) == set(api.STATES)


def test_a_missing_model_directory_is_named_before_vllm_starts(tmp_path: Path) -> None:
    config.check_model_dir(str(tmp_path))  # there: fine
    config.check_model_dir("HuggingFaceTB/SmolLM2-135M-Instruct")  # a hub id: vLLM's business
    with pytest.raises(config.ConfigError, match=r"/models/nope: no such directory.*spec\.model"):
        config.check_model_dir("/models/nope")
