"""A trained model (SmolLM2-135M-Instruct) answers the same after a restore, and a second one.

The tiny random model proves bit-equal computation; this one also shows that
what comes back is still right: "The capital of France is" ends in Paris
before the checkpoint and after each restore. One boot, shared with
test_kv_reuse (conftest's smollm2_ckpt; its checkpoint includes the agent's own
verification restore), then two restores in fresh namespaces, like two new
pods: the mmap restore of the patched CRIU, then a copying one. Prompts span
one to several of vLLM's KV blocks (128 tokens on CPU), and a batch is sent
concurrently so the restored scheduler batches them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rekindle_agent.checkpointing import criu
from rekindle_dev.smollm2 import OUTPUT_FILES

from tests.vllm.conftest import AgentFactory, SmolCheckpoint
from tests.vllm.smollm2_talk import (
    ANSWER_MAX_TOKENS,
    COMPLETIONS,
    CPU_KV_BLOCK,
    MAX_MODEL_LEN,
    ask,
)

pytestmark = [pytest.mark.vllm, pytest.mark.criu]


def test_converted_directory_is_what_vllm_reads(smollm2_model: Path) -> None:
    smollm2 = smollm2_model
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


def test_long_prompts_span_several_kv_blocks(smollm2_model: Path) -> None:
    """The premise of the determinism test: its longest prompts cross KV block boundaries."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_model))
    lengths = [len(tok.encode(p)) for p in COMPLETIONS]
    assert lengths[0] == 5 and tok.encode(COMPLETIONS[0])[0] != tok.bos_token_id  # no BOS added
    assert CPU_KV_BLOCK < lengths[3] < 2 * CPU_KV_BLOCK, lengths
    assert 4 * CPU_KV_BLOCK < lengths[4] < MAX_MODEL_LEN - ANSWER_MAX_TOKENS, lengths


def test_same_answers_on_the_proving_restore(smollm2_ckpt: SmolCheckpoint) -> None:
    before = smollm2_ckpt.before
    assert smollm2_ckpt.manifest["fingerprint"]["model_digest"]
    assert "Paris" in before.sequential[0], before
    assert "Paris" in before.chat, before
    # Batching does not change a greedy answer on this build: the batch agrees
    # with the same prompts sent one by one.
    assert before.batch[: len(COMPLETIONS)] == before.sequential
    assert smollm2_ckpt.verified == before  # the checkpoint's own verification restore


@pytest.mark.parametrize("mmap_restore", ["auto", "off"])
def test_same_answers_after_a_restore(
    smollm2_factory: AgentFactory, smollm2_ckpt: SmolCheckpoint, mmap_restore: str
) -> None:
    """A new pod restores (auto: the mmap restore of the patched CRIU; off: copying)."""
    assert criu.probe(str(smollm2_factory.criu)).mmap_restore, "the patched CRIU maps"
    agent = smollm2_factory.start(
        name=f"restore-{mmap_restore}",
        restore_from=str(smollm2_ckpt.path),
        max_model_len=MAX_MODEL_LEN,
        mmap_restore=mmap_restore,
    )
    try:
        st = agent.wait_ready(300)
        assert st.origin == "restored" and st.last_fallback is None, st.raw
        assert st.raw["restored_with_mmap"] == (mmap_restore == "auto")
        assert ask(agent) == smollm2_ckpt.before, f"restore ({mmap_restore}) answered differently"
    except BaseException:
        print(agent.tail(200))
        raise
    finally:
        agent.stop()
