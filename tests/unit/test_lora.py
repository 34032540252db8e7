"""LoRA serving, from spec.lora to vLLM's flags and the agent's admin routes.

The spec is parsed and refused as the CRD would; what the operator writes
(agent_command) is what the agent reads back and turns into vLLM's LoRA flags,
with adapter directories made absolute inside the model's; a spec without LoRA
keeps its fingerprint. The admin routes run against a fake vLLM (the real one:
tests/vllm/test_lora.py).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from aiohttp import ClientSession, ClientTimeout
from rekindle_agent.config import AgentConfig, ConfigError
from rekindle_agent.supervision.vllm_launch import vllm_command
from rekindle_contract import api, lora
from rekindle_operator.agent_command import agent_args
from rekindle_operator.spec import Lora, SpecError, parse_spec
from rekindle_operator.spec_fingerprint import spec_fingerprint

from tests.unit.test_agent_security_proxy import KEY, TOKEN, WAIT, call, serving

ADMIN = {"Authorization": "Bearer " + TOKEN.decode()}
LORA = {"maxAdapters": 2, "maxRank": 8, "adapters": [{"name": "sql", "path": "adapters/sql"}]}


def spec(**extra: object) -> dict[str, object]:
    return {"model": {"source": "/models/tiny"}, **extra}


def test_spec_lora_reaches_vllm_flags_and_the_fingerprint() -> None:
    s = parse_spec("tiny", "ns", spec(lora=LORA))
    assert s.lora == Lora(2, 8, (("sql", "adapters/sql"),))
    args = agent_args(s)
    assert (args.lora_max_adapters, args.lora_max_rank) == (2, 8)
    assert args.lora_adapters == "sql=adapters/sql"
    cfg = AgentConfig(
        model=args.model,
        lora_max_adapters=args.lora_max_adapters,
        lora_max_rank=args.lora_max_rank,
        lora_adapters=args.lora_adapters,
    )
    cfg.validate()
    argv, env = vllm_command(cfg)
    i = argv.index("--enable-lora")
    assert argv[i:] == [
        "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
        "--lora-modules", "sql=/models/tiny/adapters/sql",
    ]  # fmt: skip
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    # Off: no flag, no runtime loading, and the fingerprint a spec without it always had.
    plain = parse_spec("tiny", "ns", spec())
    argv, env = vllm_command(AgentConfig(model="/models/tiny"))
    assert "--enable-lora" not in argv and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in env
    assert agent_args(plain).lora_max_adapters == 0
    assert spec_fingerprint(s) != spec_fingerprint(plain)
    other = parse_spec("tiny", "ns", spec(lora={**LORA, "maxRank": 16}))
    assert spec_fingerprint(other) != spec_fingerprint(s)
    # Defaults: one adapter per batch, rank 16, none at start (all loaded at run time).
    assert parse_spec("tiny", "ns", spec(lora={})).lora == Lora(1, 16, ())


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ({"maxRank": 12}, "spec.lora.maxRank: 12; use one of 1, 8, 16"),
        ({"maxAdapters": 0}, "spec.lora.maxAdapters: 0 is not a whole number >= 1"),
        ({"adapters": [{"name": "sql"}]}, "spec.lora.adapters[0] needs name and path"),
        ({"adapters": [{"name": "sql", "path": "../other"}]}, "without '.', '..'"),
        ({"adapters": [{"name": "sql", "path": "/abs"}]}, "relative to the model's directory"),
        ({"adapters": [{"name": ".hidden", "path": "a"}]}, "not starting with '.'"),
        (
            {"adapters": [{"name": "a", "path": "x"}, {"name": "a", "path": "y"}]},
            "must be unique: a repeat",
        ),
        ({"adapters": [{"name": "tiny", "path": "x"}]}, "'tiny' is the base model's name"),
    ],
)
def test_refusals_say_what_to_change(value: dict[str, object], words: str) -> None:
    with pytest.raises(SpecError) as e:
        parse_spec("tiny", "ns", spec(lora=value))
    assert words in str(e.value), str(e.value)


def test_a_model_id_has_no_directory_for_adapters() -> None:
    with pytest.raises(SpecError) as e:
        parse_spec("tiny", "ns", {"model": {"source": "Qwen/Qwen2-0.5B"}, "lora": LORA})
    assert "is a model id" in str(e.value)


def test_the_agent_refuses_what_the_operator_would() -> None:
    for kw, words in (
        ({"lora_adapters": "sql=a"}, "needs --lora-max-adapters >= 1"),
        ({"lora_max_adapters": 1, "lora_max_rank": 7}, "--lora-max-rank 7: use one of"),
        ({"lora_max_adapters": 1, "lora_adapters": "sql"}, "write NAME=DIR"),
        ({"lora_max_adapters": 1, "lora_adapters": "model=a"}, "the base model's name"),
    ):
        with pytest.raises(ConfigError) as e:
            AgentConfig(model="/m", **kw).validate()
        assert words in str(e.value), (kw, str(e.value))
    assert lora.parse_adapters(lora.format_adapters([("a", "x/y"), ("b", "z")])) == [
        ("a", "x/y"),
        ("b", "z"),
    ]


def _adapter(model: Path, rel: str) -> None:
    (model / rel).mkdir(parents=True)
    (model / rel / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))


async def _admin_routes(tmp_path: Path) -> None:
    _adapter(tmp_path, "adapters/two")
    async with (
        serving(tmp_path, lora_max_adapters=2, lora_max_rank=8) as sv,
        ClientSession(timeout=ClientTimeout(total=WAIT)) as s,
    ):
        load, unload = sv.admin + api.PATH_LORA_LOAD[1:], sv.admin + api.PATH_LORA_UNLOAD[1:]
        body = {"name": "two", "dir": "adapters/two"}
        assert (await call(s, "POST", load, json=body))[0] == 401  # the admin token
        assert (await call(s, "POST", load, json=body, headers=KEY))[0] == 401  # not the API key
        status, text = await call(s, "POST", load, json=body, headers=ADMIN)
        assert status == 200, text
        for bad, code in (
            ({"name": "two", "dir": "../etc"}, 400),
            ({"name": "two", "dir": "/etc"}, 400),
            ({"name": "two"}, 400),
            ({"name": "two", "dir": "adapters/none"}, 404),  # no adapter_config.json there
        ):
            assert (await call(s, "POST", load, json=bad, headers=ADMIN))[0] == code, bad
        status, text = await call(s, "POST", unload, json={"name": "two"}, headers=ADMIN)
        assert status == 200, text
        assert sv.vllm.seen == ["POST /v1/load_lora_adapter", "POST /v1/unload_lora_adapter"]
        # The serve port never forwards vLLM's own routes for it.
        for path in ("v1/load_lora_adapter", "v1/unload_lora_adapter"):
            assert (await call(s, "POST", sv.url + path, json={}, headers=KEY))[0] == 404
        assert len(sv.vllm.seen) == 2


def test_admin_loads_and_unloads_adapters_inside_the_model(tmp_path: Path) -> None:
    asyncio.run(_admin_routes(tmp_path))


async def _lora_off(tmp_path: Path) -> None:
    async with serving(tmp_path) as sv, ClientSession(timeout=ClientTimeout(total=WAIT)) as s:
        body = {"name": "two", "dir": "adapters/two"}
        status, text = await call(s, "POST", sv.admin + "v1/lora/load", json=body, headers=ADMIN)
        assert status == 409 and "set spec.lora" in text


def test_admin_refuses_lora_when_it_is_off(tmp_path: Path) -> None:
    asyncio.run(_lora_off(tmp_path))
