"""The restore pointer: the operator signs (path, service UID, Checkpoint UID); a pod the
operator made restores only from a pointer signed for its service, below its root."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
from rekindle_agent import config
from rekindle_agent.agent import Agent
from rekindle_agent.config import AgentConfig
from rekindle_contract import restore_pointer
from rekindle_contract.pod import CHECKPOINT_ENV, CHECKPOINT_SIGNATURE_ENV, SERVICE_UID_ENV

KEY = b"k" * 48
ROOT = "/var/lib/rekindle/checkpoints"
SERVICE = "5e1f0c2a-2222-4a3b-9c2d-0123456789ab"
CKPT_UID = "0d5a6c7e-1111-4a3b-9c2d-0123456789ab"
PATH = f"{ROOT}/c1-{CKPT_UID[:8]}"
GOOD = restore_pointer.sign(KEY, PATH, SERVICE, CKPT_UID)


def test_the_operators_signature_is_accepted() -> None:
    assert restore_pointer.problem(KEY, PATH, SERVICE, GOOD, ROOT) is None
    assert restore_pointer.problem(KEY, PATH, SERVICE, GOOD, ROOT + "/") is None


OTHER_UID = "99999999-1111-4a3b-9c2d-0123456789ab"


@pytest.mark.parametrize(
    ("key", "path", "service", "signature", "needle"),
    [
        # Another directory under the same signature (an edited ConfigMap).
        (KEY, f"{ROOT}/c0-{CKPT_UID[:8]}", SERVICE, GOOD, "does not match"),
        # The same pointer in another service's pods (or signed with another key).
        (KEY, PATH, OTHER_UID, GOOD, "does not match"),
        (b"o" * 48, PATH, SERVICE, GOOD, "does not match"),
        # Signed correctly, but for a directory that is not that Checkpoint's.
        (
            KEY,
            f"{ROOT}/c2-aaaaaaaa",
            SERVICE,
            restore_pointer.sign(KEY, f"{ROOT}/c2-aaaaaaaa", SERVICE, CKPT_UID),
            "not the signed Checkpoint's",
        ),
        (KEY, PATH, SERVICE, "", "no signature"),
        (KEY, PATH, SERVICE, None, "no signature"),
        (KEY, PATH, SERVICE, "v0:" + GOOD[3:], "format"),
        (KEY, PATH, SERVICE, "garbage", "format"),
        (None, PATH, SERVICE, GOOD, "no signing key"),
        # Paths out of the checkpoint root, however signed.
        (KEY, f"{ROOT}/../etc", SERVICE, GOOD, "normalized"),
        (KEY, f"{ROOT}/a/../c1-{CKPT_UID[:8]}", SERVICE, GOOD, "normalized"),
        (KEY, "-x", SERVICE, GOOD, "normalized"),
        (KEY, "/tmp/c1-0d5a6c7e", SERVICE, GOOD, "directly below"),
        (KEY, f"{ROOT}/c1/images", SERVICE, GOOD, "directly below"),
        (KEY, ROOT, SERVICE, GOOD, "directly below"),
    ],
)
def test_anything_else_is_refused(
    key: bytes | None, path: str, service: str, signature: str | None, needle: str
) -> None:
    why = restore_pointer.problem(key, path, service, signature, ROOT)
    assert why is not None and needle in why


def _cfg(env: dict[str, str], tmp_path: Path) -> AgentConfig:
    """The agent's settings as its container starts it: flags, then the pod's env."""
    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    ns = parser.parse_args(["--model", str(tmp_path), "--checkpoint-root", ROOT])
    return config.from_args(ns, env)


def test_a_pod_of_a_service_checks_the_pointer_from_its_env(tmp_path: Path) -> None:
    env = {CHECKPOINT_ENV: PATH, CHECKPOINT_SIGNATURE_ENV: GOOD, SERVICE_UID_ENV: SERVICE}
    assert config.refuse_unsigned_pointer(_cfg(env, tmp_path), KEY) is None
    # A value starting with "-" reaches the agent as data, not as a flag, and is refused.
    dash = _cfg({**env, CHECKPOINT_ENV: "--criu=/tmp/evil"}, tmp_path)
    assert dash.restore_from == "--criu=/tmp/evil" and dash.criu == "criu"
    why = config.refuse_unsigned_pointer(dash, KEY)
    assert why is not None and "normalized" in why
    unsigned = _cfg({CHECKPOINT_ENV: PATH, SERVICE_UID_ENV: SERVICE}, tmp_path)
    assert "no signature" in (config.refuse_unsigned_pointer(unsigned, KEY) or "")
    # An agent started by hand (no service UID) trusts its own flags.
    assert config.refuse_unsigned_pointer(_cfg({CHECKPOINT_ENV: PATH}, tmp_path), KEY) is None


@pytest.mark.parametrize(("policy", "state"), [("if-present", "Booted"), ("require", "Failed")])
def test_a_refused_pointer_boots_or_fails_and_says_why(
    tmp_path: Path, policy: str, state: str
) -> None:
    cfg = AgentConfig(
        model=str(tmp_path),
        run_dir=str(tmp_path / "run"),
        worker_extension="none",
        restore_policy=policy,
    )
    agent = Agent(cfg, b"t" * 24, signing_key=KEY, refused_pointer="the pointer is forged")
    booted: list[Any] = []
    agent.boot = lambda: booted.append(1) or agent.set_state("Booting", "booted")  # type: ignore[method-assign,func-returns-value]
    try:
        agent.start()
        doc = agent.status_doc()
        assert doc["last_fallback"] is not None
        assert doc["last_fallback"]["reason"] == "pointer_refused"
        assert doc["last_fallback"]["message"] == "the pointer is forged"
        assert booted == ([1] if state == "Booted" else [])
        if state == "Failed":
            assert doc["state"] == "Failed" and "the pointer is forged" in doc["message"]
    finally:
        agent.reaper.stop()
