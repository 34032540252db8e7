from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from rekindle_agent import api, config, state
from rekindle_agent.agent import normalize_checkpoint, token_ok


def _parse(argv: list[str], env: dict[str, str] | None = None) -> config.AgentConfig:
    p = argparse.ArgumentParser()
    config.add_arguments(p)
    return config.from_args(p.parse_args(argv), env=env or {})


def test_precedence_flag_over_file_over_env(tmp_path: Path) -> None:
    f = tmp_path / "agent.json"
    f.write_text(json.dumps({"model": "/m", "criu": "/file/criu", "drain-timeout": 5}))
    cfg = _parse(["--config", str(f)], env={api.CRIU_ENV: "/env/criu"})
    assert (cfg.criu, cfg.drain_timeout, cfg.model) == ("/file/criu", 5, "/m")
    cfg = _parse(["--config", str(f), "--criu", "/flag/criu"], env={api.CRIU_ENV: "/env/criu"})
    assert cfg.criu == "/flag/criu"
    assert _parse(["--model", "/m"], env={api.CRIU_ENV: "/env/criu"}).criu == "/env/criu"


def test_defaults_and_passthrough() -> None:
    cfg = _parse(["--model", "/m", "--no-prefetch", "--", "--dtype", "float32"])
    assert (cfg.serve_port, cfg.admin_port, cfg.vllm_port) == (8000, 8081, 18000)
    assert cfg.prefetch is False and cfg.seccomp_io_uring is True
    assert cfg.vllm_args == ["--dtype", "float32"]
    assert cfg.restore_policy == "if-present"


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        ([], "--model is required"),
        (["--model", "/m", "--serve-port", "8081"], "must all differ"),
        (["--model", "/m", "--run-dir", "rel"], "absolute"),
        (["--model", "/m", "--drain-timeout", "0"], "drain-timeout"),
    ],
)
def test_bad_settings_say_what_to_change(argv: list[str], needle: str) -> None:
    with pytest.raises(config.ConfigError, match=needle):
        _parse(argv)


def test_unknown_file_key(tmp_path: Path) -> None:
    f = tmp_path / "a.json"
    f.write_text(json.dumps({"model": "/m", "prot": 1}))
    with pytest.raises(config.ConfigError, match="unknown setting 'prot'"):
        _parse(["--config", str(f)])


def test_checkpoint_env_and_unexpanded_k8s_var() -> None:
    assert _parse(["--model", "/m"], env={"REKINDLE_CHECKPOINT": "/c/1"}).checkpoint == "/c/1"
    assert normalize_checkpoint("$(REKINDLE_CHECKPOINT)") is None
    assert normalize_checkpoint("") is None
    assert normalize_checkpoint("/c/1") == "/c/1"


def test_token_check() -> None:
    tok = b"s3cret-token-0123456789"
    assert token_ok(tok, "Bearer s3cret-token-0123456789")
    assert not token_ok(tok, "Bearer s3cret-token-012345678")
    assert not token_ok(tok, "s3cret-token-0123456789")
    assert not token_ok(tok, None)


def test_state_transitions() -> None:
    st = state.Status()
    for s in ("Ready", "Draining", "Checkpointing", "Restoring", "Ready"):
        st.set_state(s)
    with pytest.raises(state.TransitionError):
        st.set_state("Checkpointing")  # must drain first
    st.record_fallback("checksum_mismatch", "pages-1.img")
    doc = st.to_json()
    assert doc["ready"] and doc["last_fallback"]["reason"] == "checksum_mismatch"
    assert set(state.TRANSITIONS) == set(api.STATES)
