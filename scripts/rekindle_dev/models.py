"""The embedded tiny model: a seeded random-weight Llama with a locally trained tokenizer.

Tests and the demo must not download anything from a model hub, and they need
an oracle: greedy decoding of a fixed seed's weights is deterministic, so the
same prompts give the same completions before a checkpoint and after a restore.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

# A Llama-style chat template: enough for /v1/chat/completions to render prompts.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]

_WORDS_TEXT = (
    "cold start checkpoint restore kernel page cache memory process thread weight tensor "
    "model token prompt server cluster node pod container image layer shared vector matrix "
    "the a of to and in is it that for on with as was by at be this from or have an they "
    "which one you were all we when there can more if out so what up about into than time "
    "river mountain light stone garden winter summer ocean forest city road bridge window"
)
_WORDS = _WORDS_TEXT.split()


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the generated model; the defaults load in vLLM CPU in seconds."""

    hidden_size: int = 256
    intermediate_size: int = 688
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    vocab_size: int = 2048
    max_position_embeddings: int = 2048
    seed: int = 0


def _training_corpus(seed: int, lines: int = 4000) -> list[str]:
    """A deterministic pseudo-English corpus, so the tokenizer needs no download."""
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        n = rng.randint(4, 16)
        sentence = " ".join(rng.choice(_WORDS) for _ in range(n))
        out.append(sentence.capitalize() + rng.choice([".", "?", "!", ","]))
    return out


def _train_tokenizer(spec: TinyModelSpec) -> object:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_corpus(spec.seed), trainer=trainer)
    return tok


def generate_tiny_model(out_dir: Path, spec: TinyModelSpec | None = None) -> Path:
    """Write a loadable HF-format Llama (config, safetensors, tokenizer) into out_dir.

    Idempotent: an existing directory generated from the same spec is kept, so
    a content hash of the files (the checkpoint fingerprint) stays stable.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    spec = spec or TinyModelSpec()
    out_dir = Path(out_dir)
    stamp = out_dir / "rekindle-tiny.json"
    if stamp.exists() and json.loads(stamp.read_text()) == asdict(spec):
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)

    raw = _train_tokenizer(spec)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="</s>",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out_dir)

    vocab = len(tokenizer)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    torch.manual_seed(spec.seed)
    # A wider init than HF's default (0.02) makes greedy outputs vary with the
    # prompt, so the before/after comparison is a meaningful oracle.
    config.initializer_range = 0.2
    model = LlamaForCausalLM(config).bfloat16()
    model.save_pretrained(out_dir, safe_serialization=True)
    stamp.write_text(json.dumps(asdict(spec), sort_keys=True))
    return out_dir


def model_digest(model_dir: Path) -> str:
    """sha256 over the model's files (names and contents): part of a checkpoint's fingerprint."""
    h = hashlib.sha256()
    for p in sorted(Path(model_dir).rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(model_dir)).encode())
            with p.open("rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
    return h.hexdigest()


def generate_lora_adapter(
    out_dir: Path, spec: TinyModelSpec | None = None, rank: int = 8, seed: int = 1
) -> Path:
    """Write a PEFT-format LoRA adapter for the tiny model (spec) into out_dir.

    On q_proj and v_proj of every layer, with both A and B random (PEFT trains B
    from zero; a random one makes the adapter change greedy output, which is what
    a test of LoRA serving compares). seed picks a different adapter. Idempotent
    like generate_tiny_model.
    """
    import torch
    from safetensors.torch import save_file

    spec = spec or TinyModelSpec()
    out_dir = Path(out_dir)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "target_modules": ["q_proj", "v_proj"],
        "base_model_name_or_path": "tiny",
        "rekindle_seed": seed,
    }
    stamp = out_dir / "adapter_config.json"
    if stamp.exists() and json.loads(stamp.read_text()) == config:
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    head_dim = spec.hidden_size // spec.num_attention_heads
    outs = {"q_proj": spec.hidden_size, "v_proj": spec.num_key_value_heads * head_dim}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(spec.num_hidden_layers):
        for proj, out in outs.items():
            key = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            a = torch.randn(rank, spec.hidden_size, generator=gen) * 0.2
            b = torch.randn(out, rank, generator=gen) * 0.2
            tensors[f"{key}.lora_A.weight"] = a.contiguous()
            tensors[f"{key}.lora_B.weight"] = b.contiguous()
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    stamp.write_text(json.dumps(config, sort_keys=True))
    return out_dir
