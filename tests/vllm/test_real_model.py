"""A trained model (SmolLM2-135M-Instruct) answers the same after a restore, and a second one.

The tiny random model proves bit-equal computation; this one also shows that
what comes back is still right: "The capital of France is" ends in Paris
before the checkpoint and after each restore. One boot (its checkpoint
includes the agent's own verification restore), then two restores in fresh
namespaces, like two new pods: the mmap restore where this CRIU has it, then a
copying one. Prompts span one to several of vLLM's KV blocks (128 tokens on
CPU), and a batch is sent concurrently so the restored scheduler batches them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from rekindle_agent import criu
from rekindle_dev.smollm2 import OUTPUT_FILES, generate_smollm2

from tests.vllm.conftest import AgentFactory, AgentProc, factory_for

pytestmark = [pytest.mark.vllm, pytest.mark.criu]

SERVED = "smollm2"
MAX_TOKENS = 24
CPU_KV_BLOCK = 128  # vLLM's default KV block size on CPU (tokens)
MAX_MODEL_LEN = 1024
PORTS = ["Dover", "Calais", "Ostend", "Bergen", "Cork", "Bilbao", "Genoa", "Naples"]


def _ferry_log(days: int) -> str:
    """A long, varied prompt (no repeated sentence): one KV block every few days."""
    lines = [
        f"On day {d}, the ferry left {PORTS[d % len(PORTS)]} at {6 + d % 12} o'clock "
        f"with {40 + (d * 37) % 200} passengers and {3 + (d * 7) % 20} cars."
        for d in range(1, days + 1)
    ]
    return (
        "Ferry log.\n"
        + "\n".join(lines)
        + "\nQuestion: which port did the ferry leave on day 3? Answer:"
    )


# Plain completions of several lengths: 5 tokens to more than four KV blocks.
PROMPTS = [
    "The capital of France is",
    "Water boils at a temperature of",
    "Here is a short list of three fruits: apples,",
    _ferry_log(6),
    _ferry_log(28),
]
# The same questions sent at once, so the server batches them.
BATCH = [*PROMPTS, "The largest planet in the solar system is", "A week has seven days:"]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@dataclass
class Answers:
    """Everything one server said: the oracle is equality of two Answers."""

    sequential: list[str] = field(default_factory=list)
    batch: list[str] = field(default_factory=list)
    chat: str = ""


def ask(agent: AgentProc) -> Answers:
    out = Answers(sequential=[agent.complete(p, MAX_TOKENS, model=SERVED) for p in PROMPTS])
    with ThreadPoolExecutor(len(BATCH)) as pool:
        out.batch = list(pool.map(lambda p: agent.complete(p, MAX_TOKENS, model=SERVED), BATCH))
    body = {"model": SERVED, "messages": CHAT, "max_tokens": MAX_TOKENS, "temperature": 0}
    status, text = agent.request("POST", "/v1/chat/completions", body, timeout=120)
    assert status == 200, text
    out.chat = json.loads(text)["choices"][0]["message"]["content"]
    return out


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The converted model (from the cache after the first run; ~30 s the first time)."""
    return generate_smollm2(tmp_path_factory.mktemp("models") / "smollm2")


@pytest.fixture(scope="module")
def factory(
    tmp_path_factory: pytest.TempPathFactory, smollm2: Path, criu_prefix: Path
) -> Iterator[AgentFactory]:
    yield from factory_for(tmp_path_factory, "agent-smollm2", smollm2, criu_prefix, SERVED)


def test_converted_directory_is_what_vllm_reads(smollm2: Path) -> None:
    """Plain HF layout: bf16 safetensors, no GGUF quantization entry, tokenizer, template."""
    from safetensors import safe_open

    assert sorted(p.name for p in smollm2.iterdir()) == sorted(OUTPUT_FILES)
    cfg = json.loads((smollm2 / "config.json").read_text())
    assert "quantization_config" not in cfg
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["dtype"] == "bfloat16"
    assert cfg["tie_word_embeddings"] is True
    with safe_open(str(smollm2 / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        dtypes = {str(f.get_slice(n).get_dtype()) for n in names}
        embed = f.get_slice("model.embed_tokens.weight").get_shape()
    assert dtypes == {"BF16"}
    assert "lm_head.weight" not in names  # tied: vLLM reuses the embedding
    assert (
        len([n for n in names if n.endswith("self_attn.q_proj.weight")]) == cfg["num_hidden_layers"]
    )
    assert embed == [cfg["vocab_size"], cfg["hidden_size"]]
    gen = json.loads((smollm2 / "generation_config.json").read_text())
    assert gen["temperature"] == 0.0 and set(gen["eos_token_id"]) == {0, 2}
    assert "<|im_start|>" in (smollm2 / "chat_template.jinja").read_text()


def test_long_prompts_span_several_kv_blocks(smollm2: Path) -> None:
    """The premise of the determinism test: its longest prompts cross KV block boundaries."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2))
    lengths = [len(tok.encode(p)) for p in PROMPTS]
    assert lengths[0] == 5 and tok.encode(PROMPTS[0])[0] != tok.bos_token_id  # no BOS added
    assert CPU_KV_BLOCK < lengths[3] < 2 * CPU_KV_BLOCK, lengths
    assert 4 * CPU_KV_BLOCK < lengths[4] < MAX_MODEL_LEN - MAX_TOKENS, lengths


def test_same_answers_after_checkpoint_and_two_restores(factory: AgentFactory) -> None:
    agent = factory.start(name="boot", max_model_len=MAX_MODEL_LEN)
    try:
        assert agent.wait_ready(600).origin == "booted"
        before = ask(agent)
        manifest = agent.client.checkpoint(str(factory.checkpoints / "c1"), timeout=900)
        assert agent.wait_ready(60).origin == "restored"
        verified = ask(agent)  # the checkpoint's own verification restore
    except BaseException:
        print(agent.tail(200))
        raise
    finally:
        agent.stop()
    assert manifest["fingerprint"]["model_digest"]
    assert "Paris" in before.sequential[0], before
    assert "Paris" in before.chat, before
    # Batching does not change a greedy answer on this build: the batch agrees
    # with the same prompts sent one by one.
    assert before.batch[: len(PROMPTS)] == before.sequential
    assert verified == before

    has_mmap = criu.probe(str(factory.criu)).mmap_restore
    for attempt, settings in enumerate([{"mmap_restore": "auto"}, {"mmap_restore": "off"}]):
        agent = factory.start(
            name=f"restore{attempt}",
            checkpoint=str(factory.checkpoints / "c1"),
            max_model_len=MAX_MODEL_LEN,
            **settings,
        )
        try:
            st = agent.wait_ready(300)
            assert st.origin == "restored" and st.last_fallback is None, st.raw
            assert st.raw["restored_with_mmap"] == (has_mmap and attempt == 0)
            assert ask(agent) == before, f"restore {attempt} answered differently"
        except BaseException:
            print(agent.tail(200))
            raise
        finally:
            agent.stop()
