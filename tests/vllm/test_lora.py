"""LoRA serving on a real vLLM, through the agent, across a checkpoint.

A tiny model with two generated adapters inside its directory (PEFT format,
rekindle_dev.models.generate_lora_adapter): one served from the start
(--lora-adapters), one loaded at run time through the admin API. Each changes
greedy output (the oracle that the adapter is applied, not ignored); the serve
port refuses vLLM's own loading route; after the checkpoint (whose proving
restore is the server answering afterwards), base model and both adapters answer
exactly as before, and an unloaded adapter is gone.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from rekindle_dev.models import generate_lora_adapter, generate_tiny_model

from tests.vllm.conftest import PROMPTS, AgentFactory, AgentProc, factory_for

pytestmark = [pytest.mark.vllm, pytest.mark.criu]

ASKED = PROMPTS[:3]


@pytest.fixture(scope="module")
def lora_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = generate_tiny_model(tmp_path_factory.mktemp("models") / "tiny-lora")
    generate_lora_adapter(model / "adapters" / "sql", seed=1)
    generate_lora_adapter(model / "adapters" / "two", seed=2)
    return model


@pytest.fixture(scope="module")
def lora_factory(
    tmp_path_factory: pytest.TempPathFactory, lora_model: Path, criu_prefix: Path
) -> Iterator[AgentFactory]:
    yield from factory_for(tmp_path_factory, "agent-lora", lora_model, criu_prefix)


def answers(agent: AgentProc, model: str) -> list[str]:
    return [agent.complete(p, model=model) for p in ASKED]


def served_models(agent: AgentProc) -> set[str]:
    with urllib.request.urlopen(agent.serve_url + "/v1/models", timeout=30) as r:
        return {m["id"] for m in json.loads(r.read())["data"]}


def test_adapters_serve_and_survive_a_checkpoint(lora_factory: AgentFactory) -> None:
    agent = lora_factory.start(
        name="lora", lora_max_adapters=2, lora_max_rank=8, lora_adapters="sql=adapters/sql"
    )
    try:
        assert agent.wait_ready(600).origin == "booted"
        base, sql = answers(agent, "tiny"), answers(agent, "sql")
        assert sql != base, "the adapter changed nothing: is it applied?"
        # vLLM's own loading route is not on the serve port ...
        req = urllib.request.Request(
            agent.serve_url + "/v1/load_lora_adapter",
            data=json.dumps({"lora_name": "x", "lora_path": "/"}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=30)
        assert e.value.code == 404
        # ... the admin API loads one from inside the model's directory.
        agent.client.load_lora("two", "adapters/two")
        two = answers(agent, "two")
        assert two != base and two != sql
        assert served_models(agent) >= {"tiny", "sql", "two"}

        agent.client.checkpoint(str(lora_factory.checkpoints / "lora"), timeout=900)
        assert agent.wait_ready(60).origin == "restored"
        assert answers(agent, "tiny") == base
        assert answers(agent, "sql") == sql
        assert answers(agent, "two") == two  # loaded at run time, kept by the checkpoint

        agent.client.unload_lora("two")
        assert "two" not in served_models(agent)
        with pytest.raises(urllib.error.HTTPError) as e:
            agent.complete(ASKED[0], model="two")
        assert e.value.code == 404
    except BaseException:
        print(agent.tail(120))
        raise
    finally:
        agent.stop()
